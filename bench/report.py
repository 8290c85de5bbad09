"""Turn run records into the table rows, the ratios against the targets, and the printed table.

Definitions (the same for every system):
- output tokens/s = useful output tokens (each request's own max_tokens, never padding or waste) /
  wall time of the whole workload (first request issued → last response complete);
- TTFT = request issued → its first token in the client's hands (static baseline: its batch's start
  → end of the batch's prefill step);
- inter-token latency = every gap between successive content chunks (ours) or tokens (baselines),
  pooled over all requests; p50 / p99 with linear interpolation;
- peak RSS = largest sampled RSS sum of the system's process tree (ours: `met serve` + API + worker
  + redis-server; baselines: their own child process: Python, torch, transformers, weights, caches).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from measure import RunRecord, TreeUsage, percentile
from workloads import Workload

# (workload, reference system, target ratio ours / reference for output tokens/s)
THROUGHPUT_TARGETS = {"mixed": ("hf-static", 2.0), "uniform": ("hf-static", 1.0), "single": ("hf-static", 0.9)}
PREFIX_TTFT_TARGET = 0.15  # median TTFT of requests 2..16 over the first's
PREFIX_CACHED_TARGET = 3984  # cached_tokens each later request reports, at least
TTFT_OVERHEAD_TARGET_MS = 10.0


@dataclass(frozen=True, slots=True)
class SystemResult:
    workload: str
    system: str
    completed: int
    useful_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    e2e_p50_s: float
    e2e_p99_s: float
    peak_rss_mib: float
    other_load_cores: float  # mean CPU cores used by other processes on the machine meanwhile
    error: str | None = None
    notes: tuple[str, ...] = ()
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    value: float
    target: float
    higher_is_better: bool

    @property
    def met(self) -> bool | None:
        if math.isnan(self.value) or math.isnan(self.target):
            return None
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    def verdict(self) -> str:
        return {True: "met", False: "NOT met", None: "n/a"}[self.met]


def summarize(workload: Workload, record: RunRecord, usage: TreeUsage) -> SystemResult:
    timings = record.timings
    ttfts = [t.ttft_s * 1000 for t in timings]
    gaps = [g * 1000 for t in timings for g in t.gaps_s]
    e2es = [t.e2e_s for t in timings]
    useful = sum(t.output_tokens for t in timings)
    tps = useful / record.wall_s if record.wall_s > 0 and not record.error else math.nan
    return SystemResult(
        workload=workload.spec.name,
        system=record.system,
        completed=len(timings),
        useful_tokens=useful,
        wall_s=record.wall_s,
        tokens_per_s=tps,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        itl_p50_ms=percentile(gaps, 50),
        itl_p99_ms=percentile(gaps, 99),
        e2e_p50_s=percentile(e2es, 50),
        e2e_p99_s=percentile(e2es, 99),
        peak_rss_mib=usage.peak_rss_bytes / 2**20,
        other_load_cores=usage.other_cpu_cores,
        error=record.error,
        notes=record.notes,
        extra={**cpu_figures(usage), **record.extra},  # a run's own (measured-window) CPU figures win
    )


def cpu_figures(usage: TreeUsage) -> dict[str, float]:
    """CPU seconds per process role (and of the bench's own clients) — where the 2 cores went."""
    figures = {f"cpu_s_{role}": round(seconds, 1) for role, seconds in sorted(usage.cpu_by_role.items())}
    if usage.bench_cpu_s:
        figures["cpu_s_bench_clients"] = round(usage.bench_cpu_s, 1)
    return figures


def checks(workload: str, rows: list[SystemResult]) -> list[Check]:
    by_system = {r.system: r for r in rows}
    ours = by_system.get("ours")
    out: list[Check] = []
    reference, target = THROUGHPUT_TARGETS.get(workload, ("", math.nan))
    for mine in (s for s in by_system if s.startswith("ours")):  # ours (default flags: the targets), ours-int4 and ours-lean
        for system, row in by_system.items():
            if system.startswith("ours"):
                continue
            ratio = by_system[mine].tokens_per_s / row.tokens_per_s if row.tokens_per_s > 0 else math.nan
            out.append(Check(f"throughput {mine}/{system}", ratio, target if system == reference and mine == "ours" else math.nan, True))
    if ours is None:
        return out
    if workload == "prefix" and "prefix_first_ttft_ms" in ours.extra:
        x = ours.extra
        out.append(Check("prefix: later TTFT p50 / first TTFT", x["prefix_later_ttft_p50_ms"] / x["prefix_first_ttft_ms"], PREFIX_TTFT_TARGET, False))
        out.append(Check("prefix: fewest cached_tokens of requests 2..N", x["prefix_later_min_cached_tokens"], PREFIX_CACHED_TARGET, True))
    # the fastest in-process prefill of the prompt among the transformers baselines (bf16 is emulated, and slow,
    # on a CPU without native bf16, where our worker prefills in float32: hf-static-fp32 is the fair reference there)
    prefills = {name: row.extra["prefill_ms_median"] for name, row in by_system.items() if name.startswith("hf-static") and "prefill_ms_median" in row.extra}
    if workload == "single" and prefills:
        name = min(prefills, key=prefills.__getitem__)
        overhead = ours.ttft_p50_ms - prefills[name]
        out.append(Check(f"pipeline TTFT overhead ms (ours TTFT p50 - {name}'s in-process prefill)", overhead, TTFT_OVERHEAD_TARGET_MS, False))
    return out


_COLUMNS = (
    ("system", "{:<14}", "system"),
    ("done", "{:>5}", "completed"),
    ("tok/s", "{:>8.1f}", "tokens_per_s"),
    ("wall s", "{:>8.1f}", "wall_s"),
    ("TTFT p50 ms", "{:>12.1f}", "ttft_p50_ms"),
    ("TTFT p99 ms", "{:>12.1f}", "ttft_p99_ms"),
    ("ITL p50 ms", "{:>11.1f}", "itl_p50_ms"),
    ("ITL p99 ms", "{:>11.1f}", "itl_p99_ms"),
    ("e2e p50 s", "{:>10.2f}", "e2e_p50_s"),
    ("peak RSS MiB", "{:>13.0f}", "peak_rss_mib"),
    ("other load", "{:>11.2f}", "other_load_cores"),
)


def table(rows: list[SystemResult]) -> str:
    """A markdown table (also readable as plain text)."""
    head = "| " + " | ".join(name for name, _, _ in _COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in _COLUMNS) + "|"
    lines = [head, rule]
    for row in rows:
        values = asdict(row)
        lines.append("| " + " | ".join(fmt.format(values[key]).strip() for _, fmt, key in _COLUMNS) + " |")
    return "\n".join(lines)


def check_lines(found: list[Check]) -> str:
    lines = []
    for c in found:
        target = "" if math.isnan(c.target) else f"  (target {'≥' if c.higher_is_better else '≤'} {c.target:g}: {c.verdict()})"
        lines.append(f"- {c.name}: {c.value:.2f}{target}")
    return "\n".join(lines)
