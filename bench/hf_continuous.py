"""Reference (c): transformers' own continuous batching (`ContinuousBatchingManager`) in-process.

The same requests in the same closed loop as our clients: `concurrency` requests are submitted at
once and the next one goes in as soon as one finishes. Each request is greedy with its own
`max_new_tokens` and EOS disabled (`eos_token_id=-1`), and records per-token timestamps, so TTFT is
first token − submission and the gaps are between consecutive tokens. transformers' defaults are kept
(SDPA on CPU; prefix block sharing allowed) except the cache size and per-step token budget, which
are set to our server's (`max_tokens_per_step`, one slot per client) because they cannot be inferred
from accelerator memory on a CPU. Runs in a child process (see isolate.py).
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from hf_static import load
from measure import RequestTiming, RunRecord, gaps
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from workloads import BenchRequest, Workload

PAGE_SIZE = 256
MAX_BATCH_TOKENS = 512  # our worker's default max_tokens_per_step
RESULT_POLL_S = 1.0


def run_continuous(workload: Workload, folder: Path, timeout_s: float) -> RunRecord:
    model, tokenizer = load(folder)
    longest = max(len(r.prompt_ids) + r.max_tokens for r in workload.requests)
    pages_per_request = -(-longest // PAGE_SIZE)
    cb_config = ContinuousBatchingConfig(
        page_size=PAGE_SIZE,
        num_blocks=pages_per_request * workload.spec.concurrency + 4,
        max_batch_tokens=MAX_BATCH_TOKENS,
        max_requests_per_batch=workload.spec.concurrency,
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in workload.requests), eos_token_id=-1, pad_token_id=pad_id)
    with torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
        manager.start()
        try:
            warm = workload.requests[0]
            _closed_loop(manager, (BenchRequest(-1, "", 0, warm.prompt_ids, 4),), concurrency=1, timeout_s=120)  # not measured
            return _closed_loop(manager, workload.requests, concurrency=workload.spec.concurrency, timeout_s=timeout_s)
        finally:
            manager.stop(block=True, timeout=30)
            manager.destroy()


def _closed_loop(manager: Any, requests: tuple[BenchRequest, ...], *, concurrency: int, timeout_s: float) -> RunRecord:
    queue = deque(requests)
    issued: dict[str, tuple[BenchRequest, float]] = {}

    def submit() -> None:
        request = queue.popleft()
        rid = f"bench-{request.index}"
        issued[rid] = (request, time.perf_counter())
        manager.add_request(list(request.prompt_ids), request_id=rid, max_new_tokens=request.max_tokens, record_timestamps=True, eos_token_id=-1)

    started = time.perf_counter()
    deadline = started + timeout_s
    for _ in range(min(concurrency, len(queue))):
        submit()
    timings: list[RequestTiming] = []
    errors: list[str] = []
    while len(timings) + len(errors) < len(requests) and time.perf_counter() < deadline:
        result = manager.get_result(timeout=RESULT_POLL_S)
        if result is None:
            if not manager.is_running():
                errors.append("the continuous batching thread stopped")
                break
            continue
        if not result.is_finished():
            continue
        request, at = issued[result.request_id]
        if result.error:
            errors.append(f"request {request.index}: {result.error}")
        else:
            timings.append(_timing(request, at, result))
        if queue:
            submit()
    wall = time.perf_counter() - started
    if len(timings) + len(errors) < len(requests):
        errors.append(f"{len(requests) - len(timings) - len(errors)} request(s) unfinished after {wall:.0f}s (limit {timeout_s:.0f}s)")
    error = f"{len(errors)} error(s); first: {errors[0]}" if errors else None
    return RunRecord("hf-continuous", wall, tuple(sorted(timings, key=lambda t: t.index)), tuple(errors[:5]), error)


def _timing(request: BenchRequest, issued: float, result: Any) -> RequestTiming:
    done = time.perf_counter() - issued
    stamps = [t - issued for t in (result.timestamps or [])][: request.max_tokens]
    if not stamps:
        raise RuntimeError(f"request {request.index}: no token timestamps")
    stamp_gaps = gaps(stamps)
    tokens = min(len(result.generated_tokens), request.max_tokens)
    return RequestTiming(request.index, len(request.prompt_ids), tokens, stamps[0], stamp_gaps, done, chunks=len(stamps))
