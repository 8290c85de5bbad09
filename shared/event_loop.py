"""The event loop every role runs on (uvloop: libuv's, in C), and the garbage collector's settings.

An API node's and a worker's work per token is mostly event-loop callbacks and socket I/O (Redis replies,
SSE writes), which uvloop does for a fraction of asyncio's own loop's CPU (bench/RESULTS.md, session 16).

Per token both allocate a few dozen short-lived objects, and CPython's cyclic collector ran a young
collection every 700 allocations and, every so often, an old one over everything the process holds (the
tokenizer's and the model's Python objects included): 6 % of a loaded API node's samples were in
`gc_collect_main`. `settle_heap()` (once the role has loaded what it keeps) moves what exists into the
permanent generation, which collections skip (`gc.freeze`, as vLLM does after its engine starts), and
collects young objects every 50,000 allocations instead. Nothing cyclic is created per token, so this
changes when garbage is found, not whether.
"""

from __future__ import annotations

import gc
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run a role's main coroutine to its end on a new uvloop event loop."""
    return uvloop.run(main)


YOUNG_THRESHOLD = 50_000  # allocations between young collections (CPython's default: 700)


def settle_heap() -> None:
    """Freeze what the process holds now (out of every later collection) and collect young objects less often."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
