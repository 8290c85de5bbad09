"""The real default model through the engine and the paged KV cache: batched, chunked, joining
mid-batch, preempted when the block pool runs out, and reusing cached prefixes — greedy output
equals transformers' own forward for each prompt alone."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from models.files import local_folder
from models.prompt import PromptRenderer
from shared.deltas import Content, Finish
from shared.ir import Message, Protocol, Request, Role, SamplingParams, TextPart
from shared.settings import Settings
from workers.engine import Engine
from workers.runner import TorchRunner, load_model
from workers.scheduler import Sequence, StepPlan

pytestmark = [pytest.mark.model, pytest.mark.timeout(900)]  # slow on a loaded 2-core machine

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.", "What is 2+2? Explain."]


@pytest.fixture(scope="module")
def parts() -> tuple[PromptRenderer, object]:
    settings = Settings.from_env(os.environ)
    name, folder = local_folder(settings.model, settings.model_cache)
    renderer = PromptRenderer.load(folder, name=name, max_model_len=512)
    model = load_model(folder, device=torch.device("cpu"), dtype=torch.float32)
    return renderer, model


def request(renderer: PromptRenderer, i: int, max_tokens: int) -> Request:
    req = Request(
        id=f"q{i}",
        protocol=Protocol.OPENAI_CHAT,
        model="m",
        messages=(Message(role=Role.USER, content=(TextPart(text=QUESTIONS[i]),)),),
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    return replace(req, prompt_token_ids=tuple(renderer.render(req)))


def test_batched_chunked_generation_equals_generate_alone(parts: tuple[PromptRenderer, object]) -> None:
    renderer, model = parts
    runner = TorchRunner(model, max_len=512, kv_budget_mb=128, device=torch.device("cpu"), dtype=torch.float32)
    engine = Engine(runner, renderer.tokenizer, renderer.info, settings=Settings(max_running=4, max_tokens_per_step=24))
    requests = [request(renderer, i, max_tokens=20) for i in range(4)]
    tokens: dict[str, list[int]] = {r.id: [] for r in requests}
    for r in requests[:2]:
        engine.add(r)
    for step in range(200):
        if step == 3:
            for r in requests[2:]:
                engine.add(r)  # join while the first two decode
        for e in engine.step():
            if isinstance(e.delta, (Content, Finish)):
                tokens[e.request_id].extend(e.delta.token_ids)
        if not engine.has_work():
            break
    assert engine.stats.batch_peak == 4
    for r in requests:
        assert tokens[r.id] == greedy_alone(model, list(r.prompt_token_ids), 20), r.id


@torch.inference_mode()
def greedy_alone(model: object, prompt: list[int], n: int) -> list[int]:
    """Reference: transformers' own forward and its own DynamicCache, batch of one, never stopping at EOS."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)  # type: ignore[operator]
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(n - 1):
        out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)  # type: ignore[operator]
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_preemption_under_a_tiny_kv_budget_still_gives_every_request_its_exact_greedy_output(parts: tuple[PromptRenderer, object]) -> None:
    renderer, model = parts
    runner = TorchRunner(model, max_len=512, kv_budget_mb=4, device=torch.device("cpu"), dtype=torch.float32)
    assert runner.num_blocks == 5  # 80 tokens: one request of ~37 + 16 at a time, two only while short
    engine = Engine(runner, renderer.tokenizer, renderer.info, settings=Settings(max_running=8, max_tokens_per_step=64))
    requests = [replace(request(renderer, i, max_tokens=16), priority=3 - i) for i in range(4)]  # later arrivals outrank earlier ones
    tokens: dict[str, list[int]] = {r.id: [] for r in requests}
    pending = list(requests)
    for step in range(400):
        if pending and step % 4 == 0:
            engine.add(pending.pop(0))
        for e in engine.step():
            if isinstance(e.delta, (Content, Finish)):
                tokens[e.request_id].extend(e.delta.token_ids)
        if not engine.has_work() and not pending:
            break
    assert engine.scheduler.preemptions >= 2
    for r in requests:
        assert tokens[r.id] == greedy_alone(model, list(r.prompt_token_ids), 16), r.id


