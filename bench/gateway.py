"""The gateway's overhead: one workload against an upstream directly and through a gateway in front of it.

    cd bench && ../.venv/bin/python gateway.py                      # our own met serve as the upstream
    cd bench && ../.venv/bin/python gateway.py --upstream llamacpp  # llama.cpp's server (./dev test-gateway builds it)

Starts the upstream and a `met serve --upstream …` in front of it, then runs the same streaming chat
workload (greedy, `ignore_eos` where the upstream honours it, fixed max_tokens) against each, twice in
turn (direct, gateway, direct, gateway) so a drift of the shared machine hits both alike. TTFT = first
content chunk at the client; throughput = output characters / wall time (llama-cpp-python's server
streams no usage; the text is the same on both paths, greedy). Prints TTFT p50
of each, the overhead (gateway − direct, ms) and the throughput ratio (gateway / direct); targets ≤ 10 ms
and ≥ 0.95×. Only the ratios mean anything on a loaded machine.

It also prints where the CPU went in each mode: CPU seconds per 1,000 output chunks of the upstream,
the gateway's API process, its worker(s), its Redis and this client (psutil, user + system), so the
gateway path's own cost per chunk is a number, not a guess.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cli.embedded_redis import free_port  # noqa: E402

PROMPTS = ["Tell me about Paris.", "Write about the sea.", "Describe a forest.", "Explain how rain forms."]


def wait_http(url: str, proc: subprocess.Popen[bytes], *, timeout: float = 300.0, ready_key: str | None = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args} exited with {proc.returncode}")
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200 and (ready_key is None or r.json().get(ready_key)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready in {timeout}s")


def start_met(data_dir: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "cli.main", "serve", "--port", str(port), "--data-dir", str(data_dir), *extra]
    with open(data_dir.with_suffix(".log"), "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{port}/ready", proc, ready_key="workers")
    return proc


def start_llamacpp(port: int, threads: int | None) -> subprocess.Popen[bytes]:
    from tests.e2e.llamacpp import llamacpp_command

    proc = subprocess.Popen(llamacpp_command(port, threads=threads), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{port}/v1/models", proc)
    return proc


def processes(upstream: subprocess.Popen[bytes], gateway: subprocess.Popen[bytes]) -> dict[str, list[psutil.Process]]:
    """The processes whose CPU is counted, by role (a `met serve`'s children: redis-server, workers)."""
    out: dict[str, list[psutil.Process]] = {"upstream": [], "api": [], "worker": [], "redis": [], "client": [psutil.Process()]}
    for root, role in ((upstream, "upstream"), (gateway, "api")):
        top = psutil.Process(root.pid)
        out[role].append(top)
        for child in top.children(recursive=True):
            name = " ".join(child.cmdline())
            out["redis" if "redis-server" in name else "worker" if " worker" in name else role].append(child)
    return out


def cpu_seconds(procs: dict[str, list[psutil.Process]]) -> dict[str, float]:
    totals = {}
    for role, members in procs.items():
        total = 0.0
        for proc in members:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                pass
        totals[role] = total
    return totals


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft, chars, chunks, last = -1.0, 0, 0, started
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text = (chunk["choices"][0]["delta"].get("content") or "") if chunk.get("choices") else ""
            if ttft < 0 and text:
                ttft = time.perf_counter() - started
            chars += len(text)
            chunks += bool(text)
            last = time.perf_counter() if text else last
    CHUNKS[0] += chunks
    TIMES.append((ttft, last - started, time.perf_counter() - started))
    return ttft, chars


CHUNKS = [0]  # content chunks received, all requests
TIMES: list[tuple[float, float, float]] = []  # per request: first content, last content, end of stream (s from the start)


async def workload(url: str, *, requests: int, concurrency: int, max_tokens: int) -> tuple[list[float], float]:
    """(TTFTs, output characters per second) of `requests` streaming requests, `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def run(i: int) -> tuple[float, int]:
            async with gate:
                return await one(client, url, PROMPTS[i % len(PROMPTS)], max_tokens)

        started = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(requests)))
        wall = time.perf_counter() - started
    return [t for t, _ in results], sum(n for _, n in results) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", choices=("met", "llamacpp"), default="met")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--pin", action="store_true", help="diagnosis, not a headline: the upstream on CPU 0, the gateway and this client on CPU 1")
    parser.add_argument("--upstream-threads", type=int, default=None, help="llama.cpp's --n_threads (default: its own, half the cores)")
    parser.add_argument("--rounds", type=int, default=2, help="direct then gateway, this many times in turn")
    parser.add_argument("--gateway-arg", action="append", default=[], help="one more `met serve` flag for the gateway, e.g. --gateway-arg=--no-upstream-yield")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    up_port, gw_port = free_port(), free_port()
    procs = []
    try:
        procs.append(start_met(tmp / "upstream", up_port) if args.upstream == "met" else start_llamacpp(up_port, args.upstream_threads))
        procs.append(start_met(tmp / "gateway", gw_port, "--upstream", f"http://127.0.0.1:{up_port}/v1", "--upstream-max-inflight", str(args.concurrency), *args.gateway_arg))
        direct_url, gateway_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
        shape = {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens}
        asyncio.run(workload(direct_url, requests=args.concurrency, concurrency=args.concurrency, max_tokens=8))  # warm-up
        asyncio.run(workload(gateway_url, requests=args.concurrency, concurrency=args.concurrency, max_tokens=8))
        ttfts: dict[str, list[float]] = {"direct": [], "gateway": []}
        rates: dict[str, list[float]] = {"direct": [], "gateway": []}
        watched = processes(procs[0], procs[1])
        if args.pin:  # does the gateway cost the upstream time only by sharing its cores?
            for role, members in watched.items():
                for proc in members:
                    proc.cpu_affinity([0] if role == "upstream" else [1])
        cpu: dict[str, dict[str, float]] = {"direct": {}, "gateway": {}}
        chunks = {"direct": 0, "gateway": 0}
        spans: dict[str, list[tuple[float, float, float]]] = {"direct": [], "gateway": []}
        for _ in range(args.rounds):
            for name, url in (("direct", direct_url), ("gateway", gateway_url)):
                before, count = cpu_seconds(watched), CHUNKS[0]
                TIMES.clear()
                t, rate = asyncio.run(workload(url, **shape))
                after = cpu_seconds(watched)
                for role in after:
                    cpu[name][role] = cpu[name].get(role, 0.0) + after[role] - before[role]
                chunks[name] += CHUNKS[0] - count
                spans[name] += TIMES
                ttfts[name] += t
                rates[name].append(rate)
        p50 = {k: statistics.median(v) * 1000 for k, v in ttfts.items()}
        tput = {k: statistics.mean(v) for k, v in rates.items()}
        threads = f" ({args.upstream_threads or 'default'} threads)" if args.upstream == "llamacpp" else ""
        threads += " (pinned: upstream on CPU 0, the rest on CPU 1)" if args.pin else ""
        threads += f" (gateway: {' '.join(args.gateway_arg)})" if args.gateway_arg else ""
        print(f"upstream: {args.upstream}{threads}; {args.requests} requests x {args.rounds} rounds, {args.concurrency} concurrent, {args.max_tokens} tokens each")
        print(f"TTFT p50 direct {p50['direct']:.1f} ms, through the gateway {p50['gateway']:.1f} ms: overhead {p50['gateway'] - p50['direct']:+.1f} ms (target <= 10)")
        print(f"throughput direct {tput['direct']:.1f} chars/s, through the gateway {tput['gateway']:.1f} chars/s: ratio {tput['gateway'] / tput['direct']:.3f}x (target >= 0.95)")
        for name in ("direct", "gateway"):
            first, last, end = (statistics.median(x[i] for x in spans[name]) * 1000 for i in range(3))
            ends = [x[2] * 1000 for x in spans[name]]
            print(
                f"request p50, {name}: first content {first:.1f} ms, last content {last:.1f} ms, end of stream {end:.1f} ms"
                f" (mean {statistics.mean(ends):.1f}, max {max(ends):.1f})"
            )
        for name in ("direct", "gateway"):
            per = {role: 1000 * seconds / max(1, chunks[name]) for role, seconds in cpu[name].items()}
            shown = ", ".join(f"{role} {value:.2f}" for role, value in per.items())
            print(f"CPU s per 1000 chunks, {name} ({chunks[name]} chunks): {shown}; total {sum(per.values()):.2f}")
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
