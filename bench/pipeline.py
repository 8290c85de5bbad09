"""The pipeline under load: thousands of concurrent streams through API nodes and workers whose model
costs next to nothing, so what is measured is the server's own work per token.

    python bench/pipeline.py [--streams 64,256,1024,4096] [--tokens 128] [--engine tiny|sim]
                             [--sim-step-ms 20] [--topology 1x1|2x2] [--flag=--stream-interval=4 ...]

Engines (the worker's model):
- tiny: a 2-layer, hidden-64 random Llama on the default model's tokenizer and template
  (tests/tiny_model.py, built offline once), run by the real worker (scheduler, lean forward,
  sampling, detokenization): the issue's measuring setup;
- sim: the simulated engine (`--model-impl sim`, workers/sim.py): the same worker and engine, the
  forward replaced by a sleep of `--sim-step-ms` per step (the GPU's time, no CPU), so the worker's
  CPU is the pipeline's alone.
Topologies: 1x1 is `met serve` (embedded Redis, one API node, one worker); 2x2 is a redis-server,
two `met api` and two `met worker` processes, the clients split over the two API nodes.

Per stream count, N clients (bench/loadclient.py, one connection each, all started at once) stream
`--tokens` tokens each (`ignore_eos`, greedy) while `/ready` is polled every 0.5 s. Printed: delivered
tokens/s (completion tokens of complete streams / wall time), errors (non-200, cut or incomplete
streams), ITL p50 / p99 (gaps between content events; with sim, also over the engine's step time),
`/ready` statuses, and CPU ms per 1k delivered tokens per process kind: API, worker, Redis, the
client (this process). The server runs with room for every stream (`--max-running`, `--max-queue`,
`--max-connections` raised to the stream count), as an operator sizing a node for this load would.

Only loopback traffic; every run is bounded in time; the servers are always stopped.
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
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from loadclient import ReadyWatch, StreamResult, chat_body, stream_once, watch_ready
from measure import TreeSampler, percentile

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from cli.embedded_redis import EmbeddedRedis, free_port  # noqa: E402
from tests.tiny_model import TINY_NAME, build_tiny_model  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the sea."
READY_TIMEOUT_S = 300.0


@dataclass
class Server:
    """The processes of one topology: every API node's port, and the pids whose trees are sampled."""

    ports: list[int]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    redis_url: str = ""

    def log_tail(self) -> str:
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in self.logs if p.exists())


@dataclass(frozen=True)
class Flags:
    """Each role's flags: `met api` takes the API node's, `met worker` the worker's, `met serve` both."""

    api: tuple[str, ...]
    worker: tuple[str, ...]

    @property
    def serve(self) -> list[str]:
        return [*self.api, *self.worker]


def flags_for(engine: str, cache: Path, sim_step_ms: float, streams: int, extra: list[str]) -> Flags:
    model = ("--model", str(build_tiny_model(cache / TINY_NAME))) if engine == "tiny" else ()
    engine_flags = ("--model-impl", "sim", "--sim-step-ms", str(sim_step_ms)) if engine == "sim" else ()
    room = str(max(streams, 32))
    api = (*model, "--max-queue", str(max(streams * 2, 256)), "--max-connections", str(max(streams * 2, 1024)))
    worker = (*model, *engine_flags, "--max-running", room)
    extra_api = tuple(f for f in extra if f.split("=")[0] in API_FLAGS)
    extra_worker = tuple(f for f in extra if f.split("=")[0] not in API_FLAGS)
    return Flags(api + extra_api, worker + extra_worker)


API_FLAGS = {"--redis-max-connections", "--max-queue", "--max-connections", "--ping-interval"}  # --flag values that go to the API node


