"""Prompt rendering and tokenization off the event loop: bounded thread lanes, and a child process for
huge token counts.

Measured on this 2-core machine with SmolLM2's fast tokenizer (see the issue-15b report): tokenizing
32 MiB of text takes ~25-35 s and peaks at ~5.3 GB RSS. HF fast tokenizers release the GIL while they
encode, so a thread keeps the loop turning through the encode itself; but the pieces around it hold the
GIL: building the 8M-id Python lists (0.22 s + 0.10 s) and freeing the encoding (0.34 s), each a loop
stall, and ~3-5x that on a loaded machine (a 1.7 s gap measured with four such counts in threads).
Hence:
- `run`: work for a body up to `LARGE_BODY_BYTES` runs on `tokenize_threads` threads (its GIL pieces are
  milliseconds); a larger body's on one thread of its own, so a huge body never delays small requests'
  rendering and at most one huge tokenization (and its memory) runs at a time in this process.
- `count`: `count_tokens` of a large body runs in a child process (spawned, one task per child), which
  returns one int: the GIL pieces stall the child, not the loop, and the child's ~5 GB is returned to
  the OS when it exits. Generations keep the thread lane: they need the ids, and a prompt over 1 MiB is
  past the context of most models anyway (refused after rendering). The child is spawned, and the
  renderer sent with each task, off the event loop (see `_count`). It encodes without offsets (`for_bulk`).
  On either lane a long text is cut into pieces encoded on every core (`PromptRenderer._encode`: the same
  ids; a 30 MiB count in 3.3 s instead of 13 s, 1.2 GiB at its peak instead of 3.9, on 2 cores:
  bench/bulk_tokenize.py). It runs at the API node's own CPU priority: at
  nice +10 it did not measurably shorten the largest gap of a stream running beside four 30 MiB counts
  in CI (tests/e2e/test_abuse.py: 1.20 s without, 1.77 s with it, one 2-core run each), and beside a
  worker decoding on both cores it got so little CPU that the four counts outlasted a 900 s client
  timeout (a later CI run). A count is the client's answer too, not a job to starve.
Past `tokenize_queue` large jobs waiting or running, another is refused at once (OpenAI 503, Anthropic 529: ingest.parsers.errors.status_for)
instead of queueing without bound. A job whose client left still runs to its end.
Must not: know protocols or routes.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, TypeVar

from shared.errors import ApiError
from shared.ir import Request
from shared.settings import Settings

T = TypeVar("T")
LARGE_BODY_BYTES = 1 << 20  # a body above this is tokenized on the large lane


def _count(renderer: Any, request: Request) -> int:
    """In the child: the renderer comes with the task, pickled by the pool's feeder thread. Not as the
    pool's `initargs`: those are written by whichever thread spawns the child, and that write blocks
    until the child has imported transformers to unpickle them (seconds of a stalled loop, measured)."""
    return len(renderer.for_bulk().render(request))


def _ignore_interrupts() -> None:
    """In the child: Ctrl-C reaches the terminal's whole process group; the server shuts the pool down,
    and the child must not die printing a KeyboardInterrupt traceback of its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Tokenizing:
    """The lanes (see the module docstring); `run(size, work)` awaits `work()` on the thread lane for
    `size`; `count(size, request)` awaits the number of prompt tokens of `request`."""

    def __init__(self, settings: Settings, renderer: Any) -> None:
        self._small = ThreadPoolExecutor(max_workers=max(1, settings.tokenize_threads), thread_name_prefix="met-tokenize")
        self._large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="met-tokenize-large")
        self._renderer = renderer
        self._counting: ProcessPoolExecutor | None = None  # started on the first large count
        self._large_limit = max(1, settings.tokenize_queue)
        self._large_jobs = 0  # waiting or running on the large lanes

    async def run(self, size: int, work: Callable[[], T]) -> T:
        if size <= LARGE_BODY_BYTES:
            return await asyncio.get_running_loop().run_in_executor(self._small, work)
        return await self._large_job(self._large, work)

    async def count(self, size: int, request: Request) -> int:
        """`len(renderer.render(request))`; a large body's is counted in a child process."""
        if size <= LARGE_BODY_BYTES:
            return len(await self.run(size, lambda: self._renderer.render(request)))
        if self._counting is None:
            spawn = multiprocessing.get_context("spawn")  # never fork a process that runs an event loop and threads
            self._counting = ProcessPoolExecutor(1, mp_context=spawn, max_tasks_per_child=1, initializer=_ignore_interrupts)
        return await self._large_job(self._counting, _count, self._renderer, request)

    async def _large_job(self, pool: Executor, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a large lane (a process pool needs a picklable `fn` and `args`, not a closure)."""
        if self._large_jobs >= self._large_limit:
            raise ApiError(
                f"The server is tokenizing {self._large_jobs} large requests already (the limit is {self._large_limit}, "
                "--tokenize-queue); retry shortly.",
                status=429,
                kind="overloaded",
                code="tokenizer_busy",
                retry_after=5.0,
            )
        self._large_jobs += 1
        try:
            if isinstance(pool, ProcessPoolExecutor):  # its submit may spawn the child: not on the event loop
                return await asyncio.wrap_future(await asyncio.to_thread(pool.submit, fn, *args))
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        finally:
            self._large_jobs -= 1

    def close(self) -> None:
        for pool in (self._small, self._large, self._counting):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
