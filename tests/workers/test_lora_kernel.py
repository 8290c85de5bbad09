"""The LoRA gather-matmul kernel (workers.lora_kernel): each listed row gets its own slot's (x A^T) B^T, as a
float64 reference says, skipping only B's zero columns; a row's bits do not depend on the other rows or the
threads; it is built once per source, compiler and CPU into the build cache; without a compiler it says why
and the adapters fall back to `torch.bmm`."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from models.adapters import Base
from workers import lora, lora_kernel

IN, OUT = 40, 72  # neither a multiple of the kernel's 16 lanes: a tail of `in`, and 8 columns past the last 64


@pytest.fixture(scope="module")
def kernel() -> lora_kernel.Kernel:
    k = lora_kernel.load()
    assert k is not None, "the kernel did not build (is a C++ compiler installed?)"
    return k


def stack(dtype: torch.dtype, *, slots: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A^T [S, IN, 32], B^T [S, 32, OUT] like a fused pair of two parts: ranks 5 and 16 (padded to 16 each),
    the first part's B on columns 0:24, the second's on 24:72 (block-diagonal, with zero padded ranks)."""
    g = torch.Generator().manual_seed(seed)
    at = torch.zeros(slots, IN, 32)
    bt = torch.zeros(slots, 32, OUT)
    at[:, :, :5] = torch.randn(slots, IN, 5, generator=g)
    at[:, :, 16:32] = torch.randn(slots, IN, 16, generator=g)
    bt[:, :5, :24] = torch.randn(slots, 5, 24, generator=g)
    bt[:, 16:32, 24:] = torch.randn(slots, 16, OUT - 24, generator=g)
    return at.to(dtype), bt.to(dtype), lora_kernel.column_bounds(bt.to(dtype))


