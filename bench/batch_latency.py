"""Interactive latency while a batch drains: TTFT p50 of streaming chat requests with the server idle,
then while a 200-line batch runs beside them, through one `met serve` with default settings.

    .venv/bin/python bench/batch_latency.py [--lines 200] [--probes 12] [--batch-max-tokens 64]

Prints both medians, their ratio (target ≤ 1.5×), and the batch's own throughput. The baseline is the
same server with no batch: the comparison is ours against ourselves, which is what the target is about.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI
from ours import running_server, wait_ready


def ttft(client: OpenAI, i: int) -> float:
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": f"Say one word about the number {i}."}], max_tokens=16, temperature=0, stream=True
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
    return first if first is not None else time.perf_counter() - started


def probe(client: OpenAI, count: int, pause: float) -> list[float]:
    out = []
    for i in range(count):
        out.append(ttft(client, i))
        time.sleep(pause)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--probes", type=int, default=12)
    parser.add_argument("--batch-max-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, running_server(Path(tmp)) as server:
        wait_ready(server)
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=300)
        probe(client, 2, 0.0)  # warm-up
        idle = probe(client, args.probes, 0.3)
        rows = [
            {
                "custom_id": f"l{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "m", "max_tokens": args.batch_max_tokens, "messages": [{"role": "user", "content": f"Write about the number {i}."}], "ignore_eos": True},
            }
            for i in range(args.lines)
        ]
        uploaded = client.files.create(file=("b.jsonl", io.BytesIO("\n".join(map(json.dumps, rows)).encode())), purpose="batch")
        started = time.perf_counter()
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        while client.batches.retrieve(batch.id).request_counts.completed < 8:
            time.sleep(0.2)
        busy = probe(client, args.probes, 0.3)
        while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            time.sleep(0.5)
        wall = time.perf_counter() - started
    idle_p50, busy_p50 = statistics.median(idle), statistics.median(busy)
    print(f"interactive TTFT p50, idle:          {idle_p50 * 1000:7.1f} ms  ({args.probes} streaming requests)")
    print(f"interactive TTFT p50, batch running: {busy_p50 * 1000:7.1f} ms")
    print(f"ratio: {busy_p50 / idle_p50:.2f}x  (target <= 1.5x)")
    usage = done.usage.output_tokens if done.usage else 0
    print(f"batch: {done.status}, {done.request_counts.completed}/{done.request_counts.total} lines in {wall:.1f} s, {usage / wall:.1f} output tok/s")
    return 0 if busy_p50 / idle_p50 <= 1.5 else 1


if __name__ == "__main__":
    sys.exit(main())
