"""Prompt logprobs: the scorer against the real default model's own forward over each prefix, and the
engine writing them once, first, on a text-less Content delta."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from models.files import local_folder
from shared.deltas import Content, Error, Finish
from shared.settings import Settings
from workers import prompt_logprobs
from workers.engine import Engine
from workers.prompt_logprobs import score_prompt
from workers.runner import TorchRunner, load, load_model

from .fakes import INFO, ByteTokenizer, ScriptedRunner, make_request


@pytest.fixture(scope="module")
def model() -> Any:
    settings = Settings.from_env(os.environ)
    _, folder = local_folder(settings.model, settings.model_cache)
    return load_model(folder, device=torch.device("cpu"), dtype=torch.float32)


@pytest.mark.model
@pytest.mark.parametrize("path", ["hf", "lean"])
@pytest.mark.parametrize("chunk", [512, 2], ids=["one chunk", "chunked"])
def test_each_position_scores_its_token_after_the_tokens_before_it(model: Any, chunk: int, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against transformers' forward over each prefix alone: the hf path's scorer, and the lean path's
    (`TorchRunner.score_prompt`: its own forward, CHUNK positions at a time, on weights read directly)."""
    monkeypatch.setattr(prompt_logprobs, "CHUNK", chunk)
    prompt = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    if path == "hf":
        scored = score_prompt(model, prompt, 3, device=torch.device("cpu"))
    else:
        settings = Settings.from_env(os.environ)
        folder = local_folder(settings.model, settings.model_cache)[1]
        _, lean, config = load(folder, device=torch.device("cpu"), dtype=torch.float32, model_impl="auto", max_len=64)
        assert lean is not None
        scored = TorchRunner(None, lean=lean, config=config, max_len=64, kv_budget_mb=8, device=torch.device("cpu"), dtype=torch.float32).score_prompt(prompt, 3)
    assert len(scored) == len(prompt) - 1
    for i, (logprob, top) in enumerate(scored, start=1):
        with torch.inference_mode():
            alone = model(input_ids=torch.tensor([prompt[:i]])).logits[0, -1].log_softmax(-1)  # the prefix by itself
        assert logprob == pytest.approx(alone[prompt[i]].item(), abs=1e-4)
        best = alone.topk(3)
        assert [t for t, _ in top] == best.indices.tolist() and [v for _, v in top] == pytest.approx(best.values.tolist(), abs=1e-4)


def engine_with_scorer(calls: list[tuple[list[int], int]]) -> Engine:
    engine = Engine(ScriptedRunner(lambda seq: "ok"), ByteTokenizer(), INFO, settings=Settings())

    def scorer(prompt: list[int], top: int) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
        calls.append((prompt, top))
        return [(-1.0 * i, ((prompt[i], -1.0 * i), (99, -9.0))[:top]) for i in range(1, len(prompt))]

    engine.score_prompt = scorer
    return engine


def test_the_engine_writes_prompt_logprobs_first_on_admission_and_not_on_a_resume() -> None:
    calls: list[tuple[list[int], int]] = []
    engine = engine_with_scorer(calls)
    first = engine.add(make_request("a", prompt_len=3, prompt_logprobs=1), attempt=2)
    assert calls == [([1, 2, 3], 1)]
    assert len(first) == 1 and isinstance(first[0].delta, Content) and first[0].delta.text == "" and first[0].delta.token_ids == ()
    entries = first[0].delta.prompt_logprobs
    assert [(e.token, e.token_id, e.logprob) for e in entries] == [("\x00", 1, 0.0), ("\x01", 2, -1.0), ("\x02", 3, -2.0)]
    assert entries[1].top == (("\x01", 2, -1.0),) and first[0].delta.attempt == 2
    assert engine.add(make_request("b", prompt_len=3, prompt_logprobs=1), resume=(112,)) == [] and len(calls) == 1
    assert engine.add(make_request("c", prompt_len=3)) == [] and len(calls) == 1  # not asked


def test_a_request_asking_on_a_worker_without_a_scorer_ends_with_an_error() -> None:
    engine = Engine(ScriptedRunner(lambda seq: "ok"), ByteTokenizer(), INFO, settings=Settings())
    out = engine.add(make_request("a", prompt_len=3, prompt_logprobs=0))
    assert len(out) == 1 and isinstance(out[0].delta, Error) and not engine.has_work()


def test_generation_goes_on_after_the_prompt_logprobs() -> None:
    engine = engine_with_scorer([])
    engine.add(make_request("a", prompt_len=3, prompt_logprobs=0))
    text, finish = [], None
    for _ in range(20):
        for e in engine.step():
            if isinstance(e.delta, Content):
                text.append(e.delta.text)
            finish = e.delta if isinstance(e.delta, Finish) else finish
    assert "".join(text) == "ok" and finish is not None
