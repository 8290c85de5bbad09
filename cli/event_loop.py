"""The event loop every role runs on: uvloop (libuv's, in C).

An API node's and a worker's work per token is mostly event-loop callbacks and socket I/O (Redis replies,
SSE writes), which uvloop does for a fraction of asyncio's own loop's CPU (bench/RESULTS.md, session 16).
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run a role's main coroutine to its end on a new uvloop event loop."""
    return uvloop.run(main)