SYSTEM = "You are a careful assistant for a small bakery. " * 12


def test_prefix_cache_reuse_gives_the_exact_greedy_output_of_a_full_prefill(parts: tuple[PromptRenderer, object]) -> None:
    renderer, model = parts
    runner = TorchRunner(model, max_len=512, kv_budget_mb=64, device=torch.device("cpu"), dtype=torch.float32)
    engine = Engine(runner, renderer.tokenizer, renderer.info, settings=Settings(max_running=4, max_tokens_per_step=64))
    requests = []
    for i, question in enumerate(QUESTIONS[:3]):
        messages = (Message(role=Role.SYSTEM, content=(TextPart(text=SYSTEM),)), Message(role=Role.USER, content=(TextPart(text=question),)))
        req = Request(id=f"s{i}", protocol=Protocol.OPENAI_CHAT, model="m", messages=messages, sampling=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        requests.append(replace(req, prompt_token_ids=tuple(renderer.render(req))))
    tokens: dict[str, list[int]] = {r.id: [] for r in requests}
    cached: dict[str, int] = {}
    for r in requests:  # one after another: each later one finds the system prompt cached
        engine.add(r)
        while engine.has_work():
            for e in engine.step():
                if isinstance(e.delta, (Content, Finish)):
                    tokens[e.request_id].extend(e.delta.token_ids)
                if isinstance(e.delta, Finish):
                    cached[e.request_id] = e.delta.usage.cached_tokens
    assert cached["s0"] == 0 and cached["s1"] >= 96 and cached["s2"] >= 96
    for r in requests:
        assert tokens[r.id] == greedy_alone(model, list(r.prompt_token_ids), 12), r.id


@pytest.mark.parametrize("impl", ["hf", "lean"])
def test_a_cached_prefix_gives_the_bf16_logits_of_the_same_prompt_computed_whole(impl: str) -> None:
    """What `met replay` and n seeded choices rely on, in the dtype the server runs: a prompt whose
    prefix blocks come from the cache (its last chunk shorter) gets, bit for bit, the logits it got
    when only the shared template prefix was cached. Whole-block key reads on the hf path broke this."""
    settings = Settings.from_env(os.environ)
    name, folder = local_folder(settings.model, settings.model_cache)
    renderer = PromptRenderer.load(folder, name=name, max_model_len=512)
    model = load_model(folder, device=torch.device("cpu"), dtype=torch.bfloat16)
    runner = TorchRunner(model, max_len=512, kv_budget_mb=64, device=torch.device("cpu"), dtype=torch.bfloat16, model_impl=impl)
    logits: dict[str, list[torch.Tensor]] = {}
    forward = runner.forward

    def recording(plan: StepPlan) -> tuple[list[Sequence], torch.Tensor]:
        rows, out = forward(plan)
        for seq, row in zip(rows, out, strict=True):
            logits.setdefault(seq.request.id, []).append(row.clone())
        return rows, out

    runner.forward = recording  # type: ignore[method-assign]
    # one row per token a step (speculative decoding's draft rows would record guesses the model then refused)
    engine = Engine(runner, renderer.tokenizer, renderer.info, settings=Settings(max_running=4, max_tokens_per_step=512, speculative="off"))
    cached: dict[str, int] = {}
    for rid, text in (("other", "Name a colour."), ("first", "Say hello in French."), ("again", "Say hello in French.")):
        req = Request(id=rid, protocol=Protocol.OPENAI_CHAT, model="m", messages=(Message(role=Role.USER, content=(TextPart(text=text),)),), sampling=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        engine.add(replace(req, prompt_token_ids=tuple(renderer.render(req))))
        while engine.has_work():
            for e in engine.step():
                if isinstance(e.delta, Finish):
                    cached[e.request_id] = e.delta.usage.cached_tokens
    assert 0 < cached["first"] < cached["again"]  # the template prefix, then the whole prompt's full blocks
    assert len(logits["first"]) == len(logits["again"]) == 16
    for step, (a, b) in enumerate(zip(logits["first"], logits["again"], strict=True)):
        assert torch.equal(a, b), (step, float((a - b).abs().max()))
