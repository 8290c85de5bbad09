"""Worker faults under load, with live processes (issue 34's reclaim experiments): `met api` and simulated
`met worker`s (`--model-impl sim`: the real worker, scheduler and engine, each forward a wait) on a
redis-server of the test's own.

- kill -9 of a worker while 200 requests are queued: its claimed requests are reclaimed once their lease
  lapses and resume before the backlog that was queued at the kill has all started (before: new claims
  came first, so they waited behind everything); every request finishes exactly once.
- three rolling SIGTERMs while requests longer than the drain timeout run: a hand-back keeps the delivery
  count as it was, so no request is dead-lettered however many restarts it rides through (before: every
  hand-back counted as a failed delivery and the third dead-lettered them)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from shared import keys
from shared.codec import decode_delta, request_id_of
from shared.deltas import Finish

from ..conftest import wait_for
from ..topology import RedisProcs, Role, spawn_role, start_standalone, wait_serving

pytestmark = pytest.mark.e2e

LEASE_S = 2.0
SIM = ("--model-impl", "sim", "--sim-step-ms", "20", "--lease", str(LEASE_S))


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    procs: RedisProcs = start_standalone(tmp_path / "redis")
    yield f"redis://127.0.0.1:{procs.ports[0]}/0"
    procs.stop()


def api_node(tmp_path: Path, url: str) -> Role:
    return spawn_role("api", "api", tmp_path, "--redis-url", url, "--data-dir", str(tmp_path / "api"), "--max-queue", "1024")


def worker(name: str, tmp_path: Path, url: str, *args: str) -> Role:
    return spawn_role(name, "worker", tmp_path, "--redis-url", url, "--data-dir", str(tmp_path / name), *SIM, *args)


class Load:
    """`count` non-streamed chat requests sent at once from a thread of their own; `rids` once answered."""

    def __init__(self, base: str, count: int, max_tokens: int) -> None:
        self.rids: list[str] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(base, count, max_tokens), daemon=True)
        self.thread.start()

    def _run(self, base: str, count: int, max_tokens: int) -> None:
        try:
            self.rids = asyncio.run(self._all(base, count, max_tokens))
        except BaseException as exc:  # re-raised by `wait`
            self.error = exc

    @staticmethod
    async def _all(base: str, count: int, max_tokens: int) -> list[str]:
        async with httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_connections=count)) as client:

            async def one(i: int) -> str:
                body = {"model": "m", "messages": [{"role": "user", "content": f"Request {i}."}], "max_tokens": max_tokens}
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                return str(response.json()["id"]).removeprefix("chatcmpl-")  # the request id (a stream would send it as X-Request-Id)

            return list(await asyncio.gather(*(one(i) for i in range(count))))

    def wait(self) -> list[str]:
        self.thread.join(600)
        if self.error is not None:
            raise self.error
        return self.rids


def deltas_of(r: redis.Redis, rid: str) -> list[tuple[int, Any]]:
    """(entry time in ms, delta) of a request's recorded stream."""
    entries: Any = r.xrange(keys.delta_stream(rid))
    return [(int(entry_id.decode().split("-")[0]), decode_delta(fields[b"d"])) for entry_id, fields in entries if b"d" in fields]


def queued(r: redis.Redis) -> dict[bytes, str]:
    """Request-stream entry id → request id, for every request queued."""
    entries: Any = r.xrange(keys.REQUEST_STREAM)
    return {entry_id: request_id_of(fields) for entry_id, fields in entries}


def held_by(r: redis.Redis, pid: int) -> list[str]:
    """The request ids the worker process `pid` holds (pending under its consumer name) now."""
    names = [w.decode() for w in r.zrange(keys.WORKERS_ALIVE, 0, -1)]
    mine = {n for n in names if int(r.hget(keys.worker_info(n), "pid") or 0) == pid}
    pending: Any = r.xpending_range(keys.REQUEST_STREAM, keys.WORKER_GROUP, "-", "+", 10_000)
    ids = queued(r)
    return [ids[p["message_id"]] for p in pending if p["consumer"].decode() in mine]


