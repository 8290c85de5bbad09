"""`models.tokenizer.load_tokenizer`: the class AutoTokenizer would build, for every model type the
direct (torch-free) load covers and for one it must not; and the default model's tokenizer loads in a
process that never imports torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from models.tokenizer import GENERIC_MODEL_TYPES, load_tokenizer, loads_directly

from ..conftest import ROOT

pytestmark = pytest.mark.model

TEXT = "Hello <|im_start|> world, 12345 ünïcode\n\tdef f(x): return x"


def folder_of_type(source: Path, into: Path, model_type: str, **declared: object) -> Path:
    """The default model's tokenizer files under a config of another model type."""
    into.mkdir()
    for name in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(source / name, into / name)
    (into / "tokenizer_config.json").write_text(json.dumps({**json.loads((source / "tokenizer_config.json").read_text()), **declared}))
    config = json.loads((source / "config.json").read_text())
    (into / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return into


@pytest.mark.parametrize("model_type", sorted(GENERIC_MODEL_TYPES))
def test_a_covered_model_type_loads_directly_as_the_class_autotokenizer_builds(default_model_folder: Path, tmp_path: Path, model_type: str) -> None:
    folder = folder_of_type(default_model_folder, tmp_path / model_type, model_type)
    assert loads_directly(folder)
    ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(auto)
    assert ours(TEXT)["input_ids"] == auto(TEXT)["input_ids"] and ours.chat_template == auto.chat_template
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (auto.eos_token_id, auto.bos_token_id, auto.pad_token_id)


def test_a_model_type_autotokenizer_gives_its_own_class_goes_through_autotokenizer(default_model_folder: Path, tmp_path: Path) -> None:
    """transformers builds Qwen2Tokenizer for a qwen2 folder that declares the generic class; so must we."""
    folder = folder_of_type(default_model_folder, tmp_path / "qwen2", "qwen2")
    assert not loads_directly(folder)
    assert type(load_tokenizer(folder)).__name__ == type(AutoTokenizer.from_pretrained(str(folder))).__name__ == "Qwen2Tokenizer"
    custom = folder_of_type(default_model_folder, tmp_path / "custom", "llama", auto_map={"AutoTokenizer": ["x.Tok", None]})
    assert not loads_directly(custom)  # custom code: AutoTokenizer decides


def test_the_default_models_tokenizer_loads_without_importing_torch(default_model_folder: Path) -> None:
    """What an API node and a gateway worker load (an API process's start: 4.2 -> 1.9 s of CPU, 450 -> 180 MB: bench/start_cost.py)."""
    probe = f"import sys; from models.tokenizer import load_tokenizer; t = load_tokenizer({str(default_model_folder)!r}); print(len(t('hi')['input_ids']), 'torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "False"], done.stdout
