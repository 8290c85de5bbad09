"""Resumable streams: a client reconnects to a stream it lost, on any API node, and gets the rest.

A stream of several choices is resumed as a whole: its request id names the list of its parts
(`keys.choices`), its event ids carry a position per choice (encoders.wire.Slotted).

Owns: reading the resume point (`X-Request-Id` with `Last-Event-ID` on the generation routes; Responses'
`GET /v1/responses/{id}?stream=true&starting_after=N` uses the same machinery), loading the recorded
request IR, counting attachments, and the resume grace: a stream whose client vanished is cancelled
only after `--resume-grace-s`, and not at all if the client came back meanwhile (through any node).
The frames themselves come from re-encoding the delta stream from its start (encoders.wire `skip`).
Must not: encode frames or parse protocol bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import orjson
from blacksheep import Request as HttpRequest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from ingest.http.auth import owns
from ingest.http.publish import cancel, owner_of
from shared import keys
from shared.codec import decode_request
from shared.errors import ApiError, invalid
from shared.ir import Protocol, Request

ATTACH_TTL = 3600
_pending: set[asyncio.Task[None]] = set()  # grace timers in flight (a reference keeps each alive)


def resume_point(http: HttpRequest) -> tuple[str, str] | None:
    """(request id, last event id seen) when the client asks to resume, else None."""
    last = http.get_first_header(b"Last-Event-ID")
    if last is None:
        return None
    rid = http.get_first_header(b"X-Request-Id")
    if rid is None:
        raise invalid("Resuming a stream needs the 'X-Request-Id' header of the original response with 'Last-Event-ID'.", "X-Request-Id", "missing_request_id")
    return rid.decode(errors="replace"), last.decode(errors="replace")


def event_position(value: str, param: str) -> int:
    try:
        position = int(value)
    except ValueError:
        position = -2
    if position < -1:
        raise invalid(f"'{param}' must be the integer id of an event of the stream, got {value!r}.", param, "invalid_value")
    return position


def event_positions(value: str, slots: int, param: str) -> tuple[int, ...]:
    """A stream of several choices' event id: one position per slot (encoders.wire.Slotted)."""
    try:
        positions = tuple(event_position(v, param) for v in value.split("."))
    except ApiError:
        positions = ()
    if len(positions) != slots:
        raise invalid(
            f"'{param}' must be the id of an event of this stream ({slots} positions joined by '.'), got {value!r}.", param, "invalid_value"
        )
    return positions


async def record_choices(redis: Redis, request_id: str, parts: Sequence[str], *, ttl: int) -> None:
    await redis.set(keys.choices(request_id), orjson.dumps(list(parts)), ex=ttl)


async def choices_of(redis: Redis, request_id: str) -> list[str] | None:
    """The parts of a stream of several choices, or None for a stream of one."""
    raw = await redis.get(keys.choices(request_id))
    return None if raw is None else [str(part) for part in orjson.loads(raw)]


async def load(redis: Redis, request_id: str, protocol: Protocol, *, caller: str) -> Request:
    """The recorded request behind a stream to resume (404 once its dump has expired, or when `caller`
    did not make it: the same answer, so another key learns nothing of the id)."""
    raw = await redis.get(keys.request_ir(request_id))
    if raw is None or not owns(caller, await owner_of(redis, request_id)):
        raise ApiError(f"No stream '{request_id}' to resume: it never existed or finished too long ago.", status=404, kind="not_found", code="stream_not_found")
    request = decode_request(raw)
    if request.protocol is not protocol:
        raise invalid(f"Stream '{request_id}' was not made on this route (it is a {request.protocol.value} request).", "X-Request-Id", "wrong_route")
    return request


@dataclass(frozen=True, slots=True)
class Attached:
    """How one connection is attached to its stream: the attachment count it started with (`attach`;
    0 for the first connection) and whether leaving never cancels it (a background response)."""

    count: int = 0
    detached: bool = False


FIRST = Attached()


async def attach(redis: Redis, request_id: str) -> int:
    """Count a client attaching to a stream (a resume); the count after it, which that connection's
    `graceful_cancel` compares against (the first connection's is 0: nothing counted yet)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.incr(keys.attachments(request_id))
        pipe.expire(keys.attachments(request_id), ATTACH_TTL)
        count, _ = await pipe.execute()
    return int(count)


def graceful_cancel(redis: Redis, request_id: str, grace_s: float, parts: Sequence[str] = (), *, attached: int = 0) -> Callable[[], Awaitable[None]]:
    """The `on_abandon` of a resumable stream: cancel it (every one of its `parts`, for a stream of
    several choices) after `grace_s` unless a client attached after this connection did. `attached` is
    the attachment count when this connection attached (`attach`; 0 for the first), so a client that
    re-attached before this connection's loss was even noticed (through another API node) keeps its
    stream: the count is compared with the one this connection started with, not the one at its loss."""
    targets = tuple(parts) or (request_id,)

    async def cancel_all() -> None:
        for target in targets:
            await cancel(redis, target)

    async def nobody_else() -> bool:
        return int(await redis.get(keys.attachments(request_id)) or 0) <= attached

    async def abandon() -> None:
        if grace_s <= 0:
            with contextlib.suppress(RedisError):  # Redis away: the generation goes on (a resume, or the worker's deadline, ends it)
                if await nobody_else():
                    await cancel_all()
            return

        async def later() -> None:
            await asyncio.sleep(grace_s)
            with contextlib.suppress(RedisError):
                if await nobody_else():
                    await cancel_all()

        task = asyncio.create_task(later())
        _pending.add(task)
        task.add_done_callback(_pending.discard)

    return abandon
