"""The worker loop: all of a worker's Redis I/O around its engine's step.

Each `step_once()`: claim new requests (and, every half lease, reclaim ones whose holder died),
check cancel flags, run one engine step in a thread (so Redis I/O is not blocked behind a forward),
and write the step's deltas through the fenced script (`workers.leases`). A request is XACKed only
after its terminal event is written. Periodically: heartbeat (figures for /ready, the TUI, /metrics),
lease renewal, and trimming the request stream below the oldest unacknowledged entry.
SIGTERM drains: stop claiming, finish in-flight work within `drain_timeout`, then release the leases
of what is left so another worker resumes it at once.

`ClaimLoop` is the part every kind of worker shares (claims, leases, fenced writes, cancels,
heartbeat, drain); a kind of worker is its engine plus four hooks: how many requests it can take
(`capacity`), how it starts or resumes one (`start`), one step (`run_step`) and its heartbeat figures
(`engine_figures`). `WorkerLoop` runs the model `Engine` (a step in a thread); workers/gateway.py's
`GatewayLoop` runs requests on an upstream OpenAI-compatible server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar

from redis.asyncio import Redis

from shared import keys
from shared.codec import decode_delta, decode_request, encode_delta
from shared.deltas import Error, ErrorKind, Finish, FinishReason, StreamDelta, Usage, is_terminal
from shared.ir import Request
from shared.settings import Settings
from workers import leases
from workers.engine import Emission, Engine

log = logging.getLogger(__name__)
TRIM_EVERY_S = 60.0
OPERATOR_CANCEL_MESSAGE = "The request was cancelled by the server's operator."


@dataclass(frozen=True, slots=True)
class Held:
    entry_id: str
    attempt: int


class LoopEngine(Protocol):
    """What `ClaimLoop` needs of any engine."""

    def has_work(self) -> bool: ...
    def active_ids(self) -> list[str]: ...
    def cancel(self, request_id: str) -> list[Emission]: ...
    def discard(self, request_id: str) -> None: ...
    def fail_all(self, message: str) -> list[Emission]: ...


E = TypeVar("E", bound=LoopEngine)


class ClaimLoop(Generic[E]):
    def __init__(self, redis: Redis, engine: E, *, settings: Settings, worker_id: str, info: dict[str, str]) -> None:
        self.redis = redis
        self.engine = engine
        self.settings = settings
        self.worker_id = worker_id
        self.info = info
        self.started = time.time()
        self.draining = False
        self.held: dict[str, Held] = {}
        self.finished_total = 0
        self.cancelled_total = 0
        self.operator_cancels: set[str] = set()  # requests an operator cancelled, until their Error is written
        self.stale_total = 0
        self._fenced = redis.register_script(leases.FENCED_WRITE)
        self._due: dict[str, float] = defaultdict(float)
        self.crash_on = fault_injection(settings)

    async def run(self, stop: asyncio.Event) -> None:
        await leases.ensure_group(self.redis)
        await self.heartbeat()
        keeper = asyncio.create_task(self.keep_alive())
        try:
            while not stop.is_set():
                await self.step_once()
            await self.drain()
        finally:
            keeper.cancel()

    async def keep_alive(self) -> None:
        """Renew leases and heartbeat on a timer of their own: a long step (a big prefill on a busy
        machine) runs in a thread, and must not let the leases lapse or the worker look dead."""
        while True:
            await asyncio.sleep(min(self.settings.lease_s / 3, self.settings.heartbeat_interval))
            try:
                await leases.renew(self.redis, self.worker_id, [h.entry_id for h in self.held.values()])
                if self._every("heartbeat", self.settings.heartbeat_interval):
                    await self.heartbeat()
            except RuntimeError:
                continue  # the step thread changed the engine's tables mid-read; next beat
            except Exception:
                log.exception("lease renewal failed")

    async def step_once(self) -> None:
        if not self.draining:
            await self.claim(block_ms=None if self.engine.has_work() else 200)
        await self.check_cancels()
        if self.engine.has_work():
            await self.publish(await self.run_step())
        await self.periodic()

    # ---- the hooks a kind of worker fills in -----------------------------------------------------

    async def run_step(self) -> list[Emission]:
        """One engine step's emissions."""
        raise NotImplementedError

    def capacity(self) -> int:
        """Requests to claim now."""
        raise NotImplementedError

    def start(self, request: Request, *, attempt: int, recorded: list[StreamDelta]) -> list[Emission]:
        """Hand a claimed request to the engine; `recorded` holds what earlier attempts wrote (no terminal)."""
        raise NotImplementedError

    def engine_figures(self) -> dict[str, Any]:
        """The engine's part of the heartbeat hash."""
        raise NotImplementedError

    def _every(self, name: str, seconds: float) -> bool:
        now = time.monotonic()
        if now < self._due[name]:
            return False
        self._due[name] = now + seconds
        return True

    async def periodic(self) -> None:
        if not self.draining and self._every("reclaim", self.settings.lease_s / 2):
            await self.reclaim()
        if self._every("forget dead", self.settings.heartbeat_ttl):
            for worker in await leases.forget_dead_workers(self.redis, heartbeat_ttl=self.settings.heartbeat_ttl, lease_s=self.settings.lease_s):
                log.info("worker %s is gone (no heartbeat, nothing pending): removed from the alive set", worker)
        if self._every("trim", TRIM_EVERY_S):
            await leases.trim_acknowledged(self.redis)
            await self.redis.zremrangebyscore(keys.REQUEST_INDEX, "-inf", time.time() - self.settings.dump_ttl)

    async def claim(self, *, block_ms: int | None) -> None:
        count = self.capacity()
        if count:
            for claimed in await leases.claim_new(self.redis, self.worker_id, count=count, block_ms=block_ms):
                await self.take(claimed)
        elif block_ms:
            await asyncio.sleep(block_ms / 1000)

    async def reclaim(self) -> None:
        count = self.capacity()
        if count:
            for claimed in await leases.reclaim_idle(self.redis, self.worker_id, count=count, lease_s=self.settings.lease_s):
                log.warning("reclaimed request entry %s (delivery %d)", claimed.entry_id, claimed.deliveries)
                await self.take(claimed)

    async def take(self, claimed: leases.Claimed) -> None:
        """Start (or resume) a claimed request under a new attempt number."""
        try:
            assert claimed.fields is not None, "entry trimmed"
            request = decode_request(claimed.fields[b"req"])
        except Exception as exc:  # a payload never kills the worker
            await self.unreadable(claimed, exc)
            return
        recorded = await self.recorded_deltas(request.id)
        terminal = next((d for d in recorded if is_terminal(d)), None)
        if terminal is not None:  # an earlier attempt finished it and died before its ack: finish the books only
            outcome: Any = await self.redis.hget(keys.request_meta(request.id), "outcome")
            self.held[request.id] = Held(claimed.entry_id, 0)
            await self._forget(request.id, ack=True, outcome=bytes(outcome).decode() if outcome else _outcome(terminal))
            return
        attempt = await leases.begin_attempt(self.redis, request.id, worker=self.worker_id, deliveries=claimed.deliveries)
        self.held[request.id] = Held(claimed.entry_id, attempt)
        if claimed.deliveries > self.settings.max_deliveries:
            await self.dead_letter(request, claimed)
            return
        flag = await self.redis.get(keys.cancel_flag(request.id))
        if flag is not None:
            usage = Usage(prompt_tokens=len(request.prompt_token_ids))
            cancelled = Emission(request.id, Finish(reason=FinishReason.CANCELLED, usage=usage, attempt=attempt))
            await self.publish([self._as_cancel(cancelled, flag)])
            return
        if self.crash_on and self.crash_on in request.raw_body:
            log.critical("fault injection: exiting hard on request %s (crash_on)", request.id)
            os._exit(70)
        await self.publish(self.start(request, attempt=attempt, recorded=recorded))

    async def unreadable(self, claimed: leases.Claimed, exc: Exception) -> None:
        """An entry that does not decode: dead-lettered and acknowledged; when it names its request, that
        request ends with one Error (its client is not left waiting), whatever the delivery count."""
        reason = f"{type(exc).__name__}: {exc}"[:300]
        rid = (claimed.fields or {}).get(b"id", b"").decode(errors="replace")
        log.error("unreadable request entry %s (request %s): %s", claimed.entry_id, rid or "?", reason)
        await self.redis.xadd(keys.DEAD_LETTER, {"id": rid, "entry": claimed.entry_id, "deliveries": claimed.deliveries, "reason": reason, "at": time.time()})
        if not rid:
            await self.redis.xack(keys.REQUEST_STREAM, keys.WORKER_GROUP, claimed.entry_id)
            return
        attempt = await leases.begin_attempt(self.redis, rid, worker=self.worker_id, deliveries=claimed.deliveries)
        self.held[rid] = Held(claimed.entry_id, attempt)
        error = Error(message="The worker could not read this request (it was set aside).", kind=ErrorKind.INTERNAL, attempt=attempt)
        await self.publish([Emission(rid, error)])

    async def recorded_deltas(self, request_id: str) -> list[StreamDelta]:
        entries: Any = await self.redis.xrange(keys.delta_stream(request_id))
        return [decode_delta(fields[b"d"]) for _id, fields in entries if b"d" in fields]

    async def dead_letter(self, request: Request, claimed: leases.Claimed) -> None:
        log.error("request %s was delivered %d times; moving it to the dead letters", request.id, claimed.deliveries)
        await self.redis.xadd(keys.DEAD_LETTER, {"id": request.id, "entry": claimed.entry_id, "deliveries": claimed.deliveries, "at": time.time()})
        error = Error(
            message=f"The request failed {claimed.deliveries - 1} times and was set aside (dead-lettered).",
            kind=ErrorKind.INTERNAL,
            attempt=self.held[request.id].attempt,
        )
        await self.publish([Emission(request.id, error)])

    async def check_cancels(self) -> None:
        active = self.engine.active_ids()
        if not active or not self._every("cancels", 0.05):
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in active:
                pipe.get(keys.cancel_flag(rid))
            flags = await pipe.execute()
        emissions: list[Emission] = []
        for rid, flag in zip(active, flags, strict=True):
            if flag is not None:
                emissions.extend(self._as_cancel(e, flag) for e in self.engine.cancel(rid))
        await self.publish(emissions)

    def _as_cancel(self, emission: Emission, flag: bytes | str) -> Emission:
        """An operator's cancel reaches the client as an Error (a client that went away gets the quiet
        CANCELLED finish, which nobody reads): see the table in shared/deltas.py."""
        if flag not in (keys.OPERATOR_CANCEL, keys.OPERATOR_CANCEL.decode()) or not emission.terminal:
            return emission
        self.operator_cancels.add(emission.request_id)
        return replace(emission, delta=Error(message=OPERATOR_CANCEL_MESSAGE, kind=ErrorKind.INTERNAL, attempt=emission.delta.attempt))

    async def publish(self, emissions: list[Emission]) -> None:
        """Write each request's deltas through the fenced script; ack the ones that ended."""
        if not emissions:
            return
        by_request: dict[str, list[Emission]] = defaultdict(list)
        for e in emissions:
            by_request[e.request_id].append(e)
        now = time.time()
        rids = [rid for rid in by_request if rid in self.held]
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in rids:
                terminal = next((e for e in by_request[rid] if e.terminal), None)
                args: list[Any] = [self.held[rid].attempt, self.settings.dump_ttl, self._outcome(terminal), now, terminal.batch_max if terminal else 0]
                await self._fenced(keys=list(_script_keys(rid)), args=[*args, *(encode_delta(e.delta) for e in by_request[rid])], client=pipe)
            results = await pipe.execute()
        for rid, written in zip(rids, results, strict=True):
            terminal = next((e for e in by_request[rid] if e.terminal), None)
            if not written:
                log.warning("request %s: attempt %d is stale; another worker owns it now", rid, self.held[rid].attempt)
                self.stale_total += 1
                self.engine.discard(rid)
                self.held.pop(rid, None)
                self.operator_cancels.discard(rid)
            elif terminal is not None:
                outcome = self._outcome(terminal)
                self._count(outcome)
                self.operator_cancels.discard(rid)
                await self._forget(rid, ack=True, outcome=outcome)

    def _outcome(self, terminal: Emission | None) -> str:
        if terminal is None:
            return ""
        return FinishReason.CANCELLED.value if terminal.request_id in self.operator_cancels else _outcome(terminal.delta)

    def _count(self, outcome: str) -> None:
        self.finished_total += 1
        if outcome == FinishReason.CANCELLED.value:
            self.cancelled_total += 1

    async def _forget(self, rid: str, *, ack: bool, outcome: str | None = None) -> None:
        held = self.held.pop(rid, None)
        if held is None or not ack:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(keys.REQUEST_STREAM, keys.WORKER_GROUP, held.entry_id)
            if outcome is not None:
                pipe.decr(keys.INFLIGHT)
                pipe.xadd(keys.FINISHED, {"id": rid, "outcome": outcome}, maxlen=100_000, approximate=True)
            await pipe.execute()

    async def heartbeat(self) -> None:
        figures: dict[Any, Any] = {
            **self.info,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": self.started,
            "heartbeat": time.time(),
            "draining": int(self.draining),
            **self.engine_figures(),
            "finished": self.finished_total,
            "cancelled": self.cancelled_total,
            "stale_writes": self.stale_total,
        }
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(keys.worker_info(self.worker_id), mapping=figures)
            pipe.expire(keys.worker_info(self.worker_id), int(self.settings.heartbeat_ttl) + 1)
            pipe.zadd(keys.WORKERS_ALIVE, {self.worker_id: time.time()})
            await pipe.execute()

    async def drain(self) -> None:
        """Stop claiming, finish what runs within the drain timeout, hand the rest back, leave."""
        self.draining = True
        await self.heartbeat()
        deadline = time.monotonic() + self.settings.drain_timeout
        while self.engine.has_work() and time.monotonic() < deadline:
            await self.step_once()
        left = list(self.held.items())
        if left:
            log.warning("drain timeout: handing %d request(s) back for another worker to resume", len(left))
            await leases.release(self.redis, self.worker_id, [h.entry_id for _, h in left], lease_s=self.settings.lease_s)
            for rid, _ in left:
                self.engine.discard(rid)
            self.held.clear()
        await self.redis.zrem(keys.WORKERS_ALIVE, self.worker_id)
        await self.redis.delete(keys.worker_info(self.worker_id))


