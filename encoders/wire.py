"""The thin wire module beside the pure encoders: reads a request's delta stream from Redis, frames SSE,
sends keep-alive pings during silence, and turns a vanished client into a cancel flag.

Resumable streams: every frame an encoder produces gets an SSE `id:`, its position in the stream
(0, 1, 2…; pings have none). Encoders are pure functions of the request and its deltas, so a stream
re-encoded from the first delta yields the same frames with the same ids: resuming after event N is
re-encoding and skipping frames up to N (`skip`), on any API node. For Responses the id equals the
event's `sequence_number`. A stream of several choices (encoders.fan_in) numbers each choice's frames
on its own and gives every event the positions of all of them, dot-joined (`4.-1.7`): the choices'
interleaving is not reproducible, but each choice's frames are.

Keep-alive comments (`: ping`, on the protocols with no ping event) go out as the comment line alone,
without the blank line that ends an SSE event (`sse_response`): the last event id is sticky (WHATWG
SSE, "dispatch the event"), so after any event with an `id:` a blank line dispatches an event with
empty data, which the openai SDK parses as JSON and fails on. blacksheep's writer always ends a frame
with a blank line, hence the few lines of our own here.

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

from blacksheep import Response
from blacksheep.contents import ServerSentEvent, StreamedContent, TextServerSentEvent
from blacksheep.scribe import write_sse
from redis.asyncio import Redis
from redis.exceptions import RedisError

from encoders.fan_in import Tagged, is_last, tag_terminal
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


async def fan_in(tails: list[AsyncIterator[StreamDelta | None]]) -> AsyncIterator[Tagged | None]:
    """Several choices' delta streams as one, in arrival order, each delta tagged with its choice; the
    last one yielded is marked (every choice ended, or one failed). Each tail is read by its own task
    (one slot each on a cluster: the choices' keys hash apart); they stop when this generator closes."""
    queue: asyncio.Queue[tuple[int, StreamDelta | Exception | None]] = asyncio.Queue()

    async def pump(slot: int, deltas: AsyncIterator[StreamDelta | None]) -> None:
        try:
            async for delta in deltas:
                await queue.put((slot, delta))
        except Exception as exc:  # re-raised by the reader, as a single tail's would be
            await queue.put((slot, exc))

    tasks = [asyncio.create_task(pump(slot, deltas)) for slot, deltas in enumerate(tails)]
    done: set[int] = set()
    try:
        while True:
            slot, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                yield None
                continue
            tagged = tag_terminal(slot, item, done, len(tails))
            yield tagged
            if tagged.last:
                return
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def write_event(event: ServerSentEvent) -> bytes:
    """An event's bytes (blacksheep's writer), except a keep-alive: an event that is only a comment
    goes out as its comment line with no blank line after it, so it dispatches no event. The `openai`
    SDKs' decoder yields an event at every blank line once any `id:` was seen (the last event id
    persists, per the SSE spec) and fails to parse its empty data; a dangling comment line is skipped by
    every parser and still keeps proxies and clients from timing the stream out."""
    if event.comment and not (event.data or event.event or event.id):
        return b"".join(b": " + line.encode() + b"\n" for line in event.comment.splitlines())
    return bytes(write_sse(event))


def sse_response(events: AsyncIterator[ServerSentEvent], headers: list[tuple[bytes, bytes]]) -> Response:
    """A `text/event-stream` response of these events (written by `write_event`)."""

    async def body() -> AsyncIterator[bytes]:
        async for event in events:
            yield write_event(event)

    return Response(200, headers, StreamedContent(b"text/event-stream", body))


def to_sse(frame: Frame, position: int | str | None = None) -> TextServerSentEvent:
    return TextServerSentEvent(frame.data, event=frame.event, comment=frame.comment, id=None if position is None else str(position))


class Numbered:
    """Gives encoder frames their stream positions; those at or before `skip` are not sent."""

    terminal = staticmethod(is_terminal)  # the delta that ends the stream

    def __init__(self, skip: int = -1) -> None:
        self.skip = skip
        self.position = -1

    def send(self, frames: list[Frame]) -> list[TextServerSentEvent]:
        out = []
        for frame in frames:
            self.position += 1
            if self.position > self.skip:
                out.append(to_sse(frame, self.position))
        return out


class Slotted:
    """Positions of a stream of several choices (encoders.fan_in): frames come tagged with their slot;
    each slot counts its own, those at or before its `skip` entry are not sent, and an event's id is
    every slot's position, dot-joined. A slot not yet re-encoded up to what the client holds reports
    its `skip` entry, so an id never claims less than the client has (a second resume repeats nothing)."""

    terminal = staticmethod(is_last)

    def __init__(self, slots: int, skip: tuple[int, ...] | None = None) -> None:
        self.skip = skip or (-1,) * slots
        self.positions = [-1] * slots

    def send(self, frames: list[tuple[int, Frame]]) -> list[TextServerSentEvent]:
        out = []
        for slot, frame in frames:
            self.positions[slot] += 1
            if self.positions[slot] > self.skip[slot]:
                out.append(to_sse(frame, ".".join(str(max(p, s)) for p, s in zip(self.positions, self.skip, strict=True))))
        return out


class Numbering(Protocol):
    """How a stream's frames become events (their ids, what a resume skips), and its last delta."""

    def send(self, frames: Any) -> list[TextServerSentEvent]: ...
    def terminal(self, delta: Any) -> bool: ...


class Encoder(Protocol):
    """A StreamEncoder, or encoders.fan_in's FanInEncoder (tagged deltas in, tagged frames out)."""

    def feed(self, delta: Any) -> Any: ...
    def finish(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class ClientLink:
    """How the wire learns the client is gone, and what to do then (flag the cancel)."""

    is_disconnected: Callable[[], Awaitable[bool]]
    on_abandon: Callable[[], Awaitable[None]]
    check_every: float = 0.25


async def sse_events(
    deltas: AsyncIterator[Any],
    encoder: Encoder,
    *,
    ping: Callable[[], list[Frame]],
    ping_interval: float,
    client: ClientLink,
    numbering: Numbering | None = None,
) -> AsyncIterator[TextServerSentEvent]:
    """Encode deltas as SSE, pinging after `ping_interval` of silence; frames at positions up to the
    numbering's skip (a resumed stream's Last-Event-ID) are encoded but not sent (default: `Numbered()`,
    nothing skipped; a stream of several choices has `Slotted`). The ASGI server drops writes to a
    closed connection silently, so the client is polled; if it is gone before the terminal event, stop
    and call `on_abandon` (which flags the cancel the worker acts on, after the resume grace)."""
    completed = False
    numbered = numbering or Numbered()
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
            completed = numbered.terminal(delta)
            events = numbered.send(encoder.feed(delta))
            for event in events:
                yield event
            if events:
                last_sent = now
        else:
            for event in numbered.send(encoder.finish()):
                yield event
    finally:
        if not completed:
            await asyncio.shield(client.on_abandon())
        close = getattr(deltas, "aclose", None)
        if close is not None:  # stop the tails now (a fan-in's reader tasks), not when collected
            with contextlib.suppress(RuntimeError):  # already running: it is being closed by its own error
                await close()


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
