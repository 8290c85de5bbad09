"""What constrained decoding costs the rows that do not use it: one batch of 32 through the pipeline.

Two runs against one live `met serve --workers 1` (started as in ours.py; the default model), each 32
streaming chat requests sent at once (one decode batch; `--max-running` defaults to 32), greedy,
`max_tokens` each:
- all-free: 32 unconstrained requests (`ignore_eos`, so each generates exactly max_tokens);
- half: the same 16 unconstrained requests (even indices) + 16 with a JSON-schema `response_format`
  (an object holding an array of short strings, so the grammar keeps the row busy for a while).
Figures: the unconstrained half's decode tok/s (per request: (completion tokens − 1) / (end − first
token), then the median over the half), in both runs, and the ratio (target: within 10 %); the
constrained rows' grammar-mask overhead per step, from the worker's heartbeat counters
(`mask_ms_total` / `masked_steps`, filled by the sampler) over the half run. The run order is
all-free, half, all-free again, and the better all-free figure is the baseline (a shared machine).

    python bench/constrained.py [--max-tokens 64]

Only loopback traffic; every wait is bounded; the server is always stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from openai import AsyncOpenAI
from ours import REPO_ROOT, running_server, wait_ready

sys.path.insert(0, str(REPO_ROOT))
from shared import keys

BATCH = 32
SCHEMA = {
    "type": "object",
    "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 8, "maxItems": 24}},
    "required": ["words"],
    "additionalProperties": False,
}
PROMPTS = ["Tell me about rivers.", "List words about the sea.", "Describe a mountain.", "Name things in a kitchen."]


async def one(client: AsyncOpenAI, index: int, *, constrained: bool, max_tokens: int) -> dict[str, Any]:
    extra: dict[str, Any] = {} if constrained else {"ignore_eos": True}
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "words", "schema": SCHEMA}} if constrained else {"type": "text"}
    issued = time.perf_counter()
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        max_tokens=max_tokens,
        response_format=fmt,
        extra_body=extra,
    )
    first = last = 0.0
    tokens = 0
    async for chunk in stream:
        now = time.perf_counter() - issued
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or now
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    rate = (tokens - 1) / (last - first) if last > first else 0.0
    return {"index": index, "constrained": constrained, "tokens": tokens, "decode_tps": rate}


async def batch(base_url: str, *, half: bool, max_tokens: int) -> list[dict[str, Any]]:
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=600)
    try:
        jobs = [one(client, i, constrained=half and i % 2 == 1, max_tokens=max_tokens) for i in range(BATCH)]
        return list(await asyncio.wait_for(asyncio.gather(*jobs), timeout=900))
    finally:
        await client.close()


def mask_counters(redis_url: str) -> tuple[float, int]:
    r = redis.Redis.from_url(redis_url)
    try:
        total_ms, steps = 0.0, 0
        for worker in r.zrange(keys.WORKERS_ALIVE, 0, -1):
            info = r.hgetall(keys.worker_info(worker.decode()))
            total_ms += float(info.get(b"mask_ms_total", 0))
            steps += int(info.get(b"masked_steps", 0))
        return total_ms, steps
    finally:
        r.close()


def free_rate(results: list[dict[str, Any]]) -> float:
    return statistics.median(r["decode_tps"] for r in results if r["index"] % 2 == 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, running_server(Path(tmp)) as server:
        wait_ready(server)
        redis_url = (Path(tmp) / "redis.url").read_text().strip()
        asyncio.run(batch(server.base_url, half=False, max_tokens=8))  # warm-up
        free1 = asyncio.run(batch(server.base_url, half=False, max_tokens=args.max_tokens))
        time.sleep(2.5)  # a heartbeat lands between runs
        ms0, steps0 = mask_counters(redis_url)
        mixed = asyncio.run(batch(server.base_url, half=True, max_tokens=args.max_tokens))
        time.sleep(2.5)
        ms1, steps1 = mask_counters(redis_url)
        free2 = asyncio.run(batch(server.base_url, half=False, max_tokens=args.max_tokens))
    baseline = max(free_rate(free1), free_rate(free2))
    mixed_rate = free_rate(mixed)
    constrained = [r for r in mixed if r["constrained"]]
    steps = steps1 - steps0
    print(f"batch {BATCH}, max_tokens {args.max_tokens}, greedy, one worker")
    print(f"unconstrained half, all-unconstrained run: {baseline:.1f} tok/s per request (median; runs {free_rate(free1):.1f}, {free_rate(free2):.1f})")
    print(f"unconstrained half, half-constrained run:  {mixed_rate:.1f} tok/s per request (median)")
    print(f"ratio: {mixed_rate / baseline:.3f} (target >= 0.90)")
    print(f"constrained rows: {statistics.median(r['tokens'] for r in constrained):.0f} tokens each (median), {statistics.median(r['decode_tps'] for r in constrained):.1f} tok/s per request")
    if steps:
        print(f"grammar mask overhead: {(ms1 - ms0) / steps:.2f} ms per step over {steps} masked steps (fill 16 masks + apply)")


if __name__ == "__main__":
    main()
