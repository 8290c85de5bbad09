"""The thin wire module beside the pure encoders: follows a request's delta stream (through the API
node's bus.tails hub), frames SSE, sends keep-alive pings during silence, and turns a vanished client
into a cancel flag.

Batches: everything the hub read for a stream at once is one batch (`Batch`, a list of deltas); its
frames are encoded together and written to the client in one write (`sse_response`), so a stream the
client does not keep up with costs one write per batch, not per token.

Resumable streams: every frame an encoder produces gets an SSE `id:`, its position in the stream
(0, 1, 2…; pings have none). Encoders are pure functions of the request and its deltas, so a stream
re-encoded from the first delta yields the same frames with the same ids: resuming after event N is
re-encoding and skipping frames up to N (`skip`), on any API node. For Responses the id equals the
event's `sequence_number`. A stream of several choices (encoders.fan_in) numbers each choice's frames
on its own and gives every event the positions of all of them, dot-joined (`4.-1.7`): the choices'
interleaving is not reproducible, but each choice's frames are.

A client that leaves is seen at once, not polled: `Presence` runs one task per connection awaiting
the ASGI `receive()`, which yields `http.disconnect` when the connection closes, and wakes the
stream's subscriptions (the ASGI server drops writes to a closed connection silently).

Keep-alive comments (`: ping`, on the protocols with no ping event) go out as the comment line alone,
without the blank line that ends an SSE event (`Event.wire`): the last event id is sticky (WHATWG
SSE, "dispatch the event"), so after any event with an `id:` a blank line dispatches an event with
empty data, which the openai SDK parses as JSON and fails on.

Everything protocol-specific is in the encoders; this module only moves their frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from blacksheep import Response
from blacksheep.contents import StreamedContent

from bus.tails import Entry, Tails
from encoders.fan_in import Tagged, is_last, tag_terminal
from encoders.frames import Frame
from shared import keys
from shared.codec import decode_delta
from shared.deltas import Batch, Error, ErrorKind, StreamDelta, is_terminal

log = logging.getLogger(__name__)

Receive = Callable[[], Awaitable[dict[str, Any]]]  # the ASGI receive callable


class StreamEncoder(Protocol):
    def feed(self, delta: StreamDelta) -> list[Frame]: ...
    def finish(self) -> list[Frame]: ...


LOST_REDIS = "This server lost its connection to the request's stream; the generation goes on: resume the stream (Last-Event-ID) or retry."
TIMED_OUT = "The request timed out before a worker finished it."


class Presence:
    """Whether the client of one HTTP request is still connected, learned without polling: while any stream
    of the request waits (`on_gone` registered its waker), a task awaits the ASGI `receive()` (after the
    body was read it returns only `http.disconnect`), and on disconnect sets `gone` and calls every
    registered waker, so the response ends at once. The task stops when the last waker is removed
    (`off`). `Presence()` (no receive): a client that never leaves (tests, followers)."""

    def __init__(self, receive: Receive | None = None) -> None:
        self.gone = False
        self._receive = receive
        self._wakers: list[Callable[[], None]] = []
        self._task: asyncio.Task[None] | None = None

    def on_gone(self, wake: Callable[[], None]) -> None:
        self._wakers.append(wake)
        if self._receive is not None and self._task is None and not self.gone:
            self._task = asyncio.create_task(self._watch(self._receive))

    def off(self, wake: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._wakers.remove(wake)
        if not self._wakers and self._task is not None:
            self._task.cancel()
            self._task = None

    async def _watch(self, receive: Receive) -> None:
        with contextlib.suppress(Exception):  # a receive that fails is a connection that is gone
            while (await receive()).get("type") != "http.disconnect":
                pass
        self.leave()

    def leave(self) -> None:
        """The client is gone (its connection closed, or a test says so): wake whoever waits for it."""
        self.gone = True
        for wake in list(self._wakers):
            wake()


class Observer(Protocol):
    """Who sees each batch as it passes (ingest.http.metrics.Observation: /metrics and the access log)."""

    def batch(self, batch: Batch) -> None: ...
    def close(self) -> None: ...


async def tail(
    tails: Tails, request_id: str, *, deadline: float, presence: Presence | None = None, observer: Observer | None = None
) -> AsyncIterator[Batch | None]:
    """Yield the request's deltas in batches, in order, until the terminal one; `None` when quiet (about
    once a second with nothing new, or once its client left: `presence`).

    Past `deadline` (unix time) without a terminal event, yield a synthesized timeout Error so no
    client is left hanging (e.g. no worker is alive to claim the request). Redis errors are this API
    node's (bus.tails retries them); only a long outage ends the stream with one synthesized Error
    (the generation is not cancelled; the stream can be resumed once Redis is back). `observer` sees
    every batch before it is yielded, and is closed when the stream ends.
    """
    sub = tails.subscribe(keys.delta_stream(request_id))  # the hub hands over each entry's DELTA_FIELD
    if presence is not None:
        presence.on_gone(sub.wake)
        if presence.gone:
            sub.wake()
    try:
        while True:
            batch = _batch_of(await sub.take(), error=sub.error, deadline=deadline)
            if not batch:
                yield None
                continue
            if observer is not None:
                observer.batch(batch)
            yield batch
            if is_terminal(batch[-1]):
                return
    finally:
        tails.unsubscribe(sub)
        if presence is not None:
            presence.off(sub.wake)
        if observer is not None:
            observer.close()


def _batch_of(entries: list[Entry], *, error: str, deadline: float) -> Batch:
    """The deltas of what a subscription took, up to a terminal one; a synthesized Error after a long
    Redis outage (`error`) or past `deadline` with nothing come; [] when quiet."""
    batch: Batch = []
    for _entry_id, payload in entries:
        if payload is None:
            continue  # the marker that created the stream
        delta = decode_delta(payload)
        batch.append(delta)
        if is_terminal(delta):
            return batch
    if error:
        batch.append(Error(message=LOST_REDIS, kind=ErrorKind.INTERNAL, attempt=0))
    elif not batch and time.time() > deadline:
        batch.append(Error(message=TIMED_OUT, kind=ErrorKind.TIMEOUT, attempt=0))
    return batch


async def fan_in(tails: list[AsyncIterator[Batch | None]]) -> AsyncIterator[list[Tagged] | None]:
    """Several choices' delta streams as one, in arrival order, each delta tagged with its choice; the
    last one yielded is marked (every choice ended, or one failed). Each tail is read by its own task;
    they stop when this generator closes."""
    queue: asyncio.Queue[tuple[int, Batch | Exception | None]] = asyncio.Queue()

    async def pump(slot: int, deltas: AsyncIterator[Batch | None]) -> None:
        try:
            async for batch in deltas:
                await queue.put((slot, batch))
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
            tagged = [tag_terminal(slot, delta, done, len(tails)) for delta in item]
            yield tagged
            if any(t.last for t in tagged):
                return
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Event(NamedTuple):
    """One SSE event: an encoder frame and its position (`id:`), or a keep-alive (no position). A tuple:
    one is made per token, and a frozen dataclass costs several times as much to build."""

    frame: Frame
    id: str | None = None

    @property
    def event(self) -> str | None:
        return self.frame.event

    @property
    def data(self) -> str:
        return self.frame.data

    def wire(self) -> bytes:
        """The event's bytes. A keep-alive that is only a comment goes out as its comment line with no blank
        line after it, so it dispatches no event: the `openai` SDKs' decoder yields an event at every blank
        line once any `id:` was seen (the last event id persists, per the SSE spec) and fails to parse its
        empty data; a dangling comment line is skipped by every parser and still keeps proxies and clients
        from timing the stream out."""
        frame = self.frame
        if frame.comment and not (frame.data or frame.event or self.id):
            return b"".join(b": " + line.encode() + b"\n" for line in frame.comment.splitlines())
        return frame.to_sse(self.id)


def sse_response(batches: AsyncIterator[list[Event]], headers: list[tuple[bytes, bytes]], *, count: Callable[[int], None] | None = None) -> Response:
    """A `text/event-stream` response: each batch of events in one write. `count(+1)` when the body starts,
    `count(-1)` when it ends, however it ends (a draining API node waits for its open streams)."""

    async def body() -> AsyncIterator[bytes]:
        if count is not None:
            count(1)
        try:
            async for batch in batches:
                if batch:
                    yield b"".join([event.wire() for event in batch])
        finally:
            if count is not None:
                count(-1)

    return Response(200, headers, _EventStream(b"text/event-stream", body))


class _EventStream(StreamedContent):
    """blacksheep's streamed content, less the generator it wraps around ours to hand out our chunks
    (one layer of async iteration per write; its own class iterates `get_parts()`, whatever it returns)."""

    def get_parts(self) -> Any:  # (its stub calls it a coroutine; blacksheep iterates what it returns)
        return self.generator()


class Numbered:
    """Gives encoder frames their stream positions; those at or before `skip` are not sent."""

    terminal = staticmethod(is_terminal)  # the delta that ends the stream

    def __init__(self, skip: int = -1) -> None:
        self.skip = skip
        self.position = -1

    def send(self, frames: list[Frame]) -> list[Event]:
        out = []
        for frame in frames:
            self.position += 1
            if self.position > self.skip:
                out.append(Event(frame, str(self.position)))
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

    def send(self, frames: list[tuple[int, Frame]]) -> list[Event]:
        out = []
        for slot, frame in frames:
            self.positions[slot] += 1
            if self.positions[slot] > self.skip[slot]:
                out.append(Event(frame, ".".join(str(max(p, s)) for p, s in zip(self.positions, self.skip, strict=True))))
        return out


class Numbering(Protocol):
    """How a stream's frames become events (their ids, what a resume skips), and its last delta."""

    def send(self, frames: Any) -> list[Event]: ...
    def terminal(self, delta: Any) -> bool: ...


