"""Ingest's Redis writes: put an admitted request on the request stream, flag a cancel."""

from __future__ import annotations

import time
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from ingest.auth import ANONYMOUS
from shared import keys
from shared.codec import VERSION, encode_request
from shared.ir import Request

CANCEL_TTL = 3600
OWNER = "owner"  # the request meta field naming the caller id that made it (ingest.auth.owns)


async def submit(redis: Redis, request: Request, *, owner: str = ANONYMOUS) -> None:
    """Record the request (IR, meta, index), create its empty delta stream (so that workers' NOMKSTREAM
    writes can never recreate an expired one), then XADD it (never MAXLEN: accepted work is never trimmed).

    A non-transactional pipeline keeps the order and stays valid on a Redis cluster, where these keys
    live in different slots."""
    async with redis.pipeline(transaction=False) as pipe:
        _queue(pipe, request, owner)
        await pipe.execute()


async def submit_batch_line(redis: Redis, request: Request, *, owner: str = ANONYMOUS) -> None:
    """`submit` for a batch line, all or nothing (MULTI/EXEC), with its place in the queue counted:
    once the IR key exists the line is queued, so a dispatcher that restarts asks `is_queued` and never
    queues a line twice or loses one. (MULTI over these keys needs one Redis, not a cluster.)"""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.incrby(keys.INFLIGHT, 1)
        _queue(pipe, request, owner)
        await pipe.execute()


async def is_queued(redis: Redis, request_id: str) -> bool:
    return bool(await redis.exists(keys.request_ir(request_id)))


async def owner_of(redis: Redis, request_id: str) -> str | None:
    """The caller id that made the request (None: unknown, expired, or queued before owners were recorded)."""
    raw: Any = await redis.hget(keys.request_meta(request_id), OWNER)
    return bytes(raw).decode() if raw is not None else None


def _queue(pipe: Pipeline, request: Request, owner: str) -> None:
    encoded = encode_request(request)
    now = time.time()
    deltas = keys.delta_stream(request.id)
    pipe.set(keys.request_ir(request.id), encoded)
    pipe.hset(
        keys.request_meta(request.id),
        mapping={"status": "queued", "protocol": request.protocol.value, "model": request.model, "endpoint": request.endpoint, "received_at": now, OWNER: owner},
    )
    pipe.xadd(deltas, {"created": b"1"}, id="0-1")
    pipe.xtrim(deltas, maxlen=0, approximate=False)
    pipe.zadd(keys.REQUEST_INDEX, {request.id: now})
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
