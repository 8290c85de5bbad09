"""LoRA adapters for the tests, built offline with peft on a given base model: random A and B from a fixed
seed (`init_lora_weights=False`), saved in peft's format (adapter_config.json, adapter_model.safetensors).
Built once per folder."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(base: Any, folder: Path, *, seed: int, rank: int = 8, targets: tuple[str, ...] = ALL, strength: float = 0.1, **config: Any) -> Path:
    """An adapter of `base` (left untouched: peft wraps a copy) in `folder`, its B scaled by `strength`;
    `config`: more LoraConfig fields."""
    import torch
    from peft import LoraConfig, get_peft_model

    if (folder / "adapter_model.safetensors").exists():
        return folder
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # peft 0.21 reads transformers' deprecated `is_gradient_checkpointing` (a FutureWarning)
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, target_modules=list(targets), init_lora_weights=False, **{"lora_alpha": 16, **config}))
    with torch.no_grad():  # peft's random B is as large as A: scale the pair so an adapter moves the logits, not drowns them
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(strength)
    model.save_pretrained(str(folder))
    return folder


def merged(base: Any, folder: Path) -> Any:
    """peft's own merged model of `base` (a copy) and the adapter in `folder`: the reference a served adapter must match."""
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).merge_and_unload().eval()


def default_model_adapters(root: Path, names: tuple[str, ...] = ("support-bot", "pirate"), *, rank: int = 16, first_seed: int = 11) -> dict[str, Path]:
    """Adapters of the default model (SmolLM2-135M-Instruct, float32 as loaded here), one per name, of `rank`
    (lora_alpha 2 × rank, seeds from `first_seed`) on every projection, weak enough that the model still writes words but other ones than without it.
    Built once per `root`."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from models.files import local_folder
    from shared.settings import Settings

    folders = {name: root / name for name in names}
    if all((f / "adapter_model.safetensors").exists() for f in folders.values()):
        return folders
    settings = Settings.from_env(os.environ)
    _, folder = local_folder(settings.model, settings.model_cache)
    base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    for seed, target in enumerate(folders.values(), start=first_seed):
        build_adapter(base, target, seed=seed, rank=rank, lora_alpha=2 * rank, strength=0.5)
    return folders
