"""LoRA adapters on a worker: read peft's format, keep the resident ones, add each row's low-rank delta.

Owns: reading an adapter folder (`adapter_config.json` through peft's own `LoraConfig`, the weights from
`adapter_model.safetensors`) into per-projection (A, B) pairs, refusing what it cannot serve with an
`AdapterError` naming the file; `Adapters`, the resident set (`--max-loras` of them, least recently used
first out, never one a sequence holds); and the delta of a step's rows (`add_deltas`), used by the lean
forward (`workers.llama`) and by forward hooks on the hf path (`hook_hf`).

Batched, not swapped: a step's rows are grouped by adapter (`step_rows`: one permutation a step), and per
adapter a projection's delta is two small GEMMs on its own rows, `(x A^T) B^T` with peft's scaling folded
into B — so a step's cost grows with its rows and ranks, not with how many adapters it mixes, and rows
of the base model pay nothing. Each GEMM goes through `workers.kernels.linear`, so a row's delta has the
same bits alone as among others (the row-invariance contract of docs/cpu.md holds with adapters).
q/k/v and gate/up are fused on the lean path: their A's are stacked and their B's laid out block-diagonally
(`_fuse`), one pair a fused projection. Hand-written because peft swaps or merges one adapter per model
(its mixed-batch `adapter_names` runs a Python loop per module over sub-batches of an unfused HF model);
what it gives us is the format, the config and the pattern rules.

Must not: know the scheduler or Redis; load anything it has not checked (a bad file loads nothing).
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workers import kernels

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
GROUPS = ("qkv", "o", "gate_up", "down")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class Pair:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r], peft's scaling folded in


@dataclass(frozen=True, slots=True)
class Adapter:
    """One adapter as a step uses it: per layer, per projection group (`GROUPS`), its pair or None."""

    name: str
    path: str
    rank: int  # the largest rank of its modules
    modules: tuple[str, ...]  # the projections it targets (`TARGETS`' names)
    layers: tuple[dict[str, Pair], ...]  # [layers] group → fused pair (lean path)
    hf: dict[str, Pair]  # "model.layers.{i}.{block}.{name}" → pair (hf path: unfused)

    @property
    def key(self) -> tuple[str, str]:
        return (self.name, self.path)


def _shapes(model: Any) -> tuple[int, dict[str, tuple[int, int]]]:
    """The base model's layer count and each target projection's (in, out) from its config."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    hidden, inter, q = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv_heads * head_dim), "v_proj": (hidden, kv_heads * head_dim), "o_proj": (q, hidden)}
    shapes |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    return cfg.num_hidden_layers, shapes


def read_config(folder: Path) -> Any:
    """peft's LoraConfig of the folder, checked for what this server serves (AdapterError otherwise)."""
    from peft import LoraConfig

    path = folder / CONFIG
    if not path.is_file():
        raise AdapterError(f"{path}: no such file (a LoRA adapter in peft's format has {CONFIG} and {WEIGHTS})")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path}: not a JSON file ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {doc.get('peft_type') if isinstance(doc, dict) else None!r}; only LORA adapters are served")
    try:
        config = LoraConfig.from_pretrained(str(folder))
    except (TypeError, ValueError) as exc:
        raise AdapterError(f"{path}: {exc}") from exc
    unsupported = [
        ("use_dora", bool(getattr(config, "use_dora", False))),
        ("modules_to_save", bool(getattr(config, "modules_to_save", None))),
        ("bias", getattr(config, "bias", "none") != "none"),
        ("lora_bias", bool(getattr(config, "lora_bias", False))),
        ("fan_in_fan_out", bool(getattr(config, "fan_in_fan_out", False))),
    ]
    for name, used in unsupported:
        if used:
            raise AdapterError(f"{path}: {name} is not supported (plain LoRA on q/k/v/o and gate/up/down projections only)")
    return config


