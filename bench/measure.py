"""Measurement primitives shared by every system under test.

Owns: the per-request timing record, the per-run record a system returns, percentiles, and the
process-tree sampler (peak RSS of a process and all its descendants every 0.2 s, plus how much CPU
the rest of the machine used meanwhile — on a shared 2-core box that is what skews a figure).
Must not: know about HTTP, transformers or a workload's shape.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from dataclasses import dataclass, field

import psutil

SAMPLE_PERIOD_S = 0.2


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """One request as its client saw it. Times in seconds from the moment the request was issued."""

    index: int
    prompt_tokens: int
    output_tokens: int  # useful tokens: at most the request's max_tokens
    ttft_s: float  # first content (first token)
    gaps_s: tuple[float, ...]  # between successive content chunks (~1 token each)
    e2e_s: float  # the whole response is in the client's hands
    chunks: int = 0  # content chunks received (ours); tokens for the in-process baselines
    cached_tokens: int = 0  # prompt tokens the server reported read from its prefix cache (ours)


@dataclass(frozen=True, slots=True)
class RunRecord:
    """What one system returns for one workload."""

    system: str
    wall_s: float  # first request issued → last response complete
    timings: tuple[RequestTiming, ...] = ()
    notes: tuple[str, ...] = ()
    error: str | None = None
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TreeUsage:
    peak_rss_bytes: int
    own_cpu_s: float  # CPU seconds used by the sampled tree
    other_cpu_cores: float  # mean cores busy outside the sampled tree and this bench process
    cpu_by_role: dict[str, float] = field(default_factory=dict)  # CPU seconds per process role in the tree
    bench_cpu_s: float = 0.0  # CPU seconds of this bench process (the HTTP clients, for ours)


def gaps(times: list[float]) -> tuple[float, ...]:
    """Differences between successive times."""
    return tuple(b - a for a, b in itertools.pairwise(times))


def percentile(values: list[float] | tuple[float, ...], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class TreeSampler:
    """Samples the RSS sum of `pid` and its descendants every 0.2 s in a thread, until `stop()`."""

    def __init__(self, pid: int, *, max_duration_s: float) -> None:
        self.pid = pid
        self.max_duration_s = max_duration_s
        self.peak_rss = 0
        self._cpu: dict[int, float] = {}  # pid -> user+system CPU seconds used since the sampler started
        self._cpu_base: dict[int, float] = {}  # pid -> its CPU seconds when first seen (0 if born later)
        self._roles: dict[int, str] = {}  # pid -> what the process is (worker, api, redis, ...)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._started = 0.0
        self._busy_start = 0.0
        self._bench_cpu_start = 0.0

    def start(self) -> TreeSampler:
        self._started = time.monotonic()
        self._busy_start = _machine_busy_s()
        self._bench_cpu_start = _cpu_s(psutil.Process(os.getpid()))
        self.sample_once()
        self._cpu_base.update(self._cpu)  # processes alive now count from here, not from their birth
        self._cpu = dict.fromkeys(self._cpu, 0.0)
        self._thread.start()
        return self

    def stop(self) -> TreeUsage:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample_once()
        elapsed = max(time.monotonic() - self._started, 1e-9)
        own = sum(self._cpu.values())
        bench = _cpu_s(psutil.Process(os.getpid())) - self._bench_cpu_start
        if self.pid == os.getpid():
            bench = 0.0  # the tree is this process; counted in `own`
        other = max(0.0, _machine_busy_s() - self._busy_start - own - bench) / elapsed
        roles: dict[str, float] = {}
        for pid, cpu in self._cpu.items():
            role = self._roles.get(pid, "other")
            roles[role] = roles.get(role, 0.0) + cpu
        return TreeUsage(peak_rss_bytes=self.peak_rss, own_cpu_s=own, other_cpu_cores=other, cpu_by_role=roles, bench_cpu_s=bench)

    def _run(self) -> None:
        deadline = self._started + self.max_duration_s
        while not self._stop.wait(SAMPLE_PERIOD_S) and time.monotonic() < deadline:
            self.sample_once()

    def sample_once(self) -> None:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        rss = 0
        for proc in procs:
            try:
                rss += proc.memory_info().rss
                self._cpu[proc.pid] = _cpu_s(proc) - self._cpu_base.get(proc.pid, 0.0)
                if proc.pid not in self._roles:
                    self._roles[proc.pid] = _role(proc)
            except psutil.Error:
                continue
        self.peak_rss = max(self.peak_rss, rss)


def _role(proc: psutil.Process) -> str:
    """A short name for a process in a sampled tree, from its command line."""
    line = " ".join(proc.cmdline())
    for marker, role in (("redis-server", "redis"), ("cli.main worker", "worker"), ("cli.main serve", "api"), ("cli.main api", "api"), ("multiprocessing", "child")):
        if marker in line:
            return role
    return "other"


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def _machine_busy_s() -> float:
    t = psutil.cpu_times()
    return float(t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0))


def others_cpu_cores(window_s: float) -> float:
    """Mean CPU cores busy outside this process (and its children) over the next `window_s` seconds."""
    me = psutil.Process(os.getpid())

    def ours() -> float:
        total = _cpu_s(me)
        for child in me.children(recursive=True):
            try:
                total += _cpu_s(child)
            except psutil.Error:
                continue
        return total

    busy, own = _machine_busy_s(), ours()
    time.sleep(window_s)
    return max(0.0, _machine_busy_s() - busy - (ours() - own)) / window_s


def wait_for_quiet(*, max_wait_s: float, threshold_cores: float, window_s: float = 3.0) -> tuple[float, float]:
    """Wait (at most `max_wait_s`) until other processes use under `threshold_cores`; (waited s, their load)."""
    started = time.monotonic()
    load = others_cpu_cores(window_s)
    while load > threshold_cores and time.monotonic() - started < max_wait_s:
        load = others_cpu_cores(window_s)
    return time.monotonic() - started, load
