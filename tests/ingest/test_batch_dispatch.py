"""The batch dispatcher against a real redis-server: it prepares lines off the event loop
(ingest.batch_routes.BatchLines.prepare on the tokenizing lanes), so a line's parse and render never runs
on the loop that serves the node's streams, and a line that finds the large lane full waits for a later
step instead of failing; its writes are fenced (a node that lost the batch's lease queues nothing, a line
is never queued twice) and batch records change by compare-and-set."""

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

from ingest import batch_dispatch, batch_jobs
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
        await redis.set(keys.batch_lease(doc["id"]), "off-loop")
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
        await redis.set(keys.batch_lease(doc["id"]), "busy-lane")
        runner.api.tokenizing._large_jobs = 1  # an interactive 30 MiB body holds the one place on the large lane
        await dispatcher._queue_more(doc, job)
        assert list(job.todo) == ["big"] and not job.inflight and not runner.threads
        assert not await redis.hlen(keys.batch_results(doc["id"]))
        runner.api.tokenizing._large_jobs = 0  # it finished
        await dispatcher._queue_more(doc, job)
        assert not job.todo and list(job.inflight.values()) == ["big"]
        await redis.aclose()

    asyncio.run(scenario())


def test_a_node_that_lost_the_lease_queues_nothing_and_a_queued_line_is_not_queued_again(redis_server: str) -> None:
    """Node A paused past its lease; node B took the batch and queued line "a". A wakes with its old view
    (both lines to do): before, it queued "a" a second time and "b" beside B."""

    async def scenario() -> None:
        redis = Redis.from_url(redis_server)
        doc = {"id": f"batch_fenced{time.monotonic_ns()}", "owner": "k"}
        lease = keys.batch_lease(doc["id"])
        node_b = BatchDispatcher(redis, Settings(), runner=RecordingLines(Settings()), node_id="node-b")
        await redis.set(lease, "node-b")
        b_job = job_of("a", size=100)
        await node_b._queue_more(doc, b_job)
        assert list(b_job.inflight.values()) == ["a"]
        before = await redis.xlen(keys.REQUEST_STREAM)
        node_a = BatchDispatcher(redis, Settings(), runner=RecordingLines(Settings()), node_id="node-a")
        node_a.jobs[doc["id"]] = a_job = job_of("a", "b", size=100)
        await node_a._queue_more(doc, a_job)
        assert await redis.xlen(keys.REQUEST_STREAM) == before  # nothing queued: not "a" again, not "b"
        assert doc["id"] not in node_a.jobs  # it stops driving the batch
        await redis.set(lease, "node-a")  # A leads again later (B died): "a" is queued, so it is followed, not resent
        a_job = job_of("a", "b", size=100)
        await node_a._queue_more(doc, a_job)
        assert await redis.xlen(keys.REQUEST_STREAM) == before + 1  # only "b"
        assert sorted(a_job.inflight.values()) == ["a", "b"]
        await redis.aclose()

    asyncio.run(scenario())


def test_batch_record_changes_are_compare_and_set(redis_server: str) -> None:
    async def scenario() -> None:
        redis = Redis.from_url(redis_server)
        settings = Settings()
        doc = await batch_jobs.create(redis, settings, record={"protocol": batch_jobs.OPENAI, "owner": "k", "endpoint": "/v1/chat/completions"}, lines=[{"custom_id": "x"}])
        bid = doc["id"]
        # concurrent changes from several nodes: each lands (a read-modify-write would keep one of them)
        await asyncio.gather(*(batch_jobs.update(redis, settings, bid, **{f"mark_{i}": i}) for i in range(20)))
        marked = await batch_jobs.load(redis, bid)
        assert all(marked[f"mark_{i}"] == i for i in range(20))
        # a cancel that arrives after the dispatcher ended the batch leaves it ended (it used to strand it in `cancelling`)
        await batch_jobs.update(redis, settings, bid, only_from=("validating", "in_progress", "cancelling"), status="completed")
        after = await batch_jobs.update(redis, settings, bid, only_from=("validating", "in_progress"), status="cancelling")
        assert after["status"] == "completed" and (await batch_jobs.load(redis, bid))["status"] == "completed"
        await redis.aclose()

    asyncio.run(scenario())
