"""LoRA adapters on a worker: read peft's format, keep the resident ones, add each row's low-rank delta.

Owns: reading an adapter folder that `models.adapters.check` found servable (its config, the weights of
`adapter_model.safetensors`) into per-projection (A, B) pairs with peft's scaling; `Adapters`, the resident set (`--max-loras` of them, least recently used
first out, never one a sequence holds); and the delta of a step's rows: `add_stacked` in the lean forward
(`workers.llama`), `add_deltas` in forward hooks on the hf path (`HfHooks`).

Batched, not swapped: each row adds `(x A^T) B^T` of its own adapter (peft's scaling folded into B), rows
of the base model pay nothing. On the lean path a prefill chunk multiplies its adapter's pair (two GEMMs
through `workers.kernels.linear`) and the step's other rows, of however many adapters, go to one call of
the gather-matmul kernel per projection group (`workers.lora_kernel`; two `torch.bmm` over the resident
adapters' `Stack` without it); the hf path groups rows by adapter (`step_rows`) and multiplies each group's
pair. A row's delta has the same bits alone as among others either way (the row-invariance contract of
docs/cpu.md holds with adapters).
q/k/v and gate/up are fused on the lean path: their A's are stacked and their B's laid out block-diagonally
(`_fuse`), one pair a fused projection. Hand-written because peft swaps or merges one adapter per model
(its mixed-batch `adapter_names` runs a Python loop per module over sub-batches of an unfused HF model);
what it gives us is the format, the config and the pattern rules.

Must not: know the scheduler or Redis; load anything it has not checked (a bad file loads nothing).

Size (~410 lines): one adapter's life on a worker (read, fuse, keep resident, multiply) on both forward
paths; the gather-matmul kernel and the adapter checks live in modules of their own.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from models.adapters import TARGETS, WEIGHTS, AdapterError, Base, check, module_path, tensor_module
from workers import kernels, lora_kernel

__all__ = ["AdapterError", "Adapters", "HfHooks", "StackedRows", "StepRows", "add_deltas", "add_stacked", "read", "stacked_rows", "step_rows"]

GROUPS = ("qkv", "o", "gate_up", "down")

log = logging.getLogger(__name__)


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
    layers: tuple[dict[str, Pair], ...]  # [layers] group → fused pair (lean path; empty on the hf path)
    hf: dict[str, Pair]  # "model.layers.{i}.{block}.{name}" → pair (hf path: unfused; empty on the lean path)

    @property
    def key(self) -> tuple[str, str]:
        return (self.name, self.path)


def read(folder: str | Path, *, base: Base, max_rank: int) -> dict[str, Pair]:
    """The adapter's pairs in float32 on CPU, by module path ("model.layers.{i}.{block}.{name}"), once
    `models.adapters.check` has found the folder servable on a model of this shape (AdapterError
    otherwise). The scaling is peft's: lora_alpha (or its `alpha_pattern` match, by peft's own rule) over
    r, or over √r with `use_rslora`. peft is imported only for an adapter with an `alpha_pattern` (its
    import takes ~1.8 s of CPU and brings transformers' model code and torch._dynamo with it, which a
    worker otherwise never loads: `workers.checkpoint`), so that adapter's first load costs that once."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    config = check(folder, base=base, max_rank=max_rank).config
    try:
        tensors = load_file(str(folder / WEIGHTS))
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"{folder / WEIGHTS}: {exc}") from exc
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        halves.setdefault(tensor_module(key), {})["A" if ".lora_A" in key else "B"] = tensor.float()
    patterns: dict[str, float] = config.get("alpha_pattern") or {}
    if patterns:
        from peft.utils.other import get_pattern_key
    pairs = {}
    for module, ab in sorted(halves.items()):
        r = ab["A"].shape[0]
        alpha = float(config.get("lora_alpha", 8))
        if patterns:
            alpha = float(patterns.get(get_pattern_key(list(patterns), module), alpha))
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        pairs[module] = Pair(ab["A"].contiguous(), (ab["B"] * scaling).contiguous())
    return pairs


