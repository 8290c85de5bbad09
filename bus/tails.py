"""Tails: one process's readers of many delta streams at once, so a waiting stream costs a coroutine
and a buffer, not a Redis connection (design invariant 14).

A `Tails` hub runs a few reader tasks. Each reader owns a group of subscriptions and reads all of
their streams in one `XREAD BLOCK` call, hands each subscription the entries of its stream, and
calls again. On a single server a reader's streams may be any keys: a subscription goes to the least
busy reader, and another reader starts only once each has `Pace.per_reader` streams (up to
`Pace.readers`), since every call has a fixed cost, paid per reader each time the workers write. On a
Redis Cluster one call may only name keys of one hash slot, so there is a
reader per slot in use (per-request keys are sharded into few slots: shared.keys.request_shard).

A blocked reader learns of a new subscription through its doorbell: a one-entry stream of its own,
named in every call and rung with an XADD, so a subscription made while the call is on its way to
Redis still wakes it (a CLIENT UNBLOCK sent before the call arrives would be lost). Rings coalesce:
one per call, however many streams join.

Back-pressure is per subscription: a consumer that does not keep up (a slow client) lets at most
`Pace.buffer` entries pile up; past that its stream is left out of the reads until it has taken them, and
then read on from the last entry it was handed: the entries wait in Redis, not in this process.

Quiet: a subscription that got nothing for `Pace.quiet_s` is woken with nothing (`take()` returns []), so
its consumer can ping its client and check deadlines without a timer of its own per wait.

Redis errors are this process's, not the streams': a reader retries with a capped backoff, its
subscribers meanwhile woken as quiet, and only after `Pace.retry_s` of failures are they failed
(`Subscription.error`). Must not: decode entries (the consumer does) or know about HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import RedisError

from bus.connect import is_cluster
from shared import keys

log = logging.getLogger(__name__)

Entry = tuple[bytes, bytes | None]  # (entry id, the value of the hub's field; None for an entry without it)

COUNT = 256  # entries per stream per call (a stream read from its start takes several calls)
BELL_TTL_S = 86_400


@dataclass(frozen=True, slots=True)
class Pace:
    """A hub's limits (tests shorten them)."""

    readers: int = 4  # most reader tasks on a single server
    per_reader: int = 1024  # streams a reader takes before another one starts (each call has a fixed cost)
    block_ms: int = 2_000  # a reader's longest wait in one call (a doorbell ends it sooner); under redis-py's 5 s socket timeout
    buffer: int = 512  # entries a subscription holds before its stream is left out of reads
    quiet_s: float = 1.0  # a subscription with nothing for this long is woken with nothing
    retry_s: float = 30.0  # Redis failing this long fails the subscriptions


@dataclass(eq=False, slots=True)
class Subscription:
    """One consumer of one delta stream: the entries read for it and not yet taken."""

    key: str
    last: bytes | str  # the id of the last entry handed to this subscription ("0-0": from the start)
    entries: list[Entry] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    quiet_since: float = field(default_factory=time.monotonic)
    paused: bool = False  # the buffer is full: left out of reads until taken
    error: str = ""  # set when Redis stayed unreachable past `retry_s`: the consumer ends its stream
    closed: bool = False
    reader: _Reader | None = None

    def wake(self) -> None:
        """Wake the consumer with whatever is there (e.g. its client went away)."""
        self.event.set()

    async def take(self) -> list[Entry]:
        """The entries read since the last call, waiting for some; [] when woken with nothing (quiet,
        an error, `wake()`)."""
        if not self.entries and not self.error:
            await self.event.wait()
        self.event.clear()
        taken, self.entries = self.entries, []
        if self.paused and self.reader is not None:
            self.paused = False
            self.reader.changed()
        return taken


