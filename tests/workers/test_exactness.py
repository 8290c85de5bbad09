"""The contract (docs/cpu.md, "Exact on every CPU"), in the dtype the server runs (bf16, lean path): a greedy
request's tokens do not depend on whether its prefix came from the cache, where the step budget cut its
prompt, whether it is a resumed attempt, or whether speculative decoding checked guessed tokens in its steps
(with a stop string, a grammar and seeded sampling too) — checked on this CPU and under ONEDNN_MAX_CPU_ISA capped at
each lower level it supports, so one AMX machine checks all three kinds. Each level runs in a child
process (`exactness_probe.py`: oneDNN reads the cap once per process), which also reports which ISA
oneDNN dispatched to. Plus the two library GEMMs the contract needs help with (`workers.kernels`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers import kernels, quant

ROOT = Path(__file__).resolve().parents[2]
FLAGS = kernels.cpu_flags()
LEVELS = ["AVX2"] + (["AVX512_CORE_BF16"] if "avx512_bf16" in FLAGS else []) + (["AVX512_CORE_AMX"] if "amx_bf16" in FLAGS else [])
# The CPU's own top level (AVX-512 BF16 or AMX) is what the uncapped run dispatches to (that run asserts so),
# so it is not run a second time under its cap; an AVX2-only CPU (or AVX-512 without BF16) runs every level.
TOP = LEVELS[-1] if LEVELS[-1] != "AVX2" else None
CAPPED = [level for level in LEVELS if level != TOP]


@pytest.mark.model
@pytest.mark.timeout(900)
@pytest.mark.parametrize("isa", [None, *CAPPED], ids=lambda isa: isa or "default")
def test_a_greedy_request_gets_the_same_tokens_cold_cached_chunked_and_resumed(isa: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "MKL_CBWR")}
    if isa:
        env["ONEDNN_MAX_CPU_ISA"] = isa
    done = subprocess.run([sys.executable, str(ROOT / "tests/workers/exactness_probe.py")], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=840, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"ONEDNN_MAX_CPU_ISA={isa or '(unset)'}: oneDNN ISA {out['isa']!r}; kernels {out['kernels']}")
    if isa is None and TOP is not None:  # this run stands for the top level's (CAPPED): it did dispatch there
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", TOP)
        assert out["isa"] == kernels.onednn_isa(), f"the uncapped run is not {TOP}'s"
    cold, cached, chunked, resumed = out["cold"], out["cached"], out["chunked"], out["resumed"]
    assert cold[1] == 0 and cached[1] >= 64, (cold[1], cached[1])  # the second one did find its prefix cached
    assert len(cold[0]) == 40
    assert cached[0] == cold[0], "a prefix-cache hit changed the greedy tokens"
    assert chunked[0] == cold[0], "7-token prompt chunks changed the greedy tokens"
    assert resumed[0] == cold[0], "a resumed attempt changed the greedy tokens"
    if out["kernels"]["cpu"] != "avx2":  # AVX2: decode rows of a step with others multiply in float32 unless --batch-invariant (docs/cpu.md)
        assert out["batched"][0] == cold[0], "batch-mates changed the greedy tokens"
    spec = out["speculative"]
    for way, (off, on) in spec.items():
        assert on == off, f"speculative decoding changed the tokens ({way})"
    assert spec["story"][0] == cold[0] and spec["story_resumed"][0] == cold[0]
    assert len(spec["copy_stop"][0]) < len(spec["copy"][0])  # the stop string did end it early
    assert out["guesses"]["accepted"] >= 20, out["guesses"]  # guesses were checked and kept, not skipped
    print(f"speculative: {out['guesses']}")


def test_a_bf16_linear_gives_a_row_the_same_bits_among_any_number_of_rows() -> None:
    """On AMX a call of more than 32 rows takes the tile kernel with other sums, and on AVX-512 BF16 a
    one-row call of a 1536-wide input another kernel than two rows (`kernels.calls_for` pads and cuts
    the calls); measured on an AMX Xeon, where this fails with plain F.linear, at both ISA levels."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no native bf16 on this CPU: bf16 rows multiply in float32 (the next test)")
    gen = torch.Generator().manual_seed(1)
    for k, n in ((576, 960), (576, 3072), (1536, 576), (576, 49152)):
        w = torch.randn(n, k, generator=gen).bfloat16()
        x = torch.randn(300, k, generator=gen).bfloat16()
        alone = torch.cat([quant.linear(x[i : i + 1], w) for i in range(300)])
        for m in (2, 7, 32, 33, 64, 100, 300):
            assert torch.equal(quant.linear(x[:m], w), alone[:m]), (k, n, m)
    print(f"CPU {kernels.cpu_kind()}: {kernels.describe()['bf16_rows_per_call']}")


def test_a_float32_linear_gives_a_row_the_same_bits_among_any_number_of_rows() -> None:
    """MKL picks float32 kernels by row count on Intel CPUs (1–8 rows differed on an AMX Xeon);
    `MKL_CBWR=AUTO,STRICT`, set when `workers` is imported, makes it reproducible there, but on an AMD
    EPYC (AVX2) 1–3 rows still differed from the same rows among 700: `kernels.linear` (a float32 model's
    projections) pads such calls to what its probe found. The float32 way is also what bf16 rows take
    on a CPU without native bf16 (`quant.linear(wide=True)`, padded to WIDE_ROWS)."""
    assert os.environ.get("MKL_CBWR") == kernels.MKL_MODE
    gen = torch.Generator().manual_seed(2)
    for n, k in ((1536, 576), (576, 1536)):
        w = torch.randn(n, k, generator=gen)
        x = torch.randn(700, k, generator=gen)
        whole = kernels.linear(x, w)
        for m in (1, 2, 3, 4, 5, 8, 16, 33, 100):
            assert torch.equal(kernels.linear(x[:m], w), whole[:m]), (n, k, m)
        alone = torch.cat([kernels.linear(x[i : i + 1], w) for i in range(40)])
        assert torch.equal(alone, whole[:40]), (n, k)
        wb = w.bfloat16()
        wide = quant.linear(x.bfloat16(), wb, wide=True)
        for m in (1, 3, 7, 12, 13, 64):
            assert torch.equal(quant.linear(x[:m].bfloat16(), wb, wide=True), wide[:m]), m
    print(f"CPU {kernels.cpu_kind()}: {kernels.rows_per_call()}")
