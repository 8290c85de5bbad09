"""Speculative decoding (prompt lookup, `--speculative ngram`, the default) against ours without it and llama.cpp.

Systems, one after another on the same requests, each a fresh server as a user starts it:
- ours: `met serve` with default settings (speculative decoding on);
- ours-off: `met serve --speculative off`;
- llama.cpp / llama.cpp-pld (edit workload only, where the gateway tier built it: `./dev test-gateway` or
  `./dev setup-llama-cpp`): llama.cpp's server as the gateway tier runs it (llama-cpp-python 0.3.36, the
  default model's Q4_1 GGUF, tests/e2e/llamacpp.py), without and with its own model-free speculation,
  `--draft_model prompt-lookup-decoding` (llama-cpp-python's name for prompt-lookup decoding: its server
  has no `--spec-type ngram-simple`, which is llama.cpp's own `llama-server` flag).

Workloads (streamed with the official `openai` SDK, greedy, one request at a time):
- edit: 8 requests, each a ~1,500-token source file of this repository (a different one each) and "write the
  whole file again, unchanged except that <its first class or function> is renamed"; max_tokens --edit-tokens (384). tokens/s = generated tokens (the text
  re-tokenized with the model's tokenizer, the same count for every system) / seconds from request to
  last chunk, summed over the requests. ours and ours-off must write the same text (greedy is exact).
- single: bench/workloads.py's `single` (8 × 128 tokens, a 64-token prompt, ignore_eos): ours / ours-off.
- uniform: bench/workloads.py's `uniform` (32 clients × 128 tokens): ours / ours-off (output tokens/s).

Criteria (PASS/FAIL): edit ours / ours-off ≥ 2.5; single ≥ 0.95; uniform ≥ 0.95; edit texts identical.

    python bench/speculative.py [--quick] [--edit-tokens 384] [--only edit,single,uniform] [--no-llamacpp]

Only loopback traffic; every loop is bounded in count and time; every server is stopped however it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from ours import REPO_ROOT, ClientConfig, run_workload, running_server, served_model, wait_ready, warm_up
from workloads import build, spec_for

sys.path.insert(0, str(REPO_ROOT))

from models.files import local_folder
from shared.settings import Settings
from tests.e2e.llamacpp import MODEL_ALIAS, llamacpp_command, missing_message

EDIT_SOURCES = (
    "workers/scheduler.py",
    "workers/engine.py",
    "workers/runner.py",
    "workers/claims.py",
    "workers/sampling.py",
    "ingest/http/metrics.py",
    "shared/settings.py",
    "workers/llama.py",
)
EDIT_FILE_TOKENS = 1500
# the phrasing the default model follows (it answers "repeat this file exactly ..." put first with a summary)
EDIT_ASK = "Here is a file:\n\n```python\n{code}```\n\nWrite the whole file again, unchanged except that `{name}` is renamed `{new}`."
TARGETS = {"edit": 2.5, "single": 0.95, "uniform": 0.95}


@dataclass(frozen=True, slots=True)
class EditRun:
    system: str
    tokens: int
    seconds: float
    texts: tuple[str, ...]
    ttft_s: tuple[float, ...]
    figures: dict[str, float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def edit_prompts(tokenizer: object) -> list[str]:
    """A ~EDIT_FILE_TOKENS-token head of each source file (cut at a line), in the ask."""
    out = []
    for path in EDIT_SOURCES:
        lines, kept = (REPO_ROOT / path).read_text().splitlines(keepends=True), []
        for line in lines:
            if len(tokenizer.encode("".join([*kept, line]))) > EDIT_FILE_TOKENS:  # type: ignore[attr-defined]
                break
            kept.append(line)
        code = "".join(kept)
        name = re.search(r"^(?:class|def) (\w+)", code, re.MULTILINE)
        old = name.group(1) if name else "self"
        out.append(EDIT_ASK.format(code=code, name=old, new=f"{old}2"))
    return out


async def _stream(base_url: str, model: str, prompt: str, max_tokens: int) -> tuple[str, float, float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=900)
    try:
        issued = time.perf_counter()
        first = None
        parts: list[str] = []
        stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], stream=True, temperature=0, max_tokens=max_tokens)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first if first is not None else time.perf_counter() - issued
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts), time.perf_counter() - issued, first or 0.0
    finally:
        await client.close()


def run_edit(system: str, base_url: str, model: str, prompts: list[str], max_tokens: int, tokenizer: object) -> EditRun:
    asyncio.run(_stream(base_url, model, "Say hi.", 4))  # warm-up: one-time costs are not measured
    texts, seconds, firsts, tokens = [], 0.0, [], 0
    for prompt in prompts:
        text, took, first = asyncio.run(_stream(base_url, model, prompt, max_tokens))
        texts.append(text)
        seconds += took
        firsts.append(first)
        tokens += len(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]
    return EditRun(system, tokens, seconds, tuple(texts), tuple(firsts), {})


@contextmanager
def ours(root: Path, name: str, *flags: str) -> Iterator[tuple[str, str, Path]]:
    data = root / name
    with running_server(data, *flags) as server:
        wait_ready(server)
        yield server.base_url, served_model(server.base_url), data


@contextmanager
def llamacpp(pld: bool) -> Iterator[str]:
    from ours import free_loopback_port, terminate

    port = free_loopback_port()
    extra = ["--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens", "10"] if pld else []
    proc = subprocess.Popen([*llamacpp_command(port, threads=os.cpu_count()), *extra], cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llama.cpp's server exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        terminate(proc)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 edit requests of 64 tokens, the quick single and uniform workloads")
    p.add_argument("--edit-tokens", type=int, help="max_tokens of an edit request (default 384; --quick 64)")
    p.add_argument("--only", default="edit,single,uniform", help="workloads, comma-separated, of edit,single,uniform")
    p.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out of the edit workload")
    a = p.parse_args(argv)
    only = [w.strip() for w in a.only.split(",") if w.strip()]
    edit_tokens = a.edit_tokens or (64 if a.quick else 384)
    _, folder = local_folder("smollm2", Settings.from_env(os.environ).model_cache)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    kinds = subprocess.run("grep -o 'avx512_bf16\\|amx_bf16' /proc/cpuinfo | sort -u", shell=True, capture_output=True, text=True, check=False).stdout.split()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=False).stdout.strip()
    print("command: python bench/speculative.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"commit {commit}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; CPU: {', '.join(kinds) or 'AVX2-only'}; {os.cpu_count()} cores")
    ratios: dict[str, float] = {}
    same_text: bool | None = None
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="met-spec-bench-") as tmp:
        root = Path(tmp)
        if "edit" in only:
            ratios["edit"], same_text = edit_section(root, tokenizer, quick=a.quick, max_tokens=edit_tokens, with_llamacpp=not a.no_llamacpp, lines=lines)
        for name in ("single", "uniform"):
            if name in only:
                ratios[name] = workload_section(root, name, tokenizer, quick=a.quick)
    print()
    for line in lines:
        print(line)
    failed = False
    for name, ratio in ratios.items():
        ok = ratio >= TARGETS[name]
        failed |= not ok
        print(f"{'PASS' if ok else 'FAIL'} {name} tokens/s, ours / ours-off: {ratio:.2f} (≥ {TARGETS[name]:g})")
    if same_text is not None:
        failed |= not same_text
        print(f"{'PASS' if same_text else 'FAIL'} edit texts, ours and ours-off: {'identical' if same_text else 'DIFFER'}")
    return 1 if failed else 0


def edit_section(root: Path, tokenizer: object, *, quick: bool, max_tokens: int, with_llamacpp: bool, lines: list[str]) -> tuple[float, bool]:
    """The edit workload on each system; prints its table; returns (ours / ours-off tokens/s, same texts)."""
    prompts = edit_prompts(tokenizer)[: 2 if quick else None]
    print(f"edit: {len(prompts)} requests one at a time, files of {[len(tokenizer.encode(x)) for x in prompts]} prompt tokens, max_tokens {max_tokens}")  # type: ignore[attr-defined]
    runs = []
    for name, flags in (("ours", ()), ("ours-off", ("--speculative", "off"))):
        log(f"edit: {name}")
        with ours(root, f"edit-{name}", *flags) as (url, model, _):
            run = run_edit(name, url, model, prompts, max_tokens, tokenizer)
            runs.append(EditRun(run.system, run.tokens, run.seconds, run.texts, run.ttft_s, spec_figures(url)))
    problem = missing_message()
    if with_llamacpp and problem is None:
        for name, pld in (("llama.cpp", False), ("llama.cpp-pld", True)):
            log(f"edit: {name}")
            with llamacpp(pld) as url:
                runs.append(run_edit(name, url, MODEL_ALIAS, prompts, max_tokens, tokenizer))
    elif with_llamacpp:
        lines.append(f"llama.cpp left out: {problem}")
    by = {r.system: r for r in runs}
    print("| system | tokens | seconds | tokens/s | TTFT p50 ms | guesses kept |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        kept = f"{r.figures['spec_accepted']:.0f}/{r.figures['spec_proposed']:.0f}" if r.figures.get("spec_proposed") else "-"
        print(f"| {r.system} | {r.tokens} | {r.seconds:.1f} | {r.tokens_per_s:.1f} | {sorted(r.ttft_s)[len(r.ttft_s) // 2] * 1000:.0f} | {kept} |")
    for other in ("llama.cpp", "llama.cpp-pld"):
        if other in by:
            lines.append(f"edit tokens/s, ours / {other}: {by['ours'].tokens_per_s / by[other].tokens_per_s:.2f}")
    return by["ours"].tokens_per_s / by["ours-off"].tokens_per_s, by["ours"].texts == by["ours-off"].texts


def workload_section(root: Path, name: str, tokenizer: object, *, quick: bool) -> float:
    """bench/workloads.py's `name` workload on ours and ours-off; returns the output tokens/s ratio."""
    workload = build(spec_for(name, quick=quick, scale=1.0), tokenizer)
    rates = {}
    for system, flags in (("ours", ()), ("ours-off", ("--speculative", "off"))):
        log(f"{name}: {system}")
        with ours(root, f"{name}-{system}", *flags) as (url, model, _):
            config = ClientConfig(url, model, request_timeout_s=600, workload_timeout_s=1800)
            warm_up(config, "Say hi.")
            record = run_workload(config, workload)
            if record.error:
                raise RuntimeError(f"{name} {system}: {record.error}")
            rates[system] = sum(t.output_tokens for t in record.timings) / record.wall_s
    print(f"{name}: {workload.spec.num_requests} requests, {workload.spec.concurrency} at a time: ours {rates['ours']:.1f} tok/s, ours-off {rates['ours-off']:.1f} tok/s")
    return rates["ours"] / rates["ours-off"]


def spec_figures(url: str) -> dict[str, float]:
    """The worker's speculative-decoding counters from /metrics (0 where absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = {}
    for name, key in (("met_spec_decode_num_draft_tokens_total", "spec_proposed"), ("met_spec_decode_num_accepted_tokens_total", "spec_accepted")):
        for line in text.splitlines():
            if line.startswith(name + " "):
                found[key] = float(line.split()[-1])
    return found


if __name__ == "__main__":
    sys.exit(main())
