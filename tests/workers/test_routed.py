"""A worker's side of prefix routing against a real Redis: the block pool's journal, the routing index it
feeds (workers.routed.KVIndex) and a gateway's stand-in for it (PromptKeys), the adoption of the routed
streams of workers that are gone (adopt_routed), and the API node's XADD onto a routed stream that falls
back to the shared one once that stream was deleted (ingest.http.publish)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from redis.asyncio import Redis

from ingest.http.publish import Admission, admit_and_submit, submit
from shared import keys
from shared.block_keys import index_key, prompt_keys
from workers import leases, routed
from workers.blocks import BlockPool
from workers.routed import KVIndex, PromptKeys, adopt_routed

from ..conftest import redis_db
from .fakes import make_request

TTL = 10.0  # heartbeat_ttl of the adoption tests
LEASE = 0.05  # a lease short enough that an entry nobody renews is idle past it after a short sleep


@pytest.fixture
async def redis(redis_server: str) -> AsyncIterator[Redis]:
    async with redis_db(redis_server, 13) as client:
        yield client


def _ids(values: object) -> set[bytes]:
    return set(values)  # type: ignore[call-overload]


# ---- the block pool's journal and the routing index ----------------------------------------------------


def test_the_pool_journals_the_keys_it_gains_and_evicts_only_when_asked_to() -> None:
    pool = BlockPool(2)
    assert pool.take_journal() == {}  # no journal kept: nothing recorded
    a = pool.allocate()
    assert a is not None
    pool.register(a, b"k" * 16)
    assert pool.take_journal() == {}
    pool.journal = {}
    b = pool.allocate()
    assert b is not None
    pool.register(b, b"b" * 16)
    pool.release([a])
    pool.release([b])
    assert pool.take_journal() == {b"b" * 16: True}
    assert pool.take_journal() == {}  # taken: emptied
    assert pool.allocate() == a  # the oldest cached block is evicted for a new one
    assert pool.take_journal() == {b"k" * 16: False}
    assert sorted(pool.cached_keys()) == [b"b" * 16]


async def test_flush_writes_added_and_removed_keys_with_a_ttl(redis: Redis) -> None:
    index = KVIndex("w1", ttl_s=TTL)
    full = prompt_keys(list(range(1, 80)))  # 4 keys
    index.note({k: True for k in full})
    await index.flush(redis, force=True)
    assert _ids(await redis.smembers(keys.kv_index("w1"))) == {index_key(k) for k in full}
    assert 0 < await redis.ttl(keys.kv_index("w1")) <= TTL + 1
    assert index.size == 4 and index.pending == {}
    index.note({full[3]: False, full[2]: False})
    await index.flush(redis, force=True)
    assert _ids(await redis.smembers(keys.kv_index("w1"))) == {index_key(k) for k in full[:2]}
    assert index.size == 2


async def test_flush_is_rate_limited_unless_forced(redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routed, "FLUSH_EVERY_S", 3600.0)
    index = KVIndex("w2", ttl_s=TTL)
    first, second = (prompt_keys(list(range(start, start + 40))) for start in (1, 1000))
    index.note({k: True for k in first})
    await index.flush(redis)  # the first flush is not held back
    index.note({k: True for k in second})
    await index.flush(redis)  # within FLUSH_EVERY_S of the last: waits
    assert _ids(await redis.smembers(keys.kv_index("w2"))) == {index_key(k) for k in first}
    assert set(index.pending) == {index_key(k) for k in second}  # kept for the next flush
    await index.flush(redis, force=True)
    assert _ids(await redis.smembers(keys.kv_index("w2"))) == {index_key(k) for k in first + second}


async def test_a_snapshot_replaces_whatever_the_set_held(redis: Redis) -> None:
    await redis.sadd(keys.kv_index("w3"), b"stale-01", b"stale-02")
    index = KVIndex("w3", ttl_s=TTL)
    now_cached = prompt_keys(list(range(1, 50)))
    index.note({b"x" * 16: True})  # superseded by the snapshot
    index.replace_all(now_cached)
    await index.flush(redis, force=True)
    assert _ids(await redis.smembers(keys.kv_index("w3"))) == {index_key(k) for k in now_cached}
    assert index.size == len(now_cached) and index.snapshot is None
    assert 0 < await redis.ttl(keys.kv_index("w3")) <= TTL + 1


def test_prompt_keys_lru_evicts_the_oldest_and_journals_it() -> None:
    served = PromptKeys(capacity=4)
    a = list(range(1, 34))  # 2 blocks
    b = list(range(100, 133))
    c = list(range(200, 233))
    served.served(a)
    served.served(b)
    assert served.take_journal() == {k: True for k in prompt_keys(a) + prompt_keys(b)}
    served.served(a)  # a is now the most recent: b's keys are the oldest
    assert served.take_journal() == {}
    served.served(c, cache_salt="s")
    assert served.take_journal() == {**{k: True for k in prompt_keys(c, cache_salt="s")}, **{k: False for k in prompt_keys(b)}}
    served.served(b)
    journal = served.take_journal()
    assert {k for k, present in journal.items() if not present} == set(prompt_keys(a))  # a is the oldest now
    assert {k for k, present in journal.items() if present} == set(prompt_keys(b))


# ---- adopting the routed streams of workers that are gone ----------------------------------------------


async def _route(redis: Redis, worker: str, rid: str) -> None:
    """What an API node does: queue the request on `worker`'s routed stream."""
    request = make_request(rid, prompt_len=40)
    assert await admit_and_submit(redis, [request], Admission(100, 600.0), stream=keys.routed_stream(worker)) >= 0


