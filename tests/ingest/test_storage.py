"""The per-key storage quota (ingest.http.storage) against a real redis-server: admission enters each request's
record in its key's ledger in the same script; past the cap, what expires first is dropped, finished
requests' records before stored responses, never a request in flight, and never another key's."""

from __future__ import annotations

import time
from typing import Any

import pytest
from redis.asyncio import Redis

from ingest.http import responses_store, storage
from ingest.http.publish import Admission, Origin, admit_and_submit
from shared import keys
from shared.codec import FINISHED, Meta, encode_request
from shared.ir import Message, Role, TextPart
from tests.workers.fakes import make_request

pytestmark = pytest.mark.redis

KB = 1024
QUOTA = storage.Quota(cap=100 * KB, record_s=3600, response_s=7200, keep_s=7300)


def big(rid: str, size: int) -> Any:
    from dataclasses import replace

    return replace(make_request(rid), messages=(Message(role=Role.USER, content=(TextPart(text="x" * size),)),))


async def admit(redis: Redis, rid: str, size: int, owner: str, quota: storage.Quota | None = QUOTA) -> int:
    return await admit_and_submit(redis, [big(rid, size)], Admission(10_000, 600.0, quota), origin=Origin(owner, "t"))


async def finish(redis: Redis, *rids: str) -> None:
    for rid in rids:
        await redis.hset(keys.request_meta(rid), Meta.STATUS, FINISHED)


@pytest.fixture
async def redis(redis_server: str) -> Any:
    client = Redis.from_url(redis_server)
    await client.flushall()
    yield client
    await client.aclose()


async def test_admission_enters_each_record_in_its_keys_ledger_and_returns_the_keys_total(redis: Redis) -> None:
    sizes = [len(encode_request(big(f"a{i}", 20 * KB))) for i in range(3)]
    totals = [await admit(redis, f"a{i}", 20 * KB, "key-a") for i in range(3)]
    assert totals == [sizes[0], sizes[0] + sizes[1], sum(sizes)]
    assert await admit(redis, "b0", 5 * KB, "key-b") == len(encode_request(big("b0", 5 * KB)))  # its own ledger
    assert await admit(redis, "c0", 5 * KB, "key-c", quota=None) == 0  # no quota: no ledger
    assert not await redis.exists(keys.stored_sizes("key-c"))
    assert 0 < await redis.ttl(keys.stored_index("key-a")) <= QUOTA.keep_s


async def test_expired_entries_leave_the_ledger_on_its_next_write(redis: Redis) -> None:
    await storage.record(redis, "key-a", [("r:old", 50 * KB, time.time() - 1), ("r:live", 10 * KB, time.time() + 60)], keep_s=100)
    assert await storage.total(redis, "key-a") == 60 * KB  # nothing is pruned by the write that adds it
    total = await storage.record(redis, "key-a", [("s:resp", 1 * KB, time.time() + 60)], keep_s=100)
    assert total == 11 * KB and await redis.zrange(keys.stored_index("key-a"), 0, -1) == [b"r:live", b"s:resp"]


async def test_past_the_cap_finished_records_that_expire_first_go_first_never_one_in_flight(redis: Redis) -> None:
    for i in range(6):
        await admit(redis, f"a{i}", 30 * KB, "key-a")  # 6 x ~30 KB against a 100 KB cap
    await finish(redis, "a1", "a2", "a3", "a4", "a5")  # a0, the oldest, is still in flight
    await admit(redis, "other", 30 * KB, "key-b")
    dropped = await storage.make_room(redis, "key-a", QUOTA.cap)
    assert dropped == {"record": 3, "response": 0}
    left = [rid for rid in ("a0", "a1", "a2", "a3", "a4", "a5") if await redis.exists(keys.request_ir(rid))]
    assert left == ["a0", "a4", "a5"]  # in flight, and the newest two: within the cap with a0 counted
    assert not await redis.exists(keys.request_meta("a1"), keys.delta_stream("a1")) and await redis.zscore(keys.REQUEST_INDEX, "a1") is None
    assert await storage.total(redis, "key-a") <= QUOTA.cap
    assert await redis.exists(keys.request_ir("other"))  # another key's record is never touched
    assert await storage.make_room(redis, "key-a", QUOTA.cap) == {"record": 0, "response": 0}


async def test_nothing_is_dropped_while_every_record_over_the_cap_is_in_flight(redis: Redis) -> None:
    for i in range(5):
        await admit(redis, f"a{i}", 30 * KB, "key-a")
    assert await storage.make_room(redis, "key-a", QUOTA.cap, batch=2) == {"record": 0, "response": 0}
    assert all([await redis.exists(keys.request_ir(f"a{i}")) for i in range(5)])
    await finish(redis, "a4")  # only the newest finished: found past four in flight, two to a page
    assert await storage.make_room(redis, "key-a", QUOTA.cap, batch=2) == {"record": 1, "response": 0}
    assert not await redis.exists(keys.request_ir("a4"))


async def test_stored_responses_count_and_go_after_the_records_that_expire_before_them(redis: Redis) -> None:
    quota = storage.Quota(cap=60 * KB, record_s=3600, response_s=7200, keep_s=7300)
    conversation = [Message(role=Role.USER, content=(TextPart(text="y" * 25 * KB),))]
    await responses_store.save(redis, "resp_1", body={"id": "resp_1"}, conversation=conversation, owner="key-a", quota=quota)
    await admit(redis, "a0", 20 * KB, "key-a", quota=quota)
    await admit(redis, "a1", 20 * KB, "key-a", quota=quota)
    await finish(redis, "a0", "a1")
    assert await storage.total(redis, "key-a") > quota.cap
    assert await storage.make_room(redis, "key-a", quota.cap) == {"record": 1, "response": 0}  # a0 expires before the response
    assert await redis.exists(keys.stored_response("resp_1")) and not await redis.exists(keys.request_ir("a0"))
    await admit(redis, "a2", 40 * KB, "key-a", quota=quota)  # in flight: a1, then the response, make room for it
    dropped = await storage.make_room(redis, "key-a", quota.cap)
    assert dropped == {"record": 1, "response": 1} and not await redis.exists(keys.stored_response("resp_1"))
    assert await redis.exists(keys.request_ir("a2")) and not await redis.exists(keys.request_ir("a1"))
