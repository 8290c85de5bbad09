"""A Llama-family model's weights straight from its folder (config.json and safetensors) into the lean
forward's layout (`workers.llama.LlamaWeights`), without building transformers' model.

Why: the lean path never runs transformers' forward, but loading through `AutoModelForCausalLM` imports
its model code, which imports torch.distributed.tensor and torch._dynamo: ~1.5 s of CPU and ~250 MB at
every worker start, more than the load itself (`python bench/start_cost.py`). safetensors reads the
tensors; this module only names them, fuses q/k/v and gate/up as `llama.from_hf` does, and computes the
default RoPE frequencies as transformers' Llama does (`tests/workers/test_checkpoint.py` holds every
tensor equal to `llama.from_hf` of the transformers-loaded model, for each family).

It loads only what it can state exactly: a folder whose config.json leaves out a field whose default
differs between families, a RoPE type other than "default" (their frequencies come from transformers'
config handling), or a checkpoint whose tensor names are not exactly the family's, returns why instead,
and the worker loads through transformers as before (`workers.runner.load`).

Must not: import transformers' model code, or guess a value the folder does not state.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from workers import llama

REQUIRED = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "rms_norm_eps", "tie_word_embeddings")
INDEX = "model.safetensors.index.json"


def read_config(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / "config.json").read_text()))


def rope_theta(config: dict[str, Any]) -> tuple[float | None, str]:
    """(base, RoPE type) as config.json states them, in transformers' old (`rope_theta`, `rope_scaling`)
    or new (`rope_parameters`) layout."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        return None, "per layer type"
    theta = params.get("rope_theta", config.get("rope_theta"))
    return (float(theta) if theta is not None else None), str(params.get("rope_type", params.get("type", "default")))


def why_not(config: dict[str, Any], *, max_len: int) -> str | None:
    """Why this folder is not loaded directly (None: it is)."""
    theta, kind = rope_theta(config)
    if (why := llama.unsupported_config(config, max_len=max_len, rope_type=kind)) is not None:
        return why
    if kind != "default" or "partial_rotary_factor" in config:
        return f"RoPE type {kind!r}{' with partial_rotary_factor' if 'partial_rotary_factor' in config else ''}: its frequencies come from transformers' config"
    missing = [name for name in REQUIRED if name not in config] + (["rope_theta"] if theta is None else [])
    if config["model_type"] == "qwen3" and "head_dim" not in config:
        missing.append("head_dim")
    if missing:
        return f"config.json does not state {', '.join(missing)}"
    return None


def tensor_files(folder: Path) -> list[Path]:
    if (folder / INDEX).exists():
        shards = json.loads((folder / INDEX).read_text())["weight_map"].values()
        return [folder / name for name in sorted(set(shards))]
    return [folder / "model.safetensors"]


def expected_names(config: dict[str, Any]) -> set[str]:
    """The tensors a checkpoint of this config holds, by transformers' names for the family."""
    family = config["model_type"]
    qkv_bias = family == "qwen2" or (family in ("llama", "qwen3") and config.get("attention_bias", False))
    o_bias = family in ("llama", "qwen3") and config.get("attention_bias", False)
    names = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if config["tie_word_embeddings"] else {"lm_head.weight"})
    for i in range(config["num_hidden_layers"]):
        at = f"model.layers.{i}."
        names |= {at + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight")}
        names |= {f"{at}mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        names |= {f"{at}self_attn.{n}_proj.weight" for n in "qkv"}
        names |= {f"{at}self_attn.{n}_proj.bias" for n in "qkv"} if qkv_bias else set()
        names |= {at + "self_attn.o_proj.bias"} if o_bias else set()
        names |= {f"{at}self_attn.{n}_norm.weight" for n in "qk"} if family == "qwen3" else set()
    return names


def load(folder: Path, *, max_len: int, device: torch.device, dtype: torch.dtype, config: dict[str, Any] | None = None) -> tuple[llama.LlamaWeights | None, str | None]:
    """(the lean weights, None), or (None, why the folder is left to transformers' loader). `config`: its
    config.json, where the caller has read it already."""
    from safetensors import safe_open

    config = config if config is not None else read_config(folder)
    if (why := why_not(config, max_len=max_len)) is not None:
        return None, why
    files = tensor_files(folder)
    if not all(f.exists() for f in files):
        return None, "no model.safetensors"
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(safe_open(str(path), framework="pt")) for path in files]
        where = {name: f for f in opened for name in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
        found, expected = set(where), expected_names(config)
        if found != expected:
            odd = sorted(found ^ expected)
            return None, f"tensor names other than the family's ({len(odd)}: {', '.join(odd[:3])}{', ...' if len(odd) > 3 else ''})"
        heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
        head_dim, hidden = int(config.get("head_dim") or config["hidden_size"] // heads), int(config["hidden_size"])
        shapes = {n: tuple(where[n].get_slice(n).get_shape()) for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight")}
        if list(shapes.values()) != [(heads * head_dim, hidden), (kv_heads * head_dim, hidden)]:
            return None, f"q/k projection shapes {list(shapes.values())}, not config.json's heads x head_dim"
        return _read(config, expected, lambda name: where[name].get_tensor(name).to(device=device, dtype=dtype), device=device), None


def _read(config: dict[str, Any], names: set[str], take: Callable[[str], torch.Tensor], *, device: torch.device) -> llama.LlamaWeights:
    """The weights (`names`: the checkpoint's, `expected_names`), each tensor read as it is placed
    (`take(name)`), so that the load holds no second copy of more than one layer's parts while fusing them."""
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)

    def fuse(at: str, parts: tuple[str, ...], kind: str) -> torch.Tensor:
        return torch.cat([take(f"{at}{n}.{kind}") for n in parts])

    layers = []
    for i in range(int(config["num_hidden_layers"])):
        at = f"model.layers.{i}."
        qkv_names = tuple(f"self_attn.{n}_proj" for n in "qkv")
        layers.append(
            llama.Layer(
                index=i,
                input_norm=take(at + "input_layernorm.weight"),
                qkv=fuse(at, qkv_names, "weight"),
                qkv_bias=fuse(at, qkv_names, "bias") if at + "self_attn.q_proj.bias" in names else None,
                o=take(at + "self_attn.o_proj.weight"),
                o_bias=take(at + "self_attn.o_proj.bias") if at + "self_attn.o_proj.bias" in names else None,
                q_norm=take(at + "self_attn.q_norm.weight") if at + "self_attn.q_norm.weight" in names else None,
                k_norm=take(at + "self_attn.k_norm.weight") if at + "self_attn.k_norm.weight" in names else None,
                post_norm=take(at + "post_attention_layernorm.weight"),
                gate_up=fuse(at, ("mlp.gate_proj", "mlp.up_proj"), "weight"),
                down=take(at + "mlp.down_proj.weight"),
            )
        )
    embed = take("model.embed_tokens.weight")
    theta, _ = rope_theta(config)
    assert theta is not None  # why_not checked it
    # transformers' Llama (and Qwen2/3, Mistral) default RoPE: LlamaRotaryEmbedding.compute_default_rope_parameters
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    return llama.LlamaWeights(
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        eps=float(config["rms_norm_eps"]),
        inv_freq=inv_freq.to(device),
        rope_scale=1.0,
        embed=embed,
        layers=tuple(layers),
        norm=take("model.norm.weight"),
        lm_head=embed if config["tie_word_embeddings"] else take("lm_head.weight"),
    )
