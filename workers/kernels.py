"""Which CPU GEMM kernels run, chosen so that a row's result never depends on the rows beside it.

The contract (docs/cpu.md, "Exact on every CPU"): for a given request, model, dtype and flags, a token's
logits do not depend on whether its prefix came from the cache, where the step budget cut its prompt,
or what shared its step. The lean forward (`workers.llama`) keeps that by construction for attention;
the linear layers are library GEMMs, and two of them do not keep it by themselves:

- **MKL's float32 GEMM** (the wide rows on a CPU without native bf16, a float32 model) picks kernels by
  the row count on Intel CPUs: on an AMX Xeon 1–8 rows gave other sums than the same rows among 700
  (`tests/workers/test_kernels.py`). MKL's own conditional numerical reproducibility fixes that:
  `MKL_CBWR=AUTO,STRICT` (read once, at MKL's first call, so it is set when this package is imported;
  an operator's own value is kept). Its cost: a one-row float32 GEMV 0.13 → 0.25 ms, 16+ rows the same.
  It is not enough on an AMD EPYC (AVX2, session 45): 1–3 rows still gave other sums than the same rows
  among 700, whatever `MKL_CBWR` said, so float32 weights are probed like bf16 ones (below) and such
  calls padded to 4 rows.
- **oneDNN's AMX bf16 GEMM** (Intel Sapphire Rapids and later): a call of more than 32 rows runs the AMX
  tile kernel, whose sums differ from the ≤ 32-row kernel's and with the call's row count (a call of a
  fixed row count gives any row the same bits wherever it sits and whatever the others hold), and on
  AVX-512 BF16 a one-row call of a 1536-wide input (SmolLM2's down projection) took another kernel than
  two rows. So `linear` (what `quant.linear` runs for bf16) pads a call up to and cuts it at the sizes
  `calls_for` found: each row then gets what it gets alone. Measured (2-core AMX Xeon, SmolLM2 shapes, 512 rows): 576→3072 0.74 → 2.66 ms,
  576→960 0.25 → 1.03 ms; capping oneDNN below AMX instead (`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`)
  cost 7.9 ms. `--no-row-invariant` keeps the single call (faster prefill, no promise).

`calls_for` is probed, not looked up: whether a bf16 GEMM is row-invariant depends on the CPU, on the
oneDNN inside the pinned torch and on `ONEDNN_MAX_CPU_ISA`, so the worker measures it and logs and
reports what it found (`describe`). A probe of SmolLM2's five shapes takes ~2.3 s of a worker's start (the
576x49152 head most), so each finding is kept on disk (`$METRALE_BUILD_CACHE/gemm-probe/`, like the LoRA
kernel's build) under a key of everything the measurement depends on (`_probe_key`: this module's source,
torch's version and build configuration, the CPU's model and flags, the GEMM environment variables, the
thread count, the shape and kind): a later worker on the same machine and torch reads it instead. Hand-written because no library chooses
GEMM row blocking for reproducibility on CPU (vLLM's batch-invariant mode is CUDA kernels).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MKL_MODE = "AUTO,STRICT"
PROBE_MAX = 64  # rows a probe multiplies
PROBE_SIZES = (1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 33, 48, 64)  # call sizes it compares with each row alone (33: the first past AMX's 32)
FLOORS = (1, 2, 4, 8)  # the least rows per call tried, smallest first
LIMITS = (32, 16, 8, 4, 2, 1)  # the most rows per call tried, largest first
GEMM_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE", "OMP_NUM_THREADS")


def pin_environment() -> None:
    """MKL's reproducible mode, unless the operator chose one. Before MKL's first call (this package's import)."""
    os.environ.setdefault("MKL_CBWR", MKL_MODE)


ENABLED = True  # `--row-invariant` (default); the runner sets it from the settings before the first step


Calls = tuple[int, int | None]  # (at least, at most) rows per bf16 GEMM call: fewer are padded with zero rows, more are cut
ANY: Calls = (1, None)
_FOUND: dict[tuple[int, int, str], Calls] = {}  # (k, n, "bf16" | "f32") → calls
BF16, F32 = "bf16", "f32"


def _probe(k: int, n: int, kind: str) -> Calls:
    if (k, n, kind) not in _FOUND:
        _FOUND[k, n, kind] = _stored(k, n, kind)
    return _FOUND[k, n, kind]


def _stored(k: int, n: int, kind: str) -> Calls:
    """`_measure`'s answer from the probe cache (see the module docstring), measured and kept on a miss.
    A cache that cannot be read or written is measured around (the answer is the same, only slower)."""
    path = probe_cache() / f"{_probe_key(k, n, kind)}.json"
    try:
        lo, hi = json.loads(path.read_text())
        return int(lo), None if hi is None else int(hi)
    except (OSError, ValueError, TypeError):
        pass
    calls = _measure(k, n, kind)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(list(calls)))
        temporary.replace(path)  # atomic: workers starting together never read half a file
    except OSError:
        pass
    return calls


