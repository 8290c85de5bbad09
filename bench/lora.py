"""LoRA adapters served batched: the uniform workload spread over 8 adapters against the same on the base model.

One `met serve` (defaults, plus `--lora` for 8 adapters of the default model: rank 16 on every q/k/v/o and
gate/up/down projection, built offline with peft, tests/lora_adapters.py), then bench/workloads.py's `uniform`
workload (32 clients × 128 tokens, streamed with the official `openai` SDK, greedy, ignore_eos), in rounds
alternating: every request on the base model, then request i on adapter i % 8 (4 per adapter, so each step
mixes all 8). Output tokens/s of each run; the ratio adapters / base, from the sums over the rounds.

Criterion (PASS/FAIL): adapters / base ≥ 0.8 (issue 37).

    python bench/lora.py [--quick] [--rounds 2] [--rank 16] [--adapters 8]

Only loopback traffic; every loop is bounded in count and time; the server is stopped however it ends.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from ours import REPO_ROOT, ClientConfig, run_workload, running_server, served_model, wait_ready, warm_up
from workloads import build, spec_for

sys.path.insert(0, str(REPO_ROOT))

from tests.lora_adapters import default_model_adapters

TARGET = 0.8


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the quick uniform workload (8 clients × 32 tokens), one round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=8)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from models.files import local_folder
    from shared.settings import Settings

    settings = Settings.from_env({})
    _, folder = local_folder(settings.model, settings.model_cache)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    workload = build(spec_for("uniform", quick=args.quick, scale=1.0), tokenizer)
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory(prefix="met-lora-bench-") as tmp:
        root = Path(tmp)
        names = tuple(f"tuned-{i}" for i in range(args.adapters))
        adapters = default_model_adapters(root / "adapters", names, rank=args.rank, first_seed=100)
        flags = [f for name, path in adapters.items() for f in ("--lora", f"{name}={path}")]
        totals = {"base": [0.0, 0.0], "adapters": [0.0, 0.0]}  # tokens, seconds
        with running_server(root / "serve", *flags) as server:
            wait_ready(server)
            model = served_model(server.base_url)
            for name in (model, *adapters):  # each adapter loaded and its GEMM shapes probed before anything is timed
                warm_up(ClientConfig(server.base_url, name, 600, 1800), "Say hi.")
            for n in range(rounds):
                for system, models in (("base", ()), ("adapters", tuple(adapters))):
                    config = ClientConfig(server.base_url, model, request_timeout_s=600, workload_timeout_s=1800, models=models)
                    record = run_workload(config, workload)
                    if record.error:
                        raise RuntimeError(f"{system}: {record.error}\n{server.log_tail()}")
                    tokens = sum(t.output_tokens for t in record.timings)
                    totals[system][0] += tokens
                    totals[system][1] += record.wall_s
                    print(f"round {n + 1} {system}: {tokens} tokens in {record.wall_s:.1f} s = {tokens / record.wall_s:.1f} tok/s", flush=True)
    rates = {k: t / s for k, (t, s) in totals.items()}
    ratio = rates["adapters"] / rates["base"]
    spec = workload.spec
    print(f"uniform ({spec.num_requests} requests, {spec.concurrency} at a time, {spec.max_tokens[0]} tokens each), {args.adapters} adapters of rank {args.rank}:")
    print(f"base {rates['base']:.1f} tok/s, adapters {rates['adapters']:.1f} tok/s: adapters / base {ratio:.2f} (>= {TARGET}: {'PASS' if ratio >= TARGET else 'FAIL'})")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