class Tails:
    """The hub: subscribe to a stream, take its entries as they come; a few readers do the reading."""

    def __init__(self, redis: Redis, *, node: str, field: str, pace: Pace = Pace()) -> None:  # frozen: one shared default is safe
        self.redis = redis
        self.field = field.encode()  # the one field of each entry handed over (a delta stream's `d`)
        self._read = _raw_reads(redis)
        self.node = node  # names this process's doorbells
        self.pace = pace
        self._cluster = is_cluster(redis)
        self._readers: dict[Hashable, _Reader] = {}
        self._ticker: asyncio.Task[None] | None = None
        self.closed = False
        self.reads = 0  # XREAD calls made (figures for tests and benches)
        self.bells = 0  # ... of which a doorbell ended

    def subscribe(self, key: str, after: str = "0-0") -> Subscription:
        """Follow `key` from after entry `after`; `unsubscribe` when done."""
        sub = Subscription(key=key, last=after)
        reader = self._reader_for(key)
        sub.reader = reader
        reader.add(sub)
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick())
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        sub.closed = True
        if sub.reader is not None:
            sub.reader.remove(sub)

    @property
    def subscriptions(self) -> int:
        return sum(len(r.subs) for r in self._readers.values())

    async def close(self) -> None:
        """Stop the readers: each blocked call is ended by its doorbell (a cancelled blocking read can sit
        out its whole block in redis-py before the cancel takes), then whatever is left is cancelled."""
        self.closed = True
        readers = [r for r in self._readers.values() if r.task is not None and not r.task.done()]
        for reader in readers:
            reader.changed()
        if readers:
            await asyncio.wait([r.task for r in readers if r.task is not None], timeout=2.0)
        tasks = [r.task for r in readers if r.task is not None and not r.task.done()]
        if self._ticker is not None:
            tasks.append(self._ticker)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._readers.clear()

    def _reader_for(self, key: str) -> _Reader:
        if self._cluster:
            group: Hashable = keys.hash_tag(key)
        else:
            least = min(self._readers, key=lambda g: len(self._readers[g].subs), default=None)
            if least is None or (len(self._readers[least].subs) >= self.pace.per_reader and len(self._readers) < self.pace.readers):
                least = str(len(self._readers))
            group = least
        reader = self._readers.get(group)
        if reader is None:
            reader = self._readers[group] = _Reader(self, keys.tail_doorbell(self.node, str(group)))
        return reader

    async def _tick(self) -> None:
        """Wake the subscriptions that got nothing for `quiet_s` (their consumers ping and check deadlines)."""
        while self._readers:
            await asyncio.sleep(self.pace.quiet_s / 2)
            now = time.monotonic()
            for reader in self._readers.values():
                for subs in reader.subs.values():
                    for sub in subs:
                        if now - sub.quiet_since >= self.pace.quiet_s:
                            sub.quiet_since = now
                            sub.event.set()


