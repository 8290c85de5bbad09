"""What the exactness contract costs on this CPU (`workers.kernels`): the default model in bf16 on the lean
path, through the engine as the worker runs it, with the row-invariant GEMM calls (default) and without
(`--no-row-invariant`, the old single call), side by side in one process, alternating runs.

Workloads: prefill (one 480-token prompt, 1 output token: a step is a 480-row GEMM), single (one
stream, 48 tokens) and mixed (8 streams of 48 tokens joining while a 480-token prompt prefills).
Prints the median wall time of each and the ratio. Run under each oneDNN level the CPU has:

    python bench/exact_cost.py [--repeat 5]
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python bench/exact_cost.py
    grep -o 'avx512_bf16\\|amx_bf16' /proc/cpuinfo | sort -u   # say which CPU a figure comes from
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout, not the installed one

import torch

from models.files import local_folder
from models.prompt import PromptRenderer
from shared.ir import Message, Protocol, Request, Role, SamplingParams, TextPart
from shared.settings import Settings
from workers import kernels, llama
from workers.engine import Engine
from workers.runner import TorchRunner, load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    settings = Settings.from_env(os.environ)
    name, folder = local_folder(settings.model, settings.model_cache)
    renderer = PromptRenderer.load(folder, name=name, max_model_len=2048)
    model = load_model(folder, device=torch.device("cpu"), dtype=torch.bfloat16)
    runner = TorchRunner(model, max_len=2048, kv_budget_mb=256, device=torch.device("cpu"), dtype=torch.bfloat16, model_impl="lean")
    assert runner.lean is not None
    found = kernels.probe_all(llama.weight_shapes(runner.lean))

    def request(rid: str, text: str, max_tokens: int) -> Request:
        req = Request(id=rid, protocol=Protocol.OPENAI_CHAT, model="m", messages=(Message(role=Role.USER, content=(TextPart(text=text),)),), sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return replace(req, prompt_token_ids=tuple(renderer.render(req)))

    long_text = " ".join(f"word{i}" for i in range(230))

    def run(reqs: list[Request]) -> float:
        engine = Engine(runner, renderer.tokenizer, renderer.info, settings=Settings(max_running=16, prefix_cache=False))
        start = time.perf_counter()
        for r in reqs:
            engine.add(r)
        while engine.has_work():
            engine.step()
        return time.perf_counter() - start

    workloads = {
        "prefill": lambda: [request("p", long_text, 1)],
        "single": lambda: [request("s", "Write a story about a lighthouse.", 48)],
        "mixed": lambda: [request(f"m{i}", f"Tell me about the number {i}.", 48) for i in range(8)] + [request("mp", long_text, 8)],
    }
    print(f"CPU: {kernels.cpu_kind()} (ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '')!r}), MKL_CBWR={os.environ.get('MKL_CBWR')}, threads {torch.get_num_threads()}")
    print(f"row-invariant calls: {found}")
    print(f"{'workload':<10}{'row-invariant s':>18}{'single call s':>16}{'ratio':>8}")
    for label, make in workloads.items():
        times: dict[bool, list[float]] = {True: [], False: []}
        run(make())  # warm
        for _ in range(args.repeat):
            for on in (True, False):
                kernels.ENABLED = on
                times[on].append(run(make()))
        kernels.ENABLED = True
        ours, old = statistics.median(times[True]), statistics.median(times[False])
        print(f"{label:<10}{ours:>18.3f}{old:>16.3f}{ours / old:>8.2f}")


if __name__ == "__main__":
    main()