async def _streams_of(redis: Redis, *workers: str) -> None:
    await leases.ensure_group(redis)
    for worker in workers:
        await leases.ensure_group(redis, keys.routed_stream(worker))


def _rid(claimed: leases.Claimed) -> str:
    assert claimed.fields is not None
    return claimed.fields[b"id"].decode()


async def test_what_a_dead_worker_held_on_its_routed_stream_is_reclaimed_past_the_lease(redis: Redis) -> None:
    await _streams_of(redis, "dead", "other")
    await redis.zadd(keys.ROUTED_WORKERS, {"dead": time.time(), "other": time.time()})  # its heartbeat not even stale yet
    await _route(redis, "dead", "held-1")
    [read] = await leases.claim_new(redis, "dead", count=4, block_ms=None, own=keys.routed_stream("dead"))
    assert read.stream == keys.routed_stream("dead")
    await asyncio.sleep(LEASE * 3)  # nobody renews it
    [taken] = await adopt_routed(redis, "other", count=4, heartbeat_ttl=TTL, lease_s=LEASE)
    assert (taken.stream, taken.entry_id, _rid(taken), taken.deliveries) == (keys.routed_stream("dead"), read.entry_id, "held-1", 2)
    [row] = await redis.xpending_range(keys.routed_stream("dead"), keys.WORKER_GROUP, min="-", max="+", count=10)
    assert row["consumer"] == b"other"


async def test_a_live_workers_held_and_unread_entries_are_left_to_it(redis: Redis) -> None:
    await _streams_of(redis, "live", "other")
    await redis.zadd(keys.ROUTED_WORKERS, {"live": time.time(), "other": time.time()})
    await _route(redis, "live", "held-2")
    await leases.claim_new(redis, "live", count=1, block_ms=None, own=keys.routed_stream("live"))
    await _route(redis, "live", "unread-2")
    assert await adopt_routed(redis, "other", count=4, heartbeat_ttl=TTL, lease_s=30.0) == []  # held within its lease
    assert await leases.undelivered(redis, keys.routed_stream("live")) == 1
    await asyncio.sleep(LEASE * 3)
    [taken] = await adopt_routed(redis, "other", count=4, heartbeat_ttl=TTL, lease_s=LEASE)
    assert _rid(taken) == "held-2"  # what it held past the lease is reclaimed (it stopped renewing), never what it has not read
    assert await leases.undelivered(redis, keys.routed_stream("live")) == 1
    assert await adopt_routed(redis, "live", count=4, heartbeat_ttl=TTL, lease_s=30.0) == []  # its own stream is not adopted


