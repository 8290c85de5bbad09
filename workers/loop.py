"""The worker loop: all of a worker's Redis I/O around `Engine.step()`.

Claims requests through the consumer group, checks cancel flags, runs a step in a thread (so Redis
I/O is not blocked behind a forward), appends the step's deltas to each request's stream in one
pipeline, and XACKs a request only after its terminal event is written. Heartbeats the worker's
presence (model, pid, started, active, batch figures) with a TTL.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared import keys
from shared.codec import CodecError, decode_request, encode_delta
from shared.deltas import Content, Error, ErrorKind, Finish, FinishReason, Usage
from shared.settings import Settings
from workers.engine import Emission, Engine

log = logging.getLogger(__name__)


async def ensure_group(redis: Redis) -> None:
    try:
        await redis.xgroup_create(keys.REQUEST_STREAM, keys.WORKER_GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class WorkerLoop:
    def __init__(self, redis: Redis, engine: Engine, *, settings: Settings, worker_id: str, info: dict[str, str]) -> None:
        self.redis = redis
        self.engine = engine
        self.settings = settings
        self.worker_id = worker_id
        self.info = info
        self.started = time.time()
        self._entries: dict[str, str] = {}  # request id -> request stream entry id
        self._first_token: set[str] = set()
        self._last_heartbeat = 0.0
        self._last_cancel_check = 0.0
        self._last_counts = (time.monotonic(), 0, 0)
        self.finished_total = 0
        self.cancelled_total = 0

    async def run(self, stop: asyncio.Event) -> None:
        await ensure_group(self.redis)
        await self.heartbeat()
        while not stop.is_set():
            await self.step_once()
        await self.shutdown()

    async def step_once(self) -> None:
        await self.claim(block_ms=None if self.engine.has_work() else 200)
        await self.check_cancels()
        if self.engine.has_work():
            try:
                emissions = await asyncio.to_thread(self.engine.step)
            except Exception:
                log.exception("engine step failed; ending the requests in flight with an error")
                emissions = self.engine.fail_all("The worker failed while generating this response.")
            await self.publish(emissions)
        if time.monotonic() - self._last_heartbeat >= self.settings.heartbeat_interval:
            await self.heartbeat()

    def _capacity(self) -> int:
        return max(0, self.engine.scheduler.num_free_slots - len(self.engine.scheduler.waiting))

    async def claim(self, *, block_ms: int | None) -> None:
        count = self._capacity()
        if count == 0:
            return
        reply: Any = await self.redis.xreadgroup(keys.WORKER_GROUP, self.worker_id, {keys.REQUEST_STREAM: ">"}, count=count, block=block_ms)
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                await self._accept(_text(entry_id), fields)

    async def _accept(self, entry_id: str, fields: dict[bytes, bytes]) -> None:
        try:
            request = decode_request(fields[b"req"])
        except (KeyError, CodecError, ValueError) as exc:
            log.error("dropping unreadable request entry %s: %s", entry_id, exc)
            await self.redis.xack(keys.REQUEST_STREAM, keys.WORKER_GROUP, entry_id)
            return
        self._entries[request.id] = entry_id
        if await self.redis.exists(keys.cancel_flag(request.id)):
            usage = Usage(prompt_tokens=len(request.prompt_token_ids))
            await self.publish([Emission(request.id, Finish(reason=FinishReason.CANCELLED, usage=usage))])
            return
        await self.redis.hset(keys.request_meta(request.id), mapping={"status": "running", "worker": self.worker_id, "attempt": 1, "claimed_at": time.time()})
        self.engine.add(request, attempt=1)

    async def check_cancels(self) -> None:
        now = time.monotonic()
        active = self.engine.active_ids()
        if not active or now - self._last_cancel_check < 0.05:
            return
        self._last_cancel_check = now
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in active:
                pipe.exists(keys.cancel_flag(rid))
            flags = await pipe.execute()
        emissions: list[Emission] = []
        for rid, flag in zip(active, flags, strict=True):
            if flag:
                emissions.extend(self.engine.cancel(rid))
        await self.publish(emissions)

    async def publish(self, emissions: list[Emission]) -> None:
        if not emissions:
            return
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            for e in emissions:
                pipe.xadd(keys.delta_stream(e.request_id), {"d": encode_delta(e.delta)})
                if isinstance(e.delta, Content) and e.request_id not in self._first_token:
                    self._first_token.add(e.request_id)
                    pipe.hset(keys.request_meta(e.request_id), "first_token_at", now)
                if e.terminal:
                    self._terminal(pipe, e, now)
            await pipe.execute()

    def _terminal(self, pipe: Any, e: Emission, now: float) -> None:
        rid = e.request_id
        outcome = e.delta.reason.value if isinstance(e.delta, Finish) else f"error:{e.delta.kind.value}"  # type: ignore[union-attr]
        self.finished_total += 1
        if outcome == FinishReason.CANCELLED.value:
            self.cancelled_total += 1
        pipe.hset(
            keys.request_meta(rid),
            mapping={"status": "finished", "outcome": outcome, "finished_at": now, "batch_max": e.batch_max},
        )
        pipe.decr(keys.INFLIGHT)
        entry = self._entries.pop(rid, None)
        if entry is not None:
            pipe.xack(keys.REQUEST_STREAM, keys.WORKER_GROUP, entry)
        for key in keys.request_keys(rid):
            pipe.expire(key, self.settings.dump_ttl)
        pipe.xadd(keys.FINISHED, {"id": rid, "outcome": outcome}, maxlen=100_000, approximate=True)
        self._first_token.discard(rid)

    def _rates(self, now: float) -> tuple[float, float]:
        """Prefill and decode tokens/s since the previous heartbeat."""
        stats = self.engine.stats
        then, prefill, decode = self._last_counts
        self._last_counts = (now, stats.prefill_tokens, stats.decode_tokens)
        span = max(now - then, 1e-6)
        return (stats.prefill_tokens - prefill) / span, (stats.decode_tokens - decode) / span

    async def heartbeat(self) -> None:
        now = time.monotonic()
        self._last_heartbeat = now
        stats = self.engine.stats
        sched = self.engine.scheduler
        prefill_tps, decode_tps = self._rates(now)
        runner = self.engine.runner
        figures: dict[Any, Any] = {
            **self.info,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": self.started,
            "heartbeat": time.time(),
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "active": len(self.engine.active_ids()),
            "batch_peak": stats.batch_peak,
            "last_batch": stats.last_batch,
            "steps": stats.steps,
            "prefill_tokens": stats.prefill_tokens,
            "decode_tokens": stats.decode_tokens,
            "step_ms": round(stats.last_step_s * 1000, 2),
            "prefill_tps": round(prefill_tps, 1),
            "decode_tps": round(decode_tps, 1),
            "kv_used_tokens": sum(s.computed for s in sched.running),
            "kv_total_tokens": runner.num_slots * runner.max_len,
            "kv_slots_used": len(sched.running),
            "preemptions": sched.preemptions,
            "finished": self.finished_total,
            "cancelled": self.cancelled_total,
        }
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(keys.worker_info(self.worker_id), mapping=figures)
            pipe.expire(keys.worker_info(self.worker_id), int(self.settings.heartbeat_ttl) + 1)
            pipe.zadd(keys.WORKERS_ALIVE, {self.worker_id: time.time()})
            await pipe.execute()

    async def shutdown(self) -> None:
        """End every in-flight request with one terminal event, then leave the live set."""
        emissions = []
        for rid in self.engine.active_ids():
            self.engine.cancel(rid)
            emissions.append(Emission(rid, Error(message="The worker shut down before finishing this request.", kind=ErrorKind.OVERLOADED)))
        await self.publish(emissions)
        await self.redis.zrem(keys.WORKERS_ALIVE, self.worker_id)
        await self.redis.delete(keys.worker_info(self.worker_id))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
