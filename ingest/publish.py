"""Ingest's Redis writes: put an admitted request on the request stream, flag a cancel."""

from __future__ import annotations

import time
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from bus.connect import is_cluster
from shared import keys
from shared.codec import VERSION, encode_request
from shared.ir import Request

CANCEL_TTL = 3600


async def submit(redis: Redis, request: Request) -> None:
    """Record the request (IR, meta, index), create its empty delta stream (so that workers' NOMKSTREAM
    writes can never recreate an expired one), then XADD it (never MAXLEN: accepted work is never trimmed).

    On one Redis a non-transactional pipeline keeps that order. On a cluster these keys live in
    different slots and redis-py sends each node's share concurrently, so the request's own keys are
    written first (one slot, one script) and the global ones after (bus.connect)."""
    if is_cluster(redis):
        encoded = encode_request(request)
        await _record(redis, request, encoded)
        async with redis.pipeline(transaction=False) as pipe:
            _enqueue(pipe, request, encoded)
            await pipe.execute()
        return
    async with redis.pipeline(transaction=False) as pipe:
        _queue(pipe, request)
        await pipe.execute()


async def submit_batch_line(redis: Redis, request: Request) -> None:
    """`submit` for a batch line, all or nothing (MULTI/EXEC), with its place in the queue counted:
    once the IR key exists the line is queued, so a dispatcher that restarts asks `is_queued` and never
    queues a line twice or loses one.

    A cluster has no MULTI across slots, so there it takes three steps: the request's keys without the
    IR (an idempotent script), then the count and the XADD, then the IR key. A dispatcher that dies
    between the last two queues that one line twice when it restarts (it runs twice; its result is
    recorded once, by custom_id): at least once, never lost."""
    if is_cluster(redis):
        encoded = encode_request(request)
        await _record(redis, request, b"")
        async with redis.pipeline(transaction=False) as pipe:
            pipe.incrby(keys.INFLIGHT, 1)
            _enqueue(pipe, request, encoded)
            await pipe.execute()
        await redis.set(keys.request_ir(request.id), encoded)
        return
    async with redis.pipeline(transaction=True) as pipe:
        pipe.incrby(keys.INFLIGHT, 1)
        _queue(pipe, request)
        await pipe.execute()


async def is_queued(redis: Redis, request_id: str) -> bool:
    return bool(await redis.exists(keys.request_ir(request_id)))


def _queue(pipe: Pipeline, request: Request) -> None:
    encoded = encode_request(request)
    now = time.time()
    deltas = keys.delta_stream(request.id)
    pipe.set(keys.request_ir(request.id), encoded)
    pipe.hset(
        keys.request_meta(request.id),
        mapping={"status": "queued", "protocol": request.protocol.value, "model": request.model, "endpoint": request.endpoint, "received_at": now},
    )
    pipe.xadd(deltas, {"created": b"1"}, id="0-1")
    pipe.xtrim(deltas, maxlen=0, approximate=False)
    pipe.zadd(keys.REQUEST_INDEX, {request.id: now})
    pipe.xadd(keys.REQUEST_STREAM, {"v": VERSION, "id": request.id, "req": encoded})


# The request's own keys, one slot (cluster path): KEYS ir, meta, deltas; ARGV encoded IR ('' = not
# yet), protocol, model, endpoint, now. Creates the empty delta stream once (an empty stream stays a key).
_RECORD = """
if redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('XADD', KEYS[3], '0-1', 'created', '1')
  redis.call('XTRIM', KEYS[3], 'MAXLEN', 0)
end
redis.call('HSET', KEYS[2], 'status', 'queued', 'protocol', ARGV[2], 'model', ARGV[3], 'endpoint', ARGV[4], 'received_at', ARGV[5])
if ARGV[1] ~= '' then redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"""


async def _record(redis: Redis, request: Request, encoded: bytes) -> None:
    ids = (keys.request_ir(request.id), keys.request_meta(request.id), keys.delta_stream(request.id))
    await redis.eval(_RECORD, 3, *ids, encoded, request.protocol.value, request.model, request.endpoint, time.time())


def _enqueue(pipe: Any, request: Request, encoded: bytes) -> None:
    """The global half of a submit (cluster path): the index and the request stream."""
    pipe.zadd(keys.REQUEST_INDEX, {request.id: time.time()})
    pipe.xadd(keys.REQUEST_STREAM, {"v": VERSION, "id": request.id, "req": encoded})


# Atomically: refuse (-1) when admitting ARGV[1] more requests would pass the limit ARGV[2].
_ADMIT = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n + tonumber(ARGV[1]) > tonumber(ARGV[2]) then return -1 end
return redis.call('INCRBY', KEYS[1], ARGV[1])
"""


async def admit(redis: Redis, count: int, limit: int) -> bool:
    """Reserve `count` places in the queue; False when the queue is full."""
    result = await redis.eval(_ADMIT, 1, keys.INFLIGHT, count, limit)
    return int(result) >= 0


async def release(redis: Redis, count: int) -> None:
    await redis.decrby(keys.INFLIGHT, count)


async def cancel(redis: Redis, request_id: str, *, by_operator: bool = False) -> None:
    """Flag the request cancelled. A disconnected client's cancel ends it quietly (nobody is left to
    tell); an operator's (`met top`, `c`) ends it with an error the client sees (shared/deltas.py)."""
    await redis.set(keys.cancel_flag(request_id), keys.OPERATOR_CANCEL if by_operator else keys.CLIENT_CANCEL, ex=CANCEL_TTL)