def _spawn(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


@contextmanager
def topology(kind: str, workdir: Path, flags: Flags) -> Iterator[Server]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    met = [sys.executable, "-m", "cli.main"]
    with ExitStack() as stack:
        if kind == "1x1":
            port = free_port()
            server = Server([port])
            cmd = [*met, "serve", "--no-tui", "--port", str(port), "--data-dir", str(workdir), "--workers", "1", *flags.serve]
            server.logs.append(workdir / "serve.log")
            server.procs.append(_spawn(cmd, server.logs[-1], env))
            server.redis_url = str(workdir / "redis.url")  # read once it exists (`serve` writes it at start)
        else:
            redis = EmbeddedRedis(str(workdir / "redis"))
            url = redis.start()
            stack.callback(redis.stop)
            server = Server([free_port(), free_port()], redis_url=url)
            for i, port in enumerate(server.ports):
                server.logs.append(workdir / f"api{i}.log")
                server.procs.append(_spawn([*met, "api", "--redis-url", url, "--port", str(port), *flags.api], server.logs[-1], env))
            for i in range(2):
                server.logs.append(workdir / f"worker{i}.log")
                server.procs.append(_spawn([*met, "worker", "--redis-url", url, *flags.worker], server.logs[-1], env))
            server.procs.append(_redis_proc(redis))
        stack.callback(_stop, server)
        _wait_ready(server, workers=1 if kind == "1x1" else 2)
        if kind == "1x1":
            server.redis_url = Path(server.redis_url).read_text().strip()
        yield server


def _redis_proc(redis: EmbeddedRedis) -> subprocess.Popen[bytes]:
    """The embedded redis-server's process, for sampling (its Popen object, whatever EmbeddedRedis names it)."""
    for value in vars(redis).values():
        if isinstance(value, subprocess.Popen):
            return value
    raise RuntimeError("EmbeddedRedis keeps no process handle")


def _wait_ready(server: Server, *, workers: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    for port in server.ports:
        while True:
            if any(p.poll() is not None for p in server.procs):
                raise RuntimeError(f"a server process exited:\n{server.log_tail()}")
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2)
                if ready.status_code == 200 and ready.json()["workers"] >= workers:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready in {READY_TIMEOUT_S:.0f} s:\n{server.log_tail()}")
            time.sleep(0.25)


def _stop(server: Server) -> None:
    for proc in server.procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in server.procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def worker_phases(server: Server) -> dict[str, float]:
    """The workers' CPU ms per loop phase (workers.claims.Phases), summed over their heartbeats."""
    import redis

    totals: dict[str, float] = {}
    with redis.Redis.from_url(server.redis_url) as client:
        for key in client.scan_iter(match="met:worker:*"):
            for name, value in client.hgetall(key).items():
                field_name = name.decode()
                if field_name.startswith("cpu_") and field_name.endswith("_ms"):
                    totals[field_name[4:-3]] = totals.get(field_name[4:-3], 0.0) + float(value)
    return totals


@dataclass
class LoadResult:
    streams: int
    wall_s: float
    results: list[StreamResult]
    ready: ReadyWatch
    cpu_s: dict[str, float]
    phases_ms: dict[str, float] = field(default_factory=dict)

    @property
    def complete(self) -> list[StreamResult]:
        return [r for r in self.results if r.complete]

    @property
    def tokens(self) -> int:
        return sum(r.completion_tokens for r in self.complete)

    def errors(self) -> dict[str, int]:
        kinds: dict[str, int] = {}
        for r in self.results:
            if not r.complete:
                kind = f"{r.status} {r.error[:60]}" if r.error else f"{r.status} incomplete"
                kinds[kind] = kinds.get(kind, 0) + 1
        return kinds

    def gaps_ms(self) -> list[float]:
        return [(b - a) * 1000 for r in self.complete for a, b in zip(r.event_times, r.event_times[1:], strict=False)]


async def _load(ports: list[int], streams: int, body: bytes, timeout_s: float) -> tuple[list[StreamResult], ReadyWatch, float]:
    stop, watch = asyncio.Event(), ReadyWatch()
    watcher = asyncio.create_task(watch_ready("127.0.0.1", ports[0], stop, watch))
    started = time.perf_counter()
    results = await asyncio.gather(*(stream_once("127.0.0.1", ports[i % len(ports)], body, timeout_s=timeout_s) for i in range(streams)))
    wall = time.perf_counter() - started
    stop.set()
    await watcher
    return list(results), watch, wall


def _roles(pid: int) -> str:
    line = " ".join(psutil.Process(pid).cmdline())
    return line


def warm_up(server: Server, model: str, timeout_s: float) -> None:
    asyncio.run(_load(server.ports, 8, chat_body(model=model, prompt=PROMPT, max_tokens=8), timeout_s))


def run_load(server: Server, streams: int, tokens: int, model: str, timeout_s: float) -> LoadResult:
    body = chat_body(model=model, prompt=PROMPT, max_tokens=tokens)
    phases = worker_phases(server)
    samplers = [TreeSampler(p.pid, max_duration_s=timeout_s + 60).start() for p in server.procs]
    results, watch, wall = asyncio.run(_load(server.ports, streams, body, timeout_s))
    time.sleep(1.5)  # a heartbeat after the last step
    after = worker_phases(server)
    cpu: dict[str, float] = {}
    for sampler in samplers:
        usage = sampler.stop()
        for role, seconds in usage.cpu_by_role.items():
            cpu[role] = cpu.get(role, 0.0) + seconds
        cpu["client"] = usage.bench_cpu_s
    return LoadResult(streams, wall, results, watch, cpu, {name: after[name] - phases.get(name, 0.0) for name in after})


def report(result: LoadResult, *, step_ms: float) -> dict[str, object]:
    tokens = max(result.tokens, 1)
    gaps = result.gaps_ms()
    per_1k = {role: round(seconds * 1e6 / tokens, 1) for role, seconds in sorted(result.cpu_s.items())}
    server_roles = [r for r in per_1k if r != "client"]
    row: dict[str, object] = {
        "streams": result.streams,
        "complete": len(result.complete),
        "errors": result.errors(),
        "delivered_tok_s": round(result.tokens / result.wall_s, 1),
        "wall_s": round(result.wall_s, 2),
        "itl_p50_ms": round(percentile(gaps, 50), 1),
        "itl_p99_ms": round(percentile(gaps, 99), 1),
        "ready": result.ready.statuses,
        "ready_failures": result.ready.failures[:3],
        "cpu_ms_per_1k": per_1k,
        "server_cpu_ms_per_1k": round(sum(per_1k[r] for r in server_roles), 1),
        "worker_phases_ms_per_1k": {name: round(ms * 1000 / tokens, 1) for name, ms in result.phases_ms.items()},
    }
    if step_ms:
        row["itl_added_p50_ms"] = round(percentile(gaps, 50) - step_ms, 1)
        row["itl_added_p99_ms"] = round(percentile(gaps, 99) - step_ms, 1)
    if gaps:
        row["itl_mean_ms"] = round(statistics.fmean(gaps), 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="64,256,1024")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--engine", choices=("tiny", "sim"), default="tiny")
    parser.add_argument("--sim-step-ms", type=float, default=20.0)
    parser.add_argument("--topology", choices=("1x1", "2x2"), default="1x1")
    parser.add_argument("--flag", action="append", default=[], help="an extra flag (--name=value), for the API nodes or the workers as its name says (repeatable)")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--rounds", type=int, default=1, help="loads per stream count on the same server; the median round by server CPU is reported")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    cache = Path(os.environ.get("MET_BENCH_CACHE", Path.home() / ".cache" / "metrale" / "bench"))
    cache.mkdir(parents=True, exist_ok=True)
    rows = []
    for streams in (int(s) for s in opts.streams.split(",")):
        with tempfile.TemporaryDirectory(prefix="met-pipeline-") as tmp:
            flags = flags_for(opts.engine, cache, opts.sim_step_ms, streams, opts.flag)
            with topology(opts.topology, Path(tmp), flags) as server:
                model = httpx.get(f"http://127.0.0.1:{server.ports[0]}/v1/models", timeout=10).json()["data"][0]["id"]
                warm_up(server, model, opts.timeout_s)
                rounds = [report(run_load(server, streams, opts.tokens, model, opts.timeout_s), step_ms=step_ms(opts)) for _ in range(opts.rounds)]
        row = sorted(rounds, key=lambda r: float(r["server_cpu_ms_per_1k"]))[len(rounds) // 2]  # type: ignore[arg-type]
        row.update(engine=opts.engine, topology=opts.topology, tokens=opts.tokens, flags=opts.flag, rounds=len(rounds))
        if len(rounds) > 1:
            row["server_cpu_ms_per_1k_rounds"] = [r["server_cpu_ms_per_1k"] for r in rounds]
        rows.append(row)
        print(json.dumps(row) if opts.json else _line(row), flush=True)


def step_ms(opts: argparse.Namespace) -> float:
    return float(opts.sim_step_ms) if opts.engine == "sim" else 0.0


def _line(row: dict[str, object]) -> str:
    cpu = row["cpu_ms_per_1k"]
    assert isinstance(cpu, dict)
    parts = " / ".join(f"{k} {v}" for k, v in cpu.items())
    return (
        f"{row['streams']:>5} streams: {row['delivered_tok_s']:>8} tok/s, {row['complete']} complete, errors {row['errors'] or 0}, "
        f"ITL p50 {row['itl_p50_ms']} / p99 {row['itl_p99_ms']} ms, /ready {row['ready']}, "
        f"server CPU {row['server_cpu_ms_per_1k']} ms per 1k tokens ({parts}); worker phases {row['worker_phases_ms_per_1k']}"
        + (f"; rounds {row['server_cpu_ms_per_1k_rounds']}" if "server_cpu_ms_per_1k_rounds" in row else "")
    )


if __name__ == "__main__":
    main()