def read(folder: str | Path, *, model: Any, max_rank: int, name: str = "") -> dict[str, Pair]:
    """The adapter's pairs in float32 on CPU, by module path ("model.layers.{i}.{block}.{name}"), checked
    against the base model's shapes and `max_rank`. AdapterError names the file and the tensor."""
    from peft.utils.other import get_pattern_key
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    config = read_config(folder)
    path = folder / WEIGHTS
    if not path.is_file():
        raise AdapterError(f"{path}: no such file")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"{path}: not a safetensors file ({exc})") from exc
    layers, shapes = _shapes(model)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in TARGETS or TARGETS[m.group(3)][0] != m.group(2) or int(m.group(1)) >= layers:
            raise AdapterError(f"{path}: tensor {key!r} is not a LoRA A/B of a q/k/v/o or gate/up/down projection of a layer of this {layers}-layer model")
        halves.setdefault(f"model.layers.{m.group(1)}.{m.group(2)}.{m.group(3)}", {})[m.group(4)] = tensor
    if not halves:
        raise AdapterError(f"{path}: holds no LoRA weights")
    pairs = {}
    for module, ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: {module} has lora_{next(iter(ab))} but not its other half")
        a, b = ab["A"].float(), ab["B"].float()
        fan_in, fan_out = shapes[module.rsplit(".", 1)[1]]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, r):
            raise AdapterError(f"{path}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit this model's [{fan_out}, {fan_in}] projection")
        if r > max_rank:
            raise AdapterError(f"{path}: {module} has rank {r}, above --max-lora-rank {max_rank}")
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha)
        scaling = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        pairs[module] = Pair(a.contiguous(), (b * scaling).contiguous())
    return pairs


def build(pairs: dict[str, Pair], *, model: Any, name: str, path: str, dtype: torch.dtype, device: torch.device) -> Adapter:
    """Lay read pairs out for both paths in the model's dtype: unfused for the hf path's hooks, fused
    per group for the lean path (`_fuse`)."""
    layers, shapes = _shapes(model)
    hf = {k: Pair(p.a.to(device, dtype), p.b.to(device, dtype)) for k, p in pairs.items()}
    lean: list[dict[str, Pair]] = []
    for i in range(layers):
        groups: dict[str, Pair] = {}
        for group in GROUPS:
            parts = [(n, TARGETS[n][0]) for n, (_block, g, _part) in TARGETS.items() if g == group]
            found = {n: pairs.get(f"model.layers.{i}.{block}.{n}") for n, block in parts}
            if any(found.values()):
                groups[group] = _fuse([(found[n], shapes[n]) for n, _ in parts], dtype=dtype, device=device)
        lean.append(groups)
    modules = tuple(sorted({k.rsplit(".", 1)[1] for k in pairs}, key=list(TARGETS).index))
    return Adapter(name=name, path=path, rank=max(p.a.shape[0] for p in pairs.values()), modules=modules, layers=tuple(lean), hf=hf)


def _fuse(parts: list[tuple[Pair | None, tuple[int, int]]], *, dtype: torch.dtype, device: torch.device) -> Pair:
    """One pair for a fused projection (q/k/v, gate/up): A's stacked [Σr, in], B block-diagonal [Σout, Σr]
    (a part without an adapter contributes no rank and zero rows)."""
    fan_in = parts[0][1][0]
    ranks = [p.a.shape[0] if p is not None else 0 for p, _ in parts]
    a = torch.zeros(sum(ranks), fan_in)
    b = torch.zeros(sum(out for _, (_, out) in parts), sum(ranks))
    row = col = 0
    for (pair, (_, out)), r in zip(parts, ranks, strict=True):
        if pair is not None:
            a[col : col + r] = pair.a
            b[row : row + out, col : col + r] = pair.b
        row, col = row + out, col + r
    return Pair(a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())


