"""The CPU kernel that adds many LoRA adapters' deltas in one call (`lora_kernel.cpp`): built once, loaded by ctypes.

Why hand-written: a step's rows of several adapters each need their own adapter's small A and B (punica's
SGMV/BGMV, what vLLM runs on a GPU). No maintained library has that for a CPU: vLLM's CPU LoRA path is plain
torch ops, punica and its successors are CUDA/Triton, and torch's `_grouped_mm` on a CPU is a reference loop
(16 ms where one `bmm` takes 0.1 ms: bench/RESULTS.md, session 23). Through two `torch.bmm` and three index ops
a projection group, 8 adapters of rank 16 cost the default model ~20 ms a 32-row step on 2 cores; the kernel,
which reads each adapter's weights once, skips the block-diagonal zeros of the fused q/k/v and gate/up B and
holds its sums in registers, ~7 ms (bench/RESULTS.md, session 24).

Built with the system's C++ compiler (`$CXX`, else `g++`): `-O3 -march=native -fopenmp`, at the worker's start, into
`$METRALE_BUILD_CACHE/lora-kernel/<key>/` (default `~/.cache/metrale-build`), the key a hash of the source, the
flags, the compiler's version and this CPU's flags, so a fresh clone or a second worker reuses it. Its
`libgomp.so.1` is the one torch has loaded (same soname), so the kernel runs on torch's OpenMP threads.
Without a compiler `load()` logs why (a worker that then runs an adapter warns once) and returns None, and
the adapters multiply through `torch.bmm` (`workers.lora.add_stacked`).

Must not: be called with tensors of another dtype or device than `DTYPES` on a CPU, or rows not contiguous
in their last dimension (`supports`, `workers.lora` checks).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from workers.kernels import build_cache

__all__ = ["DTYPES", "LANES", "Kernel", "column_bounds", "load"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("lora_kernel.cpp")
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-Wno-psabi")  # and -march: this CPU's unless `load` names one
DTYPES = (torch.bfloat16, torch.float32)
LANES = 16  # the kernel's ranks come in multiples of this (`workers.lora.build_stack` pads them)


class Kernel:
    """`add(y, x, order, starts, at, bt, bounds)`: y[order[j]] += (x[order[j]] A_s^T) B_s^T for the rows j of
    slot s (`starts[s]:starts[s + 1]`), in place; at [S, in, R], bt [S, R, out], bounds [S, R, 2] int32 (the
    columns of bt[s, k] that may be non-zero, multiples of `LANES` or out)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        p, i = ctypes.c_void_p, ctypes.c_int64
        self._fns = {}
        for dtype, name in ((torch.bfloat16, "lora_add_bf16"), (torch.float32, "lora_add_f32")):
            fn = getattr(lib, name)
            fn.restype = None
            fn.argtypes = [p, i, p, i, p, p, i, p, p, p, i, i, i, ctypes.c_int]
            self._fns[dtype] = fn

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in DTYPES

    def add(self, y: torch.Tensor, x: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, at: torch.Tensor, bt: torch.Tensor, bounds: torch.Tensor) -> None:  # noqa: PLR0913 (the kernel's operands)
        if x.stride(-1) != 1:
            x = x.contiguous()
        assert y.stride(-1) == 1 and y.dtype == x.dtype == at.dtype == bt.dtype and at.shape[2] % LANES == 0
        self._fns[y.dtype](y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), order.data_ptr(), starts.data_ptr(), starts.numel() - 1, at.data_ptr(), bt.data_ptr(), bounds.data_ptr(), at.shape[1], at.shape[2], bt.shape[2], torch.get_num_threads())


def column_bounds(bt: torch.Tensor) -> torch.Tensor:
    """`Kernel.add`'s `bounds`: per (slot, rank) of B^T [S, R, out] the columns [o0, o1) holding its non-zeros,
    rounded out to multiples of `LANES` (o1 at most out); [0, 0) for an all-zero one."""
    nz = bt != 0
    out = bt.shape[-1]
    first = nz.to(torch.uint8).argmax(-1)
    last = out - 1 - nz.flip(-1).to(torch.uint8).argmax(-1)
    o0, o1 = first // LANES * LANES, ((last // LANES + 1) * LANES).clamp(max=out)
    return torch.where(nz.any(-1)[..., None], torch.stack((o0, o1), -1), 0).to(torch.int32).contiguous()


def load(march: str = "native") -> Kernel | None:
    """The kernel, built here first if this source, compiler, CPU and `march` have none in the cache; None
    (with the reason logged) where it cannot be built. Every element's sums run in one order whatever the
    vector width, so a build for an older `march` (e.g. "haswell": AVX2) gives the same bits."""
    named = os.environ.get("CXX", "g++")
    compiler = shutil.which(named)
    if compiler is None:
        log.info("LoRA adapters multiply through torch.bmm: no C++ compiler (%s) to build %s", named, SOURCE.name)
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
        flags = (*FLAGS, f"-march={march}")
        target = _cache() / _key(version, flags) / "liblora.so"
        if not target.exists():
            _build(compiler, flags, target)
        kernel = Kernel(ctypes.CDLL(str(target)), target)
        log.info("LoRA adapters multiply through %s", target)
        return kernel
    except (OSError, subprocess.SubprocessError) as exc:
        detail = exc.stderr[-2000:] if isinstance(exc, subprocess.CalledProcessError) and exc.stderr else exc
        log.info("LoRA adapters multiply through torch.bmm: %s did not build: %s", SOURCE.name, detail)
        return None


def _cache() -> Path:
    return build_cache("lora-kernel")


def _key(compiler_version: str, flags: tuple[str, ...]) -> str:
    cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "") if Path("/proc/cpuinfo").exists() else ""
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags).encode(), compiler_version.encode(), cpu.encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _build(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    """Compile into a temporary file beside `target`, then rename: workers building at once each get a whole
    library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".liblora-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300, check=True)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
