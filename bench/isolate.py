"""Run an in-process baseline in a fresh child process, so its peak RSS and its CPU are its own.

Owns: spawning the child (multiprocessing "spawn": no torch state inherited from this process),
sampling its process tree while it runs, collecting its `RunRecord` with a time bound, and always
reaping it. A child that raises hands back a record carrying the error text instead of a figure.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from measure import RunRecord, TreeSampler, TreeUsage

POLL_S = 1.0


def _child_main(target: Callable[..., RunRecord], system: str, args: tuple[Any, ...], out: Any) -> None:
    try:
        record = target(*args)
    except BaseException as exc:  # the parent reports it; a baseline failing is a result, not a crash
        record = RunRecord(system, 0.0, error=f"{type(exc).__name__}: {exc}", notes=(traceback.format_exc()[-2000:],))
    out.put(record)


def run_isolated(target: Callable[..., RunRecord], system: str, args: tuple[Any, ...], *, timeout_s: float) -> tuple[RunRecord, TreeUsage]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_child_main, args=(target, system, args, out), name=f"bench-{system}")
    proc.start()
    assert proc.pid is not None
    sampler = TreeSampler(proc.pid, max_duration_s=timeout_s).start()
    try:
        record = _await_record(proc, out, system, timeout_s)
    finally:
        usage = sampler.stop()
        _reap(proc)
    return record, usage


def _await_record(proc: Any, out: Any, system: str, timeout_s: float) -> RunRecord:
    """The child's record; gives up at the deadline or soon after the child dies without one."""
    deadline = time.monotonic() + timeout_s
    grace = 3  # polls after the child is gone, for a record still in the pipe
    while time.monotonic() < deadline and grace > 0:
        try:
            record: RunRecord = out.get(timeout=POLL_S)
            return record
        except queue.Empty:
            if not proc.is_alive():
                grace -= 1
    why = "died" if not proc.is_alive() else f"gave no result within {timeout_s:.0f}s"
    return RunRecord(system, 0.0, error=f"the {system} child {why} (exit code {proc.exitcode})")


def _reap(proc: Any) -> None:
    proc.join(30)
    if proc.is_alive():
        proc.terminate()
        proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
