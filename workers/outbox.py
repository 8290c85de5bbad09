"""The worker's outbox: a step's deltas written through the fenced script, and ended requests settled.

Each write goes through `workers.leases` FENCED_WRITE: one call per request on a single server, one per
hash slot on a cluster, all in one round trip. What Redis did not confirm stays in `outbox` (in order)
and is sent again on the next try; the script skips deltas an earlier try already wrote (the reply was
lost, not the write: `Held.written`), so a retried write never duplicates an event. A request another
worker took over meanwhile is refused by the fence and dropped here, as after any lost lease. A request
is XACKed, taken off the in-flight set and announced on the finished feed only after its terminal
event is written (`_settle`).

`Outbox` is a part of `workers.claims.ClaimLoop`: it keeps no state of its own and works on the loop's
(the held requests, the outbox, what waits to settle).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from bus.connect import queue_script
from shared import keys
from shared.codec import encode_delta, finished_entry
from shared.deltas import Error, Finish, FinishReason, StreamDelta
from shared.settings import Settings
from workers import leases
from workers.coalesce import Coalescer
from workers.engine import Emission

if TYPE_CHECKING:
    from workers.claims import LoopEngine

log = logging.getLogger("workers.loop")


@dataclass(slots=True)
class Held:
    entry_id: str
    attempt: int
    written: int = 0  # deltas of this attempt the fenced script has confirmed
    stream: str = keys.REQUEST_STREAM  # where the entry is pending: the shared request stream or a routed one

    @property
    def entry(self) -> tuple[str, str]:
        return self.stream, self.entry_id


class Outbox:
    """The loop's writes and settles (see the module docstring); mixed into `ClaimLoop`."""

    redis: Redis
    settings: Settings
    engine: LoopEngine
    held: dict[str, Held]
    outbox: list[Emission]
    coalesce: Coalescer
    settle: dict[str, str]
    operator_cancels: set[str]
    finished_total: int
    cancelled_total: int
    stale_total: int
    _publishing: asyncio.Lock
    _fenced: Any
    _cluster: bool
    _fenced_loaded: bool

    async def publish(self, emissions: list[Emission]) -> None:
        """Queue `emissions` behind what waits in the outbox and write it all through the fenced script;
        settle (ack, count, feed) the requests that ended. On a Redis error what is not confirmed stays
        queued (the error propagates): the next try resends it, and the script skips what it had written."""
        async with self._publishing:  # one write at a time: a gateway's claimer publishes beside the step loop
            self.outbox.extend(self.coalesce.take(emissions))
            if self.outbox:
                await self._write_outbox()
            if self.settle:
                await self._settle()

    async def _write_outbox(self) -> None:
        """Write what waits in the outbox through the fenced script: one call for every request on a
        single server, one per hash slot on a cluster, all in one round trip."""
        sent = len(self.outbox)  # the step loop may append behind these while the write is out
        by_request: dict[str, list[Emission]] = defaultdict(list)
        for e in self.outbox[:sent]:
            by_request[e.request_id].append(e)
        writes = [self._write_of(rid, batch) for rid, batch in by_request.items() if rid in self.held]
        if not writes:  # only emissions of requests this worker no longer holds (cancelled, stale): nothing to write
            del self.outbox[:sent]
            return
        groups = _by_slot(writes) if self._cluster else [writes]
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            for group in groups:
                script_keys, args = leases.fenced_args(group, ttl=self.settings.dump_ttl, now=now)
                queue_script(pipe, self._fenced, script_keys, args, loaded=self._fenced_loaded)
            try:
                results = await pipe.execute()
            except NoScriptError:  # a restarted (or flushed) Redis lost it: the next try loads it again
                self._fenced_loaded = False
                raise
        self._fenced_loaded = self._fenced_loaded or bool(writes)
        del self.outbox[:sent]
        for group, result in zip(groups, results, strict=True):
            for write, written in zip(group, result, strict=True):
                self._written(write, by_request[write.request_id], bool(written))

    def _write_of(self, rid: str, batch: list[Emission]) -> leases.Write:
        held = self.held[rid]
        terminal = next((e for e in batch if e.terminal), None)
        deltas = tuple(encode_delta(e.delta) for e in batch)
        return leases.Write(rid, held.attempt, deltas, written=held.written, outcome=self._outcome(terminal), batch_max=terminal.batch_max if terminal else 0)

    def _written(self, write: leases.Write, batch: list[Emission], written: bool) -> None:
        """Book one request's write: stale (another worker owns it now) or written, and ended if terminal."""
        rid = write.request_id
        if not written:
            log.warning("request %s: attempt %d is stale; another worker owns it now", rid, write.attempt)
            self.stale_total += 1
            self.engine.discard(rid)
            self.coalesce.forget(rid)
            self.held.pop(rid, None)
            self.operator_cancels.discard(rid)
            return
        self.held[rid].written += len(batch)
        if write.outcome:
            self._count(write.outcome)
            self.operator_cancels.discard(rid)
            self.settle[rid] = write.outcome

    async def _settle(self) -> None:
        """Ack every ended request, take it off the in-flight set and announce it on the finished feed:
        one round trip for all of them (XACK and ZREM repeat harmlessly if a lost reply makes it run twice)."""
        ended = [(rid, outcome, self.held[rid]) for rid, outcome in self.settle.items() if rid in self.held]
        if ended:
            async with self.redis.pipeline(transaction=False) as pipe:
                for stream, entry_ids in leases.by_stream([held.entry for _, _, held in ended]).items():
                    pipe.xack(stream, keys.WORKER_GROUP, *entry_ids)
                for in_flight in keys.IN_FLIGHT_SETS:  # interactive or a batch line: ZREM of an absent id is harmless
                    pipe.zrem(in_flight, *(rid for rid, _, _ in ended))
                for rid, outcome, _ in ended:
                    pipe.xadd(keys.FINISHED, finished_entry(rid, outcome), maxlen=100_000, approximate=True)
                await pipe.execute()
        for rid in list(self.settle):
            self.held.pop(rid, None)
            del self.settle[rid]

    def _outcome(self, terminal: Emission | None) -> str:
        if terminal is None:
            return ""
        return FinishReason.CANCELLED.value if terminal.request_id in self.operator_cancels else outcome_of(terminal.delta)

    def _count(self, outcome: str) -> None:
        self.finished_total += 1
        if outcome == FinishReason.CANCELLED.value:
            self.cancelled_total += 1

    async def _forget(self, rid: str, *, ack: bool, outcome: str | None = None) -> None:
        held = self.held.get(rid)
        if held is None:
            return
        if ack:  # XACK and ZREM repeat harmlessly if a lost reply makes this run twice
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xack(held.stream, keys.WORKER_GROUP, held.entry_id)
                if outcome is not None:
                    for in_flight in keys.IN_FLIGHT_SETS:
                        pipe.zrem(in_flight, rid)
                    pipe.xadd(keys.FINISHED, finished_entry(rid, outcome), maxlen=100_000, approximate=True)
                await pipe.execute()
        self.held.pop(rid, None)


def _by_slot(writes: list[leases.Write]) -> list[list[leases.Write]]:
    """Writes grouped by the hash slot of their keys (a cluster script touches one slot)."""
    groups: dict[str, list[leases.Write]] = defaultdict(list)
    for w in writes:
        groups[keys.hash_tag(keys.request_meta(w.request_id))].append(w)
    return list(groups.values())


def outcome_of(delta: StreamDelta) -> str:
    """A terminal delta as the finished feed and the request meta name its outcome."""
    if isinstance(delta, Finish):
        return delta.reason.value
    if isinstance(delta, Error):
        return f"error:{delta.kind.value}"
    return ""
