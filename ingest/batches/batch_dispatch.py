"""The batch dispatcher: every API node runs one; each batch is driven by whichever node holds its lease.

Each `step_once()`: for every batch not ended (`BATCHES_ACTIVE`), take or renew its lease
(`keys.batch_lease`, SET NX PX: a node that dies loses it after `lease_s` and another node resumes
the batch), then advance it: collect the lines whose request reached its terminal event (the result is
the same final JSON a non-streaming client gets, stored once per `custom_id`), queue more lines up to
`--batch-max-inflight` at the batch priority, and once every line has its result write the output.
State lives in Redis only; what a node keeps in memory (`_Job`: the lines in flight and the positions of the
rest, never the whole input) is rebuilt from Redis on takeover, a page of lines at a time:
lines with a result are done, lines whose request id (derived from batch id + custom_id) is already
queued are in flight — so no line is queued twice and none is lost, whatever restarts.
Cancel (and expiry) stop queueing, cancel what is in flight, and give every unfinished line a
canceled / expired result; finished lines are kept.
Must not: know protocol shapes (the `LineRunner` the app passes in does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from ingest.batches import batch_jobs, files
from ingest.http import storage
from ingest.http.publish import LIFETIME_MARGIN_S, cancel, is_queued, submit_batch_line
from shared import keys
from shared.codec import decode_request, delta_of, deltas_of
from shared.deltas import Finish, StreamDelta, is_terminal
from shared.errors import ApiError
from shared.ir import Request
from shared.settings import Settings

log = logging.getLogger("met.batch")
LIVE = ("validating", "in_progress", "cancelling")  # statuses the dispatcher may still end (a record ended once stays ended)

# Take the lease if free, or renew it if this node holds it; 1 if this node holds it now.
_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""


class LineRunner(Protocol):
    """What the dispatcher needs of the protocols (built by the app from its Surface rows)."""

    async def prepare(self, doc: dict[str, Any], line: dict[str, Any], request_id: str, *, size: int) -> Request:
        """The prepared request IR of a line (`size`: its bytes), made off the event loop as any body's is:
        raises ApiError when its body is refused, or (kind `overloaded`) when the tokenizer is busy."""
        ...

    def result(self, doc: dict[str, Any], line: dict[str, Any], request: Request, deltas: list[StreamDelta]) -> tuple[str, dict[str, Any]]:
        """(outcome, result line) from a finished request's deltas."""
        ...

    def refused(self, doc: dict[str, Any], line: dict[str, Any], request_id: str, err: ApiError) -> dict[str, Any]: ...

    def unrun(self, doc: dict[str, Any], line: dict[str, Any], request_id: str, outcome: str) -> dict[str, Any]: ...


READ_AHEAD = 32  # lines read from Redis at once as they are about to be queued
PAGE = 500  # lines read at once on takeover and when writing the output


@dataclass
class _Job:
    """What a node keeps of a batch it leads: the positions of the lines still to queue, and the lines in
    flight (their bodies, for their results). Never the whole input: a line's body is read from Redis
    (keys.batch_lines) when it is about to be queued, READ_AHEAD at a time, and dropped once its result is in."""

    todo: deque[int]  # positions (in keys.batch_lines) of lines neither finished nor queued, in input order
    lines: dict[str, dict[str, Any]] = field(default_factory=dict)  # custom_id → line, of lines in flight
    sizes: dict[str, int] = field(default_factory=dict)  # custom_id → the line's stored bytes (picks its tokenizing lane), in flight
    ahead: dict[int, tuple[dict[str, Any], int]] = field(default_factory=dict)  # position → (line, bytes) read ahead of `todo`
    inflight: dict[str, str] = field(default_factory=dict)  # request id → custom_id
    requests: dict[str, Request] = field(default_factory=dict)  # request id → IR (for the result body)
    cancel_sent: bool = False
    owner: str = ""  # the caller id that made the batch (its lines count against that key's share)