def listed(slot_rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    order = [r for rows in slot_rows for r in rows]
    starts = [0]
    for rows in slot_rows:
        starts.append(starts[-1] + len(rows))
    return torch.tensor(order, dtype=torch.long), torch.tensor(starts, dtype=torch.long)


def test_bounds_cover_each_ranks_non_zero_columns_rounded_out_to_the_lanes() -> None:
    _, _, bounds = stack(torch.float32, slots=1)
    assert bounds[0, 0].tolist() == [0, 32]  # columns 0:24, rounded out to 32
    assert bounds[0, 5].tolist() == [0, 0]  # a padded rank: nothing
    assert bounds[0, 16].tolist() == [16, 72]  # columns 24:72 from 16, the end at `out`
    bt = torch.zeros(1, 1, 100)
    bt[0, 0, 37] = 1.0
    assert lora_kernel.column_bounds(bt)[0, 0].tolist() == [32, 48]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_listed_row_gets_its_own_slots_delta_and_the_others_are_untouched(kernel: lora_kernel.Kernel, dtype: torch.dtype) -> None:
    at, bt, bounds = stack(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(13, IN, generator=g).to(dtype)
    y0 = torch.randn(13, OUT, generator=g).to(dtype)
    slot_rows = [[7, 2, 11, 0, 5, 9], [], [4]]  # six rows (a block of 4 and one of 2), none, one; rows out of order
    order, starts = listed(slot_rows)
    y = y0.clone()
    kernel.add(y, x, order, starts, at, bt, bounds)
    want = y0.double().clone()
    for s, rows in enumerate(slot_rows):
        for r in rows:
            want[r] += x[r].double() @ at[s].double() @ bt[s].double()
    tol = 1e-5 if dtype == torch.float32 else 0.05  # bf16: t and the delta are rounded like two F.linear calls
    scale = want.abs().max().item()
    assert (y.double() - want).abs().max().item() <= tol * scale
    untouched = [r for r in range(13) if r not in order.tolist()]
    assert torch.equal(y[untouched], y0[untouched])
    if dtype == torch.bfloat16:  # as two `F.linear` calls in bf16 would round, within their own order of sums
        as_linear = y0[4] + torch.nn.functional.linear(torch.nn.functional.linear(x[4], at[2].t()), bt[2].t())
        assert (y[4].double() - as_linear.double()).abs().max().item() <= 0.02 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_the_threads(kernel: lora_kernel.Kernel, dtype: torch.dtype) -> None:
    at, bt, bounds = stack(dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, IN, generator=g).to(dtype)
    y0 = torch.randn(9, OUT, generator=g).to(dtype)

    def add(slot_rows: list[list[int]], threads: int) -> torch.Tensor:
        y = y0.clone()
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            kernel.add(y, x, *listed(slot_rows), at, bt, bounds)
        finally:
            torch.set_num_threads(before)
        return y

    alone = add([[], [3], []], 1)
    for slot_rows in ([[0, 1], [3], [2, 4, 5, 6, 7, 8]], [[], [8, 0, 1, 2, 3], [5]], [[1], [6, 2, 3, 7], [0]]):
        for threads in (1, 2):
            assert torch.equal(add(slot_rows, threads)[3], alone[3]), (slot_rows, threads)


def test_built_for_avx2_the_kernel_gives_the_bits_it_gives_built_for_this_cpu(kernel: lora_kernel.Kernel) -> None:
    """Every CPU kind a worker may run on (AVX2-only, AVX-512, AMX) gets the same deltas: each element is
    summed in one order whatever the vector width (on an AVX2-only machine both builds are AVX2)."""
    avx2 = lora_kernel.load(march="haswell")
    assert avx2 is not None and avx2.path != kernel.path
    for dtype in (torch.float32, torch.bfloat16):
        at, bt, bounds = stack(dtype, seed=5)
        g = torch.Generator().manual_seed(6)
        x = torch.randn(11, IN, generator=g).to(dtype)
        y0 = torch.randn(11, OUT, generator=g).to(dtype)
        rows = listed([[0, 3, 4, 8, 9], [1], [10, 2]])
        here, there = y0.clone(), y0.clone()
        kernel.add(here, x, *rows, at, bt, bounds)
        avx2.add(there, x, *rows, at, bt, bounds)
        assert not torch.equal(here, y0) and torch.equal(here, there), dtype


def test_a_steps_decode_rows_are_listed_for_the_kernel_even_when_they_share_one_adapter(kernel: lora_kernel.Kernel) -> None:
    """Listed whatever their neighbours run, so a row takes the same path (and bits) alone as among others."""
    a = lora.Adapter(name="a", path="/a", rank=4, modules=(), layers=(), hf={})
    stack_ = lora.Stack({a.key: 0}, (), kernel, ())
    rows = lora.stacked_rows([a, None, a, a, a], stack_, torch.device("cpu"), chunks=((3, 2),))
    assert rows is not None and rows.listed is not None
    assert rows.listed.rows.tolist() == [0, 2] and rows.listed.starts.tolist() == [0, 2]
    assert [(ad.name, at) for ad, at in rows.runs] == [("a", slice(3, 5))]  # a prefill chunk is a run of its own
    without = lora.stacked_rows([a, None, a], lora.Stack({a.key: 0}, ()), torch.device("cpu"))
    assert without is not None and without.listed is None and len(without.runs) == 1  # the bmm way: one adapter is a run


def test_the_kernel_is_built_once_into_the_build_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_BUILD_CACHE", str(tmp_path))
    first = lora_kernel.load()
    assert first is not None and first.path.is_relative_to(tmp_path / "lora-kernel")
    built = first.path.stat().st_mtime_ns
    second = lora_kernel.load()
    assert second is not None and second.path == first.path and second.path.stat().st_mtime_ns == built
    assert [p.name for p in first.path.parent.iterdir()] == ["liblora.so"]  # no temporary file left


def test_without_a_compiler_it_says_why_and_the_adapters_use_bmm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("METRALE_BUILD_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", os.fspath(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.INFO, logger="workers.lora_kernel"):
        assert lora_kernel.load() is None
    assert "no C++ compiler" in caplog.text and "torch.bmm" in caplog.text
    assert not (tmp_path / "lora-kernel").exists()


def test_a_worker_without_the_kernel_warns_once_when_it_runs_an_adapter(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """At its start (every worker) the missing compiler is an info line; the first stack of adapters warns."""
    monkeypatch.setattr(lora_kernel, "load", lambda: None)
    adapters = lora.Adapters(Base(layers=0, shapes={}), max_loras=2, max_rank=8, dtype=torch.bfloat16, device=torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="workers.lora"):
        assert adapters.kernel is None and adapters.kernel is None
    assert [r.getMessage() for r in caplog.records].count(
        "LoRA adapters multiply through torch.bmm, slower with many adapters a step: the kernel did not build (workers.lora_kernel says why above)"
    ) == 1
