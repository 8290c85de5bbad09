"""What a LoRA adapter folder must be for this server to serve it, checked without loading it (torch-free).

peft's format: `adapter_config.json` (peft_type LORA, r, lora_alpha, use_rslora, alpha_pattern, …) and
`adapter_model.safetensors` (per targeted projection `…model.layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`
[r, in] and `….lora_B.weight` [out, r]). `check` reads the config and the safetensors header only (the
`safetensors` library, numpy framework: no tensor is read), so an API node refuses a bad folder when it
is registered (`POST /v1/load_lora_adapter`, `--lora`) and a worker before it loads a byte of it
(workers.lora). Served: plain LoRA on the q/k/v/o and gate/up/down projections of the Llama family's
decoder layers; refused with the file and the reason: DoRA, biases, `modules_to_save`, embeddings or the
LM head, a rank above `--max-lora-rank`, a shape that does not fit the base model.

Must not: import torch, or know Redis.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# the projections an adapter may target: module name → (its block, the lean path's fused group, its part of it)
TARGETS = {
    "q_proj": ("self_attn", "qkv", 0),
    "k_proj": ("self_attn", "qkv", 1),
    "v_proj": ("self_attn", "qkv", 2),
    "o_proj": ("self_attn", "o", 0),
    "gate_proj": ("mlp", "gate_up", 0),
    "up_proj": ("mlp", "gate_up", 1),
    "down_proj": ("mlp", "down", 0),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
_UNSUPPORTED = (
    ("use_dora", lambda v: bool(v)),
    ("modules_to_save", lambda v: bool(v)),
    ("bias", lambda v: v not in (None, "none")),
    ("lora_bias", lambda v: bool(v)),
    ("fan_in_fan_out", lambda v: bool(v)),
)


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class Base:
    """The base model's shapes an adapter must fit: its layer count and each target's (in, out)."""

    layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, config: Any) -> Base:
        """From a model config: an object with the attributes (transformers' config) or a config.json dict."""

        def get(name: str, default: Any = None) -> Any:
            return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)

        heads = get("num_attention_heads")
        head_dim = get("head_dim") or get("hidden_size") // heads
        kv = (get("num_key_value_heads") or heads) * head_dim
        hidden, inter, q = get("hidden_size"), get("intermediate_size"), heads * head_dim
        shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
        shapes |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
        return cls(int(get("num_hidden_layers")), shapes)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Base | None:
        """From a model folder's config.json (None when it has none, or not the fields: no shape check then)."""
        path = Path(folder) / "config.json"
        try:
            return cls.of(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            return None


@dataclass(frozen=True, slots=True)
class Summary:
    """What `check` found: the adapter's largest rank and the projections it targets, in `TARGETS` order."""

    rank: int
    modules: tuple[str, ...]
    config: dict[str, Any]


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG
    if not path.is_file():
        raise AdapterError(f"{path}: no such file (a LoRA adapter in peft's format has {CONFIG} and {WEIGHTS})")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path}: not a JSON file ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {doc.get('peft_type') if isinstance(doc, dict) else None!r}; only LORA adapters are served")
    for name, used in _UNSUPPORTED:
        if used(doc.get(name)):
            raise AdapterError(f"{path}: {name} is not supported (plain LoRA on q/k/v/o and gate/up/down projections only)")
    if not isinstance(doc.get("lora_alpha", 8), (int, float)) or not isinstance(doc.get("alpha_pattern") or {}, dict):
        raise AdapterError(f"{path}: lora_alpha must be a number and alpha_pattern an object")
    return doc


def tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The safetensors file's tensor names and shapes, from its header."""
    from safetensors import SafetensorError, safe_open

    path = folder / WEIGHTS
    if not path.is_file():
        raise AdapterError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="numpy") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{path}: not a safetensors file ({exc})") from exc


def check(folder: str | Path, *, base: Base | None, max_rank: int) -> Summary:
    """Whether this server can serve the adapter in `folder` on `base` (None: shapes unchecked): its summary,
    or an AdapterError naming the file and the tensor."""
    folder = Path(folder)
    config = read_config(folder)
    path = folder / WEIGHTS
    halves: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in tensor_shapes(folder).items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in TARGETS or TARGETS[m.group(3)][0] != m.group(2) or (base is not None and int(m.group(1)) >= base.layers):
            raise AdapterError(f"{path}: tensor {key!r} is not a LoRA A/B of a q/k/v/o or gate/up/down projection of a decoder layer of the base model")
        halves.setdefault(module_path(int(m.group(1)), m.group(3)), {})[m.group(4)] = shape
    if not halves:
        raise AdapterError(f"{path}: holds no LoRA weights")
    rank = 0
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: {module} has lora_{next(iter(ab))} but not its other half")
        a, b = ab["A"], ab["B"]
        fits = len(a) == 2 and len(b) == 2 and b[1] == a[0]
        if fits and base is not None:
            fan_in, fan_out = base.shapes[module.rsplit(".", 1)[1]]
            fits = a[1] == fan_in and b[0] == fan_out
        if not fits:
            raise AdapterError(f"{path}: {module}: lora_A {list(a)} and lora_B {list(b)} do not fit the base model's projection")
        if a[0] > max_rank:
            raise AdapterError(f"{path}: {module} has rank {a[0]}, above --max-lora-rank {max_rank}")
        rank = max(rank, a[0])
    modules = tuple(n for n in TARGETS if any(k.endswith("." + n) for k in halves))
    return Summary(rank=rank, modules=modules, config=config)


def module_path(layer: int, name: str) -> str:
    """The HF module path of a target projection: "model.layers.{i}.{block}.{name}" (peft's key for patterns)."""
    return f"model.layers.{layer}.{TARGETS[name][0]}.{name}"


def tensor_module(key: str) -> str:
    """The module path of a safetensors key `check` accepted."""
    m = _KEY.match(key)
    assert m is not None
    return module_path(int(m.group(1)), m.group(3))
