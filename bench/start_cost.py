"""What starting a server costs: `met serve` (one worker, the default model, embedded Redis) against
llama.cpp's server (llama-cpp-python 0.3.36 on the default model's GGUF, as the gateway tier runs it).

Per start, from launch to ready (`GET /ready` 200 for ours, `GET /v1/models` 200 for llama.cpp): the
wall time, the CPU seconds of each process (ours: the API process that is `met serve` itself, its
worker; llama.cpp: its one process), the resident memory, and whether the API process mapped libtorch
(it should not: models/tokenizer.py). One untimed start of ours first (it converts the GGUF once when
the model cache is empty); then `--runs` timed starts of each, alternating, and the medians. Prints the
ratios ours / llama.cpp. Operators start API nodes and workers often (a rolling restart, an autoscaler);
the test suite starts ~100 of them.

    python bench/start_cost.py [--runs 3] [--no-llamacpp]

Only loopback traffic; every loop is bounded in count and time; every server is stopped however it ends.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from ours import REPO_ROOT, free_loopback_port, running_server, terminate, wait_ready

sys.path.insert(0, str(REPO_ROOT))

from tests.e2e.llamacpp import llamacpp_command, missing_message

READY_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Start:
    ready_s: float
    cpu_s: dict[str, float]  # process role -> user + system CPU seconds up to ready
    rss_mb: dict[str, float]
    api_torch: bool = False


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def _role(proc: psutil.Process) -> str:
    line = " ".join(proc.cmdline())
    return "worker" if "cli.main worker" in line else "redis" if "redis" in line else proc.name()


def start_ours(root: Path) -> Start:
    began = time.monotonic()
    with running_server(root / f"ours-{time.monotonic_ns()}") as server:
        wait_ready(server)
        ready = time.monotonic() - began
        api = psutil.Process(server.proc.pid)
        procs = {"api": api, **{_role(child): child for child in api.children(recursive=True)}}
        maps = Path(f"/proc/{api.pid}/maps").read_text()
        return Start(
            ready,
            {role: _cpu(p) for role, p in procs.items()},
            {role: p.memory_info().rss / 2**20 for role, p in procs.items()},
            api_torch="libtorch" in maps,
        )


def start_llamacpp() -> Start:
    port = free_loopback_port()
    began = time.monotonic()
    proc = subprocess.Popen(llamacpp_command(port, threads=None), cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.monotonic() - began < READY_TIMEOUT_S:
            if proc.poll() is not None:
                raise RuntimeError(f"llama.cpp's server exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    ready = time.monotonic() - began
                    p = psutil.Process(proc.pid)
                    return Start(ready, {"llama.cpp": _cpu(p)}, {"llama.cpp": p.memory_info().rss / 2**20})
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"llama.cpp's server was not ready in {READY_TIMEOUT_S:.0f}s")
    finally:
        terminate(proc)


def median(starts: list[Start], pick: str) -> float:
    return statistics.median(getattr(s, pick) if pick == "ready_s" else sum(getattr(s, pick).values()) for s in starts)


def report(name: str, starts: list[Start]) -> None:
    roles = sorted({r for s in starts for r in s.cpu_s})
    cpu = ", ".join(f"{r} {statistics.median(s.cpu_s.get(r, 0.0) for s in starts):.2f}" for r in roles)
    rss = ", ".join(f"{r} {statistics.median(s.rss_mb.get(r, 0.0) for s in starts):.0f}" for r in roles)
    print(f"{name}: ready {median(starts, 'ready_s'):.2f} s; CPU s to ready: {cpu} (total {median(starts, 'cpu_s'):.2f}); RSS MB: {rss}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="timed starts of each server (default 3)")
    p.add_argument("--no-llamacpp", action="store_true", help="only ours")
    a = p.parse_args(argv)
    problem = None if a.no_llamacpp else missing_message()
    if problem:
        print(f"llama.cpp left out: {problem}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="met-start-") as tmp:
        root = Path(tmp)
        start_ours(root)  # untimed: a model conversion, first-touch page cache
        ours: list[Start] = []
        theirs: list[Start] = []
        for _ in range(a.runs):
            ours.append(start_ours(root))
            if not (a.no_llamacpp or problem):
                theirs.append(start_llamacpp())
    report("ours (met serve, 1 worker)", ours)
    print(f"  the API process mapped libtorch: {sum(s.api_torch for s in ours)} of {len(ours)} starts")
    if theirs:
        report("llama.cpp's server", theirs)
        print(f"ratio ours / llama.cpp: ready {median(ours, 'ready_s') / median(theirs, 'ready_s'):.1f}x, CPU {median(ours, 'cpu_s') / median(theirs, 'cpu_s'):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
