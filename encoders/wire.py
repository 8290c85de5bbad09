"""The thin wire module beside the pure encoders: reads a request's delta stream from Redis, frames SSE,
sends keep-alive pings during silence, and turns a vanished client into a cancel flag.

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

from encoders.frames import Frame
from shared import keys
from shared.codec import decode_delta
from shared.deltas import Error, ErrorKind, StreamDelta, is_terminal

log = logging.getLogger(__name__)


class StreamEncoder(Protocol):
    def feed(self, delta: StreamDelta) -> list[Frame]: ...
    def finish(self) -> list[Frame]: ...


async def tail(redis: Redis, request_id: str, *, deadline: float, block_ms: int = 500) -> AsyncIterator[StreamDelta | None]:
    """Yield the request's deltas in order until the terminal one; `None` after each quiet read.

    Past `deadline` (unix time) without a terminal event, yield a synthesized timeout Error so no
    client is left hanging (e.g. no worker is alive to claim the request).
    """
    key = keys.delta_stream(request_id)
    last = "0-0"
    while True:
        reply: Any = await redis.xread({key: last}, count=512, block=block_ms)
        if not reply:
            if time.time() > deadline:
                yield Error(message="The request timed out before a worker finished it.", kind=ErrorKind.TIMEOUT, attempt=0)
                return
            yield None
            continue
        for _stream, entries in reply:
            for entry_id, fields in entries:
                last = entry_id
                if b"d" not in fields:
                    continue  # the marker that created the stream
                delta = decode_delta(fields[b"d"])
                yield delta
                if is_terminal(delta):
                    return


def to_sse(frame: Frame) -> TextServerSentEvent:
    return TextServerSentEvent(frame.data, event=frame.event, comment=frame.comment)


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
) -> AsyncIterator[TextServerSentEvent]:
    """Encode deltas as SSE, pinging after `ping_interval` of silence. The ASGI server drops writes to
    a closed connection silently, so the client is polled; if it is gone before the terminal event,
    stop and call `on_abandon` (which flags the cancel the worker acts on)."""
    completed = False
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
                frames = ping() or [Frame("", comment="ping")]
            else:
                frames = encoder.feed(delta)
                completed = is_terminal(delta)
            for frame in frames:
                yield to_sse(frame)
            last_sent = now
        else:
            for frame in encoder.finish():
                yield to_sse(frame)
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
