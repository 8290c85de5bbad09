"""Per-decode-step profile of the worker, in one process: where a step's time goes, per model path.

For each model path (`--impl lean,hf`) and decode batch size (`--batch 1,8,32`): `batch` greedy
requests are prefilled, then `--steps` decode steps are timed phase by phase, exactly as the worker
runs them (the engine's own scheduler, runner and text state):
- forward     runner.forward: the step's model work up to float32 logits (CUDA synchronized)
- sampler     runner.sample: logits → tokens
- detok       the engine turning tokens into deltas (incremental detokenization, stop matching)
- redis       the deltas encoded (shared.codec) and XADDed, one pipeline per step, to a local Redis
              (the embedded redis-server of `met serve`); a plain XADD, not the worker's fenced Lua
              script, so a lower bound of the real write
- encode      the API side: each stored delta decoded and turned into OpenAI chat SSE bytes
Prints the median ms per step of each phase and the decode tok/s the whole step allows. `--draft 0,4,8`:
each sequence checks k guessed tokens a step (speculative decoding's draft rows, `workers.scheduler.Draft`;
lean path only) — what a step with k more rows per sequence costs; tok/s then assumes one token a step.

Models: `--model smollm2` (the default model, from the local cache) or random weights of a Llama
shape (`--random tiny` ≈ 1M parameters for a CPU check, `--random 1b`: hidden 2048, 16 layers,
32 heads / 8 KV heads, SmolLM2's vocabulary, ≈1.1B parameters — the GPU mode, e.g.
`python bench/step_profile.py --random 1b --device cuda --dtype bfloat16 --batch 1,16,64`).

    python bench/step_profile.py [--model smollm2 | --random tiny|1b] [--device cpu|cuda] [--dtype bfloat16]
                                 [--impl lean,hf] [--batch 1,8,32] [--prompt-len 64] [--steps 32] [--no-redis]
                                 [--temperature 0.2 --top-p 0.9]  (sampled rows: the sampler phase; default greedy)
                                 [--malloc-default]  (glibc's malloc untuned, unlike the worker)
                                 [--draft 0,8]  (k guessed rows per sequence: the step cost of speculative decoding)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout, not the installed one

import torch

from encoders.openai_chat import ChatStreamEncoder
from models.prompt import ModelInfo
from shared import keys
from shared.codec import decode_delta, encode_delta
from shared.ir import Message, Protocol, Request, Role, SamplingParams, TextPart
from shared.settings import Settings
from workers.engine import Engine
from workers.main import keep_freed_memory
from workers.runner import TorchRunner, _ahead, pick_dtype
from workers.scheduler import Draft, StepPlan

PHASES = ("forward", "sampler", "detok", "redis", "encode")
SHAPES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8},
}


@dataclass(frozen=True, slots=True)
class Loaded:
    model: Any
    tokenizer: Any
    info: ModelInfo
    label: str


class IdTokenizer:
    """Stands in when no real tokenizer is at hand (a bare GPU machine): '<id>' per token."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def load(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Loaded:
    from models.files import local_folder

    settings = Settings.from_env(os.environ)
    tokenizer: Any = None
    try:
        from transformers import AutoTokenizer

        _name, folder = local_folder("smollm2", settings.model_cache)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # a bare machine has no model cache: fall back and say so
        print(f"(no SmolLM2 tokenizer here: {type(exc).__name__}; detokenizing with '<id>' strings)")
        folder = None
    if args.random is None:
        from workers.runner import load_model

        assert folder is not None, "--model smollm2 needs the model in the local cache"
        model = load_model(folder, device=device, dtype=dtype)
        return Loaded(model, tokenizer, ModelInfo(name="smollm2", max_model_len=2048, eos_token_ids=(), sampling_defaults={}), "SmolLM2-135M")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=4096, **SHAPES[args.random])
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    params = sum(p.numel() for p in model.parameters()) / 1e9
    return Loaded(model, tokenizer or IdTokenizer(), ModelInfo(name="random", max_model_len=4096, eos_token_ids=(), sampling_defaults={}), f"random {args.random} ({params:.2f}B)")


def requests(batch: int, prompt_len: int, steps: int, *, temperature: float = 0.0, top_p: float | None = None) -> list[Request]:
    out = []
    for i in range(batch):
        prompt = tuple((i * 131 + k * 7) % 20000 + 100 for k in range(prompt_len))
        sampling = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=steps + 64, ignore_eos=True)
        req = Request(id=f"p{i}", protocol=Protocol.OPENAI_CHAT, model="m", messages=(Message(role=Role.USER, content=(TextPart(text="x"),)),), sampling=sampling, prompt_token_ids=prompt)
        out.append(req)
    return out


