"""bus.tails against a real Redis: many streams read by few calls and few connections, a subscription
made while a reader is blocked, back-pressure that leaves entries in Redis, and a long outage."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from bus.connect import connect
from bus.tails import Pace, Subscription, Tails
from cli.embedded_redis import EmbeddedRedis
from shared import keys


def stream(name: str) -> str:
    return keys.delta_stream(f"tails-{name}-{time.monotonic_ns()}")


async def numbers(sub: Subscription, count: int, timeout: float = 20.0) -> list[int]:
    """The `n` fields of the next `count` entries of a subscription (waiting at most `timeout`)."""
    got: list[int] = []
    async with asyncio.timeout(timeout):
        while len(got) < count:
            got += [int(value or b"-1") for _id, value in await sub.take()]
    return got


def test_a_thousand_streams_are_read_by_a_few_calls_on_a_few_connections(redis_server: str) -> None:
    """Each waiting stream costs a subscription, not a connection: 1,000 streams written at once are read
    by a handful of XREAD calls (one per reader and round, not one per stream), and the node's pool
    holds about one connection per reader."""

    async def scenario() -> tuple[list[list[int]], int, int]:
        redis = connect(redis_server, max_connections=16)
        tails = Tails(redis, field="n", node="t1", pace=Pace(readers=4, per_reader=250))
        names = [stream(f"k{i}") for i in range(1000)]
        subs = [tails.subscribe(name) for name in names]
        await asyncio.sleep(0.2)  # every reader blocked on its share
        before = tails.reads
        async with redis.pipeline(transaction=False) as pipe:
            for name in names:
                for n in range(3):
                    pipe.xadd(name, {"n": n})
            await pipe.execute()
        got = await asyncio.gather(*(numbers(sub, 3) for sub in subs))
        reads = tails.reads - before
        pool: Any = redis.connection_pool
        connections = len(pool._available_connections) + len(pool._in_use_connections)
        await tails.close()
        await redis.aclose()
        return list(got), reads, connections

    got, reads, connections = asyncio.run(scenario())
    assert got == [[0, 1, 2]] * 1000  # every entry of every stream, in order, once
    assert reads <= 40, reads  # 4 readers: a few rounds each (the writes land over several replies)
    assert connections <= 6, connections  # 4 readers + the doorbells' rings


def test_a_stream_subscribed_while_its_reader_is_blocked_rings_its_doorbell_and_is_read_at_once(redis_server: str) -> None:
    """The reader's call blocks on the streams it had; a new subscription rings its doorbell, which ends
    that call (counted in `bells`) so the next one reads the new stream, instead of after the block."""

    async def scenario() -> tuple[list[int], int]:
        redis = Redis.from_url(redis_server)
        tails = Tails(redis, field="n", node="t2", pace=Pace(readers=1, block_ms=4_500, quiet_s=300))
        first = tails.subscribe(stream("first"))
        await asyncio.sleep(0.3)  # the reader is blocked on `first` alone
        bells = tails.bells
        late = stream("late")
        await redis.xadd(late, {"n": 7})
        sub = tails.subscribe(late)
        got = await numbers(sub, 1, timeout=10)
        rung = tails.bells - bells
        tails.unsubscribe(first)
        await tails.close()
        await redis.aclose()
        return got, rung

    assert asyncio.run(scenario()) == ([7], 1)


def test_a_consumer_that_does_not_keep_up_is_left_in_redis_and_later_gets_every_entry_once(redis_server: str) -> None:
    """Back-pressure per stream: a subscription that does not take holds at most about `buffer` entries
    (the rest stay in Redis), while another stream on the same reader keeps flowing; once it takes,
    reading goes on from its last entry: all 2,000 arrive, in order, none twice."""

    async def scenario() -> tuple[int, list[int], list[int]]:
        redis = Redis.from_url(redis_server)
        tails = Tails(redis, field="n", node="t3", pace=Pace(readers=1, buffer=64, quiet_s=300))
        slow_key, fast_key = stream("slow"), stream("fast")
        slow, fast = tails.subscribe(slow_key), tails.subscribe(fast_key)
        async with redis.pipeline(transaction=False) as pipe:
            for n in range(2000):
                pipe.xadd(slow_key, {"n": n})
            await pipe.execute()
        await redis.xadd(fast_key, {"n": 1})
        fast_got = await numbers(fast, 1)
        await asyncio.sleep(0.3)
        held = len(slow.entries)
        slow_got = await numbers(slow, 2000)
        await tails.close()
        await redis.aclose()
        return held, fast_got, slow_got

    held, fast_got, slow_got = asyncio.run(scenario())
    assert fast_got == [1]
    assert 64 <= held <= 64 + 256  # paused once its buffer filled (one call's COUNT may overshoot)
    assert slow_got == list(range(2000))


def test_two_subscriptions_to_one_stream_from_different_points_each_get_their_own_rest(redis_server: str) -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        redis = Redis.from_url(redis_server)
        tails = Tails(redis, field="n", node="t4", pace=Pace(readers=1, quiet_s=300))
        key = stream("shared")
        ids = [await redis.xadd(key, {"n": n}) for n in range(5)]
        whole = tails.subscribe(key)
        rest = tails.subscribe(key, after=ids[2].decode())
        first = await numbers(whole, 5), await numbers(rest, 2)
        await redis.xadd(key, {"n": 5})
        second = await numbers(whole, 1), await numbers(rest, 1)
        await tails.close()
        await redis.aclose()
        return first[0] + second[0], first[1] + second[1]

    whole, rest = asyncio.run(scenario())
    assert whole == [0, 1, 2, 3, 4, 5] and rest == [3, 4, 5]


@pytest.mark.redis
def test_redis_gone_past_the_retry_window_fails_the_subscriptions_with_an_error(tmp_path: Path) -> None:
    server = EmbeddedRedis(str(tmp_path))
    url = server.start()

    async def scenario() -> tuple[str, list[Any]]:
        redis = Redis.from_url(url)
        tails = Tails(redis, field="n", node="t5", pace=Pace(readers=1, quiet_s=0.2, retry_s=1.0))
        sub = tails.subscribe(stream("gone"))
        await asyncio.sleep(0.2)
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait()
        taken: list[Any] = []
        async with asyncio.timeout(20):
            while not sub.error:
                taken += await sub.take()
        await tails.close()
        await redis.aclose()
        return sub.error, taken

    try:
        error, taken = asyncio.run(scenario())
    finally:
        server.stop()
    assert error and taken == []
