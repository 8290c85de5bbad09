"""Prefix-aware routing against a real Redis (ingest.http.routing.Router): workers described by heartbeat
hashes and WORKERS_ALIVE, their caches by routing indexes written through workers.routed.KVIndex. A request
goes to the worker holding the longest prefix, weighed against its queue; to the shared stream when nobody
holds enough of it, when the chosen worker is at its width, with one live worker, with `--routing shared`,
and on any Redis error (never raised)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from redis.asyncio import Redis

from cli.embedded_redis import free_port
from ingest.http import routing
from ingest.http.routing import Router
from shared import keys
from shared.block_keys import prompt_keys
from shared.ir import Request
from shared.settings import Settings
from workers.routed import KVIndex

from ..conftest import redis_db
from ..workers.fakes import make_request

PROMPT = tuple(range(1, 1026))  # 1025 tokens: 64 usable blocks (1024 tokens)
SETTINGS = Settings(routing="prefix", routing_min_overlap=256, routing_queue_cost=1024)


@pytest.fixture
async def redis(redis_server: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Redis]:
    monkeypatch.setattr(routing, "REFRESH_S", 0.0)  # every route reads the worker table the test just wrote
    async with redis_db(redis_server, 14) as client:
        yield client


def request(rid: str = "r", tokens: tuple[int, ...] = PROMPT, salt: str = "") -> Request:
    return replace(make_request(rid), prompt_token_ids=tokens, cache_salt=salt)


# a fit, idle worker's heartbeat
IDLE = {"routable": 1, "draining": 0, "block_size": 16, "max_running": 8, "running": 0, "waiting": 0, "routed_queue": 0}


async def worker(redis: Redis, name: str, *, cached: int = 0, seen: float | None = None, **fields: object) -> None:
    """A live worker's heartbeat (as workers.claims writes it) and an index holding `cached` blocks of PROMPT."""
    beat = time.time() if seen is None else seen
    info = {**IDLE, "heartbeat": beat, **fields}
    await redis.hset(keys.worker_info(name), mapping=info)  # type: ignore[arg-type]
    await redis.zadd(keys.WORKERS_ALIVE, {name: beat})
    if cached:
        index = KVIndex(name, ttl_s=10)
        index.note({k: True for k in prompt_keys(PROMPT)[:cached]})
        await index.flush(redis, force=True)


async def test_the_worker_holding_the_longest_prefix_gets_the_request_on_its_own_stream(redis: Redis) -> None:
    await worker(redis, "a", cached=20)
    await worker(redis, "b", cached=64)
    await worker(redis, "c")
    router = Router(redis, SETTINGS)
    route = await router.route(request())
    assert (route.stream, route.worker, route.decision, route.cached_tokens) == (keys.routed_stream("b"), "b", "routed", 1024)
    assert router.decisions == {"routed": 1} and router.routed_to == {"b": 1}
    shorter = request("r2", tokens=(*PROMPT[:400], *range(5000, 5600)))  # shares 25 blocks: a holds 20, b all
    other = await Router(redis, SETTINGS).route(shorter)
    assert (other.worker, other.cached_tokens) == ("b", 400)


async def test_the_salt_is_part_of_the_prefix(redis: Redis) -> None:
    await worker(redis, "a", cached=64)
    await worker(redis, "b")
    router = Router(redis, SETTINGS)
    assert (await router.route(request(salt="tenant"))).decision == "no_overlap"
    assert (await router.route(request())).worker == "a"


async def test_too_little_overlap_goes_to_the_shared_stream(redis: Redis) -> None:
    await worker(redis, "a", cached=15)  # 240 tokens < 256
    await worker(redis, "b")
    router = Router(redis, SETTINGS)
    route = await router.route(request())
    assert (route.stream, route.worker, route.decision) == (keys.REQUEST_STREAM, None, "no_overlap")
    short = await router.route(request("short", tokens=(1, 2, 3)))  # no full block at all
    assert (short.stream, short.decision) == (keys.REQUEST_STREAM, "no_overlap")
    await worker(redis, "a", cached=16)  # 256 tokens
    assert (await router.route(request())).worker == "a"