async def test_what_a_gone_worker_never_read_is_claimed(redis: Redis) -> None:
    await _streams_of(redis, "gone", "other")
    await redis.zadd(keys.ROUTED_WORKERS, {"gone": time.time() - TTL - 1, "other": time.time()})
    await _route(redis, "gone", "unread-3a")
    await _route(redis, "gone", "unread-3b")
    first = await adopt_routed(redis, "other", count=1, heartbeat_ttl=TTL, lease_s=30.0)
    assert [(_rid(c), c.deliveries, c.stream) for c in first] == [("unread-3a", 1, keys.routed_stream("gone"))]  # up to `count`
    second = await adopt_routed(redis, "other", count=4, heartbeat_ttl=TTL, lease_s=30.0)
    assert [_rid(c) for c in second] == ["unread-3b"]
    assert await leases.undelivered(redis, keys.routed_stream("gone")) == 0
    assert await adopt_routed(redis, "other", count=0, heartbeat_ttl=TTL, lease_s=30.0) == []


async def test_a_gone_workers_empty_stream_is_deleted_only_after_twice_the_ttl(redis: Redis) -> None:
    await _streams_of(redis, "left", "other")
    await redis.sadd(keys.kv_index("left"), b"12345678")
    await redis.zadd(keys.ROUTED_WORKERS, {"left": time.time() - TTL * 1.5, "other": time.time()})
    assert await adopt_routed(redis, "other", count=4, heartbeat_ttl=TTL, lease_s=30.0) == []
    assert await redis.exists(keys.routed_stream("left")) and await redis.zscore(keys.ROUTED_WORKERS, "left") is not None
    await redis.zadd(keys.ROUTED_WORKERS, {"left": time.time() - TTL * 2 - 1})
    await _route(redis, "left", "last-4")
    [taken] = await adopt_routed(redis, "other", count=4, heartbeat_ttl=TTL, lease_s=30.0)
    assert _rid(taken) == "last-4"
    assert await redis.exists(keys.routed_stream("left"))  # not empty: the entry is pending under "other" until acked
    await redis.xack(keys.routed_stream("left"), keys.WORKER_GROUP, taken.entry_id)
    assert await adopt_routed(redis, "other", count=4, heartbeat_ttl=TTL, lease_s=30.0) == []
    assert not await redis.exists(keys.routed_stream("left"), keys.kv_index("left"))
    assert await redis.zscore(keys.ROUTED_WORKERS, "left") is None
    assert await redis.zscore(keys.ROUTED_WORKERS, "other") is not None and await redis.exists(keys.routed_stream("other"))


# ---- publishing onto a routed stream --------------------------------------------------------------------


async def _ids_on(redis: Redis, stream: str) -> list[str]:
    return [f[b"id"].decode() for _, f in await redis.xrange(stream)]


async def test_admit_and_submit_queues_on_the_routed_stream_or_on_the_shared_one_once_it_was_deleted(redis: Redis) -> None:
    await _streams_of(redis, "here")
    await _route(redis, "here", "routed-5")
    assert await _ids_on(redis, keys.routed_stream("here")) == ["routed-5"]
    assert await _ids_on(redis, keys.REQUEST_STREAM) == []
    await _route(redis, "deleted", "fallback-5")  # no such stream: never recreated (NOMKSTREAM)
    assert not await redis.exists(keys.routed_stream("deleted"))
    assert await _ids_on(redis, keys.REQUEST_STREAM) == ["fallback-5"]
    assert await redis.zscore(keys.REQUEST_INDEX, "fallback-5") is not None and await redis.exists(keys.request_ir("fallback-5"))
    both = [make_request("part-a"), replace(make_request("part-b"), prompt_token_ids=(9, 9))]
    assert await admit_and_submit(redis, both, Admission(100, 600.0), stream=keys.routed_stream("here")) >= 0
    assert await _ids_on(redis, keys.routed_stream("here")) == ["routed-5", "part-a", "part-b"]


async def test_submit_queues_on_the_routed_stream_or_on_the_shared_one_once_it_was_deleted(redis: Redis) -> None:
    await _streams_of(redis, "here")
    await submit(redis, make_request("sub-routed"), stream=keys.routed_stream("here"))
    await submit(redis, make_request("sub-fallback"), stream=keys.routed_stream("deleted"))
    assert await _ids_on(redis, keys.routed_stream("here")) == ["sub-routed"]
    assert await _ids_on(redis, keys.REQUEST_STREAM) == ["sub-fallback"]
    assert not await redis.exists(keys.routed_stream("deleted"))
    for rid in ("sub-routed", "sub-fallback"):
        assert await redis.exists(keys.request_ir(rid), keys.request_meta(rid)) == 2
