"""Prefix-aware routing benchmark: multi-turn sessions against `met api --routing prefix|shared` and N workers.

Configurations, each on a fresh deployment (cluster.py: its own redis-server, `met api`, `met worker`
processes, so every prefix cache starts cold), one after another, on the same conversations:
- prefix: `--routing prefix` (the default) with --workers workers (3), each session its own system prompt;
- shared: `--routing shared` (every request on the shared stream: whichever worker asks first takes it);
- single: one worker (what one worker's cache gives: the single-worker figure);
- shared-prompt: `--routing prefix`, --workers workers, ONE ~2,000-token system prompt for every session
  (a hot prefix: routing must not pile every session onto the worker that cached it first).

Workload (sessions.py): --sessions sessions (24) × --turns turns (4), --concurrency sessions at a time (6),
each session's turns one after another; a session's own system prompt of 1,500-2,000 tokens (seeded by the
session number: prose, lists and code-like lines), and a growing history: each turn sends the previous
turns' user messages and the assistant's streamed answers, then a new short user message. Greedy
(temperature 0), --max-tokens (32) new tokens at most, streamed with the official `openai` SDK.

Figures per configuration: cached share of prompt tokens on turns 2.. (sum of usage.prompt_tokens_details.
cached_tokens / sum of usage.prompt_tokens), TTFT p50 on turns 2.. (request issued → first content chunk),
requests per worker (every id in Redis' request index, by its meta hash's `worker`) and their max/min,
failures, and the API's routing decisions (/metrics `met_routing_decisions_total`). Criteria (PASS/FAIL):
prefix cached share ≥ 0.9 × single and ≥ 2 × shared; TTFT p50 prefix ≤ 0.5 × shared; requests per worker
max/min ≤ 1.5 for prefix and for shared-prompt; no failures. Exit status 1 if a criterion fails.

Workers run with default settings but one: several workers on one machine get `--threads` cores / workers
(at least 1), as an operator starts them (the single worker keeps torch's default, one thread per core).
With torch's default each of 3 workers on 2 cores ran 2 spinning threads, and a token took ~0.4 s instead of
~0.03 s (measured here: the pools spun against each other), which measures the thread pools, not routing.

    python bench/routing.py [--quick] [--sessions 24] [--turns 4] [--concurrency 6] [--max-tokens 32]
                            [--workers 3] [--only prefix,shared,single,shared-prompt] [--timeout-s 3600]

Only loopback traffic; every loop is bounded in count and time; every process is stopped however it ends.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from cluster import REPO_ROOT, WorkerCounts, metrics, requests_per_worker, running_cluster
from measure import percentile
from sessions import Conversations, PlayConfig, Played, build, play

from cli.serve import worker_settings
from models.files import local_folder
from shared.settings import Settings

MODEL_SPEC = "smollm2"
CONFIGS = ("prefix", "shared", "single", "shared-prompt")
CACHED_VS_SINGLE = 0.9
CACHED_VS_SHARED = 2.0
TTFT_VS_SHARED = 0.5
MAX_MIN_REQUESTS = 1.5


@dataclass(frozen=True, slots=True)
class Options:
    sessions: int
    turns: int
    concurrency: int
    max_tokens: int
    workers: int
    only: tuple[str, ...]
    timeout_s: float


def parse_args(argv: list[str] | None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: 6 sessions, 3 at a time, 3 turns (unless set)")
    p.add_argument("--sessions", type=int, help="sessions (default 24; --quick 6)")
    p.add_argument("--turns", type=int, help="turns per session (default 4; --quick 3)")
    p.add_argument("--concurrency", type=int, help="sessions at a time (default 6; --quick 3)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per turn, at most")
    p.add_argument("--workers", type=int, default=3, help="workers of the multi-worker configurations")
    p.add_argument("--only", default=",".join(CONFIGS), help=f"configurations to run, comma-separated, of {','.join(CONFIGS)}")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="bound on each configuration's sessions")
    a = p.parse_args(argv)
    only = tuple(c.strip() for c in a.only.split(",") if c.strip())
    unknown = [c for c in only if c not in CONFIGS]
    if unknown or not only:
        p.error(f"--only: unknown configuration(s) {unknown}; choose from {','.join(CONFIGS)}")
    quick = a.quick
    return Options(
        sessions=a.sessions or (6 if quick else 24),
        turns=a.turns or (3 if quick else 4),
        concurrency=a.concurrency or (3 if quick else 6),
        max_tokens=a.max_tokens,
        workers=a.workers,
        only=tuple(c for c in CONFIGS if c in only),
        timeout_s=a.timeout_s,
    )


@dataclass(frozen=True, slots=True)
class Row:
    config: str
    routing: str
    workers: int
    played: Played
    counts: WorkerCounts
    decisions: dict[str, float]
    hit_rates: dict[str, float]  # per worker, its own prefix-cache hit rate (heartbeat)

    @property
    def failures(self) -> int:
        return len(self.played.errors)

    @property
    def cached_share(self) -> float:
        later = [t for t in self.played.turns if t.turn > 0 and t.error is None]
        prompt = sum(t.prompt_tokens for t in later)
        return sum(t.cached_tokens for t in later) / prompt if prompt else math.nan

    @property
    def first_cached_share(self) -> float:
        first = [t for t in self.played.turns if t.turn == 0 and t.error is None]
        prompt = sum(t.prompt_tokens for t in first)
        return sum(t.cached_tokens for t in first) / prompt if prompt else math.nan

    def ttft_p50_ms(self, *, first: bool) -> float:
        return percentile([t.ttft_s * 1000 for t in self.played.turns if (t.turn == 0) == first and t.ttft_s is not None], 50)

    @property
    def max_min(self) -> float:
        values = list(self.counts.per_worker.values())
        if not values:
            return math.nan
        return max(values) / min(values) if min(values) > 0 else math.inf


def run_config(name: str, options: Options, conversations: Conversations, root: Path) -> Row:
    routing = "shared" if name == "shared" else "prefix"
    workers = 1 if name == "single" else options.workers
    log(f"{name}: starting redis-server, met api --routing {routing}, {workers} × met worker")
    threads = ("--threads", str(worker_threads(workers))) if workers > 1 else ()
    with running_cluster(root / name, workers=workers, api_flags=("--routing", routing), worker_flags=threads) as cluster:
        log(f"{name}: ready; playing {conversations.sessions} sessions × {conversations.turns} turns, {options.concurrency} at a time")
        model = str(httpx.get(f"{cluster.base_url}/v1/models", timeout=10).json()["data"][0]["id"])
        config = PlayConfig(cluster.base_url, model, options.concurrency, options.max_tokens, request_timeout_s=600.0, timeout_s=options.timeout_s)
        played = play(config, conversations)
        counts = requests_per_worker(cluster)
        found = metrics(cluster)
    log(f"{name}: done in {played.wall_s:.0f}s, {len(played.errors)} failure(s)")
    for error in played.errors[:5]:
        log(f"  {error}")
    decisions = {k: v for k, v in found.get("met_routing_decisions_total", {}).items() if v}
    return Row(name, routing, workers, played, counts, decisions, found.get("met_worker_prefix_cache_hit_rate", {}))


def table(rows: list[Row]) -> str:
    head = ("config", "routing", "workers", "requests", "failures", "cached share t2+", "cached share t1", "TTFT p50 t2+ ms", "TTFT p50 t1 ms",
            "requests per worker", "max/min", "routing decisions", "wall s")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        per = " / ".join(str(n) for n in sorted(r.counts.per_worker.values(), reverse=True))
        decisions = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.decisions.items()))
        cells = (r.config, r.routing, str(r.workers), str(len(r.played.turns)), str(r.failures), f"{r.cached_share:.3f}", f"{r.first_cached_share:.3f}",
                 f"{r.ttft_p50_ms(first=False):.0f}", f"{r.ttft_p50_ms(first=True):.0f}", per, f"{r.max_min:.2f}", decisions or "-", f"{r.played.wall_s:.0f}")  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def criteria(rows: list[Row]) -> list[tuple[str, bool | None]]:
    """(line, passed); None: not measured in this run (a configuration it needs was left out)."""
    by = {r.config: r for r in rows}
    out: list[tuple[str, bool | None]] = []

    def ratio(label: str, a: str, b: str, value: float, target: float, *, at_least: bool) -> None:
        if a not in by or b not in by:
            out.append((f"{label}: n/a (needs {a} and {b})", None))
            return
        ok = value >= target if at_least else value <= target
        out.append((f"{label}: {value:.2f} ({'≥' if at_least else '≤'} {target:g})", ok))

    p, s, one = by.get("prefix"), by.get("shared"), by.get("single")
    ratio("cached share t2+, prefix / single", "prefix", "single", p.cached_share / one.cached_share if p and one else math.nan, CACHED_VS_SINGLE, at_least=True)
    ratio("cached share t2+, prefix / shared", "prefix", "shared", p.cached_share / s.cached_share if p and s else math.nan, CACHED_VS_SHARED, at_least=True)
    ttft = p.ttft_p50_ms(first=False) / s.ttft_p50_ms(first=False) if p and s else math.nan
    ratio("TTFT p50 t2+, prefix / shared", "prefix", "shared", ttft, TTFT_VS_SHARED, at_least=False)
    for name in ("prefix", "shared-prompt"):
        if name in by:
            out.append((f"requests per worker max/min, {name}: {by[name].max_min:.2f} (≤ {MAX_MIN_REQUESTS:g})", by[name].max_min <= MAX_MIN_REQUESTS))
    if "shared-prompt" in by:
        out.append((f"cached share t2+, shared-prompt: {by['shared-prompt'].cached_share:.3f} (reported, no target)", None))
    failures = sum(r.failures for r in rows)
    out.append((f"failures, all configurations: {failures} (= 0)", failures == 0))
    return out


def header(options: Options, conversations: dict[str, Conversations]) -> list[str]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, check=False).stdout.strip()

    import torch

    kinds = subprocess.run("grep -o 'avx512_bf16\\|amx_bf16' /proc/cpuinfo | sort -u", shell=True, capture_output=True, text=True, check=False).stdout.split()
    lines = [
        "command: " + " ".join(["python", "bench/routing.py", *sys.argv[1:]]),
        f"commit {git('rev-parse', '--short', 'HEAD')}{' (uncommitted changes)' if git('status', '--porcelain', '--', '.', ':!bench') else ''}, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"CPU: {', '.join(kinds) if kinds else 'AVX2-only'}; {os.cpu_count()} cores; torch {torch.__version__} "
        f"(one worker: torch's default, {torch.get_num_threads()} threads; {options.workers} workers: --threads {worker_threads(options.workers)} each)",
        f"workload: {options.sessions} sessions × {options.turns} turns, {options.concurrency} sessions at a time, greedy, max_tokens {options.max_tokens}, "
        f"default model ({MODEL_SPEC})",
    ]
    for name, conv in conversations.items():
        distinct = len(set(conv.system_prompts))
        lines.append(f"system prompts ({name}): {distinct} distinct, {min(conv.system_tokens)}-{max(conv.system_tokens)} tokens (tokenizer, no template)")
    return lines


def worker_threads(workers: int) -> int:
    """What `met serve --workers N` gives each of its workers (cli.serve.worker_settings)."""
    return worker_settings(Settings(workers=workers)).threads


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the `finally` blocks that stop the processes


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    options = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    _, folder = local_folder(MODEL_SPEC, Settings.from_env(os.environ).model_cache)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    own = build(tokenizer, sessions=options.sessions, turns=options.turns, shared_prompt=False)
    conversations = {"own prompt per session": own}
    if "shared-prompt" in options.only:
        conversations["shared-prompt"] = build(tokenizer, sessions=options.sessions, turns=options.turns, shared_prompt=True)
    for line in header(options, conversations):
        print(line, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="met-routing-bench-") as tmp:
        for name in options.only:
            conv = conversations["shared-prompt"] if name == "shared-prompt" else own
            rows.append(run_config(name, options, conv, Path(tmp)))
    print()
    print(table(rows))
    print()
    for r in rows:
        rates = ", ".join(f"{w[-8:]} {v:.2f}" for w, v in sorted(r.hit_rates.items()))
        print(f"{r.config}: {r.counts.requests} requests in the index ({r.counts.unclaimed} never claimed); worker prefix-cache hit rates: {rates or '-'}")
    print()
    found = criteria(rows)
    for line, ok in found:
        print(f"{'PASS' if ok else 'FAIL' if ok is False else '    '} {line}")
    return 1 if any(ok is False for _, ok in found) else 0


if __name__ == "__main__":
    sys.exit(main())
