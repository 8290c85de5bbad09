"""The batch dispatcher against a real redis-server that is killed and restarted: it logs the outage
once when it starts and once when it ends (not once a step, five times a second), and carries on."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from redis.asyncio import Redis

from cli.embedded_redis import EmbeddedRedis
from ingest.batch_dispatch import BatchDispatcher
from shared.settings import Settings

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