class _Reader:
    """One group's reader: `XREAD BLOCK` over every subscribed stream that is not paused, plus its doorbell."""

    def __init__(self, hub: Tails, bell: str) -> None:
        self.hub = hub
        self.bell = bell
        self.bell_last: str | None = None  # the doorbell's last entry id, once rung at start
        self.subs: dict[str, list[Subscription]] = {}
        self.task: asyncio.Task[None] | None = None
        self._wanted = asyncio.Event()  # the set of streams to read changed (or the first one came)
        self._in_call = False  # an XREAD is out: a change must ring the doorbell
        self._rung = False  # ... and it was rung for this call
        self._failing_since: float | None = None
        self._rings: set[asyncio.Task[None]] = set()

    def add(self, sub: Subscription) -> None:
        self.subs.setdefault(sub.key, []).append(sub)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run())
        self.changed()

    def remove(self, sub: Subscription) -> None:
        subs = self.subs.get(sub.key)
        if subs is None:
            return
        with contextlib.suppress(ValueError):
            subs.remove(sub)
        if not subs:
            del self.subs[sub.key]  # the next call leaves it out; no need to ring for a removal

    def changed(self) -> None:
        """The streams to read changed: read them on the next call, at once if one is blocked now."""
        self._wanted.set()
        if self._in_call and not self._rung:
            self._rung = True
            ring = asyncio.create_task(self._ring())
            self._rings.add(ring)
            ring.add_done_callback(self._rings.discard)

    async def _ring(self) -> None:
        try:
            async with self.hub.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self.bell, {"b": 1}, maxlen=1, approximate=False)
                pipe.expire(self.bell, BELL_TTL_S)
                await pipe.execute()
        except RedisError:
            pass  # the call in progress ends by its block timeout; the reader then sees the change

    async def _run(self) -> None:
        while self.subs and not self.hub.closed:
            if self.bell_last is None:
                try:
                    self.bell_last = await self._start_bell()
                except RedisError as exc:
                    await self._failed(exc)
                    continue
            # No await from here to the call's sending: a subscription made meanwhile rings the doorbell.
            self._wanted.clear()
            streams = self._streams()
            if not streams:
                await self._wanted.wait()
                continue
            streams[self.bell] = self.bell_last
            self._in_call, self._rung = True, False
            try:
                reply: Any = await self.hub._read.xread(cast(Any, streams), count=COUNT, block=self.hub.pace.block_ms)
            except RedisError as exc:
                self._in_call = False
                await self._failed(exc)
                continue
            self._in_call = False
            self.hub.reads += 1
            self._failing_since = None
            self._deliver(reply or [])

    def _streams(self) -> dict[str, bytes | str]:
        """Each stream to read, from the earliest entry any of its subscriptions still needs."""
        out: dict[str, bytes | str] = {}
        for key, subs in self.subs.items():
            live = [s.last for s in subs if not s.paused]
            if live:
                out[key] = live[0] if len(live) == 1 else min(live, key=_id_key)
        return out

    async def _start_bell(self) -> str:
        """Ring the doorbell once, so later calls name an id that a later ring is after."""
        async with self.hub.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(self.bell, {"b": 1}, maxlen=1, approximate=False)
            pipe.expire(self.bell, BELL_TTL_S)
            entry_id, _ = await pipe.execute()
        return _text(entry_id)

    def _deliver(self, reply: Any) -> None:
        now = time.monotonic()
        limit = self.hub.pace.buffer
        name = self.hub.field
        for stream, raw_entries in _streams_of(reply):
            key = stream.decode() if type(stream) is bytes else stream
            if key == self.bell:
                self.bell_last = _text(raw_entries[-1][0])
                self.hub.bells += 1
                continue
            subs = self.subs.get(key)
            if not subs:
                continue
            # (Redis sends each entry's fields as a flat list; ours lead with the one field we hand over)
            entries = [(entry_id, fields[1] if type(fields) is list and fields[0] == name else _value(fields, name)) for entry_id, fields in raw_entries]
            for sub in subs:
                if sub.paused:
                    continue  # read on from its own last entry once it has taken what it holds
                fresh = entries if len(subs) == 1 else [e for e in entries if _id_key(e[0]) > _id_key(sub.last)]
                if not fresh:
                    continue
                sub.entries += fresh
                sub.last = fresh[-1][0]
                sub.quiet_since = now
                sub.paused = len(sub.entries) >= limit
                sub.event.set()

    async def _failed(self, exc: RedisError) -> None:
        if self.hub.closed:
            return
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
            log.warning("reading delta streams failed (%s: %s); retrying", type(exc).__name__, exc)
        if now - self._failing_since > self.hub.pace.retry_s:
            log.error("giving up %d delta stream(s) after %.0f s of redis errors", len(self.subs), self.hub.pace.retry_s)
            for subs in list(self.subs.values()):
                for sub in subs:
                    sub.error = type(exc).__name__
                    sub.event.set()
            self.subs.clear()
            self._failing_since = None
            return
        await asyncio.sleep(min(0.5, self.hub.pace.retry_s / 10))


def _raw_reads(redis: Redis) -> Redis:
    """The client a hub reads with. On a single server: one on the same pool whose XREAD replies are left
    as Redis sent them (redis-py builds a dict per entry, a visible share of an API node's CPU per token;
    `_deliver` takes the one field it needs from the flat field list). A cluster client keeps redis-py's
    parsing (its reply may come either way)."""
    if is_cluster(redis):
        return redis
    raw = Redis(connection_pool=redis.connection_pool)
    raw.set_response_callback("XREAD", _as_sent)
    return raw


def _as_sent(response: Any, **_options: Any) -> Any:
    return response


def _streams_of(reply: Any) -> Any:
    """[(stream, entries)] from an XREAD reply, raw (a list of pairs) or parsed (a list, or a RESP3 dict)."""
    if not reply:
        return ()
    return reply.items() if isinstance(reply, dict) else reply


def _value(fields: Any, name: bytes) -> bytes | None:
    """One field's value of an entry: from the flat [field, value, ...] list Redis sends, or redis-py's dict."""
    if isinstance(fields, dict):
        found = fields.get(name, fields.get(name.decode()))
        return found if found is None or isinstance(found, bytes) else str(found).encode()
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == name:
            value: bytes = fields[i + 1]
            return value
    return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _id_key(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = _text(entry_id).partition("-")
    return int(ms), int(seq or 0)
