"""The thin wire module beside the pure encoders: reads a request's delta stream from Redis, frames SSE,
sends keep-alive pings during silence, and turns a vanished client into a cancel flag.

Resumable streams: every frame an encoder produces gets an SSE `id:`, its position in the stream
(0, 1, 2…; pings have none). Encoders are pure functions of the request and its deltas, so a stream
re-encoded from the first delta yields the same frames with the same ids: resuming after event N is
re-encoding and skipping frames up to N (`skip`), on any API node. For Responses the id equals the
event's `sequence_number`.

Everything protocol-specific is in the encoders; this module only moves their frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from blacksheep.contents import TextServerSentEvent
from redis.asyncio import Redis
from redis.exceptions import RedisError

from encoders.frames import Frame
from shared import keys
from shared.codec import delta_of
from shared.deltas import Error, ErrorKind, StreamDelta, is_terminal

log = logging.getLogger(__name__)


class StreamEncoder(Protocol):
    def feed(self, delta: StreamDelta) -> list[Frame]: ...
    def finish(self) -> list[Frame]: ...


LOST_REDIS = "This server lost its connection to the request's stream; the generation goes on: resume the stream (Last-Event-ID) or retry."


async def tail(
    redis: Redis, request_id: str, *, deadline: float, block_ms: int = 500, retry_s: float = 30.0
) -> AsyncIterator[StreamDelta | None]:
    """Yield the request's deltas in order until the terminal one; `None` after each quiet read.

    Past `deadline` (unix time) without a terminal event, yield a synthesized timeout Error so no
    client is left hanging (e.g. no worker is alive to claim the request). A Redis error is this API
    node's, not the request's: the read is retried from the last id read for up to `retry_s`, then one
    synthesized Error ends the client's stream (the generation is not cancelled; the stream can be
    resumed once Redis is back).
    """
    key = keys.delta_stream(request_id)
    last = "0-0"
    failing_since: float | None = None
    while True:
        try:
            reply: Any = await redis.xread({key: last}, count=512, block=block_ms)
            failing_since = None
        except RedisError as exc:
            now = time.monotonic()
            failing_since = failing_since or now
            if now - failing_since > retry_s:
                log.error("giving up tailing %s after %.0f s of redis errors: %s", request_id, retry_s, type(exc).__name__)
                yield Error(message=LOST_REDIS, kind=ErrorKind.INTERNAL, attempt=0)
                return
            await asyncio.sleep(min(0.5, retry_s / 10))
            yield None  # keep-alive pings continue while Redis is away
            continue
        if not reply:
            if time.time() > deadline:
                yield Error(message="The request timed out before a worker finished it.", kind=ErrorKind.TIMEOUT, attempt=0)
                return
            yield None
            continue
        for _stream, entries in reply:
            for entry_id, fields in entries:
                last = entry_id
                delta = delta_of(fields)
                if delta is None:
                    continue  # the marker that created the stream
                yield delta
                if is_terminal(delta):
                    return


def to_sse(frame: Frame, position: int | None = None) -> TextServerSentEvent:
    return TextServerSentEvent(frame.data, event=frame.event, comment=frame.comment, id=None if position is None else str(position))


class _Numbered:
    """Gives encoder frames their stream positions; those at or before `skip` are not sent."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.position = -1

    def send(self, frames: list[Frame]) -> list[TextServerSentEvent]:
        out = []
        for frame in frames:
            self.position += 1
            if self.position > self.skip:
                out.append(to_sse(frame, self.position))
        return out


@dataclass(frozen=True, slots=True)
class ClientLink:
    """How the wire learns the client is gone, and what to do then (flag the cancel)."""

    is_disconnected: Callable[[], Awaitable[bool]]
    on_abandon: Callable[[], Awaitable[None]]
    check_every: float = 0.25


async def sse_events(
    deltas: AsyncIterator[StreamDelta | None],
    encoder: StreamEncoder,
    *,
    ping: Callable[[], list[Frame]],
    ping_interval: float,
    client: ClientLink,
    skip: int = -1,
) -> AsyncIterator[TextServerSentEvent]:
    """Encode deltas as SSE, pinging after `ping_interval` of silence; frames at positions up to `skip`
    (a resumed stream's Last-Event-ID) are encoded but not sent. The ASGI server drops writes to a
    closed connection silently, so the client is polled; if it is gone before the terminal event, stop
    and call `on_abandon` (which flags the cancel the worker acts on, after the resume grace)."""
    completed = False
    numbered = _Numbered(skip)
    last_sent = last_check = time.monotonic()
    try:
        async for delta in deltas:
            now = time.monotonic()
            if now - last_check >= client.check_every:
                last_check = now
                if await client.is_disconnected():
                    break
            if delta is None:
                if now - last_sent < ping_interval:
                    continue
                for frame in ping() or [Frame("", comment="ping")]:
                    yield to_sse(frame)
                last_sent = now
                continue
            completed = is_terminal(delta)
            for event in numbered.send(encoder.feed(delta)):
                yield event
            if numbered.position > skip:
                last_sent = now
        else:
            for event in numbered.send(encoder.finish()):
                yield event
    finally:
        if not completed:
            await asyncio.shield(client.on_abandon())


async def collect(deltas: AsyncIterator[StreamDelta | None], *, client: ClientLink) -> list[StreamDelta]:
    """Gather a non-streaming request's deltas; a client that disconnects meanwhile cancels it."""

    async def gather() -> list[StreamDelta]:
        return [d async for d in deltas if d is not None]

    task = asyncio.ensure_future(gather())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=client.check_every)
            if not task.done() and await client.is_disconnected():
                task.cancel()
                await client.on_abandon()
                break
        return await task
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
