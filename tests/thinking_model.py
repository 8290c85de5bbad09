"""A tiny random-init Qwen3 model folder that reasons in the `<think>` format, built offline.

The default SmolLM2 has no reasoning format, so the reasoning path is tested with this: the SmolLM2
tokenizer plus `<think>` / `</think>` as added single tokens (as in Qwen3's tokenizer), a ChatML
template that opens `<think>` in the generation prompt (Qwen3-Thinking / DeepSeek-R1 style) and honours
`enable_thinking`, and a 2-layer Qwen3ForCausalLM with random weights. Its text is noise: tests drive
the answer with a grammar and count reasoning tokens, which is what the budget and the encoders need.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ message.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)


def build_thinking_model(folder: Path, *, context: int = 4096) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from models.files import local_folder
    from shared.settings import Settings

    if (folder / "config.json").exists():
        return folder
    _, source = local_folder(Settings.from_env(os.environ).model, Settings.from_env(os.environ).model_cache)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(folder))
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=context,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(config).save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": tokenizer.eos_token_id}))
    return folder
