"""Prompt rendering and tokenization off the event loop, in two bounded thread lanes.

Why threads, not processes (measured on this 2-core machine with SmolLM2's fast tokenizer, see the
issue-15b report): tokenizing 32 MiB of text takes ~34 s and peaks at ~5.3 GB RSS; run in a thread, the
event loop's longest stall meanwhile was 0.38 s (four 3.2 MiB renders at once: 0.23 s), against the whole
34 s on the loop. HF fast tokenizers release the GIL while they encode, so a thread pool is enough; a
process pool would hold a tokenizer per process and pickle every 30 MiB text across, for no gain.
What still runs on the loop holds the GIL anyway (orjson parsing the body: tens of ms for 30 MiB).

The lanes: work for a body up to `LARGE_BODY_BYTES` runs on `tokenize_threads` threads; a larger body's
runs on one thread of its own, so a huge body never delays small requests' rendering and at most one
huge tokenization (and its memory, ~170 bytes per byte of text) is in progress at a time. Past
`tokenize_queue` large jobs waiting or running, another is refused at once (429, Anthropic 529) instead
of queueing without bound. A job whose client left still runs to its end (a thread cannot be stopped).
Must not: know protocols or routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from shared.errors import ApiError
from shared.settings import Settings

T = TypeVar("T")
LARGE_BODY_BYTES = 1 << 20  # a body above this is tokenized on the large lane


class Tokenizing:
    """The two lanes (see the module docstring); `run(size, work)` awaits `work()` on the lane for `size`."""

    def __init__(self, settings: Settings) -> None:
        self._small = ThreadPoolExecutor(max_workers=max(1, settings.tokenize_threads), thread_name_prefix="met-tokenize")
        self._large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="met-tokenize-large")
        self._large_limit = max(1, settings.tokenize_queue)
        self._large_jobs = 0  # waiting or running on the large lane

    async def run(self, size: int, work: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        if size <= LARGE_BODY_BYTES:
            return await loop.run_in_executor(self._small, work)
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
            return await loop.run_in_executor(self._large, work)
        finally:
            self._large_jobs -= 1

    def close(self) -> None:
        for pool in (self._small, self._large):
            pool.shutdown(wait=False, cancel_futures=True)