async def test_one_live_worker_means_the_shared_stream(redis: Redis) -> None:
    await worker(redis, "a", cached=64)
    await worker(redis, "b", seen=time.time() - SETTINGS.heartbeat_ttl - 1)  # silent past the TTL: dead
    router = Router(redis, SETTINGS)
    route = await router.route(request())
    assert (route.stream, route.worker, route.decision) == (keys.REQUEST_STREAM, None, "single")
    await worker(redis, "b")
    assert (await router.route(request())).worker == "a"


@pytest.mark.parametrize("unfit", [{"draining": 1}, {"routable": 0}, {"block_size": 0}], ids=["draining", "not-routable", "no-block-size"])
async def test_a_draining_or_unroutable_worker_is_never_chosen(redis: Redis, unfit: dict[str, int]) -> None:
    await worker(redis, "best", cached=64, **unfit)
    await worker(redis, "some", cached=30)
    await worker(redis, "none")
    route = await Router(redis, SETTINGS).route(request())
    assert (route.worker, route.decision, route.cached_tokens) == ("some", "routed", 480)
    await redis.hset(keys.worker_info("some"), mapping=unfit)
    route = await Router(redis, SETTINGS).route(request("last"))
    assert (route.stream, route.worker, route.decision) == (keys.REQUEST_STREAM, None, "single")  # one fit worker is left


async def test_a_chosen_worker_at_its_width_sends_the_request_to_the_shared_stream(redis: Redis) -> None:
    settings = replace(SETTINGS, routing_queue_cost=1)  # the cache wins the cost even against a full queue
    await worker(redis, "a", cached=64, max_running=2, running=1, waiting=1)
    await worker(redis, "b")
    router = Router(redis, settings)
    route = await router.route(request())
    assert (route.stream, route.worker, route.decision) == (keys.REQUEST_STREAM, None, "busy")
    await worker(redis, "a", cached=64, max_running=2, running=1, routed_queue=0)
    assert (await router.route(request())).worker == "a"
    assert (await router.route(request())).decision == "busy"  # what this node routed since the heartbeat counts too


async def test_routing_shared_never_routes(redis: Redis) -> None:
    await worker(redis, "a", cached=64)
    await worker(redis, "b")
    router = Router(redis, replace(SETTINGS, routing="shared"))
    for i in range(3):
        route = await router.route(request(f"r{i}"))
        assert (route.stream, route.worker, route.decision) == (keys.REQUEST_STREAM, None, "off")
    assert router.decisions == {"off": 3}


async def test_a_prefix_every_request_shares_spreads_once_its_workers_queue_costs_more_than_prefilling_it(redis: Redis) -> None:
    await worker(redis, "a", cached=64)
    await worker(redis, "b")
    router = Router(redis, SETTINGS)
    chosen = [(await router.route(request(f"r{i}"))).worker for i in range(3)]
    # a: 1 token to prefill + 1024 a request this node routed to it since its heartbeat; b: 1025 to prefill
    assert chosen == ["a", "a", "b"]
    assert router.decisions["routed"] == 3
    await worker(redis, "a", cached=64)  # a newer heartbeat: a ran them (its queue is empty again)
    await worker(redis, "b")
    assert (await router.route(request("after"))).worker == "a"


async def test_a_redis_error_routes_to_the_shared_stream_and_never_raises(redis: Redis) -> None:
    gone = Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    try:
        router = Router(gone, SETTINGS)
        route = await router.route(request())
        assert (route.stream, route.worker, route.decision) == (keys.REQUEST_STREAM, None, "error")
        assert router.decisions == {"error": 1}
    finally:
        await gone.aclose()
    await worker(redis, "a")
    await worker(redis, "b")
    await redis.set(keys.kv_index("a"), "not a set")  # the index read fails (WRONGTYPE)
    route = await Router(redis, SETTINGS).route(request())
    assert (route.stream, route.decision) == (keys.REQUEST_STREAM, "error")


async def test_block_keys_hashed_by_the_caller_route_as_the_router_would(redis: Redis) -> None:
    await worker(redis, "a", cached=20)
    await worker(redis, "b", cached=64)
    router = Router(redis, SETTINGS)
    route = await router.route(request(), router.block_keys(request()))
    assert (route.worker, route.cached_tokens) == ("b", 1024)
    assert Router(redis, replace(SETTINGS, routing="shared")).block_keys(request()) is None