class WorkerLoop(ClaimLoop[Engine]):
    """A model worker: the torch `Engine`, one step at a time in a thread (so Redis I/O is not blocked
    behind a forward); a resumed request continues from the token ids already emitted."""

    def __init__(self, redis: Redis, engine: Engine, *, settings: Settings, worker_id: str, info: dict[str, str]) -> None:
        super().__init__(redis, engine, settings=settings, worker_id=worker_id, info=info)
        self._last_counts = (time.monotonic(), 0, 0)

    async def run_step(self) -> list[Emission]:
        try:
            return await asyncio.to_thread(self.engine.step)
        except Exception:
            log.exception("engine step failed; ending the requests in flight with an error")
            return self.engine.fail_all("The worker failed while generating this response.")

    def capacity(self) -> int:
        """Room under `max_running`, while the block pool has a free block (the blocks in use, not
        `max_model_len`, bound how many run)."""
        sched = self.engine.scheduler
        if not sched.pool.num_free:
            return 0
        return max(0, sched.max_running - len(sched.running) - len(sched.waiting))

    def start(self, request: Request, *, attempt: int, recorded: list[StreamDelta]) -> list[Emission]:
        emitted = tuple(t for d in recorded for t in getattr(d, "token_ids", ()))
        return self.engine.add(request, attempt=attempt, resume=emitted)

    def _rates(self, now: float) -> tuple[float, float]:
        """Prefill and decode tokens/s since the previous heartbeat."""
        stats = self.engine.stats
        then, prefill, decode = self._last_counts
        self._last_counts = (now, stats.prefill_tokens, stats.decode_tokens)
        span = max(now - then, 1e-6)
        return (stats.prefill_tokens - prefill) / span, (stats.decode_tokens - decode) / span

    def engine_figures(self) -> dict[str, Any]:
        stats = self.engine.stats
        sched = self.engine.scheduler
        grammars = self.engine.grammars
        prefill_tps, decode_tps = self._rates(time.monotonic())
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "active": len(self.engine.active_ids()),
            "batch_peak": stats.batch_peak,
            "last_batch": stats.last_batch,
            "steps": stats.steps,
            "prefill_tokens": stats.prefill_tokens,
            "decode_tokens": stats.decode_tokens,
            "step_ms": round(stats.last_step_s * 1000, 2),
            "mask_ms_total": round(getattr(self.engine.runner, "mask_s", 0.0) * 1000, 3),  # grammar masks (constrained rows only)
            "masked_steps": getattr(self.engine.runner, "masked_steps", 0),
            "masked_rows": getattr(self.engine.runner, "masked_rows", 0),
            "grammar_compiles": grammars.compiles if grammars is not None else 0,
            "grammar_cache_hits": grammars.hits if grammars is not None else 0,
            "prefill_tps": round(prefill_tps, 1),
            "decode_tps": round(decode_tps, 1),
            "kv_used_tokens": sched.pool.num_used * sched.pool.block_size,
            "kv_total_tokens": sched.pool.num_tokens,
            "kv_blocks_used": sched.pool.num_used,
            "prefix_cache_queries": sched.pool.queries,
            "prefix_cache_hits": sched.pool.hits,
            "running_peak": sched.running_peak,
            "preemptions": sched.preemptions,
        }


def _script_keys(rid: str) -> tuple[str, str, str, str]:
    return keys.request_meta(rid), keys.delta_stream(rid), keys.request_ir(rid), keys.cancel_flag(rid)


FAULT_INJECTION_FILE = "ENABLE_FAULT_INJECTION"


def fault_injection(settings: Settings) -> str:
    """`crash_on` (MET_CRASH_ON), honoured only where a test enabled it: with a file of this name in the
    data dir. A production deployment that merely inherits the variable never lets a client kill workers."""
    if not settings.crash_on:
        return ""
    if os.path.exists(os.path.join(settings.data_dir, FAULT_INJECTION_FILE)):
        log.warning("fault injection is on: a request containing %r kills this worker", settings.crash_on)
        return settings.crash_on
    log.warning("MET_CRASH_ON is set but fault injection is not enabled (no %s in %s): ignored", FAULT_INJECTION_FILE, settings.data_dir)
    return ""


def _outcome(delta: StreamDelta) -> str:
    if isinstance(delta, Finish):
        return delta.reason.value
    if isinstance(delta, Error):
        return f"error:{delta.kind.value}"
    return ""
