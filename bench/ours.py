"""Our system under test: a live `met serve` subprocess driven over loopback HTTP by streaming clients.

Owns: starting the server exactly as a user would (`python -m cli.main serve --workers 1`, offline),
waiting for GET /ready, always stopping it (and any child it leaves behind), and a closed loop of N
concurrent clients using the official `openai` AsyncOpenAI SDK with `stream=True`, greedy decoding,
`ignore_eos` and `stream_options.include_usage`, so every request generates exactly its max_tokens.
Per request: TTFT = first content chunk, gaps between content chunks, end-to-end time.
Must not: reach anything but 127.0.0.1, or loop without a count and time bound.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from measure import RequestTiming, RunRecord, gaps
from openai import AsyncOpenAI
from workloads import BenchRequest, Workload

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class LiveServer:
    proc: subprocess.Popen[bytes]
    base_url: str  # http://127.0.0.1:<port>
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def free_loopback_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def running_server(data_dir: Path, *flags: str) -> Iterator[LiveServer]:
    """`met serve [flags]` on a free loopback port, not yet ready (see `wait_ready`); stopped, tree
    included, however the block ends."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_loopback_port()
    log_path = data_dir / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "MET_HOST": "127.0.0.1"}
    cmd = [sys.executable, "-m", "cli.main", "serve", "--port", str(port), "--data-dir", str(data_dir), "--workers", "1", *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = LiveServer(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        yield server
    finally:
        _stop(server)


def wait_ready(server: LiveServer) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"met serve exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.base_url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"met serve was not ready in {READY_TIMEOUT_S:.0f}s:\n{server.log_tail()}")


def _stop(server: LiveServer) -> None:
    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.Error:
        children = []
    if server.proc.poll() is None:
        terminate(server.proc, STOP_TIMEOUT_S)
    for child in children:  # only what this server started (worker, redis-server), by pid
        try:
            if child.is_running():
                child.kill()
        except psutil.Error:
            continue


def terminate(proc: subprocess.Popen[bytes], wait_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited in `wait_s`."""
    proc.terminate()
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@dataclass(frozen=True, slots=True)
class ClientConfig:
    base_url: str
    model: str
    request_timeout_s: float  # per request, from issue to the last chunk
    workload_timeout_s: float  # the whole closed loop
    models: tuple[str, ...] = ()  # when set, request i asks for models[i % len(models)] (bench/lora.py: adapters)


def served_model(base_url: str) -> str:
    reply = httpx.get(f"{base_url}/v1/models", timeout=10).json()
    return str(reply["data"][0]["id"])


def run_workload(config: ClientConfig, workload: Workload) -> RunRecord:
    return asyncio.run(_closed_loop(config, workload))


def warm_up(config: ClientConfig, message: str) -> None:
    """One short request first, so one-time costs (lazy init, first allocation) are not measured."""

    async def one() -> None:
        client = _client(config)
        try:
            await _one_request(client, config, BenchRequest(-1, message, 0, (), 4))
        finally:
            await client.close()

    asyncio.run(one())


def _client(config: ClientConfig) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{config.base_url}/v1", api_key="unused", max_retries=0, timeout=config.request_timeout_s)


async def _closed_loop(config: ClientConfig, workload: Workload) -> RunRecord:
    """`concurrency` clients; each takes the next request (arrival order) as soon as its previous one ends."""
    client = _client(config)
    pending = iter(workload.requests)
    timings: list[RequestTiming] = []
    errors: list[str] = []

    async def worker() -> None:
        for request in pending:  # shared iterator: bounded by the workload's request count
            try:
                timings.append(await _one_request(client, config, request))
            except Exception as exc:
                errors.append(f"request {request.index}: {type(exc).__name__}: {exc}")

    started = time.perf_counter()
    try:
        tasks = [worker() for _ in range(workload.spec.concurrency)]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=config.workload_timeout_s)
    except TimeoutError:
        errors.append(f"workload timed out after {config.workload_timeout_s:.0f}s")
    finally:
        await client.close()
    wall = time.perf_counter() - started
    return _record(wall, timings, errors, workload)


async def _one_request(client: AsyncOpenAI, config: ClientConfig, request: BenchRequest) -> RequestTiming:
    issued = time.perf_counter()
    stream = await client.chat.completions.create(
        model=config.models[request.index % len(config.models)] if config.models and request.index >= 0 else config.model,
        messages=[{"role": "user", "content": request.message}],
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        max_tokens=request.max_tokens,
        extra_body={"ignore_eos": True},
    )
    chunk_times: list[float] = []
    prompt_tokens = completion_tokens = cached = 0
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            chunk_times.append(now - issued)
        if chunk.usage is not None:
            prompt_tokens, completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            cached = details.cached_tokens or 0 if details is not None else 0
    done = time.perf_counter() - issued
    if not chunk_times:
        raise RuntimeError("no content chunk received")
    chunk_gaps = gaps(chunk_times)
    useful = min(completion_tokens, request.max_tokens)
    return RequestTiming(request.index, prompt_tokens, useful, chunk_times[0], chunk_gaps, done, chunks=len(chunk_times), cached_tokens=cached)


def _record(wall: float, timings: list[RequestTiming], errors: list[str], workload: Workload) -> RunRecord:
    by_index = {r.index: r for r in workload.requests}
    notes = list(errors[:5])
    short = [t.index for t in timings if t.output_tokens != by_index[t.index].max_tokens]
    if short:
        notes.append(f"{len(short)} request(s) generated fewer tokens than max_tokens: {short[:8]}")
    wrong_prompt = [t.index for t in timings if t.prompt_tokens != len(by_index[t.index].prompt_ids)]
    if wrong_prompt:
        notes.append(f"{len(wrong_prompt)} request(s) report a prompt token count unlike the bench's rendering: {wrong_prompt[:8]}")
    chunks = sum(t.chunks for t in timings)
    tokens = sum(t.output_tokens for t in timings)
    extra = {"tokens_per_chunk": tokens / chunks if chunks else 0.0, "failed_requests": float(len(errors))}
    ordered = sorted(timings, key=lambda t: t.index)
    if workload.spec.shared_prefix and len(ordered) > 1:
        later = sorted(t.ttft_s for t in ordered[1:])
        extra["prefix_first_ttft_ms"] = ordered[0].ttft_s * 1000
        extra["prefix_later_ttft_p50_ms"] = later[len(later) // 2] * 1000
        extra["prefix_later_min_cached_tokens"] = float(min(t.cached_tokens for t in ordered[1:]))
    error = f"{len(errors)} request(s) failed; first: {errors[0]}" if errors else None
    return RunRecord("ours", wall, tuple(sorted(timings, key=lambda t: t.index)), tuple(notes), error, extra)


def worker_figures(server: LiveServer, data_dir: Path) -> dict[str, float]:
    """From the worker's heartbeat hash in the embedded Redis: peak running sequences and KV pool size."""
    import redis

    from shared import keys

    figures: dict[str, float] = {}
    url = (data_dir / "redis.url").read_text().strip()
    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(match=keys.worker_info("*"), count=100):
            info = {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
            if "running_peak" in info:
                figures["peak_running_seqs"] = float(info["running_peak"])
                figures["kv_pool_tokens"] = float(info.get("kv_total_tokens", 0))
    finally:
        client.close()
    return figures


def worker_rss(server: LiveServer) -> dict[str, float]:
    """RSS of the server's worker process now (taken right after /ready: model + KV pool as started)."""
    try:
        for child in psutil.Process(server.proc.pid).children(recursive=True):
            if "worker" in child.cmdline():
                return {"worker_rss_mib": child.memory_info().rss / 2**20}
    except psutil.Error:
        pass
    return {}