def build(pairs: dict[str, Pair], *, base: Base, name: str, path: str, dtype: torch.dtype, device: torch.device, lean: bool = True) -> Adapter:  # noqa: PLR0913 (keyword-only: what the adapter is and where its pairs go)
    """Lay read pairs out in the model's dtype and device for the path that runs: fused per group for the
    lean path (`_fuse`; `hf` left empty), unfused for the hf path's hooks (`layers` left empty)."""
    modules = tuple(sorted({k.rsplit(".", 1)[1] for k in pairs}, key=list(TARGETS).index))
    rank = max(p.a.shape[0] for p in pairs.values())
    if not lean:
        hf = {k: Pair(p.a.to(device, dtype), p.b.to(device, dtype)) for k, p in pairs.items()}
        return Adapter(name=name, path=path, rank=rank, modules=modules, layers=(), hf=hf)
    fused: list[dict[str, Pair]] = []
    for i in range(base.layers):
        groups: dict[str, Pair] = {}
        for group in GROUPS:
            parts = [(n, TARGETS[n][0]) for n, (_block, g, _part) in TARGETS.items() if g == group]
            found = {n: pairs.get(module_path(i, n)) for n, _block in parts}
            if any(found.values()):
                groups[group] = _fuse([(found[n], base.shapes[n]) for n, _ in parts], dtype=dtype, device=device)
        fused.append(groups)
    return Adapter(name=name, path=path, rank=rank, modules=modules, layers=tuple(fused), hf={})


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

    def __init__(self, base: Base, *, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device, lean: bool = True) -> None:
        """`base`: the shapes of the model the adapters must fit (`models.adapters.Base.of` its config)."""
        self.base, self.max_loras, self.max_rank, self.dtype, self.device = base, max_loras, max_rank, dtype, device
        # the gather-matmul kernel (`workers.lora_kernel`), built beside the start too (<1 s; cached) and waited
        # for by the first stack, so every step of the worker multiplies its adapters one way
        self._kernel: lora_kernel.Kernel | None = None
        self._kernel_build: threading.Thread | None = None
        if lean and lora_kernel.Kernel.supports(dtype, device):
            self._kernel_build = threading.Thread(target=self._load_kernel, name="lora-kernel", daemon=True)
            self._kernel_build.start()
        self.lean = lean  # which layout adapters are built in (`build`): the lean path's fused one, or the hf path's
        self.resident: OrderedDict[tuple[str, str], Adapter] = OrderedDict()
        self.holders: dict[tuple[str, str], int] = {}
        self.loads = 0
        self._stack: Stack | None = None  # the resident adapters side by side (`stack`), rebuilt when they change

    def hold(self, name: str, path: str) -> Adapter:
        """The adapter, loaded if it is not resident (AdapterError if it cannot be), held until `let_go`."""
        key = (name, path)
        adapter = self.resident.get(key)
        if adapter is None:
            pairs = read(path, base=self.base, max_rank=self.max_rank)
            adapter = build(pairs, base=self.base, name=name, path=path, dtype=self.dtype, device=self.device, lean=self.lean)
            self.loads += 1
            self.resident[key] = adapter
            self._stack = None
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
                self._stack = None

    def _load_kernel(self) -> None:
        self._kernel = lora_kernel.load()

    @property
    def kernel(self) -> lora_kernel.Kernel | None:
        """The gather-matmul kernel this worker's lean steps use, None: they use `torch.bmm`."""
        if self._kernel_build is not None:
            self._kernel_build.join()
            self._kernel_build = None
            if self._kernel is None:
                log.warning("LoRA adapters multiply through torch.bmm, slower with many adapters a step: the kernel did not build (workers.lora_kernel says why above)")
        return self._kernel

    @property
    def stack(self) -> Stack:
        if self._stack is None:
            self._stack = build_stack(list(self.resident.values()), kernel=self.kernel)
        return self._stack


