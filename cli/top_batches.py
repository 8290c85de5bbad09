"""The batch jobs `met top` shows: every batch not yet ended, with its progress, read from Redis.

Owns: the query (two pipelined round trips: the active set, then each batch's record and counts) and
`BatchView`. Must not: write anything, or know a protocol's batch object (it reads the record that
ingest.batches.batch_jobs keeps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis

from shared import keys

MAX_BATCHES = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchView:
    id: str
    protocol: str  # openai | anthropic
    status: str  # validating, in_progress, cancelling, finalizing...
    total: int
    succeeded: int
    failed: int  # errored, canceled or expired lines
    created_at: float


async def take_batches(redis: Redis) -> tuple[BatchView, ...]:
    active: Any = await redis.smembers(keys.BATCHES_ACTIVE)
    ids = sorted(a.decode() if isinstance(a, bytes) else str(a) for a in active or ())
    if not ids:
        return ()
    async with redis.pipeline(transaction=False) as pipe:
        for bid in ids:
            pipe.get(keys.batch_doc(bid))
            pipe.hgetall(keys.batch_counts(bid))
        replies = await pipe.execute()
    views = []
    for bid, raw, counts in zip(ids, replies[::2], replies[1::2], strict=True):
        if raw is None:
            continue
        doc = orjson.loads(raw)
        tally = {k.decode(): int(v) for k, v in (counts or {}).items()}
        failed = tally.get("errored", 0) + tally.get("canceled", 0) + tally.get("expired", 0)
        views.append(
            BatchView(
                id=bid,
                protocol=str(doc.get("protocol", "")),
                status=str(doc.get("status", "")),
                total=int(doc.get("total", 0)),
                succeeded=tally.get("succeeded", 0),
                failed=failed,
                created_at=float(doc.get("created_at", 0)),
            )
        )
    return tuple(sorted(views, key=lambda v: v.created_at)[:MAX_BATCHES])
