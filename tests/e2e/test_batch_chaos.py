"""A batch through chaos (issue 34's batch experiment), with live processes: two `met api` nodes and two
simulated `met worker`s (`--model-impl sim`: the real worker, scheduler and engine, each forward a wait)
on a redis-server of the test's own, 3 s leases. Every 3 s `CLIENT KILL TYPE normal` drops every Redis
connection of every process at once, and once the API node leading the batch is SIGSTOPped for 15 s: its
lease lapses, the other node takes the batch over, and the stopped node wakes later with its old view of
the batch. The batch still ends with every custom_id exactly once, counts that add up, each line queued
once, and nothing dead-lettered. (Every client retries a command once on a connection error, bus.connect,
so most kills are absorbed by that retry; what reaches the dispatcher is covered line by line in
tests/ingest/test_batch_dispatch*.py.)"""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from ingest.batches import batch_jobs
from shared import keys
from shared.codec import decode_delta
from shared.deltas import is_terminal

from ..topology import RedisProcs, Role, spawn_role, start_standalone, wait_serving

pytestmark = pytest.mark.e2e

LINES = 300
KILL_EVERY_S, STOP_S = 3.0, 15.0
ENV = {"MET_LEASE_S": "3", "MET_BATCH_MAX_INFLIGHT": "8"}  # the batch and worker leases; few lines at once, so it runs long enough
SIM = ("--model-impl", "sim", "--sim-step-ms", "20")


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    procs: RedisProcs = start_standalone(tmp_path / "redis")
    yield f"redis://127.0.0.1:{procs.ports[0]}/0"
    procs.stop()


class Killer:
    """`CLIENT KILL TYPE normal` every KILL_EVERY_S from a thread (its own connection is skipped)."""

    def __init__(self, url: str) -> None:
        self.redis = redis.Redis.from_url(url)
        self.kills = 0
        self.dropped = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(KILL_EVERY_S):
            try:
                self.dropped += int(self.redis.client_kill_filter(_type="normal"))
                self.kills += 1
            except redis.RedisError:
                pass

    def stop(self) -> None:
        self.done.set()
        self.thread.join(10)


def retrying(what: str, call: Any, timeout: float) -> Any:
    """`call()` until it answers: a request can meet a killed connection or a stopped node."""
    end = time.monotonic() + timeout
    while True:
        try:
            return call()
        except (httpx.HTTPError, openai.APIError, redis.RedisError):
            if time.monotonic() > end:
                raise AssertionError(f"{what}: no answer in {timeout:.0f} s") from None
            time.sleep(0.5)


def test_a_300_line_batch_through_client_kills_and_a_stopped_leading_node_ends_with_every_line_once(tmp_path: Path, redis_url: str) -> None:
    apis = [spawn_role(f"api{i}", "api", tmp_path, "--redis-url", redis_url, "--data-dir", str(tmp_path / f"api{i}"), env=ENV) for i in range(2)]
    workers = [spawn_role(f"w{i}", "worker", tmp_path, "--redis-url", redis_url, "--data-dir", str(tmp_path / f"w{i}"), *SIM, env=ENV) for i in range(2)]
    roles: list[Role] = [*apis, *workers]
    killer: Killer | None = None
    try:
        for api in apis:
            wait_serving(api, workers=2, others=tuple(roles))
        r = redis.Redis.from_url(redis_url)
        rows = [
            {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "max_tokens": 24, "messages": [{"role": "user", "content": f"Line {i}."}]}}
            for i in range(LINES)
        ]
        clients = [openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="x", max_retries=0, timeout=30) for api in apis]
        uploaded = clients[0].files.create(file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, rows)).encode())), purpose="batch")
        batch = clients[0].batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        killer = Killer(redis_url)

        def progress() -> int:
            counts: Any = retrying("the batch counts", lambda: r.hgetall(keys.batch_counts(batch.id)), 30)
            return sum(batch_jobs.OUTCOMES.count(k.decode()) * int(v) for k, v in counts.items())

        end = time.monotonic() + 300
        while progress() < 40:
            assert time.monotonic() < end, "the batch did not start"
            time.sleep(0.2)
        holder = retrying("the batch's lease", lambda: r.get(keys.batch_lease(batch.id)), 30)
        at_stop = progress()
        assert holder is not None and at_stop < LINES - 100, "the batch ran ahead of the faults"
        leader = next(i for i, api in enumerate(apis) if api.proc.pid == int(holder.decode().rsplit("-", 2)[1]))
        os.kill(apis[leader].proc.pid, signal.SIGSTOP)
        try:
            time.sleep(STOP_S)
            taken_over = retrying("the lease", lambda: r.get(keys.batch_lease(batch.id)), 30)
        finally:
            os.kill(apis[leader].proc.pid, signal.SIGCONT)
        assert taken_over is not None and taken_over != holder, "the other node did not take the batch over"
        other = clients[1 - leader]
        end = time.monotonic() + 600
        while (done := retrying("the batch", lambda: other.batches.retrieve(batch.id), 60)).status != "completed":
            assert done.status in ("validating", "in_progress", "finalizing"), done.status
            assert time.monotonic() < end, f"batch stuck at {done.request_counts}"
            time.sleep(0.5)
        killer.stop()
        print(f"{killer.kills} CLIENT KILLs dropped {killer.dropped} connections; node {leader} stopped {STOP_S:.0f} s at {at_stop} lines done")
        assert killer.kills >= 5 and killer.dropped > 0, (killer.kills, killer.dropped)
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0), counts
        out = [json.loads(x) for x in retrying("the output", lambda: other.files.content(done.output_file_id), 60).text.splitlines()]
        ids = [row["custom_id"] for row in out]
        assert sorted(ids) == sorted(row["custom_id"] for row in rows)  # every line, each once
        assert r.xlen(keys.DEAD_LETTER) == 0
        # Each line was queued once: its request's delta stream holds exactly one terminal event.
        streams = [r.xrange(keys.delta_stream(row["response"]["request_id"])) for row in out]
        terminals = [sum(1 for _, f in entries if b"d" in f and is_terminal(decode_delta(f[b"d"]))) for entries in streams]
        assert terminals == [1] * LINES
        for role in roles:
            assert role.proc.poll() is None, f"{role.name} exited:\n{role.log()[-3000:]}"
        for client in clients:
            client.close()
    finally:
        if killer is not None:
            killer.stop()
        for role in roles:
            if role.proc.poll() is None:
                role.proc.kill()
                role.proc.wait()