@dataclass(frozen=True, slots=True)
class Stack:
    """The resident adapters' fused pairs, slot by slot, per layer and projection group, laid out for a
    batched matmul: A^T [S, in, R] and B^T [S, R, out] (S adapters in slot order, R the widest one's rank
    there, the others zero-padded), so a step's rows of many adapters multiply in one `kernel` call or two
    `torch.bmm` calls (`add_stacked`). With the kernel R is padded to its `LANES` and `bounds` [S, R, 2] int32
    holds the columns of each B^T[s, k] that may be non-zero (rounded out to `LANES`), so it skips the
    block-diagonal zeros of the fused q/k/v and gate/up and the padded ranks."""

    slots: dict[tuple[str, str], int]  # adapter key → its slot
    layers: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...]  # group → (A^T, B^T)
    kernel: lora_kernel.Kernel | None = None
    bounds: tuple[dict[str, torch.Tensor], ...] = ()  # per layer, group → [S, R, 2] (with the kernel: `lora_kernel.column_bounds`)


def build_stack(adapters: list[Adapter], *, kernel: lora_kernel.Kernel | None = None) -> Stack:
    size = len(adapters)
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for i in range(len(adapters[0].layers) if adapters else 0):
        groups = {}
        for group in GROUPS:
            pairs = [a.layers[i].get(group) for a in adapters]
            present = [p for p in pairs if p is not None]
            if not present:
                continue
            r, fan_in, fan_out = max(p.a.shape[0] for p in present), present[0].a.shape[1], present[0].b.shape[0]
            if kernel is not None:
                r = -(-r // lora_kernel.LANES) * lora_kernel.LANES
            at = present[0].a.new_zeros((size, fan_in, r))
            bt = present[0].b.new_zeros((size, r, fan_out))
            for slot, p in enumerate(pairs):
                if p is not None:
                    at[slot, :, : p.a.shape[0]] = p.a.t()
                    bt[slot, : p.a.shape[0]] = p.b.t()
            groups[group] = (at, bt)
        layers.append(groups)
    bounds = tuple({g: lora_kernel.column_bounds(bt) for g, (_, bt) in groups.items()} for groups in layers) if kernel is not None else ()
    return Stack({a.key: slot for slot, a in enumerate(adapters)}, tuple(layers), kernel, bounds)


@dataclass(frozen=True, slots=True)
class Gathered:
    """Rows of several adapters multiplied together (`add_stacked`): padded slot by slot to `width` rows each."""

    rows: torch.Tensor  # [M] the step's flat rows, slot by slot
    take: torch.Tensor  # [S * width] per padded position the flat row it reads (padding reads row 0; its result is dropped)
    place: torch.Tensor  # [M] where each of `rows` sits among the padded positions
    width: int


@dataclass(frozen=True, slots=True)
class Listed:
    """Rows of any adapters for the kernel (`add_stacked`): the flat rows slot by slot, each slot's first."""

    rows: torch.Tensor  # [M]
    starts: torch.Tensor  # [S + 1]: slot s's rows are rows[starts[s]:starts[s + 1]]


@dataclass(frozen=True, slots=True)
class StackedRows:
    """A lean step's rows that run an adapter (`stacked_rows`): runs of one adapter, each multiplied by its
    own pairs, and the rest, listed for the kernel or gathered for the stacked matmul."""

    runs: tuple[tuple[Adapter, slice | torch.Tensor], ...]  # (adapter, its rows: a prefill chunk's slice, or an index)
    gathered: Gathered | None
    stack: Stack
    listed: Listed | None = None


def stacked_rows(adapters: list[Adapter | None], stack: Stack, device: torch.device, *, chunks: tuple[tuple[int, int], ...] = ()) -> StackedRows | None:
    """Per flat row of a lean step its adapter (None: the base), and the step's prefill chunks as (offset,
    length) → `add_stacked`'s rows; None when no row has an adapter. A chunk's rows share one adapter and
    are a run of their own. The other rows (decode, drafts) are listed for the stack's kernel however many
    adapters they run, so a row's bits do not depend on its neighbours'; without the kernel they are a run
    too when they all share one adapter, else gathered slot by slot (the `bmm` and `F.linear` agree row by
    row: `add_stacked`)."""
    runs: list[tuple[Adapter, slice | torch.Tensor]] = []
    in_runs: set[int] = set()
    for offset, length in chunks:
        adapter = adapters[offset]
        if adapter is not None:
            runs.append((adapter, slice(offset, offset + length)))
            in_runs.update(range(offset, offset + length))
    by_slot: dict[int, list[int]] = {}
    for i, adapter in enumerate(adapters):
        if adapter is not None and i not in in_runs:
            by_slot.setdefault(stack.slots[adapter.key], []).append(i)
    gathered = listed = None
    if by_slot and stack.kernel is not None:
        order, starts = [], [0]
        for slot in range(len(stack.slots)):
            order += by_slot.get(slot, [])
            starts.append(len(order))
        listed = Listed(torch.tensor(order, dtype=torch.long, device=device), torch.tensor(starts, dtype=torch.long, device=device))
    elif len(by_slot) == 1:
        rows = next(iter(by_slot.values()))
        adapter = adapters[rows[0]]
        assert adapter is not None
        runs.append((adapter, slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] == len(rows) - 1 else torch.tensor(rows, dtype=torch.long, device=device)))
    elif by_slot:
        width = max(len(r) for r in by_slot.values())
        take = [0] * (len(stack.slots) * width)
        order, place = [], []
        for slot, rows in sorted(by_slot.items()):
            for k, i in enumerate(rows):
                take[slot * width + k] = i
                order.append(i)
                place.append(slot * width + k)
        as_tensor = partial(torch.tensor, dtype=torch.long, device=device)
        gathered = Gathered(as_tensor(order), as_tensor(take), as_tensor(place), width)
    if not runs and gathered is None and listed is None:
        return None
    return StackedRows(tuple(runs), gathered, stack, listed)


