"""The batch dispatcher prepares lines off the event loop (ingest.batch_routes.BatchLines.prepare on the
tokenizing lanes), against a real redis-server: a line's parse and render never runs on the loop that
serves the node's streams, and a line that finds the large lane full waits for a later step instead of
failing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from redis.asyncio import Redis

from ingest import batch_dispatch
from ingest.batch_dispatch import BatchDispatcher
from ingest.batch_routes import BatchLines
from ingest.tokenizing import LARGE_BODY_BYTES, Tokenizing
from shared import keys
from shared.ir import Request
from shared.settings import Settings
from tests.workers.fakes import make_request

pytestmark = pytest.mark.redis


class RecordingLines(BatchLines):
    """BatchLines whose line parse is a plain request, noting the thread it ran on."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(SimpleNamespace(tokenizing=Tokenizing(settings, renderer=None), settings=settings), surfaces={})
        self.threads: list[int] = []

    def request(self, doc: dict[str, Any], line: dict[str, Any], request_id: str) -> Request:
        self.threads.append(threading.get_ident())
        return replace(make_request(request_id), priority=10)


def job_of(*cids: str, size: int) -> batch_dispatch._Job:
    return batch_dispatch._Job(lines={c: {"custom_id": c} for c in cids}, todo=deque(cids), sizes=dict.fromkeys(cids, size), owner="k")


@pytest.mark.parametrize("size", [100, 30 * 2**20], ids=["small", "30MiB"])
def test_lines_are_prepared_on_a_tokenizing_thread_never_on_the_event_loop(redis_server: str, size: int) -> None:
    async def scenario() -> None:
        redis = Redis.from_url(redis_server)
        runner = RecordingLines(Settings())
        dispatcher = BatchDispatcher(redis, Settings(), runner=runner, node_id="off-loop")
        job = job_of("a", "b", size=size)
        doc = {"id": f"batch_offloop{time.monotonic_ns()}", "owner": "k"}
        await dispatcher._queue_more(doc, job)
        assert sorted(job.inflight.values()) == ["a", "b"]
        assert len(runner.threads) == 2 and threading.get_ident() not in runner.threads
        await redis.aclose()

    asyncio.run(scenario())


def test_a_large_line_that_finds_the_large_lane_full_waits_and_is_not_errored(redis_server: str) -> None:
    async def scenario() -> None:
        redis = Redis.from_url(redis_server)
        settings = Settings(tokenize_queue=1)
        runner = RecordingLines(settings)
        dispatcher = BatchDispatcher(redis, settings, runner=runner, node_id="busy-lane")
        job = job_of("big", size=LARGE_BODY_BYTES + 1)
        doc = {"id": f"batch_busy{time.monotonic_ns()}", "owner": "k"}
        runner.api.tokenizing._large_jobs = 1  # an interactive 30 MiB body holds the one place on the large lane
        await dispatcher._queue_more(doc, job)
        assert list(job.todo) == ["big"] and not job.inflight and not runner.threads
        assert not await redis.hlen(keys.batch_results(doc["id"]))
        runner.api.tokenizing._large_jobs = 0  # it finished
        await dispatcher._queue_more(doc, job)
        assert not job.todo and list(job.inflight.values()) == ["big"]
        await redis.aclose()

    asyncio.run(scenario())