def profile(loaded: Loaded, *, impl: str, batch: int, args: argparse.Namespace, redis: Any, variant: tuple[str, int] = ("none", 0)) -> dict[str, float]:
    """`variant`: (quantization, k guessed rows per sequence)."""
    quantization, draft = variant
    device, dtype = torch.device(args.device), pick_dtype(args.dtype)
    runner = TorchRunner(loaded.model, max_len=4096, kv_budget_mb=args.kv_mb, device=device, dtype=dtype, model_impl=impl).quantize(quantization)
    settings = Settings(max_running=batch, max_tokens_per_step=max(512, batch * (draft + 1)), speculative="off")  # drafts: forced below
    engine = Engine(runner, loaded.tokenizer, loaded.info, settings=settings)
    reqs = requests(batch, args.prompt_len, args.steps, temperature=args.temperature, top_p=args.top_p)
    encoders = {r.id: ChatStreamEncoder(r) for r in reqs}
    for r in reqs:
        engine.add(r)
    while any(not s.prefilled for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (and the first decodes), untimed
    for _ in range(2):
        engine.step()  # warm-up decode steps
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.steps):
        plan = engine.scheduler.schedule()
        assert not plan.prefill and len(plan.decode) == batch
        plan = _drafted(engine, plan, draft)
        t0 = time.perf_counter()
        rows, logits = runner.forward(plan)
        sync()
        t1 = time.perf_counter()
        sampled = runner.sample(rows, logits, _ahead(len(rows), plan.verify))
        t2 = time.perf_counter()
        engine.scheduler.advance(plan)
        emissions = _emissions(engine, plan, sampled)
        t3 = time.perf_counter()
        stored = [(e.request_id, encode_delta(e.delta)) for e in emissions]
        if redis is not None:
            pipe = redis.pipeline(transaction=False)
            for rid, raw in stored:
                pipe.xadd(keys.delta_stream(rid), {"d": raw})
            pipe.execute()
        t4 = time.perf_counter()
        for rid, raw in stored:
            for frame in encoders[rid].feed(decode_delta(raw)):
                frame.to_sse()
        t5 = time.perf_counter()
        for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            times[phase].append(seconds * 1e3)
    for r in reqs:
        engine.discard(r.id)
    return {p: statistics.median(v) for p, v in times.items()}


def _drafted(engine: Engine, plan: StepPlan, draft: int) -> StepPlan:
    """The decode plan with k guesses per sequence (the prompt's own tokens: mostly wrong, so a step keeps one token)."""
    if not draft:
        return plan
    for seq in plan.decode:
        assert engine.scheduler._reserve(seq, seq.computed + 1 + draft)
    return StepPlan(verify=tuple(Draft(seq, tuple(seq.prompt[:draft])) for seq in plan.decode))


def _emissions(engine: Engine, plan: StepPlan, sampled: list[Any]) -> list[Any]:
    """The engine's own per-token path (a draft's: `Engine._verify`)."""
    if plan.verify:
        return [e for d in plan.verify for e in engine._verify(d, [s for s in sampled if s.seq is d.seq])]
    return [e for s in sampled for e in engine._append(s)]


def local_redis(enabled: bool) -> tuple[Any, Any]:
    if not enabled:
        return None, None
    from redis import Redis

    from cli.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis(tempfile.mkdtemp(prefix="step-profile-"))
    url = server.start()
    return server, Redis.from_url(url)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=("smollm2",))
    parser.add_argument("--random", choices=tuple(SHAPES), default=None, help="random weights of this Llama shape instead of --model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--impl", default="lean,hf")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--kv-mb", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's (default greedy); e.g. 0.2 with --top-p 0.9, SmolLM2's own defaults")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--malloc-default", action="store_true", help="leave glibc's malloc as it is (the worker tunes it: workers.main.keep_freed_memory)")
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--draft", default="0", help="comma-separated k: guessed rows per sequence a step (speculative decoding; lean only)")
    parser.add_argument("--quantization", default="none", help="comma-separated: none, auto, int4 (workers.quant); a quantized run loads its own copy")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), pick_dtype(args.dtype)
    loaded = load(args, device, dtype)
    kept = False if args.malloc_default else keep_freed_memory()  # as the worker does after its load
    server, redis = local_redis(not args.no_redis)
    load1, load5, _ = os.getloadavg()
    print(f"{loaded.label} on {device} {args.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads, freed memory {'kept' if kept else 'given back'}, load average {load1:.2f} {load5:.2f}")
    print(f"{'impl':10} {'batch':>5} " + " ".join(f"{p + ' ms':>11}" for p in PHASES) + f" {'step ms':>9} {'tok/s':>8}")
    try:
        for quantization in args.quantization.split(","):
            for impl in args.impl.split(","):
                for batch, draft in ((int(b), int(k)) for b in args.batch.split(",") for k in args.draft.split(",")):
                    if draft and impl != "lean":
                        continue
                    model = loaded if quantization == "none" else load(args, device, dtype)  # quantizing rewrites the model's modules
                    ms = profile(model, impl=impl, batch=batch, args=args, redis=redis, variant=(quantization, draft))
                    total = sum(ms.values())
                    label = (impl if quantization == "none" else f"{impl}+{quantization}") + (f" k{draft}" if draft else "")
                    print(f"{label:10} {batch:>5} " + " ".join(f"{ms[p]:>11.2f}" for p in PHASES) + f" {total:>9.2f} {batch * 1e3 / total:>8.1f}", flush=True)
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