def add_stacked(y: torch.Tensor, x: torch.Tensor, rows: StackedRows, *, layer: int, group: str) -> torch.Tensor:
    """y [N, out] += each adapter row's (x A^T) B^T for this layer's projection group, x [N, in], in place.
    A run multiplies its adapter's own pair (two GEMMs through `kernels.linear`); listed rows go to the
    stack's kernel (`workers.lora_kernel`: one call, each row its own slot's weights, ~3x faster than the
    `bmm` way on the LoRA bench's decode steps); gathered rows are padded
    slot by slot into [S, width, in] and multiplied by every resident adapter's A^T, B^T in two `torch.bmm`
    calls — a fixed number of calls whatever the step mixes (a pair of calls per adapter cost ~50 us of
    overhead each on CPU: 8 adapters made a 32-row decode step 1.8x slower, session 22), the FLOPs of its
    rows and ranks (and the padding). A row gets the same bits either way and alone or among others
    (measured on AVX-512 BF16, where a bmm slice and F.linear agree for every width tried:
    tests/workers/test_lora.py checks a request alone and among others)."""
    for adapter, at in rows.runs:
        pair = adapter.layers[layer].get(group)
        if pair is None:
            continue
        if isinstance(at, slice):
            y[at] += kernels.linear(kernels.linear(x[at], pair.a), pair.b)
        else:
            y.index_add_(0, at, kernels.linear(kernels.linear(x.index_select(0, at), pair.a), pair.b))
    g, entry = rows.gathered, rows.stack.layers[layer].get(group)
    if entry is None:
        return y
    if rows.listed is not None:
        assert rows.stack.kernel is not None
        rows.stack.kernel.add(y, x, rows.listed.rows, rows.listed.starts, *entry, rows.stack.bounds[layer][group])
    if g is None:
        return y
    at_, bt = entry
    padded = x.index_select(0, g.take).view(at_.shape[0], g.width, -1)  # [S, width, in]
    delta = torch.bmm(torch.bmm(padded, at_), bt).view(-1, bt.shape[-1])  # [S * width, out]
    y.index_add_(0, g.rows, delta.index_select(0, g.place))
    return y


@dataclass(frozen=True, slots=True)
class StepRows:
    """The hf path's rows that run an adapter, adapter by adapter (`step_rows`)."""

    order: torch.Tensor | None  # [M] flat rows in segment order; None: the segments are rows 0.. of the step in order
    segments: tuple[tuple[Adapter, int, int], ...]  # (adapter, start, stop) into `order`
    rows: int  # M


def step_rows(adapters: list[Adapter | None], device: torch.device) -> StepRows | None:
    """Per flat row of an hf forward its adapter (None: the base) → the grouping `add_deltas` uses; None when
    no row has one."""
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
