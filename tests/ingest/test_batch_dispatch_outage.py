"""The batch dispatcher against a real redis-server that is killed and restarted: it logs the outage
once when it starts and once when it ends (not once a step, five times a second), and carries on; a
Redis error mid-step loses no line."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from cli.embedded_redis import EmbeddedRedis
from ingest.batches import batch_dispatch
from ingest.batches.batch_dispatch import BatchDispatcher
from shared import keys
from shared.ir import Request
from shared.settings import Settings
from tests.workers.fakes import make_request

pytestmark = pytest.mark.redis


def test_an_outage_is_logged_when_it_starts_and_when_it_ends(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = EmbeddedRedis(str(tmp_path), appendfsync="always")
    url = server.start()

    async def scenario() -> None:
        redis = Redis.from_url(url, socket_connect_timeout=0.5)
        dispatcher = BatchDispatcher(redis, Settings(), runner=None, node_id="outage-test")  # type: ignore[arg-type]  # no batch: no line runs
        stop = asyncio.Event()
        task = asyncio.create_task(dispatcher.run(stop, interval=0.05))
        await asyncio.sleep(0.3)
        assert server.proc is not None
        server.proc.kill()  # kill -9
        server.proc.wait()
        await asyncio.sleep(1.5)  # ~30 steps without Redis
        await asyncio.to_thread(server.start)
        for _ in range(100):  # until a step succeeds again
            if any("is back" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.1)
        stop.set()
        await task
        await redis.aclose()

    try:
        with caplog.at_level(logging.WARNING, logger="met.batch"):
            asyncio.run(scenario())
    finally:
        server.stop()
    messages = [r.getMessage() for r in caplog.records if r.name == "met.batch"]
    assert [m for m in messages if "unavailable" in m] and len([m for m in messages if "unavailable" in m]) == 1, messages
    assert len([m for m in messages if "is back" in m]) == 1, messages


class OneLineRunner:
    """Every line is the same small request (the dispatcher's LineRunner, no protocol needed)."""

    async def prepare(self, doc: dict[str, Any], line: dict[str, Any], request_id: str, *, size: int) -> Request:
        return replace(make_request(request_id), priority=10)


def test_a_redis_error_while_queueing_a_line_leaves_it_for_the_next_step(redis_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the line left `todo` before its Redis write; the error lost it and the batch ended
    'completed' without it."""
    real = batch_dispatch.submit_batch_line
    calls = {"n": 0}

    async def flaky(redis: Redis, request: Request, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RedisConnectionError("connection reset")
        await real(redis, request, **kwargs)

    monkeypatch.setattr(batch_dispatch, "submit_batch_line", flaky)

    async def scenario() -> None:
        redis = Redis.from_url(redis_server)
        dispatcher = BatchDispatcher(redis, Settings(), runner=OneLineRunner(), node_id="flaky")  # type: ignore[arg-type]
        doc = {"id": f"batch_flaky{time.monotonic_ns()}", "owner": "k"}
        await redis.rpush(keys.batch_lines(doc["id"]), b'{"custom_id": "line-1"}')
        job = batch_dispatch._Job(todo=deque([0]), owner="k")
        await redis.set(keys.batch_lease(doc["id"]), "flaky")  # this node leads the batch
        with pytest.raises(RedisConnectionError):
            await dispatcher._queue_more(doc, job)
        assert list(job.todo) == [0] and not job.inflight  # still to do: nothing lost
        await dispatcher._queue_more(doc, job)  # the next step
        assert not job.todo and list(job.inflight.values()) == ["line-1"]
        await redis.aclose()

    asyncio.run(scenario())
