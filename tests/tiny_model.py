"""A tiny random-init Llama folder on the default model's tokenizer and chat template, built offline.

For load: its forward costs next to nothing, so a server running it spends its CPU on the pipeline
(claims, detokenization, Redis, encoders, HTTP), which is what the many-streams tests and
bench/pipeline.py measure. 2 layers, hidden 64, SmolLM2's 49,152-token vocabulary (so prompts and
output detokenize as the real model's would); its text is noise. Built once per cache folder.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TINY_NAME = "tiny-llama"


def build_tiny_model(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.files import local_folder
    from shared.settings import Settings

    if (folder / "config.json").exists():
        return folder
    settings = Settings.from_env(os.environ)
    _, source = local_folder(settings.model, settings.model_cache)
    scratch = folder.with_name(folder.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    for item in source.iterdir():  # the tokenizer, its template and the generation config: the default model's
        if item.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(item, scratch / item.name)
    import json

    base = json.loads((source / "config.json").read_text())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=int(base["vocab_size"]),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=int(base.get("max_position_embeddings", 8192)),
        bos_token_id=base.get("bos_token_id"),
        eos_token_id=base.get("eos_token_id"),
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(str(scratch))
    scratch.rename(folder)
    return folder
