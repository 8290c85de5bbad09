"""Reading dump records out of Redis: a request's IR key, meta hash and delta stream, and the time index.

Owns: the Redis reads behind `met dump`, `met replay` and the `--dump-dir` writer (async, one pipeline
per request; all of a request's keys share its shard's `{req:<shard>}` hash tag, so this works on a cluster).
Must not: write anything, or know the dump file format (shared.dumps does).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from shared import keys
from shared.codec import decode_request, deltas_of
from shared.dumps import DumpRecord, display_status, parse_meta

PAGE = 200
_GLOB_SPECIAL = re.compile(r"[\\*?\[\]]")  # escaped so an id prefix matches literally in ZSCAN MATCH


async def load_record(redis: Redis, request_id: str) -> DumpRecord | None:
    """The request's dump record, or None when its keys are gone (never existed, or past the dump TTL)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.get(keys.request_ir(request_id))
        pipe.hgetall(keys.request_meta(request_id))
        pipe.xrange(keys.delta_stream(request_id))
        raw_request, raw_meta, entries = await pipe.execute()
    if raw_request is None:
        return None
    # The stream's creation marker (no `d` field) is trimmed at once, but skip anything without a delta.
    deltas = tuple(deltas_of(entries))
    return DumpRecord(id=request_id, request=decode_request(raw_request), deltas=deltas, meta=parse_meta(raw_meta))


async def ids_with_prefix(redis: Redis, prefix: str, *, limit: int = 20) -> list[str]:
    """Recorded request ids (from the time index) that start with `prefix`, sorted, at most `limit`
    (enough to tell a unique prefix from an ambiguous one and to list the candidates)."""
    pattern = _GLOB_SPECIAL.sub(lambda m: "\\" + m.group(0), prefix) + "*"
    found: set[str] = set()
    async for member, _score in redis.zscan_iter(keys.REQUEST_INDEX, match=pattern, count=1000):
        found.add(_text(member))
        if len(found) >= limit:
            break
    return sorted(found)


@dataclass(frozen=True, slots=True)
class Listed:
    """One row of `met dump list`: the id, when it was received and its typed meta hash."""

    id: str
    received: float
    meta: dict[str, Any]

    @property
    def status(self) -> str:
        return display_status(self.meta)


async def list_requests(redis: Redis, *, since: float, limit: int, statuses: Collection[str] = ()) -> list[Listed]:
    """Requests received at or after `since` (unix time), newest first, at most `limit`, optionally only
    those whose display status (queued, running, finished, error, cancelled, expired) is in `statuses`."""
    found: list[Listed] = []
    offset = 0
    while len(found) < limit:
        page: Any = await redis.zrevrangebyscore(keys.REQUEST_INDEX, "+inf", since, start=offset, num=PAGE, withscores=True)
        if not page:
            break
        offset += len(page)
        async with redis.pipeline(transaction=False) as pipe:
            for member, _score in page:
                pipe.hgetall(keys.request_meta(_text(member)))
            metas = await pipe.execute()
        for (member, score), raw in zip(page, metas, strict=True):
            row = Listed(_text(member), float(score), parse_meta(raw))
            if not statuses or row.status in statuses:
                found.append(row)
    return found[:limit]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
