"""Weight-only int4 linears (`--quantization int4`): the decoder's projections as 4-bit weights with a
scale and a zero point per group of 32 input channels, multiplied by torch's own CPU kernel
(`aten._weight_int4pack_mm_for_cpu`, the kernel gpt-fast and torchao use). Activations, norms,
embeddings and the lm_head stay in the model's dtype.

Why: decoding one sequence reads every weight once per token, so on CPU it is bound by memory
bandwidth; 4-bit weights are a quarter of bf16's bytes (bench/RESULTS.md has the step times). The
kernel is a matrix-vector kernel, though: past about 4 rows (a batch of decodes, a prefill chunk) a
dense bf16 GEMM beats it, up to 2.6x at 512 rows. Sending large steps to kept bf16 weights was tried
and dropped: the two kernels round differently, so a sequence's tokens then depended on how many
others shared its step (a recorded request no longer replayed; seeded n-choices diverged). Each
kernel alone gives a row the same result at any batch size and thread count.

Lossless for the default model: its GGUF stores the decoder weights as Q4_1 (per 32 weights, a scale d
and a minimum m: w = d*q + m, q in 0..15), which is this format exactly ((q - 8) * scale + zero with
scale = d, zero = m + 8d). Rounding each group's min and max back to 15 steps recovers q from the
dequantized weights, so the quantized model computes with the GGUF's own weights (up to the rounding of
scale and zero to the activations' dtype); `recovery_error` measures it. Any other model is quantized
round-to-nearest (asymmetric, group 32): a lossy choice the operator makes.

Why hand-written: torch ships the kernel and the packing op; what is here is choosing each group's scale
and zero (a few lines) and routing the linears to the kernel. torchao 0.18 keeps its CPU int4 layout in
`torchao.prototype` (its stable `Int4WeightOnlyConfig` has no CPU packing format), and goes through a
tensor subclass whose dispatch would cost every one of the ~210 linear calls of a step.

CPU only: torch's CUDA int4 kernel takes another packing; `check` refuses the combination by name.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shared.settings import QUANTIZATIONS
from workers import kernels

GROUP = 32  # input channels per scale/zero: GGUF's Q4_0/Q4_1 block
WIDE_ROWS = 12  # a float32 product (`linear(..., wide=True)`) is made with at least this many rows
WIDE_TILE = 4096  # ... and with at most this many outputs at a time (an lm_head is converted in slices)


@dataclass(frozen=True, slots=True)
class Int4Weight:
    packed: torch.Tensor  # uint8 [out, in / 2], torch's CPU int4 packing
    scales_zeros: torch.Tensor  # [in / GROUP, out, 2] in the activations' dtype: (scale, zero)
    out_features: int
    in_features: int

    def dequantize(self) -> torch.Tensor:
        """The weights the kernel multiplies by, [out, in] (tests and `recovery_error`)."""
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype, device=self.packed.device)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scales_zeros).t()


Weight = torch.Tensor | Int4Weight


def check(quantization: str, device: torch.device, dtype: torch.dtype) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
    if quantization == "int4" and (why := int4_unavailable(device, dtype)):
        raise ValueError(f"--quantization int4 {why}")


def int4_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"runs on CPU only (torch's int4 CPU kernel); this worker's device is {device}"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"needs --dtype bfloat16 or float32, not {dtype}"
    return None


def resolve(quantization: str, linears: Iterable[torch.Tensor], device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """(what runs, why) for `--quantization`; `auto` is int4 where it is lossless (`already_4bit`: the
    decoder's linear weights, `hf_linears` or `lean_linears`) and runs."""
    check(quantization, device, dtype)
    if quantization != "auto":
        return quantization, "--quantization " + quantization
    if why := int4_unavailable(device, dtype):
        return "none", f"auto: int4 {why}"
    if not already_4bit(linears):
        return "none", "auto: the weights are not 4-bit already (int4 would lose accuracy; --quantization int4 forces it)"
    return "int4", "auto: the weights already are 4-bit (a Q4_0/Q4_1 GGUF): int4 computes with them as stored"


def _qparams(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [out, in] → (q [out, in / GROUP, GROUP] int32 in 0..15, scale and zero [out, in / GROUP] as
    w's dtype holds them (in float32), w's groups [out, in / GROUP, GROUP] float32)."""
    out_features, in_features = w.shape
    if in_features % GROUP or out_features % 16:
        raise ValueError(f"--quantization int4: a {out_features} x {in_features} weight; the kernel needs outputs in multiples of 16 and inputs of {GROUP}")
    groups = w.detach().float().reshape(out_features, in_features // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)  # [out, in / GROUP]
    scale = ((hi - lo) / 15).to(w.dtype).float()  # rounded as the kernel will use it
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: any scale, q = 8
    zero = (lo + 8 * scale).to(w.dtype).float()
    q = ((groups - zero[..., None]) / scale[..., None] + 8).round().clamp(0, 15).to(torch.int32)
    return q, scale, zero, groups


def quantize(w: torch.Tensor) -> Int4Weight:
    """w: [out, in] → int4 with one (scale, zero) per GROUP inputs, in w's dtype."""
    out_features, in_features = w.shape
    q, scale, zero, _ = _qparams(w)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(out_features, in_features).contiguous(), 1)
    scales_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(w.dtype)  # [in / GROUP, out, 2]
    return Int4Weight(packed=packed, scales_zeros=scales_zeros, out_features=out_features, in_features=in_features)


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None, *, wide: bool = False) -> torch.Tensor:
    """F.linear for either kind of weight: x [..., in] → [..., out].

    wide (a bf16 weight; `workers.llama` asks for it on a CPU without native bf16): the product is made in
    float32 and rounded to x's dtype, as a bf16 GEMM rounds its float32 sums; the weight is converted for
    this call. oneDNN emulates bf16 GEMMs there at a cost linear in the rows: [M, 576] @ [576, 3072] took
    0.23 ms a row (120 ms for 512 rows) against 0.23 ms for the conversion plus 1.0 ms (12 rows) or 18 ms
    (512 rows) in float32 (session 12, 2-core AMD EPYC). MKL's float32 GEMM takes other kernels, with
    other sums, for fewer than WIDE_ROWS rows (but 4 and 8; measured on AVX2), so the rows are padded to
    WIDE_ROWS: a row gets the same values among 7 rows as among 500."""
    if isinstance(w, torch.Tensor):
        if not wide:
            return kernels.linear(x, w, bias)  # F.linear, in calls that give each row its own bits (AMX, AVX-512 BF16)
        lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        padded = F.pad(rows.float(), (0, 0, 0, WIDE_ROWS - n)) if n < WIDE_ROWS else rows.float()
        out = torch.empty((n, w.shape[0]), dtype=x.dtype, device=x.device)
        for o in range(0, w.shape[0], WIDE_TILE):  # a vocabulary-sized weight converted a slice at a time
            part = slice(o, o + WIDE_TILE)
            out[:, part] = F.linear(padded, w[part].float(), None if bias is None else bias[part].float())[:n]
        return out.view(*lead, w.shape[0])
    lead = x.shape[:-1]
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, w.in_features), w.packed, GROUP, w.scales_zeros)
    y = y.view(*lead, w.out_features)
    return y + bias if bias is not None else y


