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
from typing import Protocol

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


async def tail(redis: Redis, request_id: str, *, ping_interval: float, deadline: float, block_ms: int = 1000) -> AsyncIterator[StreamDelta | None]:
    """Yield the request's deltas in order until the terminal one; `None` when a ping is due.

    Past `deadline` (unix time) without a terminal event, yield a synthesized timeout Error so no
    client is left hanging (e.g. no worker is alive to claim the request).
    """
    key = keys.delta_stream(request_id)
    last = "0-0"
    quiet_since = time.monotonic()
    while True:
        reply = await redis.xread({key: last}, count=512, block=block_ms)
        if not reply:
            if time.time() > deadline:
                yield Error(message="The request timed out before a worker finished it.", kind=ErrorKind.TIMEOUT, attempt=0)
                return
            if time.monotonic() - quiet_since >= ping_interval:
                quiet_since = time.monotonic()
                yield None
            continue
        quiet_since = time.monotonic()
        for _stream, entries in reply:
            for entry_id, fields in entries:
                last = entry_id
                delta = decode_delta(fields[b"d"])
                yield delta
                if is_terminal(delta):
                    return


def to_sse(frame: Frame) -> TextServerSentEvent:
    return TextServerSentEvent(frame.data, event=frame.event)


async def sse_events(
    deltas: AsyncIterator[StreamDelta | None],
    encoder: StreamEncoder,
    *,
    ping: Callable[[], list[Frame]],
    on_abandon: Callable[[], Awaitable[None]],
) -> AsyncIterator[TextServerSentEvent]:
    """Encode deltas as SSE. If the client goes away before the terminal event, call `on_abandon`."""
    completed = False
    try:
        async for delta in deltas:
            if delta is None:
                frames = ping()
                if not frames:
                    yield TextServerSentEvent("", comment="ping")
                for frame in frames:
                    yield to_sse(frame)
                continue
            for frame in encoder.feed(delta):
                yield to_sse(frame)
            if is_terminal(delta):
                completed = True
        for frame in encoder.finish():
            yield to_sse(frame)
    finally:
        if not completed:
            await asyncio.shield(on_abandon())


async def collect(
    deltas: AsyncIterator[StreamDelta | None],
    *,
    is_disconnected: Callable[[], Awaitable[bool]],
    on_abandon: Callable[[], Awaitable[None]],
    poll_s: float = 0.5,
) -> list[StreamDelta]:
    """Gather a non-streaming request's deltas; a client that disconnects meanwhile cancels it."""

    async def gather() -> list[StreamDelta]:
        return [d async for d in deltas if d is not None]

    task = asyncio.ensure_future(gather())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=poll_s)
            if not task.done() and await is_disconnected():
                task.cancel()
                await on_abandon()
                break
        return await task
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
