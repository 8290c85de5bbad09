"""Reasoning spans in the worker: a tiny random Qwen3 (tests/thinking_model.py) whose template opens
`<think>` in the prompt. Its output is noise, so it never closes a span by itself: whatever ends the
span is the budget, and whatever answer comes out is the grammar's doing."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.prompt import PromptRenderer
from models.reasoning import budget_for, think_format
from shared.deltas import Content, Finish, FinishReason, Reasoning
from shared.ir import Constraint, ConstraintKind, Message, Protocol, Request, Role, SamplingParams, TextPart, Thinking
from shared.seal import Sealer, new_key
from shared.settings import Settings
from tests.thinking_model import build_thinking_model
from workers.engine import Emission, Engine
from workers.reasoning import Channel, ReasoningSpan
from workers.runner import TorchRunner

ANSWER = "The answer is 42."


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> PromptRenderer:
    folder = build_thinking_model(tmp_path_factory.mktemp("thinking"))
    return PromptRenderer.load(folder, name="thinking")


@pytest.fixture(scope="module")
def model(renderer: PromptRenderer, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = Path(renderer.tokenizer.name_or_path)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def make_engine(model: Any, renderer: PromptRenderer, **settings: Any) -> Engine:
    runner = TorchRunner(model, max_len=512, kv_budget_mb=16, device=torch.device("cpu"), dtype=torch.float32)
    runner.eos_ids = renderer.info.eos_token_ids
    engine = Engine(runner, renderer.tokenizer, renderer.info, settings=Settings(max_running=4, max_tokens_per_step=256, **settings))
    engine.sealer = Sealer(new_key())
    return engine


def ask(renderer: PromptRenderer, rid: str, *, thinking: Thinking, max_tokens: int = 64, constraint: Constraint | None = None) -> Request:
    request = Request(
        id=rid,
        protocol=Protocol.OPENAI_CHAT,
        model="thinking",
        messages=(Message(role=Role.USER, content=(TextPart(text="What is six times seven?"),)),),
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens),
        thinking=thinking,
        constraint=constraint,
    )
    return Request(**{**{f: getattr(request, f) for f in request.__slots__}, "prompt_token_ids": tuple(renderer.render(request))})  # type: ignore[attr-defined]


def run(engine: Engine, request: Request, *, resume: tuple[int, ...] = ()) -> list[Emission]:
    out = engine.add(request, resume=resume)
    while engine.has_work():
        out += engine.step()
    return out


def regex(pattern: str) -> Constraint:
    return Constraint(kind=ConstraintKind.REGEX, text=pattern, param="response_format")


def test_a_budget_of_16_ends_the_span_at_16_reasoning_tokens_then_the_answer_follows(model: Any, renderer: PromptRenderer) -> None:
    engine = make_engine(model, renderer)
    out = run(engine, ask(renderer, "b16", thinking=Thinking(budget_tokens=16), constraint=regex(re.escape(ANSWER))))
    deltas = [e.delta for e in out]
    reasoning = [d for d in deltas if isinstance(d, Reasoning)]
    finish = deltas[-1]
    assert isinstance(finish, Finish) and finish.reason is FinishReason.STOP
    assert finish.usage.reasoning_tokens == 16
    assert sum(len(d.token_ids) for d in reasoning if d.text) <= 16 + 1  # the span's tokens (the first rides with its text)
    assert "".join(d.text for d in deltas if isinstance(d, Content)) == ANSWER
    # The prefix-cache count opens the stream on a text-less Content (shared.deltas.Content), then reasoning, then the answer.
    assert deltas[0] == Content(text="", attempt=1, cached_tokens=0)
    first_answer = next(i for i, d in enumerate(deltas) if isinstance(d, Content) and d.text)
    assert all(isinstance(d, Reasoning) for d in deltas[1:first_answer])
    sealed = [d.sealed for d in reasoning if d.sealed]
    assert len(sealed) == 1 and engine.sealer is not None
    assert engine.sealer.open(sealed[0]) == "".join(d.text for d in reasoning)
    assert sum(len(d.token_ids) for d in deltas) == finish.usage.completion_tokens  # every token in exactly one delta


def test_without_a_budget_the_noise_model_reasons_until_max_tokens(model: Any, renderer: PromptRenderer) -> None:
    out = run(make_engine(model, renderer), ask(renderer, "nob", thinking=Thinking(), max_tokens=40))
    finish = out[-1].delta
    assert isinstance(finish, Finish) and finish.reason is FinishReason.LENGTH
    assert finish.usage.reasoning_tokens == 40
    assert not any(isinstance(e.delta, Content) and (e.delta.text or e.delta.token_ids) for e in out)


def test_effort_maps_to_a_budget_capped_by_max_thinking_tokens(model: Any, renderer: PromptRenderer) -> None:
    assert budget_for(Thinking(effort="low")) == 1024
    assert budget_for(Thinking(effort="low"), cap=8) == 8
    assert budget_for(Thinking(enabled=False, budget_tokens=500)) == 0
    assert budget_for(Thinking()) is None
    out = run(make_engine(model, renderer, max_thinking_tokens=8), ask(renderer, "cap", thinking=Thinking(effort="high"), constraint=regex("ok")))
    finish = out[-1].delta
    assert isinstance(finish, Finish) and finish.usage.reasoning_tokens == 8
    assert "".join(e.delta.text for e in out if isinstance(e.delta, Content)) == "ok"


def test_thinking_disabled_renders_a_closed_span_and_answers_at_once(model: Any, renderer: PromptRenderer) -> None:
    request = ask(renderer, "off", thinking=Thinking(enabled=False), constraint=regex("ok"))
    assert renderer.tokenizer.decode(request.prompt_token_ids).endswith("<think>\n\n</think>\n\n")
    out = run(make_engine(model, renderer), request)
    assert [type(e.delta) for e in out] == [Content, Finish]
    assert out[-1].delta.usage.reasoning_tokens == 0  # type: ignore[union-attr]


def test_a_resumed_attempt_continues_the_span_and_its_budget_where_the_first_stopped(model: Any, renderer: PromptRenderer) -> None:
    request = ask(renderer, "res", thinking=Thinking(budget_tokens=12), constraint=regex(re.escape(ANSWER)))
    whole = run(make_engine(model, renderer), request)
    tokens = [t for e in whole for t in e.delta.token_ids]
    for cut in (5, 13, 15):  # inside the span, on the forced close, inside the answer
        resumed = run(make_engine(model, renderer), request, resume=tuple(tokens[:cut]))
        rest = [t for e in resumed for t in e.delta.token_ids]
        assert tokens[:cut] + rest == tokens, cut
        finish = resumed[-1].delta
        assert isinstance(finish, Finish) and finish.usage.reasoning_tokens == 12


def test_a_model_that_opens_its_own_span_is_routed_and_a_plain_answer_is_not() -> None:
    fmt = think_format(_Markers(), "qwen3")
    assert fmt is not None
    span = ReasoningSpan(fmt, prompt=(1, 2), budget=None)
    assert [span.route(t) for t in (fmt.start_id, 7, 8, fmt.end_id, 9)] == [Channel.MARKER, Channel.REASONING, Channel.REASONING, Channel.MARKER, Channel.ANSWER]
    plain = ReasoningSpan(fmt, prompt=(1, 2), budget=None)
    assert [plain.route(t) for t in (7, fmt.start_id)] == [Channel.ANSWER, Channel.ANSWER]
    r1 = ReasoningSpan(think_format(_Markers(), "deepseek_r1"), prompt=(1, 2), budget=2)  # type: ignore[arg-type]
    assert [r1.route(t) for t in (7, 8)] == [Channel.REASONING, Channel.REASONING] and r1.forced == [fmt.end_id, 10]


class _Markers:
    chat_template = "<think>"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return {"<think>": [100], "</think>": [101], "\n\n": [10]}[text]
