"""Leases and fencing against a real Redis: stale attempts cannot write, idle work is reclaimed,
renewal keeps live work, release hands work back at once, and trimming never drops pending work."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis

from ingest.http.publish import submit
from shared import keys
from shared.codec import decode_delta, encode_delta
from shared.deltas import Content, Finish, FinishReason, Usage
from workers import leases

from .fakes import make_request


def run(redis_url: str, body: Callable[[Redis], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        redis = Redis.from_url(redis_url)
        try:
            await redis.delete(keys.REQUEST_STREAM)
            await leases.ensure_group(redis)
            return await body(redis)
        finally:
            await redis.aclose()

    return asyncio.run(main())


async def fenced(redis: Redis, rid: str, attempt: int, *deltas: Any, outcome: str = "", written: int = 0) -> int:
    script = redis.register_script(leases.FENCED_WRITE)
    write = leases.Write(rid, attempt, tuple(encode_delta(d) for d in deltas), written=written, outcome=outcome, batch_max=1)
    script_keys, args = leases.fenced_args([write], ttl=60, now=time.time())
    [result] = await script(keys=script_keys, args=args)
    return int(result)


def test_a_stale_attempt_cannot_write_and_the_current_one_can(redis_server: str) -> None:
    async def body(redis: Redis) -> None:
        request = make_request(f"fence-{time.monotonic_ns()}")
        await submit(redis, request)
        [claimed] = await leases.claim_new(redis, "w1", count=1, block_ms=None)
        first = await leases.begin_attempt(redis, request.id, worker="w1", deliveries=1)
        assert await fenced(redis, request.id, first, Content(text="a", attempt=first)) == 1
        second = await leases.begin_attempt(redis, request.id, worker="w2", deliveries=2)
        assert (first, second) == (1, 2)
        assert await fenced(redis, request.id, first, Content(text="stale", attempt=first)) == 0
        done = Finish(reason=FinishReason.STOP, usage=Usage(), attempt=second)
        assert await fenced(redis, request.id, second, Content(text="b", attempt=second), done, outcome="stop") == 1
        texts = [f[b"d"] for _, f in await redis.xrange(keys.delta_stream(request.id))]
        assert len(texts) == 3 and b"stale" not in b"".join(texts)
        assert 0 < await redis.ttl(keys.request_ir(request.id)) <= 60
        assert (await redis.hget(keys.request_meta(request.id), "outcome")) == b"stop"
        assert claimed.deliveries == 1

    run(redis_server, body)


def test_a_write_resent_after_a_lost_reply_adds_only_the_deltas_not_yet_written(redis_server: str) -> None:
    async def body(redis: Redis) -> None:
        request = make_request(f"resend-{time.monotonic_ns()}")
        await submit(redis, request)
        attempt = await leases.begin_attempt(redis, request.id, worker="w", deliveries=1)
        a, b, c = (Content(text=t, attempt=attempt) for t in "abc")
        assert await fenced(redis, request.id, attempt, a, b) == 1  # written; say the reply was lost
        assert await fenced(redis, request.id, attempt, a, b, c, written=0) == 1  # the worker resends from what it knows
        texts = [decode_delta(f[b"d"]).text for _, f in await redis.xrange(keys.delta_stream(request.id)) if b"d" in f]  # type: ignore[union-attr]
        assert texts == ["a", "b", "c"]
        again = await leases.begin_attempt(redis, request.id, worker="w2", deliveries=2)
        assert await fenced(redis, request.id, again, Content(text="d", attempt=again)) == 1  # a new attempt counts from 0
        assert await redis.xlen(keys.delta_stream(request.id)) == 4

    run(redis_server, body)


def test_one_call_writes_many_requests_and_refuses_only_the_stale_one(redis_server: str) -> None:
    """A worker's whole step goes in one script call: each request's deltas land in its own stream, a
    stale attempt among them is refused alone, and a terminal write ends only its own request."""

    async def body(redis: Redis) -> None:
        requests = [make_request(f"multi-{i}-{time.monotonic_ns()}") for i in range(3)]
        for request in requests:
            await submit(redis, request)
        attempts = await leases.begin_attempts(redis, [(r.id, 1) for r in requests], worker="w")
        await leases.begin_attempt(redis, requests[1].id, worker="other", deliveries=2)  # taken over: attempt 1 is stale
        done = Finish(reason=FinishReason.STOP, usage=Usage(), attempt=attempts[2])
        writes = [
            leases.Write(r.id, a, tuple(encode_delta(Content(text=f"{r.id[:7]}-{n}", attempt=a)) for n in range(2)), batch_max=1) for r, a in zip(requests, attempts, strict=True)
        ]
        writes[2] = leases.Write(requests[2].id, attempts[2], (*writes[2].deltas, encode_delta(done)), outcome="stop", batch_max=3)
        script = redis.register_script(leases.FENCED_WRITE)
        script_keys, args = leases.fenced_args(writes, ttl=60, now=time.time())
        assert [int(x) for x in await script(keys=script_keys, args=args)] == [1, 0, 1]
        lengths = [await redis.xlen(keys.delta_stream(r.id)) for r in requests]
        assert lengths == [2, 0, 3]
        assert [await redis.hget(keys.request_meta(r.id), "status") for r in requests] == [b"running", b"running", b"finished"]
        assert await redis.ttl(keys.request_ir(requests[0].id)) == -1 and 0 < await redis.ttl(keys.request_ir(requests[2].id)) <= 60

    run(redis_server, body)


def test_a_cancel_sets_the_flag_and_tells_the_workers_feed_with_who_cancelled(redis_server: str) -> None:
    from bus import cancels

    async def body(redis: Redis) -> None:
        start = await cancels.last_id(redis)
        await cancels.cancel(redis, "gone-client")
        await cancels.cancel(redis, "by-operator", by_operator=True)
        notices, after = await cancels.read(redis, start)
        assert notices == [("gone-client", keys.CLIENT_CANCEL), ("by-operator", keys.OPERATOR_CANCEL)]
        assert await redis.get(keys.cancel_flag("by-operator")) == keys.OPERATOR_CANCEL
        assert await cancels.read(redis, after) == ([], after)  # read on from where it ended: nothing twice

    run(redis_server, body)


def test_writes_never_recreate_an_expired_delta_stream(redis_server: str) -> None:
    async def body(redis: Redis) -> None:
        request = make_request(f"expired-{time.monotonic_ns()}")
        await submit(redis, request)
        attempt = await leases.begin_attempt(redis, request.id, worker="w", deliveries=1)
        await redis.delete(keys.delta_stream(request.id))  # as if its TTL ran out
        await fenced(redis, request.id, attempt, Content(text="late", attempt=attempt))
        assert not await redis.exists(keys.delta_stream(request.id))

    run(redis_server, body)


def test_idle_work_is_reclaimed_with_a_higher_delivery_count_unless_renewed(redis_server: str) -> None:
    async def body(redis: Redis) -> None:
        for i in range(2):
            await submit(redis, make_request(f"lease-{i}-{time.monotonic_ns()}"))
        held = await leases.claim_new(redis, "dead", count=2, block_ms=None)
        await asyncio.sleep(0.35)
        await leases.renew(redis, "dead", [held[0].entry_id])  # this one is still being worked on
        taken = await leases.reclaim_idle(redis, "alive", count=10, lease_s=0.3)
        assert [c.entry_id for c in taken] == [held[1].entry_id]
        assert taken[0].deliveries == 2 and taken[0].fields is not None
        await leases.release(redis, "alive", [held[1].entry_id], lease_s=0.3)
        again = await leases.reclaim_idle(redis, "third", count=10, lease_s=0.3)
        assert [c.entry_id for c in again] == [held[1].entry_id]  # handed back: no need to wait for the lease
        assert again[0].deliveries == 2  # a hand-back is not a failed delivery: the count stays where it was

    run(redis_server, body)


def test_trimming_keeps_everything_pending_or_undelivered(redis_server: str) -> None:
    async def body(redis: Redis) -> None:
        for i in range(4):
            await submit(redis, make_request(f"trim-{i}-{time.monotonic_ns()}"))
        claimed = await leases.claim_new(redis, "w", count=2, block_ms=None)
        await redis.xack(keys.REQUEST_STREAM, keys.WORKER_GROUP, claimed[0].entry_id)
        await leases.trim_acknowledged(redis)
        remaining = [eid.decode() for eid, _ in await redis.xrange(keys.REQUEST_STREAM)]
        assert claimed[0].entry_id not in remaining
        assert claimed[1].entry_id in remaining and len(remaining) == 3  # pending + two never delivered

    run(redis_server, body)


def test_a_dead_worker_leaves_the_alive_set_once_its_requests_are_reclaimed(redis_server: str) -> None:
    async def body(redis: Redis) -> None:
        await redis.delete(keys.WORKERS_ALIVE)
        request = make_request(f"orphan-{time.monotonic_ns()}")
        await submit(redis, request)
        await submit(redis, make_request(f"orphan-ancient-{time.monotonic_ns()}"))
        await leases.claim_new(redis, "dead-holding", count=1, block_ms=None)  # then it died holding the request
        now = time.time()
        await redis.zadd(keys.WORKERS_ALIVE, {"dead-holding": now - 30, "dead-idle": now - 30, "ancient": now - 10_000, "live": now})
        await leases.claim_new(redis, "ancient", count=1, block_ms=None)  # holds one too, but died long ago
        gone = await leases.forget_dead_workers(redis, heartbeat_ttl=10, lease_s=10)
        assert sorted(gone) == ["ancient", "dead-idle"]
        members = {m.decode() for m in await redis.zrange(keys.WORKERS_ALIVE, 0, -1)}
        assert members == {"dead-holding", "live"}
        await leases.reclaim_idle(redis, "live", count=10, lease_s=0)  # a live worker takes the request over
        assert await leases.forget_dead_workers(redis, heartbeat_ttl=10, lease_s=10) == ["dead-holding"]
        assert {m.decode() for m in await redis.zrange(keys.WORKERS_ALIVE, 0, -1)} == {"live"}
        consumers = {c["name"].decode() for c in await redis.xinfo_consumers(keys.REQUEST_STREAM, keys.WORKER_GROUP)}
        assert "dead-idle" not in consumers and "dead-holding" not in consumers

    run(redis_server, body)


def test_reclaiming_a_request_whose_terminal_was_written_only_settles_its_books(redis_server: str) -> None:
    from shared.settings import Settings
    from workers.engine import Engine
    from workers.loop import WorkerLoop

    from .fakes import INFO, ByteTokenizer, ScriptedRunner

    async def body(redis: Redis) -> None:
        request = make_request(f"settled-{time.monotonic_ns()}")
        await redis.zadd(keys.INFLIGHT, {request.id: time.time()})
        await submit(redis, request)
        [claimed] = await leases.claim_new(redis, "died-before-ack", count=1, block_ms=None)
        attempt = await leases.begin_attempt(redis, request.id, worker="died-before-ack", deliveries=claimed.deliveries)
        done = Finish(reason=FinishReason.STOP, usage=Usage(completion_tokens=1), attempt=attempt)
        assert await fenced(redis, request.id, attempt, Content(text="a", attempt=attempt), done, outcome="stop") == 1
        finished_before = await redis.xlen(keys.FINISHED)
        engine = Engine(ScriptedRunner(lambda _seq: "x"), ByteTokenizer(), INFO, settings=Settings())
        loop = WorkerLoop(redis, engine, settings=Settings(lease_s=0.0), worker_id="survivor", info={})
        await loop.reclaim()
        meta = await redis.hgetall(keys.request_meta(request.id))
        assert (meta[b"status"], meta[b"attempt"], meta[b"worker"]) == (b"finished", str(attempt).encode(), b"died-before-ack")
        assert await redis.zscore(keys.INFLIGHT, request.id) is None
        assert await redis.xlen(keys.FINISHED) == finished_before + 1
        pending: Any = await redis.xpending(keys.REQUEST_STREAM, keys.WORKER_GROUP)
        assert pending["pending"] == 0 and not engine.active_ids()

    run(redis_server, body)


def test_the_crash_hook_is_ignored_unless_the_data_dir_enables_fault_injection(tmp_path: Any) -> None:
    from shared.settings import Settings
    from workers.faults import FAULT_INJECTION_FILE, Faults, fault_injection

    settings = Settings(crash_on="POISON", fail_on="BAD", data_dir=str(tmp_path))
    assert fault_injection(settings) == Faults()  # inherited from the environment alone: a client cannot kill or fail workers
    (tmp_path / FAULT_INJECTION_FILE).touch()
    assert fault_injection(settings) == Faults(crash_on="POISON", fail_on="BAD")
    assert fault_injection(Settings(data_dir=str(tmp_path))) == Faults()


def test_an_unreadable_entry_ends_its_request_with_one_error_and_is_dead_lettered_not_crashing_the_worker(redis_server: str) -> None:
    from shared.deltas import Error
    from shared.settings import Settings
    from workers.engine import Engine
    from workers.loop import WorkerLoop

    from .fakes import INFO, ByteTokenizer, ScriptedRunner

    async def body(redis: Redis) -> None:
        rid = f"garbled-{time.monotonic_ns()}"
        await redis.zadd(keys.INFLIGHT, {rid: time.time()})
        await redis.xadd(keys.delta_stream(rid), {"created": b"1"}, id="0-1")
        bad = b'{"v":1,"id":"%s","protocol":"openai_chat","model":"m","messages":[{"role":"nobody","content":[]}]}' % rid.encode()
        await redis.xadd(keys.REQUEST_STREAM, {"v": 1, "id": rid, "req": bad})
        letters_before = await redis.xlen(keys.DEAD_LETTER)
        engine = Engine(ScriptedRunner(lambda _seq: "x"), ByteTokenizer(), INFO, settings=Settings())
        loop = WorkerLoop(redis, engine, settings=Settings(), worker_id="reader", info={})
        await loop.claim(block_ms=None)
        recorded = [decode_delta(f[b"d"]) for _, f in await redis.xrange(keys.delta_stream(rid)) if b"d" in f]
        assert len(recorded) == 1 and isinstance(recorded[0], Error)
        assert await redis.xlen(keys.DEAD_LETTER) == letters_before + 1
        pending: Any = await redis.xpending(keys.REQUEST_STREAM, keys.WORKER_GROUP)
        assert pending["pending"] == 0 and await redis.zscore(keys.INFLIGHT, rid) is None
        assert (await redis.hget(keys.request_meta(rid), "status")) == b"finished"

    run(redis_server, body)