class Int4Linear(nn.Module):
    """Stands in for an nn.Linear inside a transformers model. `rows` selects this projection's slice
    of a fused weight (the lean path's qkv / gate_up), so the HF forward keeps working without a
    second copy of the weights."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, rows: slice | None = None) -> None:
        super().__init__()
        self.int4 = weight
        self.bias = bias
        self.rows = rows
        self.in_features = weight.in_features
        self.out_features = weight.out_features if rows is None else rows.stop - rows.start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return linear(x, self.int4, self.bias)
        y = linear(x, self.int4)[..., self.rows]
        return y + self.bias if self.bias is not None else y


def quantize_hf(model: Any) -> None:
    """Every nn.Linear of the decoder layers becomes an Int4Linear (the generic HF path)."""
    for block in model.model.layers:
        for name, module in list(block.named_modules()):
            if isinstance(module, nn.Linear):
                parent, _, attr = name.rpartition(".")
                owner = block.get_submodule(parent) if parent else block
                bias = module.bias.data if module.bias is not None else None
                setattr(owner, attr, Int4Linear(quantize(module.weight.data), bias))


def quantize_lean(model: Any, weights: Any) -> Any:
    """The lean path's fused weights as int4 (`workers.llama.LlamaWeights`), and where the weights came
    from a transformers model (not None), its modules pointed at slices of them (its forward is the
    tests' reference)."""
    layers = []
    blocks = model.model.layers if model is not None else [None] * len(weights.layers)
    for block, layer in zip(blocks, weights.layers, strict=True):
        qkv, gate_up, o, down = (quantize(w) for w in (layer.qkv, layer.gate_up, layer.o, layer.down))
        if block is not None:
            attn, mlp = block.self_attn, block.mlp
            _point(attn, ("q_proj", "k_proj", "v_proj"), qkv)
            _point(mlp, ("gate_proj", "up_proj"), gate_up)
            attn.o_proj = Int4Linear(o, attn.o_proj.bias.data if attn.o_proj.bias is not None else None)
            mlp.down_proj = Int4Linear(down, None)
        layers.append(replace(layer, qkv=qkv, gate_up=gate_up, o=o, down=down))
    return replace(weights, layers=tuple(layers))


def _point(owner: nn.Module, names: tuple[str, ...], fused: Int4Weight) -> None:
    start = 0
    for name in names:
        module = getattr(owner, name)
        rows = slice(start, start + module.out_features)
        setattr(owner, name, Int4Linear(fused, module.bias.data if module.bias is not None else None, rows))
        start = rows.stop


def give_back_memory() -> None:
    """Return the float32 scratch of quantizing (several times the weights, freed but kept by glibc's
    allocator) to the system: ~280 MiB of the worker's RSS with the default model. A no-op off glibc."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def recovery_error(w: torch.Tensor) -> float:
    """The largest |int4 weight - w| in units of its group's scale: ≪ 0.5 when w came from a Q4_0/Q4_1
    tensor (the quantization recovers it), up to 0.5 for weights that never were 4-bit."""
    q, scale, zero, groups = _qparams(w)
    return float((((q - 8) * scale[..., None] + zero[..., None] - groups).abs() / scale[..., None]).max())


def already_4bit(linears: Iterable[torch.Tensor]) -> bool:
    """Whether every linear weight of the decoder ([out, in]) is recovered within LOSSLESS: its weights
    already are 4-bit (a Q4_0/Q4_1 GGUF, like the default model), so int4 costs no accuracy against the
    file served. A fused weight is its parts stacked along out, so its groups are theirs."""
    return all(w.shape[1] % GROUP == 0 and w.shape[0] % 16 == 0 and recovery_error(w) < LOSSLESS for w in linears)


def hf_linears(model: Any) -> Iterator[torch.Tensor]:
    """The weights of the nn.Linear modules of a transformers model's decoder layers."""
    return (m.weight.data for block in model.model.layers for m in block.modules() if isinstance(m, nn.Linear))


def lean_linears(weights: Any) -> Iterator[torch.Tensor]:
    """The lean layout's projection weights (`workers.llama.LlamaWeights`), fused as they are."""
    return (w for layer in weights.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down) if isinstance(w, torch.Tensor))


LOSSLESS = 0.2  # in units of a group's scale: bf16 rounding of the stored weights and of scale/zero stays under it
