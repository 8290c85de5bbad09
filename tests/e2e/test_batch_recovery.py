"""A batch survives its processes: kill -9 of a worker and SIGKILL of the API node dispatching it, both
mid-batch, with roles as separate processes (two API nodes, two workers, one real Redis, 3 s leases).
The batch still ends with exactly one result line per input line."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import httpx
import openai
import pytest
import redis

from cli.embedded_redis import EmbeddedRedis, free_port
from ingest.batches import batch_jobs
from shared import keys
from shared.codec import decode_delta
from shared.deltas import is_terminal

from ..conftest import ROOT

pytestmark = pytest.mark.e2e

LINES = 200


class Deployment:
    def __init__(self, data: Path) -> None:
        self.data = data
        self.redis_server = EmbeddedRedis(str(data))
        self.url = self.redis_server.start()
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "MET_LEASE_S": "3", "MET_BATCH_MAX_INFLIGHT": "16"}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.apis: list[str] = []
        self.logs: list[BinaryIO] = []

    def spawn(self, role: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.data / f"{role}-{len(self.procs)}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.logs.append(log)
        cmd = [sys.executable, "-m", "cli.main", role, "--redis-url", self.url, "--data-dir", str(self.data), *args]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def api(self) -> str:
        port = free_port()
        self.spawn("api", "--port", str(port))
        base = f"http://127.0.0.1:{port}"
        self.apis.append(base)
        return base

    def wait_ready(self, base: str, workers: int) -> None:
        end = time.monotonic() + 240
        while time.monotonic() < end:
            try:
                reply = httpx.get(f"{base}/ready", timeout=2)
                if reply.status_code == 200 and reply.json()["workers"] >= workers:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"{base} not ready")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()
        self.redis_server.stop()


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    d = Deployment(tmp_path)
    yield d
    d.stop()


def pid_of_node(node_id: bytes) -> int:
    return int(node_id.decode().rsplit("-", 2)[1])  # "<host>-<pid>-<nonce>" (ingest.http.app)


def test_a_batch_finishes_every_line_once_after_a_worker_and_its_dispatching_api_node_are_killed(deployment: Deployment) -> None:
    deployment.spawn("worker")
    deployment.spawn("worker")
    first, second = deployment.api(), deployment.api()
    for base in (first, second):
        deployment.wait_ready(base, workers=2)
    r = redis.Redis.from_url(deployment.url)
    rows = [
        {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": f"Count to {i}."}]}}
        for i in range(LINES)
    ]
    with openai.OpenAI(base_url=f"{first}/v1", api_key="x", max_retries=0, timeout=120) as client:
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, rows)).encode())), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")

    def progress() -> int:
        return sum(batch_jobs.OUTCOMES.count(k.decode()) * int(v) for k, v in r.hgetall(keys.batch_counts(batch.id)).items())

    wait = time.monotonic() + 300
    while progress() < 20 and time.monotonic() < wait:
        time.sleep(0.2)
    worker = r.zrange(keys.WORKERS_ALIVE, 0, 0)[0].decode()
    os.kill(int(r.hget(keys.worker_info(worker), "pid") or 0), signal.SIGKILL)
    while progress() < 60 and time.monotonic() < wait:
        time.sleep(0.2)
    holder = r.get(keys.batch_lease(batch.id))
    assert holder is not None and progress() < LINES, "the batch ended before the faults could be injected"
    os.kill(pid_of_node(holder), signal.SIGKILL)
    survivor = second if pid_of_node(holder) == deployment.procs[2].pid else first
    with openai.OpenAI(base_url=f"{survivor}/v1", api_key="x", max_retries=0, timeout=120) as client:
        end = time.monotonic() + 600
        while (done := client.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < end, f"batch stuck at {done.request_counts}"
            time.sleep(0.5)
        assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0)
        out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    ids = [row["custom_id"] for row in out]
    assert len(ids) == LINES and sorted(set(ids)) == sorted(row["custom_id"] for row in rows)
    assert r.get(keys.batch_lease(batch.id)) is None
    # Each line was queued once: its derived request id's delta stream holds exactly one terminal event.
    streams = [r.xrange(keys.delta_stream(row["response"]["request_id"])) for row in out]
    terminals = [sum(1 for _, f in entries if b"d" in f and is_terminal(decode_delta(f[b"d"]))) for entries in streams]
    assert terminals == [1] * LINES
