"""The GEMM row probe's disk cache (workers.kernels): a worker measures a shape once per machine, torch and
environment, and later workers read what it found instead of measuring again (~2.3 s of a start)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers import kernels

SHAPE = (64, 96)  # small: a float32 probe of it takes milliseconds (float32 is probed on every CPU)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("METRALE_BUILD_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_FOUND", {})
    return tmp_path / "gemm-probe"


def test_a_shape_is_measured_once_and_later_workers_read_what_it_found(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measured = kernels.calls_for(*SHAPE, kernels.F32)
    assert measured == kernels._measure(*SHAPE, kernels.F32)
    assert [p.suffix for p in cache.iterdir()] == [".json"]  # one finding, no temporary file left
    monkeypatch.setattr(kernels, "_FOUND", {})  # a later worker: nothing in memory

    def never(*_: object) -> kernels.Calls:
        raise AssertionError("measured again")

    monkeypatch.setattr(kernels, "_measure", never)
    assert kernels.calls_for(*SHAPE, kernels.F32) == measured


def test_a_cache_entry_that_does_not_read_is_measured_again(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_measure", lambda k, n, kind: (4, 32))
    cache.mkdir(parents=True)
    (cache / f"{kernels._probe_key(*SHAPE, kernels.F32)}.json").write_text("{half a fi")
    assert kernels.calls_for(*SHAPE, kernels.F32) == (4, 32)
    monkeypatch.setattr(kernels, "_FOUND", {})
    monkeypatch.setattr(kernels, "_measure", lambda k, n, kind: (1, 1))
    assert kernels.calls_for(*SHAPE, kernels.F32) == (4, 32)  # the rewritten entry


def test_the_key_follows_what_the_kernels_choice_depends_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    base = kernels._probe_key(*SHAPE, kernels.F32)
    assert kernels._probe_key(*SHAPE, kernels.F32) == base
    assert kernels._probe_key(*SHAPE, kernels.BF16) != base
    assert kernels._probe_key(SHAPE[0], SHAPE[1] + 1, kernels.F32) != base
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert kernels._probe_key(*SHAPE, kernels.F32) != base
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert kernels._probe_key(*SHAPE, kernels.F32) != base
    finally:
        torch.set_num_threads(threads)
    assert kernels._probe_key(*SHAPE, kernels.F32) == base
