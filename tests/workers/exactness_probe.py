"""Run by `test_exactness.py` in a child process (oneDNN reads ONEDNN_MAX_CPU_ISA once per process):
the default model in bf16 on the lean path, as the server runs it, one greedy request computed four
ways — cold, with its prefix from the cache, with its prompt cut into 7-token chunks, and resumed
after 20 tokens (the way a worker picks up a crashed attempt) — next to a batch-mate; and with speculative
decoding (`--speculative ngram`) against without it: the same request cold and resumed, a request that
copies text from its prompt (where guesses are right), with a stop string, under a JSON schema, and seeded
sampling. Prints one JSON line: each way's tokens, cached tokens, the guesses checked and kept, and the
kernels' choices."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import torch

from models.files import local_folder
from models.prompt import PromptRenderer
from shared.deltas import Content, Finish
from shared.ir import Constraint, ConstraintKind, Message, Protocol, Request, Role, SamplingParams, TextPart
from shared.settings import Settings
from workers import kernels
from workers.engine import Engine
from workers.runner import TorchRunner, load

MAX_TOKENS = 40
SYSTEM = "You are a careful storyteller. Keep to the facts the user gives and write plainly. " * 4
CODE = "def area(r):\n    return 3.14159 * r * r\n\n\ndef volume(r, h):\n    return area(r) * h\n\n\nprint(volume(2, 3))\n"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "colours": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "colours"]}


def main() -> None:
    settings = Settings.from_env(os.environ)
    name, folder = local_folder(settings.model, settings.model_cache)
    renderer = PromptRenderer.load(folder, name=name, max_model_len=1024)
    model, lean, config = load(folder, device=torch.device("cpu"), dtype=torch.bfloat16, model_impl="lean", max_len=1024)  # as a worker loads it

    def request(rid: str, text: str, **sampling: object) -> Request:
        messages = (Message(role=Role.SYSTEM, content=(TextPart(text=SYSTEM),)), Message(role=Role.USER, content=(TextPart(text=text),)))
        params = replace(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), **sampling)  # type: ignore[arg-type]
        req = Request(id=rid, protocol=Protocol.OPENAI_CHAT, model="m", messages=messages, sampling=params)
        return replace(req, prompt_token_ids=tuple(renderer.render(req)))

    def engine(step_budget: int = 512, prefix_cache: bool = True, speculative: str = "off") -> Engine:
        runner = TorchRunner(model, lean=lean, config=config, max_len=1024, kv_budget_mb=64, device=torch.device("cpu"), dtype=torch.bfloat16, model_impl="lean")
        settings = Settings(max_running=8, max_tokens_per_step=step_budget, prefix_cache=prefix_cache, speculative=speculative)
        return Engine(runner, renderer.tokenizer, renderer.info, settings=settings)

    guesses = {"proposed": 0, "accepted": 0}

    def both(req: Request, resume: tuple[int, ...] = ()) -> list[list[int]]:
        """The request's tokens without and with speculative decoding."""
        off = run(engine(), req, resume=resume)[req.id][0]
        spec = engine(speculative="ngram")
        on = run(spec, req, resume=resume)[req.id][0]
        figures = spec.figures()
        guesses["proposed"] += int(figures["spec_proposed"])
        guesses["accepted"] += int(figures["spec_accepted"])
        return [list(resume) + off, list(resume) + on]

    def run(eng: Engine, *reqs: Request, resume: tuple[int, ...] = ()) -> dict[str, tuple[list[int], int]]:
        out: dict[str, tuple[list[int], int]] = {r.id: ([], 0) for r in reqs}
        for r in reqs:
            eng.add(r, resume=resume)
        while eng.has_work():
            for e in eng.step():
                if isinstance(e.delta, (Content, Finish)):
                    out[e.request_id][0].extend(e.delta.token_ids)
                if isinstance(e.delta, Finish):
                    out[e.request_id] = (out[e.request_id][0], e.delta.usage.cached_tokens)
        return out

    story = "Write a long story about a lighthouse."
    shared = engine()
    cold = run(shared, request("cold", story))["cold"]
    cached = run(shared, request("cached", story))["cached"]
    chunked = run(engine(step_budget=7, prefix_cache=False), request("chunked", story))["chunked"]
    resumed_tail = run(engine(), request("resumed", story), resume=tuple(cold[0][:20]))["resumed"]
    mates = run(engine(), request("mate", story), request("other", "Name three colours and a fruit."), request("third", "Count to twenty."))["mate"]
    copy = f"Repeat this code exactly, with 3.14159 written as 3.1416:\n\n{CODE}"
    speculative = {
        "story": both(request("story", story)),
        "story_resumed": both(request("story", story), resume=tuple(cold[0][:20])),
        "copy": both(request("copy", copy, max_tokens=80)),
        "copy_stop": both(request("stop", copy, max_tokens=80, stop=("volume",), ignore_eos=False)),
        "schema": both(replace(request("schema", "Describe a cat as JSON.", max_tokens=60, ignore_eos=False), constraint=Constraint(kind=ConstraintKind.JSON_SCHEMA, text=json.dumps(SCHEMA), param="response_format"))),
        "seeded": both(request("seeded", copy, max_tokens=60, temperature=0.7, seed=11)),
    }
    print(json.dumps({
        "isa": kernels.onednn_isa(),
        "kernels": kernels.describe(),
        "cold": cold, "cached": cached, "chunked": chunked,
        "resumed": [cold[0][:20] + resumed_tail[0], resumed_tail[1]],
        "batched": mates,
        "speculative": speculative,
        "guesses": guesses,
    }))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
