"""Throughput and latency benchmark: our `met serve` against transformers on the same request sets.

Systems, each run on exactly the same requests (same prompt token ids, same max_tokens, same arrival
order), one after another so they never compete for the CPU with each other:
- ours: a live `met serve --workers 1` subprocess (embedded Redis, API, one worker; default model
  SmolLM2-135M-Instruct in bf16), driven over 127.0.0.1 by a closed loop of N streaming clients using
  the official `openai` AsyncOpenAI SDK (see ours.py);
- hf-static: transformers `generate` in a child process, static left-padded batches of N in arrival
  order, greedy, every row run to the batch's largest max_tokens (see hf_static.py); hf-static-fp32: the
  same with the model in float32 (what a transformers user picks on a CPU without native bf16);
- hf-continuous: transformers' `ContinuousBatchingManager` in a child process, the same closed loop
  of N (see hf_continuous.py); if it fails here, its error is reported instead of a figure.
Every request generates exactly its max_tokens (ignore_eos / min_new_tokens / EOS disabled).
Figures per system: output tokens/s, TTFT p50/p99, inter-token latency p50/p99, end-to-end p50,
peak RSS of the system's process tree, and the CPU other processes used meanwhile; then the ratio
ours / baseline for throughput against the targets (definitions in report.py). For `single`, the
pipeline TTFT overhead = our median TTFT − the median in-process prefill forward of the same prompt.

    python bench/throughput.py --workload uniform|mixed|single|prefix|all [--quick] [--scale F] [--json]

`prefix` (ours only): 16 requests one after another sharing one 4,000-token message prefix with their
own 50-token suffixes; figures: the first request's TTFT, the median TTFT of the others, and the
fewest cached_tokens the server reported for them. Every run of ours also reports the worker's RSS
right after /ready and the peak number of sequences running at once (from its heartbeat).

Only loopback traffic; every loop is bounded in count and time; the server is always stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hf_continuous import run_continuous
from hf_static import DTYPES as STATIC_DTYPES
from hf_static import run_static
from isolate import run_isolated
from measure import RunRecord, TreeSampler, TreeUsage, wait_for_quiet
from ours import REPO_ROOT, ClientConfig, run_workload, running_server, served_model, wait_ready, warm_up, worker_figures, worker_rss
from report import SystemResult, check_lines, checks, cpu_figures, summarize, table
from workloads import Workload, build, spec_for

from models.files import local_folder
from shared.settings import Settings

WORKLOADS = ("uniform", "mixed", "single", "prefix")
OURS_ONLY = ("prefix",)  # workloads measuring our own cache, not a comparison
SYSTEMS = ("ours", "ours-int4", "ours-lean", "ours-invariant", "ours-fp32", "hf-static", "hf-static-fp32", "hf-continuous")  # ours: `met serve` as is; ours-int4: `--quantization auto`; ours-lean: `--model-impl lean`; ours-invariant: `--batch-invariant`; ours-fp32: `--dtype float32`
OURS_FLAGS = {"ours": (), "ours-int4": ("--quantization", "auto"), "ours-lean": ("--model-impl", "lean"), "ours-invariant": ("--batch-invariant",), "ours-fp32": ("--dtype", "float32")}
MODEL_SPEC = "smollm2"
QUIET_CORES = 0.25  # other processes' CPU use under which the shared machine counts as quiet


@dataclass(frozen=True, slots=True)
class BenchConfig:
    workloads: tuple[str, ...]
    systems: tuple[str, ...]
    quick: bool
    scale: float
    as_json: bool
    timeout_s: float  # per system and workload, model loading included
    quiet_wait_s: float  # before each system, wait at most this long for other processes to go quiet
    quiet_cores: float  # ... that is, to use fewer than this many cores
    torch_threads: int | None  # OMP_NUM_THREADS for every system under test; None: torch's default
    retries: int  # extra runs of a system whose run was disturbed by other processes


def parse_args(argv: list[str] | None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all")
    parser.add_argument("--systems", default=",".join(s for s in SYSTEMS if s not in ("ours-lean", "ours-invariant", "ours-fp32", "hf-static-fp32")), help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    parser.add_argument("--quick", action="store_true", help="a small smoke run (8 clients, 16 requests, short outputs)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the request count (at least one per client), e.g. 0.5")
    parser.add_argument("--json", action="store_true", help="write the results as JSON to stdout (the table goes to stderr)")
    parser.add_argument("--timeout-s", type=float, default=None, help="per system and workload (default 600 with --quick, else 5400)")
    parser.add_argument(
        "--quiet-wait-s",
        type=float,
        default=None,
        help="before each system, wait up to this long until other processes use < --quiet-cores (default 60 with --quick, else 900)",
    )
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="set OMP_NUM_THREADS for every system (server and baselines alike); default: torch's"
    )
    parser.add_argument("--retries", type=int, default=1, help="run a system again (up to N times) if other processes used > --quiet-cores meanwhile")
    parser.add_argument("--quiet-cores", type=float, default=QUIET_CORES, help=f"see --quiet-wait-s (default {QUIET_CORES})")
    args = parser.parse_args(argv)
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"--systems: unknown {sorted(unknown)}")
    if not 0 < args.scale <= 10:
        parser.error("--scale must be in (0, 10]")
    timeout = args.timeout_s or (600.0 if args.quick else 5400.0)
    workloads = WORKLOADS if args.workload == "all" else (args.workload,)
    quiet = args.quiet_wait_s if args.quiet_wait_s is not None else (60.0 if args.quick else 900.0)
    return BenchConfig(
        workloads=workloads,
        systems=systems,
        quick=args.quick,
        scale=args.scale,
        as_json=args.json,
        timeout_s=timeout,
        quiet_wait_s=quiet,
        quiet_cores=args.quiet_cores,
        torch_threads=args.torch_threads,
        retries=max(0, args.retries),
    )


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_ours(workload: Workload, config: BenchConfig, system: str = "ours") -> tuple[RunRecord, TreeUsage]:
    with tempfile.TemporaryDirectory(prefix="met-bench-") as tmp, running_server(Path(tmp), *OURS_FLAGS[system]) as server:
        sampler = TreeSampler(server.proc.pid, max_duration_s=config.timeout_s).start()
        try:
            wait_ready(server)
            started = worker_rss(server)
            client = ClientConfig(server.base_url, served_model(server.base_url), config.timeout_s, config.timeout_s)
            # Warm up on a message that shares no prefix with the workload's (or the first measured
            # request would find its prefix cached).
            warm_up(client, "warm up" if workload.spec.shared_prefix else workload.requests[0].message)
            window = TreeSampler(server.proc.pid, max_duration_s=config.timeout_s).start()
            try:
                record = replace(run_workload(client, workload), system=system)
            finally:
                window_usage = window.stop()
            record.extra.update(cpu_figures(window_usage))  # CPU over the measured window only
            record.extra.update({f"{k}_after_start": v for k, v in started.items()}, **worker_figures(server, Path(tmp)))
        except Exception as exc:
            record = RunRecord(system, 0.0, error=f"{type(exc).__name__}: {exc}")
        finally:
            usage = sampler.stop()
        if record.error:
            log(f"server log tail:\n{server.log_tail(2000)}")
        return record, usage


def run_system(system: str, workload: Workload, folder: Path, config: BenchConfig) -> SystemResult:
    """Run once; while other processes took more than --quiet-cores during the run, run again (at most
    --retries more times) and keep the least disturbed run."""
    best: SystemResult | None = None
    for attempt in range(1, config.retries + 2):
        result = _run_once(system, workload, folder, config)
        result.extra["attempt"] = attempt
        if best is None or result.other_load_cores < best.other_load_cores:
            best = result
        if result.error or result.other_load_cores <= config.quiet_cores:
            break
        log(f"{workload.spec.name}: {system}: other processes used {result.other_load_cores:.2f} cores meanwhile")
    assert best is not None
    return best


def _run_once(system: str, workload: Workload, folder: Path, config: BenchConfig) -> SystemResult:
    waited, others = wait_for_quiet(max_wait_s=config.quiet_wait_s, threshold_cores=config.quiet_cores)
    log(f"{workload.spec.name}: running {system} (waited {waited:.0f}s for a quiet machine; others at {others:.2f} cores)")
    if system in OURS_FLAGS:
        record, usage = run_ours(workload, config, system)
    elif system in STATIC_DTYPES:
        record, usage = run_isolated(run_static, system, (workload, folder, system), timeout_s=config.timeout_s)
    else:
        record, usage = run_isolated(run_continuous, system, (workload, folder, config.timeout_s), timeout_s=config.timeout_s)
    result = summarize(workload, record, usage)
    result.extra.update(others_at_start_cores=round(others, 2), quiet_wait_s=round(waited))
    status = f"error: {result.error}" if result.error else f"{result.tokens_per_s:.1f} tok/s in {result.wall_s:.1f}s"
    log(f"{workload.spec.name}: {system}: {status} (other processes: {result.other_load_cores:.2f} cores)")
    return result


def provenance(config: BenchConfig) -> dict[str, Any]:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, check=False)
        return done.stdout.rstrip("\n")  # not strip(): porcelain lines start with a status column

    import torch
    import transformers

    threads = config.torch_threads or f"default {torch.get_num_threads()}"
    dirty = [line[3:] for line in git("status", "--porcelain").splitlines() if not line[3:].startswith("bench/")]
    return {
        "commit": git("rev-parse", "--short", "HEAD").strip(),
        "uncommitted_files_outside_bench": dirty,
        "command": " ".join(["python", "bench/throughput.py", *sys.argv[1:]]),
        "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), no GPU used, bf16, torch {torch.__version__} "
        f"({threads} intra-op threads per system), transformers {transformers.__version__}, Python {platform.python_version()}",
        "quick": config.quick,
        "scale": config.scale,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _plain(value: Any) -> Any:
    """JSON-safe: NaN becomes null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def render_text(meta: dict[str, Any], sections: list[dict[str, Any]]) -> str:
    out = [f"commit {meta['commit']}; {meta['machine']}"]
    for section in sections:
        rows = [SystemResult(**row) for row in section["rows"]]
        out += ["", f"## {section['description']}", "", table(rows), "", check_lines(section["check_objects"])]
        for row in rows:
            extra = ", ".join(f"{k}={v:g}" for k, v in row.extra.items())
            notes = "; ".join(n.splitlines()[-1] if row.error else n for n in row.notes)
            parts = [p for p in (extra, notes, f"ERROR {row.error}" if row.error else "") if p]
            if parts:
                out.append(f"- {row.system}: " + "; ".join(parts))
    return "\n".join(out)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the `finally` blocks that stop the server


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    config = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if config.torch_threads:  # inherited by the server subprocess and the spawned baseline children
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(config.torch_threads)
    _, folder = local_folder(MODEL_SPEC, Settings.from_env(os.environ).model_cache)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    meta = provenance(config)
    log(f"commit {meta['commit']}; {meta['machine']}")
    sections = []
    for name in config.workloads:
        workload = build(spec_for(name, quick=config.quick, scale=config.scale), tokenizer)
        log(workload.describe())
        systems = [s for s in config.systems if s in OURS_FLAGS or name not in OURS_ONLY]
        rows = [run_system(system, workload, folder, config) for system in systems]
        found = checks(name, rows)
        sections.append({"workload": name, "description": workload.describe(), "spec": asdict(workload.spec), "rows": [asdict(r) for r in rows], "check_objects": found})
        log(f"{name} done:\n{table(rows)}\n{check_lines(found)}")
    text = render_text(meta, sections)
    for section in sections:
        section["checks"] = [{**asdict(c), "met": c.met} for c in section.pop("check_objects")]
    if config.as_json:
        print(text, file=sys.stderr)
        print(json.dumps(_plain({**meta, "workloads": sections}), indent=2))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