class Encoder(Protocol):
    """A StreamEncoder, or encoders.fan_in's FanInEncoder (tagged deltas in, tagged frames out)."""

    def feed(self, delta: Any) -> Any: ...
    def finish(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class ClientLink:
    """Whether the client is there (`presence`), and what to do when it left before the end (flag the cancel)."""

    presence: Presence
    on_abandon: Callable[[], Awaitable[None]]


@dataclass(slots=True)
class _Pacing:
    ping_interval: float
    last_sent: float = field(default_factory=time.monotonic)

    def due(self, now: float) -> bool:
        return now - self.last_sent >= self.ping_interval


async def sse_events(
    deltas: AsyncIterator[Any],
    encoder: Encoder,
    *,
    ping: Callable[[], list[Frame]],
    ping_interval: float,
    client: ClientLink,
    numbering: Numbering | None = None,
) -> AsyncIterator[list[Event]]:
    """Encode batches of deltas as batches of SSE events, pinging after `ping_interval` of silence;
    frames at positions up to the numbering's skip (a resumed stream's Last-Event-ID) are encoded but
    not sent (default: `Numbered()`, nothing skipped; a stream of several choices has `Slotted`). If
    the client is gone before the terminal event, stop and call `on_abandon` (which flags the cancel
    the worker acts on, after the resume grace)."""
    numbered = numbering or Numbered()
    pacing = _Pacing(ping_interval)
    presence = client.presence
    completed = False
    try:
        async for batch in deltas:
            if presence.gone:
                break
            if batch is None:
                now = time.monotonic()
                if pacing.due(now):
                    yield [Event(frame) for frame in ping() or [Frame("", comment="ping")]]
                    pacing.last_sent = now
                continue
            out, completed = _encode(batch, encoder, numbered)
            if out:
                pacing.last_sent = time.monotonic()
                yield out
            if completed:
                return
        else:
            finish = numbered.send(encoder.finish())
            if finish:
                yield finish
    finally:
        if not completed:
            await asyncio.shield(client.on_abandon())
        close = getattr(deltas, "aclose", None)
        if close is not None:  # stop the tails now (a fan-in's reader tasks), not when collected
            with contextlib.suppress(RuntimeError):  # already running: it is being closed by its own error
                await close()


def _encode(batch: list[Any], encoder: Encoder, numbered: Numbering) -> tuple[list[Event], bool]:
    """A batch's events, and whether it held the stream's last delta (then the encoder's closing frames follow)."""
    out: list[Event] = []
    for delta in batch:
        out += numbered.send(encoder.feed(delta))
        if numbered.terminal(delta):
            return out + numbered.send(encoder.finish()), True
    return out, False


async def collect(deltas: AsyncIterator[Batch | None], *, client: ClientLink) -> list[StreamDelta]:
    """Gather a non-streaming request's deltas; a client that disconnects meanwhile cancels it."""
    gathered: list[StreamDelta] = []
    try:
        async for batch in deltas:
            if client.presence.gone:
                await client.on_abandon()
                break
            if batch is not None:
                gathered += batch
    finally:
        close = getattr(deltas, "aclose", None)
        if close is not None:
            await close()
    return gathered