def build_cache(name: str) -> Path:
    """`$METRALE_BUILD_CACHE/<name>` (default `~/.cache/metrale-build`): what a worker builds or measures once
    per machine and keeps across starts (this probe's findings, the LoRA kernel)."""
    return Path(os.environ.get("METRALE_BUILD_CACHE") or Path.home() / ".cache" / "metrale-build") / name


def probe_cache() -> Path:
    return build_cache("gemm-probe")


@functools.cache
def _machine() -> str:
    """The part of `_probe_key` that cannot change in a process: this module's source, torch's version and
    build configuration, and the CPU's identity and flags (read once, not once per probed shape)."""
    import torch

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = [line for line in cpuinfo.split("\n\n")[0].splitlines() if line.startswith(("vendor_id", "cpu family", "model", "stepping", "flags"))]
    return "\0".join([Path(__file__).read_text(), torch.__version__, torch.__config__.show(), *cpu])


def _probe_key(k: int, n: int, kind: str) -> str:
    """A hash of what `_measure`'s answer depends on: which GEMM kernels oneDNN and MKL pick follows the
    CPU (model, flags), the libraries (torch's version and build), their environment and the threads."""
    import torch

    env = [f"{name}={os.environ.get(name, '')}" for name in GEMM_ENV]
    parts = [_machine(), *env, f"threads={torch.get_num_threads()}", f"{k}x{n} {kind}"]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _measure(k: int, n: int, kind: str = BF16) -> Calls:
    """The call sizes that give every row of a GEMM of a [k → n] weight (bf16 or float32) one result, whatever rows
    share its call: rows padded with zeros up to `lo` (on AVX-512 BF16 a one-row call of a 1536-wide
    input took another kernel than two rows), calls cut at `hi` (AMX: the tile kernel past 32 rows).
    Per shape: oneDNN blocks the reduction by shape. The numbers are random: the kernel is chosen by
    shape, never by value. The first (lo, hi) that holds, fewest cuts first, then least padding."""
    import torch
    import torch.nn.functional as F

    dtype = torch.bfloat16 if kind == BF16 else torch.float32
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(PROBE_MAX, k, generator=gen).to(dtype)
    alone = {lo: torch.cat([F.linear(F.pad(x[i : i + 1], (0, 0, 0, lo - 1)), weight)[:1] for i in range(PROBE_MAX)]) for lo in FLOORS}
    for hi in (None, *LIMITS):  # fewest cuts first (a cut costs a prefill far more than padding a decode)
        for lo in (f for f in FLOORS if f <= (hi or PROBE_MAX)):
            sizes = [m for m in PROBE_SIZES if m <= (hi or PROBE_MAX)]
            if all(torch.equal(_call(x[:m], weight, None, (lo, hi)), alone[lo][:m]) for m in sizes) and torch.equal(_call(x, weight, None, (lo, hi)), alone[lo]):
                return lo, hi
    return 1, 1


