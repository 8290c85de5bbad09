"""Load a model folder's tokenizer, without torch where transformers would build its generic one.

Owns: `load_tokenizer(folder)`, what the API node, the gateway workers and the model workers load.
`AutoTokenizer` picks the class from the model's config, and importing transformers' config module
imports torch: ~2.3 s of CPU at every API node start (4.2 -> 1.9 s: bench/start_cost.py)
and a few hundred MB resident, in a process that never runs the model. When the folder's
`tokenizer_config.json` names transformers' generic fast tokenizer (`TokenizersBackend`, alias
`PreTrainedTokenizerFast`), declares no custom code (`auto_map`), and `config.json`'s `model_type` is
one for which AutoTokenizer at the pinned transformers builds that very class (GENERIC_MODEL_TYPES,
checked against AutoTokenizer itself by tests/models/test_tokenizer.py), the class is built directly.
Every other folder goes through AutoTokenizer: a `qwen2` folder, for one, declares `TokenizersBackend`
and AutoTokenizer builds `Qwen2Tokenizer` for it. Written here because transformers has no torch-free
way to resolve the class (its tokenizer tables live in a module that imports the config module).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# model types whose generic-class folders AutoTokenizer (transformers 5.24) loads as TokenizersBackend
GENERIC_MODEL_TYPES = frozenset({"llama", "qwen3", "qwen3_moe", "smollm3", "olmo2", "granite", "gemma3_text"})


def loads_directly(folder: Path) -> bool:
    """Whether `folder`'s tokenizer is the generic class whatever AutoTokenizer would weigh."""
    try:
        declared = json.loads((folder / "tokenizer_config.json").read_text())
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return declared.get("tokenizer_class") in GENERIC_CLASSES and "auto_map" not in declared and model_type in GENERIC_MODEL_TYPES


def load_tokenizer(folder: Path | str) -> Any:
    """The tokenizer transformers' AutoTokenizer gives for `folder` (see the module docstring)."""
    folder = Path(folder)
    if loads_directly(folder):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