class BatchDispatcher:
    def __init__(self, redis: Redis, settings: Settings, runner: LineRunner, *, node_id: str) -> None:
        self.redis = redis
        self.settings = settings
        self.runner = runner
        self.node_id = node_id
        self.jobs: dict[str, _Job] = {}
        self._lease = redis.register_script(_LEASE)
        self.quota = storage.Quota.from_settings(settings, margin_s=LIFETIME_MARGIN_S)  # a line's record counts to its key's storage

    async def run(self, stop: asyncio.Event, interval: float = 0.2) -> None:
        down_since: float | None = None  # an outage is logged when it starts and when it ends, not every step
        while not stop.is_set():
            try:
                await self.step_once()
                if down_since is not None:
                    log.warning("batch dispatch: redis is back after %.1f s", time.monotonic() - down_since)
                    down_since = None
            except RedisError as exc:
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("batch dispatch: redis unavailable (%s); retrying every %g s", type(exc).__name__, interval)
            except Exception:
                log.exception("batch dispatch step failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    async def step_once(self) -> None:
        active: Any = await self.redis.smembers(keys.BATCHES_ACTIVE)
        for raw in sorted(active):
            batch_id = raw.decode()
            lease_ms = int(self.settings.lease_s * 1000)
            if await self._lease(keys=[keys.batch_lease(batch_id)], args=[self.node_id, lease_ms]):
                await self.advance(batch_id)
            else:
                self.jobs.pop(batch_id, None)  # another node drives it now

    async def advance(self, batch_id: str) -> None:
        try:
            doc = await batch_jobs.load(self.redis, batch_id)
        except ApiError:
            await self.redis.srem(keys.BATCHES_ACTIVE, batch_id)  # deleted or expired
            return
        if doc["status"] in batch_jobs.ENDED:
            await self._end(batch_id)
            return
        job = self.jobs.get(batch_id) or await self._load(batch_id)
        job.owner = doc["owner"]
        self.jobs[batch_id] = job
        if doc["status"] == "validating":
            doc = await batch_jobs.update(self.redis, self.settings, batch_id, only_from=("validating",), status="in_progress", in_progress_at=int(time.time()))
        stopping = "canceled" if doc["status"] == "cancelling" else "expired" if time.time() > doc["expires_at"] else None
        await self._collect(doc, job, stopping)
        if stopping is not None:
            await self._stop(doc, job, stopping)
        else:
            await self._queue_more(doc, job)
        if not job.todo and not job.inflight:
            await self._finalize(doc, stopping)

    async def _load(self, batch_id: str) -> _Job:
        """The job as Redis has it, read a page of lines at a time: lines with a result are done, lines whose
        request is queued are in flight (kept, for their results), the rest are to do (their positions)."""
        job = _Job(todo=deque())
        count = int(await self.redis.llen(keys.batch_lines(batch_id)))
        for start in range(0, count, PAGE):
            raw: Any = await self.redis.lrange(keys.batch_lines(batch_id), start, start + PAGE - 1)
            lines = [orjson.loads(r) for r in raw]
            async with self.redis.pipeline(transaction=False) as pipe:
                for line in lines:
                    pipe.hexists(keys.batch_results(batch_id), line["custom_id"])
                    pipe.exists(keys.request_ir(batch_jobs.line_request_id(batch_id, line["custom_id"])))
                found = await pipe.execute()
            for k, (line, r) in enumerate(zip(lines, raw, strict=True)):
                finished, queued = found[2 * k], found[2 * k + 1]
                cid = line["custom_id"]
                if finished:
                    continue
                if queued:  # queued by an earlier dispatcher: wait for it, never queue it again
                    job.inflight[batch_jobs.line_request_id(batch_id, cid)] = cid
                    job.lines[cid], job.sizes[cid] = line, len(r)
                else:
                    job.todo.append(start + k)
        return job

    async def _head(self, batch_id: str, job: _Job) -> tuple[dict[str, Any], int]:
        """The line at the head of `todo` and its bytes, read with the next READ_AHEAD lines when not read yet."""
        position = job.todo[0]
        if position not in job.ahead:
            raw: Any = await self.redis.lrange(keys.batch_lines(batch_id), position, position + READ_AHEAD - 1)
            job.ahead = {position + k: (orjson.loads(r), len(r)) for k, r in enumerate(raw)}
        return job.ahead[position]

    def _done_with_head(self, job: _Job) -> None:
        job.ahead.pop(job.todo.popleft(), None)

    async def _collect(self, doc: dict[str, Any], job: _Job, stopping: str | None) -> None:
        """Record the result of every in-flight line whose request has ended."""
        if not job.inflight:
            return
        rids = list(job.inflight)
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in rids:
                pipe.xrevrange(keys.delta_stream(rid), count=1)
            lasts = await pipe.execute()
        for rid, last in zip(rids, lasts, strict=True):
            if not last or (ended := delta_of(last[0][1])) is None or not is_terminal(ended):
                continue
            entries: Any = await self.redis.xrange(keys.delta_stream(rid))
            deltas = deltas_of(entries)
            cid = job.inflight[rid]  # out of `inflight` only once its result is recorded (below)
            line = job.lines[cid]
            request = job.requests.get(rid)
            if request is None:  # queued by an earlier dispatcher: the request it recorded (the line's files may be gone by now)
                raw = await self.redis.get(keys.request_ir(rid))
                if raw is not None:
                    request = decode_request(raw)
                else:  # expired with the line still open: the same parse
                    try:
                        request = await self.runner.prepare(doc, line, rid, size=job.sizes.get(cid, 0))
                    except ApiError as err:
                        if err.kind == "overloaded":
                            continue  # the tokenizer is busy: collected on a later step
                        await batch_jobs.record_result(self.redis, doc["id"], cid, outcome="errored", result=self.runner.refused(doc, line, rid, err))
                        self._forget(job, rid, cid)
                        continue
            outcome, result = self.runner.result(doc, line, request, deltas)
            if outcome == "canceled" and stopping == "expired":
                outcome, result = "expired", self.runner.unrun(doc, line, rid, "expired")
            finish = next((d for d in deltas if isinstance(d, Finish)), None)
            tokens = (finish.usage.prompt_tokens, finish.usage.completion_tokens) if finish is not None else (len(request.prompt_token_ids), 0)
            await batch_jobs.record_result(self.redis, doc["id"], cid, outcome=outcome, result=result, tokens=tokens)
            self._forget(job, rid, cid)

    @staticmethod
    def _forget(job: _Job, rid: str, cid: str) -> None:
        """A line whose result is recorded: nothing of it stays in memory."""
        del job.inflight[rid]
        job.requests.pop(rid, None)
        job.lines.pop(cid, None)
        job.sizes.pop(cid, None)

    async def _queue_more(self, doc: dict[str, Any], job: _Job) -> None:
        """Queue lines while the batch, its key and the batch pool have room (`--batch-max-inflight`,
        `--batch-max-queue-per-key`, `--batch-max-queue`). The pool is a set of its own (keys.INFLIGHT_BATCH):
        interactive admission never counts batch lines, so no batch takes a place an interactive request
        needs; workers run interactive requests first (`--batch-priority`). The key's count is what this
        node leads (each batch is led by one node); the pool's is read from Redis."""
        room = self.settings.batch_max_queue - int(await self.redis.zcard(keys.INFLIGHT_BATCH))
        owner = doc["owner"]
        key_room = self.settings.batch_max_queue_per_key - sum(len(j.inflight) for j in self.jobs.values() if j.owner == owner)
        while job.todo and len(job.inflight) < self.settings.batch_max_inflight and min(room, key_room) > 0:
            line, size = await self._head(doc["id"], job)  # off `todo` only once Redis holds it: a Redis error leaves it to the next step
            cid = line["custom_id"]
            rid = batch_jobs.line_request_id(doc["id"], cid)
            try:
                request = await self.runner.prepare(doc, line, rid, size=size)
            except ApiError as err:
                if err.kind == "overloaded":
                    break  # the tokenizer's large lane is full (interactive bodies share it): the line waits for a later step
                await batch_jobs.record_result(self.redis, doc["id"], cid, outcome="errored", result=self.runner.refused(doc, line, rid, err))
                self._done_with_head(job)
                continue
            queued = await submit_batch_line(self.redis, request, owner=owner, lease=(keys.batch_lease(doc["id"]), self.node_id))
            if not queued and not await is_queued(self.redis, rid):
                log.warning("batch %s: lease lost to another node; it drives the batch now", doc["id"])
                self.jobs.pop(doc["id"], None)
                return
            self._done_with_head(job)
            job.inflight[rid] = cid  # queued now, or by the node that held the lease meanwhile: its result is collected the same way
            job.requests[rid] = request
            job.lines[cid], job.sizes[cid] = line, size
            room, key_room = room - 1, key_room - 1
            if queued and self.quota.cap:  # its record, counted as the line's bytes, in the key's storage ledger
                entry = (storage.RECORD + rid, size, time.time() + self.quota.record_s)
                stored = await storage.record(self.redis, owner, [entry], keep_s=self.quota.keep_s)
                await storage.enforce(self.redis, owner, self.quota.cap, stored)

    async def _stop(self, doc: dict[str, Any], job: _Job, outcome: str) -> None:
        """Cancel what runs (its result comes through `_collect`); every line not started gets `outcome`."""
        if not job.cancel_sent:
            for rid in job.inflight:
                await cancel(self.redis, rid)
            job.cancel_sent = True
        while job.todo:
            line, _ = await self._head(doc["id"], job)
            rid = batch_jobs.line_request_id(doc["id"], line["custom_id"])
            await batch_jobs.record_result(self.redis, doc["id"], line["custom_id"], outcome=outcome, result=self.runner.unrun(doc, line, rid, outcome))
            self._done_with_head(job)

    async def _finalize(self, doc: dict[str, Any], stopping: str | None) -> None:
        now = int(time.time())
        status = {"canceled": "cancelled", "expired": "expired"}.get(stopping or "", "completed")
        changes: dict[str, Any] = {"status": status, f"{status}_at": now, "ended_at": now}
        if doc["protocol"] == batch_jobs.OPENAI:
            await batch_jobs.update(self.redis, self.settings, doc["id"], only_from=LIVE, status="finalizing", finalizing_at=now)
            results = await batch_jobs.results(self.redis, doc["id"])
            ordered = [results[cid] async for cid in self._custom_ids(doc["id"]) if cid in results]
            for name, wanted in (("output_file_id", True), ("error_file_id", False)):
                chosen = [r["result"] for r in ordered if (r["outcome"] == "succeeded") is wanted]
                if chosen:
                    content = b"".join(orjson.dumps(r) + b"\n" for r in chosen)
                    stored = await files.put(self.redis, self.settings, owner=doc["owner"], filename=f"{doc['id']}_{name[:-8]}.jsonl", purpose=files.OUTPUT_PURPOSE, content=content)
                    changes[name] = stored["id"]
        await batch_jobs.update(self.redis, self.settings, doc["id"], only_from=(*LIVE, "finalizing"), **changes)
        log.info("batch %s %s", doc["id"], status)
        await self._end(doc["id"])

    async def _custom_ids(self, batch_id: str) -> AsyncIterator[str]:
        """The batch's custom_ids in input order, read a page of lines at a time."""
        count = int(await self.redis.llen(keys.batch_lines(batch_id)))
        for start in range(0, count, PAGE):
            raw: Any = await self.redis.lrange(keys.batch_lines(batch_id), start, start + PAGE - 1)
            for r in raw:
                yield orjson.loads(r)["custom_id"]

    async def _end(self, batch_id: str) -> None:
        self.jobs.pop(batch_id, None)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.srem(keys.BATCHES_ACTIVE, batch_id)
            pipe.delete(keys.batch_lease(batch_id))
            await pipe.execute()