def _call(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, calls: Calls) -> torch.Tensor:
    import torch
    import torch.nn.functional as F

    lo, hi = calls
    n = x.shape[0]
    if lo <= n <= (hi or n):
        return F.linear(x, w, bias)
    if n < lo:
        return F.linear(F.pad(x, (0, 0, 0, lo - n)), w, bias)[:n]
    assert hi is not None
    return torch.cat([_call(x[i : i + hi], w, bias, calls) for i in range(0, n, hi)])


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, x [..., k] by a weight [n, k], in calls that give each row its own bits where a CPU
    GEMM needs it (`calls_for`): one plain call otherwise. On every projection of every step, so the
    common case is a flag, a dtype and a dict lookup."""
    import torch.nn.functional as F

    kind = BF16 if w.dtype == _bf16() else F32 if w.dtype == _f32() else ""
    calls = calls_for(int(w.shape[1]), int(w.shape[0]), kind) if ENABLED and kind and x.device.type == "cpu" else ANY
    rows = x.numel() // max(1, x.shape[-1])
    if calls == ANY or calls[0] <= rows <= (calls[1] or rows):
        return F.linear(x, w, bias)
    return _call(x.reshape(-1, x.shape[-1]), w, bias, calls).view(*x.shape[:-1], w.shape[0])


def calls_for(k: int, n: int, kind: str = BF16) -> Calls:
    """The rows per GEMM call of a [k → n] weight of this kind ("bf16" | "f32") on the CPU (`linear`): ANY
    for no constraint. bf16 only where it is native: elsewhere bf16 rows go the float32 way
    (`TorchRunner.wide_mode`, padded by `quant.linear` itself)."""
    found = _FOUND.get((k, n, kind))
    if found is not None:
        return found if ENABLED else ANY
    if not ENABLED or (kind == BF16 and not native_bf16()):
        return ANY
    return _probe(k, n, kind)


@functools.cache
def native_bf16() -> bool:
    """Whether oneDNN runs bf16 GEMMs natively here (AVX-512 BF16, AMX) rather than emulating them (AVX2)."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def _bf16() -> torch.dtype:
    import torch

    return torch.bfloat16


@functools.cache
def _f32() -> torch.dtype:
    import torch

    return torch.float32


def probe_all(shapes: list[tuple[int, int]], kind: str = BF16) -> str:
    """Probe a model's weight shapes up front (the worker, at load: the first step then pays nothing) and
    say what was found (`rows_per_call`)."""
    for k, n in dict.fromkeys(shapes):
        calls_for(k, n, kind)
    return rows_per_call()


def rows_per_call() -> str:
    """The shapes probed so far and the call sizes found, "KxN: lo..hi" ("f32 KxN" for float32 weights;
    the worker's report and log)."""
    return ", ".join(f"{'' if kind == BF16 else kind + ' '}{k}x{n}: {_say(v)}" for (k, n, kind), v in _FOUND.items()) or "not probed"


def _say(calls: Calls) -> str:
    lo, hi = calls
    return "any" if calls == ANY else f"{lo}..{hi or 'any'}"


def onednn_isa() -> str:
    """What oneDNN's own verbose mode names as the ISA it dispatches to here (a child process: the mode
    is read once per process). Tests print it; workers report `describe()` instead (no child at start)."""
    import subprocess
    import sys

    code = "import torch; torch.nn.functional.linear(torch.ones(64, 64, dtype=torch.bfloat16), torch.ones(64, 64, dtype=torch.bfloat16))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ONEDNN_VERBOSE": "1"}, capture_output=True, text=True, timeout=120, check=False).stdout
    return next((line.split("isa:", 1)[1].strip() for line in out.splitlines() if "isa:" in line), "none (a bf16 GEMM does not go through oneDNN at this level)")


@functools.cache
def cpu_flags() -> frozenset[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def cpu_kind() -> str:
    """AMX, AVX-512 BF16 or AVX2: the CPU kinds the contract names (docs/cpu.md) (capped by ONEDNN_MAX_CPU_ISA)."""
    flags, cap = cpu_flags(), os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    kind = "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else "avx2"
    if cap and "AMX" not in cap and kind == "amx":
        kind = "avx512_bf16" if "BF16" in cap else "avx2"
    if cap and "BF16" not in cap and "AMX" not in cap:
        kind = "avx2"
    return kind


def describe() -> dict[str, Any]:
    """What the worker reports (`met top`, /v1/metrale/workers): the kernels' choices and why."""
    return {
        "cpu": cpu_kind(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "mkl_cbwr": os.environ.get("MKL_CBWR", ""),
        "bf16_rows_per_call": rows_per_call(),
        "row_invariant": ENABLED,
    }
