"""Cancels: the flag a request keeps, and the feed that tells the workers running it.

A cancel sets the request's flag (shared.keys.cancel_flag: a worker that claims it later sees it) and
then appends the request's id to the cancel feed (shared.keys.CANCELS), which every worker reads once a
step from where it left off: one read however many requests it runs (reading each running request's
flag every step cost a GET per request, 20,000 a second for a worker running 1,024). The flag is set
first, so a worker that misses a notice because it had not claimed the request yet finds the flag when
it does. The feed entry carries who cancelled (the flag's value), so a notice needs no second read.
Must not: decide what a cancel does (the worker loop does).
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from shared import keys
from shared.codec import ID_FIELD

FEED_LENGTH = 100_000  # approximate cap: a notification feed, not accepted work
READ_COUNT = 10_000  # notices read at once
BY_FIELD = "by"
CANCEL_TTL = 3600


async def cancel(redis: Redis, request_id: str, *, by_operator: bool = False) -> None:
    """Flag the request cancelled, then tell the workers. A disconnected client's cancel ends it quietly
    (nobody is left to tell); an operator's (`met top`, `c`) ends it with an error the client sees
    (shared/deltas.py)."""
    by = keys.OPERATOR_CANCEL if by_operator else keys.CLIENT_CANCEL
    await redis.set(keys.cancel_flag(request_id), by, ex=CANCEL_TTL)
    await redis.xadd(keys.CANCELS, {ID_FIELD: request_id, BY_FIELD: by}, maxlen=FEED_LENGTH, approximate=True)


async def last_id(redis: Redis) -> str:
    """The feed's newest entry id ("0-0" when empty): a worker starting now reads what comes after it
    (what came before reaches it through the flags, when it claims)."""
    newest: Any = await redis.xrevrange(keys.CANCELS, count=1)
    return _text(newest[0][0]) if newest else "0-0"


async def read(redis: Redis, after: str) -> tuple[list[tuple[str, bytes]], str]:
    """The (request id, who) notices after entry `after`, and the id to read from next time."""
    reply: Any = await redis.xread({keys.CANCELS: after}, count=READ_COUNT)
    notices: list[tuple[str, bytes]] = []
    for _stream, entries in reply or ():
        for entry_id, fields in entries:
            after = _text(entry_id)
            rid = fields.get(ID_FIELD.encode(), fields.get(ID_FIELD))
            if rid is not None:
                notices.append((_text(rid), bytes(fields.get(BY_FIELD.encode(), keys.CLIENT_CANCEL))))
    return notices, after


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
