"""The claim loop every kind of worker shares: all of a worker's Redis I/O around its engine's step.

Each `step_once()`: claim new requests (and, every half lease, reclaim ones whose holder died; a
gateway does both on a claimer task of its own instead, `claims_on_own_task`), check cancel flags,
run one engine step, and write the step's deltas through the fenced script (workers/outbox.py). A
request is XACKed only after its terminal event is written. Periodically: heartbeat (figures for
/ready, the TUI, /metrics), lease renewal, and trimming the request stream below the oldest
unacknowledged entry. SIGTERM drains: stop claiming, finish in-flight work within `drain_timeout`,
then release the leases of what is left so another worker resumes it at once.

Redis going away (a restart, a blip) is ridden out, not fatal: the model stays loaded and running
sequences keep stepping; their deltas wait in the outbox (in order) and are written through the fence
once Redis answers again (first the leases are renewed). Redis is retried with a capped exponential
backoff. The heartbeat (its own timer) reads only `figures`, handed over after each step, never the engine.

A kind of worker is its engine plus hooks: how many requests it can take (`capacity`), the sampling
defaults it fills in as it claims (`with_defaults`), how it starts or resumes one (`start`), one step
(`run_step`) and its heartbeat figures (`engine_figures`). workers/loop.py's `WorkerLoop` runs the
model `Engine` (a step in a thread); workers/gateway.py's `GatewayLoop` runs requests on an upstream
OpenAI-compatible server.

Size (~500 lines): one class, the claim loop's state over Redis (claims, reclaims, cancels, heartbeat,
drain), whose parts share the held-request table and the Redis backoff; its writes are workers/outbox.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Generic, Protocol, TypeVar

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from bus import cancels
from bus.connect import is_cluster
from shared import keys
from shared.codec import CodecError, Meta, dead_letter_entry, deltas_of, request_id_of, request_of
from shared.deltas import Error, ErrorKind, Finish, FinishReason, StreamDelta, Usage, is_terminal
from shared.ir import Request
from shared.settings import Settings
from workers import leases
from workers.coalesce import Coalescer
from workers.engine import FAILED_ADD, Emission
from workers.faults import fault_injection
from workers.outbox import Held, Outbox, outcome_of
from workers.routed import KVIndex, adopt_routed

log = logging.getLogger("workers.loop")
TRIM_EVERY_S = 60.0
SWEEP_EVERY_S = 10.0  # heal the in-flight set (workers.leases.sweep_inflight)
SWEEP_GRACE_S = 30.0  # an admitted id with no request after this long never reached the queue
BACKOFF_S = (0.05, 2.0)  # first and longest wait between tries while Redis does not answer
CLAIM_BLOCK_MS = 200  # an idle worker's XREADGROUP block (and a claimer's: how soon it sees draining)
OPERATOR_CANCEL_MESSAGE = "The request was cancelled by the server's operator."


class Phases:
    """CPU seconds the worker spent per phase: `step` on the torch thread (the engine: scheduler, model,
    detokenization), `claim`, `cancels`, `write` (fenced writes and settles) and `periodic` on the loop's
    thread. Thread CPU time (`time.thread_time`), so waiting on Redis or a forward is not counted; a
    loop phase also counts what other tasks of the loop ran while it awaited (a heartbeat, a lease
    renewal), which is small beside it."""

    NAMES = ("step", "claim", "cancels", "write", "periodic")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.NAMES, 0.0)

    @contextmanager
    def cpu(self, name: str) -> Iterator[None]:
        started = time.thread_time()
        try:
            yield
        finally:
            self.seconds[name] += time.thread_time() - started

    def figures(self) -> dict[str, float]:
        return {f"cpu_{name}_ms": round(seconds * 1000, 1) for name, seconds in self.seconds.items()}


class LoopEngine(Protocol):
    """What `ClaimLoop` needs of any engine."""

    def has_work(self) -> bool: ...
    def active_ids(self) -> list[str]: ...
    def cancel(self, request_id: str) -> list[Emission]: ...
    def discard(self, request_id: str) -> None: ...
    def fail_all(self, message: str) -> list[Emission]: ...


E = TypeVar("E", bound=LoopEngine)


class ClaimLoop(Outbox, Generic[E]):
    engine: E

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
        self._cluster = is_cluster(redis)
        self._fenced_loaded = False  # the server has it (a pipeline ran it, no NoScriptError since): no SCRIPT EXISTS
        self._due: dict[str, float] = defaultdict(float)
        self.faults = fault_injection(settings)
        self.outbox: list[Emission] = []  # deltas not written yet (Redis did not answer), in order
        self.coalesce = Coalescer(settings.stream_interval)  # --stream-interval: Content held and merged before the outbox
        self.phases = Phases()  # CPU seconds per phase of the loop (heartbeat figures; bench/pipeline.py reads them)
        self.settle: dict[str, str] = {}  # request → outcome: terminal written, ack / feed not yet
        self.figures: dict[str, Any] = {}  # the engine's figures, handed over by the hooks (heartbeat)
        self.redis_down_since: float | None = None
        self.redis_outages = 0
        self._backoff = 0.0
        self._retry_at = 0.0
        self._publishing = asyncio.Lock()
        self._cancels_from: str | None = None  # the cancel feed's last entry read (shared.keys.CANCELS)
        self._claimer: asyncio.Task[None] | None = None
        self.reclaim_due = False  # a reclaim pass is due: it runs before the next claim of new work that has room
        self._reclaim_cursor = leases.START
        self.own_stream = keys.routed_stream(worker_id)  # what API nodes route to this worker (ingest.http.routing)
        self.kv_index = KVIndex(worker_id, ttl_s=settings.heartbeat_ttl)  # what its cache holds, for them
        self.routed_queue = 0  # entries of its own stream not read yet (at the last heartbeat)
        self.claims_by_source = dict.fromkeys(("routed_claims", "shared_claims", "adopted_claims"), 0)  # heartbeat, `met top`

    async def ensure_groups(self) -> None:
        """The consumer group on the shared stream and on this worker's own; the routing index's snapshot."""
        await leases.ensure_group(self.redis)
        await leases.ensure_group(self.redis, self.own_stream)
        self.kv_index.replace_all(self.index_snapshot())
        await self.kv_index.flush(self.redis, force=True)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():  # Redis may not be up yet (or be restarting): wait for it
            try:
                await self.ensure_groups()
                await self.heartbeat()
                break
            except RedisError as exc:
                self._lost(exc)
                await asyncio.sleep(max(0.0, self._retry_at - time.monotonic()))
        keeper = asyncio.create_task(self.keep_alive())
        try:
            while not stop.is_set():
                await self.step_once()
            await self.drain()
        finally:
            keeper.cancel()
            if self._claimer is not None:
                self._claimer.cancel()

    async def keep_alive(self) -> None:
        """Renew leases and heartbeat on a timer of their own: a long step (a big prefill on a busy
        machine) runs in a thread, and must not let the leases lapse or the worker look dead."""
        while True:
            await asyncio.sleep(min(self.settings.lease_s / 3, self.settings.heartbeat_interval))
            if not self.redis_up():
                continue  # step_once retries Redis on its backoff; nothing to renew meanwhile
            try:
                await leases.renew_all(self.redis, self.worker_id, [h.entry for h in self.held.values()])
                if self._every("heartbeat", self.settings.heartbeat_interval):
                    await self.heartbeat()
            except RedisError as exc:
                self._lost(exc)
            except Exception:
                log.exception("lease renewal failed")

    async def step_once(self) -> None:
        """One round: (Redis permitting) settle what an outage left, claim, check cancels; one engine
        step; (Redis permitting) write its deltas, then the periodic chores. Without Redis the step
        still runs and its deltas wait in the outbox."""
        phases = self.phases
        if self.redis_up():
            try:
                await self._catch_up()
                if not self.draining:
                    with phases.cpu("claim"):
                        await self.claim_between_steps()
                with phases.cpu("cancels"):
                    await self.check_cancels()
            except RedisError as exc:
                self._lost(exc)
        ended: set[str] = set()
        if self.engine.has_work() or self.claims_on_own_task:  # (then the idle loop waits in the step)
            emissions = await self.run_step()
            ended = {e.request_id for e in emissions if e.terminal}
            with phases.cpu("write"):
                self.outbox.extend(self.coalesce.take(emissions))
        elif not self.redis_up():
            await asyncio.sleep(min(0.2, max(0.0, self._retry_at - time.monotonic())))
        if self.redis_up():
            try:
                with phases.cpu("write"):
                    # the routing index first, and at once when a request ended: its client's next turn may come as
                    # soon as it reads the end, and must find this worker's blocks in the index (ingest.http.routing)
                    self.kv_index.note(self.index_changes())
                    await self.kv_index.flush(self.redis, force=bool(ended), load=self.load(ended))
                    await self.publish([])
                with phases.cpu("periodic"):
                    await self.periodic()
            except RedisError as exc:
                self._lost(exc)

    def redis_up(self) -> bool:
        """Whether to talk to Redis now: always, except between tries while it does not answer."""
        return self.redis_down_since is None or time.monotonic() >= self._retry_at

    def _lost(self, exc: RedisError) -> None:
        """A Redis call failed: wait longer before the next try (capped exponential backoff)."""
        if self.redis_down_since is None:
            self.redis_down_since = time.monotonic()
            self.redis_outages += 1
            log.warning("redis unavailable (%s: %s); generation goes on, deltas wait until it is back", type(exc).__name__, exc)
        first, cap = BACKOFF_S
        self._backoff = min(cap, self._backoff * 2 or first)
        self._retry_at = time.monotonic() + self._backoff

    async def _catch_up(self) -> None:
        """After an outage: renew the leases first (so nobody reclaims live work), then write what waited."""
        if self.redis_down_since is None:
            return
        await leases.ensure_group(self.redis)  # a Redis that came back empty has no group
        await leases.ensure_group(self.redis, self.own_stream)
        await leases.renew_all(self.redis, self.worker_id, [h.entry for h in self.held.values()])
        self.kv_index.replace_all(self.index_snapshot())  # (it may have lost the index)
        await self.publish([])
        log.warning("redis is back after %.1f s; %d request(s) in flight carried on", time.monotonic() - self.redis_down_since, len(self.held))
        self.redis_down_since, self._backoff = None, 0.0

    # ---- the hooks a kind of worker fills in -----------------------------------------------------

    # A kind of worker whose steps only wait on I/O (the gateway) claims on a task of its own, blocked in
    # XREADGROUP while it has room, instead of between steps: a new request starts at once, not when a
    # step ends, and a step costs no claim round trip. The idle loop then waits in `run_step`.
    claims_on_own_task = False

    async def claim_between_steps(self) -> None:
        """Claim between two steps: at once while the engine has work, else waiting up to CLAIM_BLOCK_MS
        for a request (the idle loop's wait). With `claims_on_own_task`: see that the claimer runs."""
        if not self.claims_on_own_task:
            await self.claim(block_ms=None if self.engine.has_work() else CLAIM_BLOCK_MS)
        elif self._claimer is None or self._claimer.done():
            self._claimer = asyncio.create_task(self._claim_forever())

    async def _claim_forever(self) -> None:
        """The claimer (`claims_on_own_task`): claims and reclaims until draining. Only it claims, so the
        capacity it reads is not raced by another claim."""
        while not self.draining:
            if not self.redis_up():
                await asyncio.sleep(max(0.01, self._retry_at - time.monotonic()))
                continue
            try:
                if self._every("reclaim", self.settings.lease_s / 2):
                    self.reclaim_due = True
                if self.capacity():
                    await self.claim(block_ms=CLAIM_BLOCK_MS)
                else:
                    await self.wait_for_room(CLAIM_BLOCK_MS / 1000)
            except RedisError as exc:
                self._lost(exc)
            except Exception:  # never a silent end: log, pause, claim again
                log.exception("claiming failed")
                await asyncio.sleep(CLAIM_BLOCK_MS / 1000)

    async def wait_for_room(self, timeout_s: float) -> None:
        """The claimer's wait while the engine is full: until a request ends, or `timeout_s`."""
        await asyncio.sleep(timeout_s)

    async def stop_claiming(self) -> None:
        """Draining began: let the claimer's claim in progress finish (it blocks CLAIM_BLOCK_MS at most)
        and start what it got; then nothing more is claimed."""
        if self._claimer is not None:
            await asyncio.gather(self._claimer, return_exceptions=True)

    async def run_step(self) -> list[Emission]:
        """One engine step's emissions."""
        raise NotImplementedError

    def capacity(self) -> int:
        """Requests to claim now."""
        raise NotImplementedError

    def with_defaults(self, request: Request) -> Request:
        """The request with the sampling fields it left unset filled from the operator's defaults: once, as
        it is claimed, for both worker kinds (WorkerLoop: every field, to the model's defaults; GatewayLoop:
        the operator's layer only)."""
        return request

    def start(self, request: Request, *, attempt: int, recorded: list[StreamDelta]) -> list[Emission]:
        """Hand a claimed request to the engine; `recorded` holds what earlier attempts wrote (no terminal)."""
        raise NotImplementedError

    def engine_figures(self) -> dict[str, Any]:
        """The engine's part of the heartbeat hash."""
        raise NotImplementedError

    def index_changes(self) -> dict[bytes, bool]:
        """Block keys gained (True) and lost (False) since the last call, for the routing index (workers.routed)."""
        return {}

    def index_snapshot(self) -> list[bytes]:
        """Every block key the routing index should hold now (called where no step runs)."""
        return []

    def load(self, ended: set[str]) -> tuple[int, int]:
        """Requests running and waiting now, for routing (from the figures the step handed over), without those
        that `ended` in the step just run."""
        return int(self.figures.get("running", 0)), int(self.figures.get("waiting", 0))

    def _every(self, name: str, seconds: float) -> bool:
        now = time.monotonic()
        if now < self._due[name]:
            return False
        self._due[name] = now + seconds
        return True

    async def periodic(self) -> None:
        if not self.draining and not self.claims_on_own_task and self._every("reclaim", self.settings.lease_s / 2):
            self.reclaim_due = True  # taken up by the next claim with room, before any new request
        if self._every("forget dead", self.settings.heartbeat_ttl):
            for worker in await leases.forget_dead_workers(self.redis, heartbeat_ttl=self.settings.heartbeat_ttl, lease_s=self.settings.lease_s):
                log.info("worker %s is gone (no heartbeat, nothing pending): removed from the alive set", worker)
        if self._every("sweep in flight", SWEEP_EVERY_S):
            healed = await leases.sweep_inflight(self.redis, grace_s=SWEEP_GRACE_S)
            if healed:
                log.warning("in-flight set: removed %d id(s) that had finished or never reached the queue: %s", len(healed), healed[:5])
        if self._every("trim", TRIM_EVERY_S):
            await leases.trim_acknowledged(self.redis)
            await leases.trim_acknowledged(self.redis, self.own_stream)
            await self.redis.zremrangebyscore(keys.REQUEST_INDEX, "-inf", time.time() - self.settings.dump_ttl)

    async def claim(self, *, block_ms: int | None) -> None:
        """Claim new requests up to the capacity; a due reclaim pass first, so a dead worker's requests
        (idle past their lease) are taken before any request queued after them."""
        if self.reclaim_due:
            await self.reclaim()
        count = self.capacity()
        if count:
            try:
                claims = await leases.claim_new(self.redis, self.worker_id, count=count, block_ms=block_ms, own=self.own_stream)
            except ResponseError as exc:  # a group missing (a Redis that lost it, a loop started without `run`): make them
                if "NOGROUP" not in str(exc):
                    raise
                await self.ensure_groups()
                claims = await leases.claim_new(self.redis, self.worker_id, count=count, block_ms=block_ms, own=self.own_stream)
            await self.take(claims)
        elif block_ms:
            await asyncio.sleep(block_ms / 1000)

    async def reclaim(self) -> None:
        """Take over what is idle past its lease, page after page (leases.reclaim_page) while there is
        room; the pass is done once a page reached the pending list's end. Out of room, it stays due and
        the next claim with room goes on from the same cursor before claiming anything new."""
        while (count := self.capacity()) > 0:
            claims, self._reclaim_cursor = await leases.reclaim_page(
                self.redis, self.worker_id, count=count, lease_s=self.settings.lease_s, start=self._reclaim_cursor
            )
            for claimed in claims:
                log.warning("reclaimed request entry %s (delivery %d)", claimed.entry_id, claimed.deliveries)
            await self.take(claims)
            if self._reclaim_cursor == leases.START:
                self.reclaim_due = False
                settings = self.settings
                await self.take(
                    await adopt_routed(self.redis, self.worker_id, count=self.capacity(), heartbeat_ttl=settings.heartbeat_ttl, lease_s=settings.lease_s)
                )
                return

    async def take(self, claims: list[leases.Claimed]) -> None:
        """Start (or resume) claimed requests, each under a new attempt number. However many there are,
        three round trips: what earlier attempts wrote and the cancel flags, the attempts begun, the first
        writes (a request that ends at once, or resumes, writes there)."""
        fresh: list[tuple[leases.Claimed, Request]] = []
        for claimed in claims:
            try:
                assert claimed.fields is not None, "entry trimmed"
                request = request_of(claimed.fields)
            except Exception as exc:  # a payload never kills the worker
                await self.unreadable(claimed, exc)
                continue
            if request.id in self.held:  # our own entry, idle past its lease (a long outage): we still run it
                log.warning("request %s: reclaimed an entry this worker still runs; carrying on with attempt %d", request.id, self.held[request.id].attempt)
                continue
            fresh.append((claimed, request))
            self._count_claim(claimed.stream)
        if not fresh:
            return
        records = await self.recorded_and_flags([request.id for _, request in fresh])
        starting: list[tuple[leases.Claimed, Request, list[StreamDelta], Any]] = []
        for (claimed, request), (recorded, flag) in zip(fresh, records, strict=True):
            if isinstance(recorded, Exception):  # what an earlier attempt wrote does not decode: set aside, as an unreadable entry
                await self.unreadable(claimed, recorded)
                continue
            terminal = next((d for d in recorded if is_terminal(d)), None)
            if terminal is not None:  # an earlier attempt finished it and died before its ack: finish the books only
                outcome: Any = await self.redis.hget(keys.request_meta(request.id), Meta.OUTCOME)
                self.held[request.id] = Held(claimed.entry_id, 0, stream=claimed.stream)
                await self._forget(request.id, ack=True, outcome=bytes(outcome).decode() if outcome else outcome_of(terminal))
                continue
            starting.append((claimed, request, recorded, flag))
        attempts = await leases.begin_attempts(self.redis, [(request.id, claimed.deliveries) for claimed, request, _, _ in starting], worker=self.worker_id)
        emissions: list[Emission] = []
        for (claimed, request, recorded, flag), attempt in zip(starting, attempts, strict=True):
            self.held[request.id] = Held(claimed.entry_id, attempt, stream=claimed.stream)
            emissions += await self._start_one(claimed, request, recorded, flag)
        await self.publish(emissions)

    def _count_claim(self, stream: str) -> None:
        source = "shared" if stream == keys.REQUEST_STREAM else "routed" if stream == self.own_stream else "adopted"
        self.claims_by_source[f"{source}_claims"] += 1

    async def _start_one(self, claimed: leases.Claimed, request: Request, recorded: list[StreamDelta], flag: Any) -> list[Emission]:
        """Hand one claimed request (its attempt begun) to the engine; its first emissions."""
        attempt = self.held[request.id].attempt
        if claimed.deliveries > self.settings.max_deliveries:
            return [await self.dead_letter(request, claimed)]
        if flag is not None:  # read before the attempt began; a cancel after it comes on the cancel feed
            usage = Usage(prompt_tokens=len(request.prompt_token_ids))
            return [self._as_cancel(Emission(request.id, Finish(reason=FinishReason.CANCELLED, usage=usage, attempt=attempt, at=time.time())), flag)]
        if self.faults.crash_on and self.faults.crash_on in request.raw_body:
            log.critical("fault injection: exiting hard on request %s (crash_on)", request.id)
            os._exit(70)
        try:
            if self.faults.fails_add(request):
                raise RuntimeError("fault injection: engine.add fails on this request")
            return self.start(self.with_defaults(request), attempt=attempt, recorded=recorded)
        except Exception:  # this request alone: the others in the batch go on
            log.exception("request %s could not be added to the engine; ending it with an error", request.id)
            self.engine.discard(request.id)
            return [Emission(request.id, Error(message=FAILED_ADD, kind=ErrorKind.INTERNAL, attempt=attempt))]

    async def unreadable(self, claimed: leases.Claimed, exc: Exception) -> None:
        """An entry that does not decode: dead-lettered and acknowledged; when it names its request, that
        request ends with one Error (its client is not left waiting), whatever the delivery count."""
        reason = f"{type(exc).__name__}: {exc}"[:300]
        rid = request_id_of(claimed.fields)
        log.error("unreadable request entry %s (request %s): %s", claimed.entry_id, rid or "?", reason)
        await self.redis.xadd(keys.DEAD_LETTER, dead_letter_entry(rid, entry=claimed.entry_id, deliveries=claimed.deliveries, now=time.time(), reason=reason))
        if not rid:
            await self.redis.xack(claimed.stream, keys.WORKER_GROUP, claimed.entry_id)
            return
        attempt = await leases.begin_attempt(self.redis, rid, worker=self.worker_id, deliveries=claimed.deliveries)
        self.held[rid] = Held(claimed.entry_id, attempt, stream=claimed.stream)
        error = Error(message="The worker could not read this request (it was set aside).", kind=ErrorKind.INTERNAL, attempt=attempt)
        await self.publish([Emission(rid, error)])

    async def recorded_and_flags(self, request_ids: list[str]) -> list[tuple[list[StreamDelta] | CodecError, Any]]:
        """What earlier attempts wrote, and the cancel flag, of each request: one round trip before they
        start. A request whose recorded deltas do not decode gets the error instead (never the worker's end)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in request_ids:
                pipe.xrange(keys.delta_stream(rid))
                pipe.get(keys.cancel_flag(rid))
            replies = await pipe.execute()
        return [(_decoded(replies[i]), replies[i + 1]) for i in range(0, len(replies), 2)]

    async def dead_letter(self, request: Request, claimed: leases.Claimed) -> Emission:
        log.error("request %s was delivered %d times; moving it to the dead letters", request.id, claimed.deliveries)
        await self.redis.xadd(keys.DEAD_LETTER, dead_letter_entry(request.id, entry=claimed.entry_id, deliveries=claimed.deliveries, now=time.time()))
        error = Error(
            message=f"The request failed {claimed.deliveries - 1} times and was set aside (dead-lettered).",
            kind=ErrorKind.INTERNAL,
            attempt=self.held[request.id].attempt,
        )
        return Emission(request.id, error)

    async def check_cancels(self) -> None:
        """Cancel what the cancel feed names among the requests this engine runs: one read of the feed
        from where the last one ended (not a flag read per running request)."""
        if self._cancels_from is None:
            self._cancels_from = await cancels.last_id(self.redis)
        if not self.engine.has_work() or not self._every("cancels", 0.05):
            return
        notices, self._cancels_from = await cancels.read(self.redis, self._cancels_from)
        emissions: list[Emission] = []
        for rid, by in notices:
            emissions.extend(self._as_cancel(e, by) for e in self.engine.cancel(rid))
        await self.publish(emissions)

    def _as_cancel(self, emission: Emission, flag: bytes | str) -> Emission:
        """An operator's cancel reaches the client as an Error (a client that went away gets the quiet
        CANCELLED finish, which nobody reads): see the table in shared/deltas.py."""
        if flag not in (keys.OPERATOR_CANCEL, keys.OPERATOR_CANCEL.decode()) or not emission.terminal:
            return emission
        self.operator_cancels.add(emission.request_id)
        return replace(emission, delta=Error(message=OPERATOR_CANCEL_MESSAGE, kind=ErrorKind.INTERNAL, attempt=emission.delta.attempt))

    async def heartbeat(self) -> None:
        # the routed queue is read first, so the load this heartbeat writes is this moment's, not the last one's
        self.routed_queue = await leases.undelivered(self.redis, self.own_stream)
        figures: dict[Any, Any] = {
            **self.info,
            **self.figures,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": self.started,
            "heartbeat": time.time(),
            "draining": int(self.draining),
            **self.engine_figures(),
            "finished": self.finished_total,
            "cancelled": self.cancelled_total,
            "stale_writes": self.stale_total,
            "redis_outages": self.redis_outages,
            "routed_queue": self.routed_queue,
            "load_at": time.time(),
            **self.claims_by_source,
            "index_size": self.kv_index.size,
            **self.phases.figures(),
        }
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(keys.worker_info(self.worker_id), mapping=figures)
            pipe.expire(keys.worker_info(self.worker_id), int(self.settings.heartbeat_ttl) + 1)
            pipe.zadd(keys.WORKERS_ALIVE, {self.worker_id: now})
            # a drained worker is gone for the routed streams' books at once (workers.routed.adopt_routed)
            pipe.zadd(keys.ROUTED_WORKERS, {self.worker_id: now - self.settings.heartbeat_ttl if self.draining else now})
            pipe.expire(self.kv_index.key, self.kv_index.ttl_s)
            await pipe.execute()

    async def drain(self) -> None:
        """Stop claiming, finish what runs within the drain timeout, hand the rest back, leave."""
        self.draining = True
        await self.stop_claiming()
        try:
            await self.heartbeat()
        except RedisError as exc:
            self._lost(exc)
        deadline = time.monotonic() + self.settings.drain_timeout
        while (self.engine.has_work() or self.outbox or self.settle) and time.monotonic() < deadline:
            await self.step_once()
        left = list(self.held.items())
        try:
            if left:
                log.warning("drain timeout: handing %d request(s) back for another worker to resume", len(left))
                for stream, entry_ids in leases.by_stream([h.entry for _, h in left]).items():
                    await leases.release(self.redis, self.worker_id, entry_ids, lease_s=self.settings.lease_s, stream=stream)
            await self.redis.zrem(keys.WORKERS_ALIVE, self.worker_id)
            await self.redis.delete(keys.worker_info(self.worker_id), self.kv_index.key)
            await self.redis.zadd(keys.ROUTED_WORKERS, {self.worker_id: time.time() - self.settings.heartbeat_ttl})
        except RedisError as exc:
            log.warning("redis unavailable while leaving (%s): %d request(s) left go to another worker when their lease lapses", type(exc).__name__, len(left))
        for rid, _ in left:
            self.engine.discard(rid)
            self.coalesce.forget(rid)
        self.held.clear()


def _decoded(entries: Any) -> list[StreamDelta] | CodecError:
    try:
        return deltas_of(entries)
    except (ValueError, KeyError, TypeError) as exc:  # CodecError, orjson's errors, a field missing
        return exc if isinstance(exc, CodecError) else CodecError(f"{type(exc).__name__}: {exc}")


