"""The model worker's loop: `ClaimLoop` (workers/claims.py) over the torch `Engine`, one step at a time
on the process's one torch thread, so Redis I/O is never blocked behind a forward.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, ParamSpec, TypeVar

from redis.asyncio import Redis

from shared.deltas import StreamDelta
from shared.ir import Request, resolve
from shared.settings import Settings
from workers.claims import ClaimLoop
from workers.engine import Emission, Engine
from workers.faults import FAULT_INJECTION_FILE, FaultyRunner

__all__ = ["FAULT_INJECTION_FILE", "WorkerLoop", "on_thread", "torch_thread"]

log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")


def torch_thread() -> ThreadPoolExecutor:
    """The one thread a model worker process runs torch on (`WorkerLoop` says why only one)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="met-torch")


def on_thread(thread: ThreadPoolExecutor, call: Callable[P, T]) -> Callable[P, T]:
    """`call`, run on `thread` while the caller waits: for torch work that the loop starts between steps."""

    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        return thread.submit(call, *args, **kwargs).result()

    return run


class WorkerLoop(ClaimLoop[Engine]):
    """A model worker: the torch `Engine`, one step at a time on its torch thread (so Redis I/O is not
    blocked behind a forward); a resumed request continues from the token ids already emitted.

    All of the process's torch work runs on that one thread (`torch_thread()`): the model's load
    (workers.main), every step, and a request's prompt scoring, which `start` runs on the loop
    between steps and so hands to the torch thread and waits for. torch's OpenMP pool belongs to the
    thread that calls torch: each thread that runs a parallel op gets a pool of its own, which lives
    as long as that thread. Once two pools exist, libgomp holds more threads than the machine has
    cores and cuts the time its threads spin at a barrier to almost nothing, so every parallel op of
    every step pays a futex sleep and wake: on 2 cores a bf16 [32, 576] @ [576, 1536] took 137 µs
    with one pool and 216-241 µs once a second thread's pool also existed (bench/RESULTS.md, session 8)."""

    def __init__(
        self,
        redis: Redis,
        engine: Engine,
        *,
        settings: Settings,
        worker_id: str,
        info: dict[str, str],
        stepper: ThreadPoolExecutor | None = None,
    ) -> None:
        super().__init__(redis, engine, settings=settings, worker_id=worker_id, info=info)
        self._last_counts = (time.monotonic(), 0, 0)
        if self.faults.fail_on:
            engine.runner = FaultyRunner(engine.runner, self.faults)
        self.figures = engine.figures()
        self._stepper = stepper or torch_thread()
        if engine.score_prompt is not None:
            engine.score_prompt = on_thread(self._stepper, engine.score_prompt)
        self._pool = engine.scheduler.pool
        self._max_running = engine.scheduler.max_running
        if self._pool.prefix_cache:
            self._pool.journal = {}  # what the routing index publishes (workers.routed)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await super().run(stop)
        finally:
            self._stepper.shutdown(wait=True)

    async def run_step(self) -> list[Emission]:
        try:
            emissions, self.figures = await asyncio.get_running_loop().run_in_executor(self._stepper, self._step)
        except Exception:  # outside the runner (which the engine isolates): the engine's own books
            log.exception("engine step failed; ending the requests in flight with an error")
            emissions = self.engine.fail_all("The worker failed while generating this response.")
            self.figures = self.engine.figures()
        return emissions

    def _step(self) -> tuple[list[Emission], dict[str, Any]]:
        """In the step thread: the step's emissions and the figures after it."""
        with self.phases.cpu("step"):  # this thread's CPU: the engine (scheduler, runner, text) without the loop's
            return self.engine.step(), self.engine.figures()

    def capacity(self) -> int:
        """The scheduler's claim room (workers.scheduler.Scheduler.claim_room)."""
        return self.engine.scheduler.claim_room()

    def with_defaults(self, request: Request) -> Request:
        return replace(request, sampling=resolve(request.sampling, self.engine.info.sampling_defaults))

    def start(self, request: Request, *, attempt: int, recorded: list[StreamDelta]) -> list[Emission]:
        emitted = tuple(t for d in recorded for t in getattr(d, "token_ids", ()))
        started = self.engine.add(request, attempt=attempt, resume=emitted)
        self.figures = self.engine.figures()  # no step runs now: between steps, on the loop
        return started

    def _rates(self, now: float) -> tuple[float, float]:
        """Prefill and decode tokens/s since the previous heartbeat."""
        done_prefill, done_decode = int(self.figures["prefill_tokens"]), int(self.figures["decode_tokens"])
        then, prefill, decode = self._last_counts
        self._last_counts = (now, done_prefill, done_decode)
        span = max(now - then, 1e-6)
        return (done_prefill - prefill) / span, (done_decode - decode) / span

    def engine_figures(self) -> dict[str, Any]:
        """The rates since the previous heartbeat, from the figures the step handed over (`figures`):
        never the engine's tables, which the step thread may be changing meanwhile."""
        prefill_tps, decode_tps = self._rates(time.monotonic())
        return {
            "prefill_tps": round(prefill_tps, 1),
            "decode_tps": round(decode_tps, 1),
            "block_size": self._pool.block_size,
            "max_running": self._max_running,
            "routable": int(self._pool.prefix_cache),
        }

    def index_changes(self) -> dict[bytes, bool]:
        """The block pool's journal: called on the loop between steps (the step thread is idle then)."""
        return self._pool.take_journal()

    def index_snapshot(self) -> list[bytes]:
        return self._pool.cached_keys()
