"""The batch dispatcher against a real redis-server: it prepares lines off the event loop
(ingest.batches.batch_routes.BatchLines.prepare on the tokenizing lanes), so a line's parse and render never runs
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

import orjson
import pytest
from redis.asyncio import Redis

from ingest.batches import batch_dispatch, batch_jobs
from ingest.batches.batch_dispatch import BatchDispatcher
from ingest.batches.batch_routes import BatchLines
from ingest.http.tokenizing import LARGE_BODY_BYTES, Tokenizing
from shared import keys
from shared.codec import DELTA_FIELD, encode_delta
from shared.deltas import Finish, FinishReason, StreamDelta, Usage
from shared.errors import ApiError
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


async def job_of(redis: Redis, batch_id: str, *cids: str, size: int, todo: list[int] | None = None) -> batch_dispatch._Job:
    """A job with lines `cids` (each `size` bytes, stored as a batch's lines are) to do: all, or those at `todo`."""
    if not await redis.exists(keys.batch_lines(batch_id)):
        pad = max(0, size - len(orjson.dumps({"custom_id": cids[0], "pad": ""})))
        await redis.rpush(keys.batch_lines(batch_id), *(orjson.dumps({"custom_id": c, "pad": "x" * pad}) for c in cids))
    return batch_dispatch._Job(todo=deque(range(len(cids)) if todo is None else todo), owner="k")


@pytest.mark.parametrize("size", [100, 30 * 2**20], ids=["small", "30MiB"])
def test_lines_are_prepared_on_a_tokenizing_thread_never_on_the_event_loop(redis_server: str, size: int) -> None:
    async def scenario() -> None:
        redis = Redis.from_url(redis_server)
        runner = RecordingLines(Settings())
        dispatcher = BatchDispatcher(redis, Settings(), runner=runner, node_id="off-loop")
        doc = {"id": f"batch_offloop{time.monotonic_ns()}", "owner": "k"}
        job = await job_of(redis, doc["id"], "a", "b", size=size)
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
        doc = {"id": f"batch_busy{time.monotonic_ns()}", "owner": "k"}
        job = await job_of(redis, doc["id"], "big", size=LARGE_BODY_BYTES + 1)
        await redis.set(keys.batch_lease(doc["id"]), "busy-lane")
        runner.api.tokenizing._large_jobs = 1  # an interactive 30 MiB body holds the one place on the large lane
        await dispatcher._queue_more(doc, job)
        assert list(job.todo) == [0] and not job.inflight and not runner.threads
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
        b_job = await job_of(redis, doc["id"], "a", "b", size=100, todo=[0])
        await node_b._queue_more(doc, b_job)
        assert list(b_job.inflight.values()) == ["a"]
        before = await redis.xlen(keys.REQUEST_STREAM)
        node_a = BatchDispatcher(redis, Settings(), runner=RecordingLines(Settings()), node_id="node-a")
        node_a.jobs[doc["id"]] = a_job = await job_of(redis, doc["id"], "a", "b", size=100)
        await node_a._queue_more(doc, a_job)
        assert await redis.xlen(keys.REQUEST_STREAM) == before  # nothing queued: not "a" again, not "b"
        assert doc["id"] not in node_a.jobs  # it stops driving the batch
        await redis.set(lease, "node-a")  # A leads again later (B died): "a" is queued, so it is followed, not resent
        a_job = await job_of(redis, doc["id"], "a", "b", size=100)
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


class UnrunLines(RecordingLines):
    def unrun(self, doc: dict[str, Any], line: dict[str, Any], request_id: str, outcome: str) -> dict[str, Any]:
        return {"custom_id": line["custom_id"], "outcome": outcome}


def test_a_node_holds_only_the_lines_in_flight_and_a_read_ahead_never_the_whole_input(redis_server: str) -> None:
    """Takeover of a 3,000-line batch (1,000 with results, 10 queued by the node before): the job keeps the
    10 lines in flight and the positions of the rest; queueing reads lines a few at a time; a cancel
    gives every remaining line its result reading pages. Before, the node held all 3,000 lines."""

    async def scenario() -> None:
        redis = Redis.from_url(redis_server)
        settings = Settings(batch_max_inflight=16)
        runner = UnrunLines(settings)
        dispatcher = BatchDispatcher(redis, settings, runner=runner, node_id="lean")
        record = {"protocol": batch_jobs.OPENAI, "owner": "k", "endpoint": "/v1/chat/completions"}
        doc = await batch_jobs.create(redis, settings, record=record, lines=[{"custom_id": f"c{i}", "body": {"pad": "x" * 200}} for i in range(3000)])
        for i in range(1000):
            await batch_jobs.record_result(redis, doc["id"], f"c{i}", outcome="succeeded", result={})
        await redis.set(keys.batch_lease(doc["id"]), "lean")
        for i in range(1000, 1010):  # queued by the node that led the batch before
            assert await batch_dispatch.submit_batch_line(redis, replace(make_request(batch_jobs.line_request_id(doc["id"], f"c{i}")), priority=10), owner="k")
        job = await dispatcher._load(doc["id"])
        assert sorted(job.lines) == sorted(f"c{i}" for i in range(1000, 1010)) and len(job.inflight) == 10
        assert list(job.todo) == list(range(1010, 3000)) and not job.ahead
        await dispatcher._queue_more(doc, job)
        assert len(job.inflight) == 16 and len(job.lines) == 16 and len(job.ahead) <= batch_dispatch.READ_AHEAD
        assert sorted(job.inflight.values()) == sorted(f"c{i}" for i in range(1000, 1016))
        job.cancel_sent = True  # (the in-flight lines' cancels are not what this test looks at)
        await dispatcher._stop(doc, job, "canceled")
        assert not job.todo and not job.ahead
        assert await redis.hlen(keys.batch_results(doc["id"])) == 1000 + 3000 - 1016
        await redis.aclose()

    asyncio.run(scenario())


class GoneFileLines(RecordingLines):
    """Lines whose parse now fails (the file a line names was deleted after it was queued); results record
    the request they were built from."""

    def request(self, doc: dict[str, Any], line: dict[str, Any], request_id: str) -> Request:
        raise ApiError("No such file: 'file-x'.", status=404, param="input[0].content[0].file_id", kind="not_found")

    def result(self, doc: dict[str, Any], line: dict[str, Any], request: Request, deltas: list[StreamDelta]) -> tuple[str, dict[str, Any]]:
        return "succeeded", {"custom_id": line["custom_id"], "priority": request.priority}


def test_a_line_queued_by_an_earlier_leader_is_collected_from_its_recorded_request_not_parsed_again(redis_server: str) -> None:
    """Node B queued line "a", then died; node A takes over after the line's file was deleted. Before, A
    parsed the line again to build its result, the parse failed, and every step of the batch failed."""

    async def scenario() -> None:
        redis = Redis.from_url(redis_server)
        doc = {"id": f"batch_taken{time.monotonic_ns()}", "owner": "k"}
        await redis.set(keys.batch_lease(doc["id"]), "node-b")
        node_b = BatchDispatcher(redis, Settings(), runner=RecordingLines(Settings()), node_id="node-b")
        b_job = await job_of(redis, doc["id"], "a", size=100, todo=[0])
        await node_b._queue_more(doc, b_job)
        [rid] = list(b_job.inflight)
        await redis.xadd(keys.delta_stream(rid), {DELTA_FIELD: encode_delta(Finish(reason=FinishReason.STOP, usage=Usage()))})
        await redis.set(keys.batch_lease(doc["id"]), "node-a")
        node_a = BatchDispatcher(redis, Settings(), runner=GoneFileLines(Settings()), node_id="node-a")
        a_job = await job_of(redis, doc["id"], "a", size=100, todo=[])
        a_job.inflight[rid] = "a"
        a_job.lines["a"] = {"custom_id": "a"}
        await node_a._collect(doc, a_job, None)
        assert not a_job.inflight and not a_job.lines  # recorded, forgotten
        recorded = orjson.loads(await redis.hget(keys.batch_results(doc["id"]), "a") or b"null")
        assert recorded == {"outcome": "succeeded", "result": {"custom_id": "a", "priority": 10}}  # from the request B recorded
        await redis.aclose()

    asyncio.run(scenario())
