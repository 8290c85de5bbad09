"""Baseline (b): transformers `generate` in-process, static batches, over the same requests.

Requests are taken in arrival order in batches of the workload's concurrency. A batch is left-padded
and run greedy with `max_new_tokens = min_new_tokens =` the batch's largest max_tokens, so EOS never
ends it early; a request's tokens beyond its own max_tokens are counted as waste, not output.
Timing: a streamer's `put` is called once with the prompt and then once per decoding step for the
whole batch, so each step's clock time is that step's token time for every row. TTFT = end of the
batch's prefill (its first step) from the batch's start; a request's end-to-end time is the batch's
end, when `generate` returns. For the single workload it also times one forward of the prompt (the
in-process prefill; median of several) to size our pipeline's TTFT overhead.
Runs in a child process (see isolate.py), so peak RSS is this baseline's alone.

`hf-static-fp32` is the same in float32: on a CPU without native bf16 (AVX2 only: oneDNN emulates bf16
GEMMs one row at a time) a transformers user would load the model in float32, and our worker multiplies
most rows in float32 there (workers.quant `linear(wide=True)`), so the bf16 baseline alone would flatter us.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from measure import RequestTiming, RunRecord, gaps
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer
from workloads import BenchRequest, Workload

PREFILL_RUNS = 9
DTYPES = {"hf-static": "bfloat16", "hf-static-fp32": "float32"}  # bench system → the dtype it loads the model in


def load(folder: Path, dtype: torch.dtype = torch.bfloat16) -> tuple[Any, Any]:
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return model, tokenizer


class StepClock(BaseStreamer):
    """Records the time of every decoding step (the first `put` is the prompt and is skipped)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_static(workload: Workload, folder: Path, system: str = "hf-static") -> RunRecord:
    model, tokenizer = load(folder, getattr(torch, DTYPES[system]))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    _generate(model, [workload.requests[0].prompt_ids], max_new=4, pad_id=pad_id)  # warm-up, not measured
    size = workload.spec.concurrency
    timings: list[RequestTiming] = []
    waste = padding = 0
    started = time.perf_counter()
    for lo in range(0, len(workload.requests), size):
        batch = workload.requests[lo : lo + size]
        batch_timings, batch_waste, batch_padding = _run_batch(model, batch, pad_id)
        timings.extend(batch_timings)
        waste += batch_waste
        padding += batch_padding
    wall = time.perf_counter() - started
    extra = {"waste_tokens": float(waste), "padding_prompt_tokens": float(padding)}
    if workload.spec.name == "single":
        extra["prefill_ms_median"] = prefill_ms(model, workload.requests[0].prompt_ids)
    notes = (f"{waste} generated tokens beyond their request's max_tokens (waste); {padding} prompt pad tokens",)
    return RunRecord(system, wall, tuple(timings), notes, None, extra)


def _run_batch(model: Any, batch: tuple[BenchRequest, ...], pad_id: int) -> tuple[list[RequestTiming], int, int]:
    max_new = max(r.max_tokens for r in batch)
    longest = max(len(r.prompt_ids) for r in batch)
    issued = time.perf_counter()
    clock = _generate(model, [r.prompt_ids for r in batch], max_new=max_new, pad_id=pad_id)
    done = time.perf_counter() - issued
    steps = [t - issued for t in clock.times]
    if len(steps) < max_new:
        raise RuntimeError(f"generate ran {len(steps)} steps, expected {max_new}")
    timings = []
    for r in batch:
        own = steps[: r.max_tokens]
        own_gaps = gaps(own)
        timings.append(RequestTiming(r.index, len(r.prompt_ids), r.max_tokens, own[0], own_gaps, done, chunks=len(own)))
    waste = sum(max_new - r.max_tokens for r in batch)
    padding = sum(longest - len(r.prompt_ids) for r in batch)
    return timings, waste, padding


@torch.inference_mode()
def _generate(model: Any, prompts: list[tuple[int, ...]], *, max_new: int, pad_id: int) -> StepClock:
    longest = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (longest - len(p)) + list(p) for p in prompts])  # [B, longest], left-padded
    attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])  # [B, longest]
    clock = StepClock()
    model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        do_sample=False,
        pad_token_id=pad_id,
        streamer=clock,
    )
    return clock


@torch.inference_mode()
def prefill_ms(model: Any, prompt_ids: tuple[int, ...]) -> float:
    """Median time of one forward over the prompt (KV cache on, last-position logits only), ms."""
    input_ids = torch.tensor([list(prompt_ids)])  # [1, T]
    times = []
    for _ in range(PREFILL_RUNS + 1):
        started = time.perf_counter()
        model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:]) * 1000