def finished_once(r: redis.Redis, rids: list[str], max_tokens: int) -> None:
    for rid in rids:
        finishes = [d for _, d in deltas_of(r, rid) if isinstance(d, Finish)]
        assert len(finishes) == 1 and finishes[0].usage.completion_tokens == max_tokens, (rid, finishes)
    assert r.xlen(keys.DEAD_LETTER) == 0, r.xrange(keys.DEAD_LETTER)


def test_a_killed_workers_requests_resume_before_the_backlog_queued_at_the_kill(tmp_path: Path, redis_url: str) -> None:
    api = api_node(tmp_path, redis_url)
    doomed, other = worker("doomed", tmp_path, redis_url, "--max-running", "8"), worker("other", tmp_path, redis_url, "--max-running", "8")
    r = redis.Redis.from_url(redis_url)
    try:
        wait_serving(api, workers=2, others=(doomed, other))
        max_tokens = 30  # 0.6 s of steps: the 200 take ~8 s on two workers of 8
        load = Load(api.base_url, 200, max_tokens)
        wait_for("200 queued, the doomed worker holding some", lambda: r.xlen(keys.REQUEST_STREAM) >= 200 and held_by(r, doomed.proc.pid), timeout=120)
        victims = held_by(r, doomed.proc.pid)
        doomed.signal(signal.SIGKILL)
        seconds, micros = r.time()
        killed_at = seconds * 1000 + micros // 1000
        backlog = [rid for rid in queued(r).values() if not deltas_of(r, rid)]  # not started at the kill
        rids = load.wait()
        finished_once(r, rids, max_tokens)
        assert victims and len(backlog) >= 50, (len(victims), len(backlog))
        resumed = [min(t for t, d in deltas_of(r, rid) if t >= killed_at) for rid in victims]
        backlog_started = sorted(min(t for t, _ in deltas_of(r, rid)) for rid in backlog)
        assert max(resumed) < backlog_started[-1], "a reclaimed request waited behind the whole backlog"
        assert all(max(d.attempt for _, d in deltas_of(r, rid)) == 2 for rid in victims)  # resumed once, by the other worker
    finally:
        for role in (api, doomed, other):
            role.stop()
        r.close()


def test_three_rolling_sigterms_under_load_dead_letter_nothing(tmp_path: Path, redis_url: str) -> None:
    """Each worker's drain (1 s) is far shorter than the requests (800 tokens, 16 s of steps): what it holds
    is handed back, and the two workers stop in turn, so a request rides through all three hand-backs
    (its fourth attempt), past `--max-deliveries` 3 had hand-backs counted."""
    api = api_node(tmp_path, redis_url)
    drain = ("--drain-timeout", "1", "--max-running", "32")  # room for all: a stopped worker's requests move to the one stopped next
    workers = [worker(f"w{i}", tmp_path, redis_url, *drain) for i in range(2)]
    r = redis.Redis.from_url(redis_url)
    try:
        wait_serving(api, workers=2, others=tuple(workers))
        max_tokens = 800
        load = Load(api.base_url, 32, max_tokens)
        wait_for("the load running", lambda: r.xlen(keys.REQUEST_STREAM) >= 32 and held_by(r, workers[0].proc.pid), timeout=120)
        for round_ in range(3):
            stopping = workers[round_ % 2]
            stopping.signal(signal.SIGTERM)
            stopping.proc.wait(60)
            assert stopping.proc.returncode == 0, stopping.log()[-3000:]
            workers[round_ % 2] = worker(f"w{round_ % 2}-{round_}", tmp_path, redis_url, *drain)
            wait_serving(api, workers=2, others=tuple(workers))
            time.sleep(1.0)  # the new worker takes some of the load before the next one stops
        rids = load.wait()
        finished_once(r, rids, max_tokens)
        attempts = [max(d.attempt for _, d in deltas_of(r, rid)) for rid in rids]
        assert max(attempts) >= 4, f"no request rode through the three restarts ({attempts}): the test proves nothing"
    finally:
        for role in (api, *workers):
            role.stop()
        r.close()