class Adapters:
    """The adapters resident on a worker: up to `max_loras` (least recently used out first, never one a
    running sequence holds), loaded on a request's first use from the path its IR carries."""

    def __init__(self, model: Any, *, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.max_loras, self.max_rank, self.dtype, self.device = model, max_loras, max_rank, dtype, device
        self.resident: OrderedDict[tuple[str, str], Adapter] = OrderedDict()
        self.holders: dict[tuple[str, str], int] = {}
        self.loads = 0

    def hold(self, name: str, path: str) -> Adapter:
        """The adapter, loaded if it is not resident (AdapterError if it cannot be), held until `let_go`."""
        key = (name, path)
        adapter = self.resident.get(key)
        if adapter is None:
            adapter = build(read(path, model=self.model, max_rank=self.max_rank, name=name), model=self.model, name=name, path=path, dtype=self.dtype, device=self.device)
            self.loads += 1
            self.resident[key] = adapter
        self.resident.move_to_end(key)
        self.holders[key] = self.holders.get(key, 0) + 1
        self._evict()
        return adapter

    def let_go(self, adapter: Adapter) -> None:
        left = self.holders.get(adapter.key, 0) - 1
        if left > 0:
            self.holders[adapter.key] = left
        else:
            self.holders.pop(adapter.key, None)
        self._evict()

    def _evict(self) -> None:
        for key in list(self.resident):
            if len(self.resident) <= self.max_loras:
                return
            if key not in self.holders:
                del self.resident[key]


@dataclass(frozen=True, slots=True)
class StepRows:
    """A step's rows that run an adapter, adapter by adapter (`step_rows`)."""

    order: torch.Tensor | None  # [M] flat rows in segment order; None: the segments are rows 0.. of the step in order
    segments: tuple[tuple[Adapter, int, int], ...]  # (adapter, start, stop) into `order`
    rows: int  # M


def step_rows(adapters: list[Adapter | None], device: torch.device) -> StepRows | None:
    """Per flat row of a step its adapter (None: the base) → the grouping `add_deltas` uses; None when no
    row has one."""
    by: dict[tuple[str, str], list[int]] = {}
    seen: dict[tuple[str, str], Adapter] = {}
    for i, adapter in enumerate(adapters):
        if adapter is not None:
            by.setdefault(adapter.key, []).append(i)
            seen[adapter.key] = adapter
    if not by:
        return None
    order = [i for rows in by.values() for i in rows]
    segments, start = [], 0
    for key, rows in by.items():
        segments.append((seen[key], start, start + len(rows)))
        start += len(rows)
    plain = order == list(range(len(order)))
    return StepRows(None if plain else torch.tensor(order, dtype=torch.long, device=device), tuple(segments), len(order))


def add_deltas(y: torch.Tensor, x: torch.Tensor, rows: StepRows, pick: Callable[[Adapter], Pair | None]) -> torch.Tensor:
    """y [N, out] += each adapter row's (x A^T) B^T, x [N, in], with the pair `pick` gives of its adapter
    (the lean path: this layer's fused group; the hf path: this module), in place."""
    xs = x[: rows.rows] if rows.order is None else x.index_select(0, rows.order)
    parts = []
    for adapter, start, stop in rows.segments:
        pair, seg = pick(adapter), xs[start:stop]
        parts.append(kernels.linear(kernels.linear(seg, pair.a), pair.b) if pair is not None else seg.new_zeros((stop - start, y.shape[-1])))
    delta = parts[0] if len(parts) == 1 else torch.cat(parts)
    if rows.order is None:
        y[: rows.rows] += delta
    else:
        y.index_add_(0, rows.order, delta)
    return y


class HfHooks:
    """The hf path's adapters: a forward hook on each targetable projection of the HF model adds the
    delta of the rows `active` names (flat rows of the call's [B * T] tokens), per module unfused."""

    def __init__(self, model: Any) -> None:
        self.active: StepRows | None = None
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in TARGETS and name.startswith("model.layers."):
                module.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(_module: Any, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if self.active is not None:
                add_deltas(out.view(-1, out.shape[-1]), inputs[0].reshape(-1, inputs[0].shape[-1]), self.active, lambda a: a.hf.get(name))

        return hook
