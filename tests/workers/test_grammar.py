"""Constrained decoding in the worker: a tiny random-init Llama over the real SmolLM2 tokenizer (its
output is noise, so whatever valid output comes out is the grammar's doing). Constrained rows always
match; unconstrained batch-mates are untouched; the matcher follows resume and preemption; a dead end
or an uncompilable grammar ends that request alone with one Error."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from typing import Any

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from models.files import local_folder
from models.grammar import Grammars, constraint_grammar
from models.prompt import ModelInfo
from shared.deltas import Content, Error, Finish, FinishReason
from shared.ir import Constraint, ConstraintKind, Message, Protocol, Request, Role, SamplingParams, TextPart
from shared.settings import Settings
from workers.engine import Emission, Engine
from workers.runner import TorchRunner
from workers.sampling import SamplerRow, process_logits, sample
from workers.scheduler import Sampled, Sequence, StepPlan

SCHEMA = {
    "type": "object",
    "properties": {"size": {"enum": ["S", "M", "L"]}, "count": {"type": "integer", "minimum": 1, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["size", "count", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def info(tokenizer: Any) -> ModelInfo:
    return ModelInfo(name="tiny", max_model_len=256, eos_token_ids=(tokenizer.eos_token_id,), sampling_defaults={})


@pytest.fixture(scope="module")
def tiny(tokenizer: Any) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(config).eval()


def ask(rid: str, constraint: Constraint | None = None, *, priority: int = 0, **sampling: Any) -> Request:
    params = replace(SamplingParams(temperature=0.0, max_tokens=48), **sampling)
    return Request(
        id=rid,
        protocol=Protocol.OPENAI_CHAT,
        model="tiny",
        messages=(Message(role=Role.USER, content=(TextPart(text="x"),)),),
        sampling=params,
        constraint=constraint,
        priority=priority,
        prompt_token_ids=(1, 520, 3210, 28, 2, 198),
    )


def schema(value: dict[str, Any]) -> Constraint:
    return Constraint(kind=ConstraintKind.JSON_SCHEMA, text=json.dumps(value), param="response_format")


def make_engine(tiny: LlamaForCausalLM, tokenizer: Any, info: ModelInfo, *, slots: int = 8) -> Engine:
    runner = TorchRunner(tiny, max_len=256, kv_budget_mb=16, device=torch.device("cpu"), dtype=torch.float32)
    runner.eos_ids = info.eos_token_ids
    return Engine(runner, tokenizer, info, settings=Settings(max_running=slots, max_tokens_per_step=256))


def drain(engine: Engine, emissions: list[Emission] | None = None) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for e in emissions or []:
        out.setdefault(e.request_id, []).append(e.delta)
    for _ in range(400):
        if not engine.has_work():
            return out
        for e in engine.step():
            out.setdefault(e.request_id, []).append(e.delta)
    raise AssertionError("did not finish")


def text_of(deltas: list[Any]) -> str:
    return "".join(d.text for d in deltas if isinstance(d, Content))


def tokens_of(deltas: list[Any]) -> list[int]:
    return [t for d in deltas if isinstance(d, (Content, Finish)) for t in d.token_ids]


def test_constrained_rows_match_their_grammar_and_free_rows_are_untouched(tiny: LlamaForCausalLM, tokenizer: Any, info: ModelInfo) -> None:
    alone = drain(engine := make_engine(tiny, tokenizer, info), [e for e in engine.add(ask("free", ignore_eos=True, max_tokens=24))])
    engine = make_engine(tiny, tokenizer, info)
    engine.add(ask("json", schema(SCHEMA)))
    engine.add(ask("free", ignore_eos=True, max_tokens=24))
    engine.add(ask("regex", Constraint(kind=ConstraintKind.REGEX, text=r"[0-9]{3}-[a-z]{2}", param="regex")))
    engine.add(ask("choice", Constraint(kind=ConstraintKind.CHOICE, choices=("red", "green", "blue"), param="choice")))
    out = drain(engine)
    jsonschema.validate(json.loads(text_of(out["json"])), SCHEMA)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text_of(out["regex"]))
    assert text_of(out["choice"]) in ("red", "green", "blue")
    for rid in ("json", "regex", "choice"):
        assert out[rid][-1].reason is FinishReason.STOP
    assert tokens_of(out["free"]) == tokens_of(alone["free"])  # the same greedy tokens as alone in the batch
    assert engine.runner.masked_steps > 0  # type: ignore[attr-defined]


def test_a_resumed_attempt_replays_the_emitted_tokens_into_the_matcher(tiny: LlamaForCausalLM, tokenizer: Any, info: ModelInfo) -> None:
    whole = drain(engine := make_engine(tiny, tokenizer, info), engine.add(ask("j", schema(SCHEMA))))["j"]
    emitted = tokens_of(whole)
    engine = make_engine(tiny, tokenizer, info)
    resumed = drain(engine, engine.add(ask("j", schema(SCHEMA)), attempt=2, resume=tuple(emitted[:5])))["j"]
    assert emitted[:5] + tokens_of(resumed) == emitted
    assert all(d.attempt == 2 for d in resumed)


def test_a_preempted_constrained_sequence_keeps_its_matcher(tiny: LlamaForCausalLM, tokenizer: Any, info: ModelInfo) -> None:
    expected = text_of(drain(engine := make_engine(tiny, tokenizer, info, slots=1), engine.add(ask("low", schema(SCHEMA), priority=5)))["low"])
    engine = make_engine(tiny, tokenizer, info, slots=1)
    engine.add(ask("low", schema(SCHEMA), priority=5))
    early: list[Any] = [e.delta for _ in range(4) for e in engine.step()]
    engine.add(ask("high", priority=0, max_tokens=4, ignore_eos=True))
    rest = drain(engine)
    assert engine.scheduler.preemptions == 1
    assert text_of([*early, *rest["low"]]) == expected
    jsonschema.validate(json.loads(expected), SCHEMA)


class RefusedTokenRunner:
    """Ignores every mask: emits token `forced` for request "bad", EOS for the others (a dead end)."""

    def __init__(self, forced: int, eos: int) -> None:
        self.forced, self.eos = forced, eos
        self.num_blocks, self.block_size, self.max_len = 64, 16, 256

    def execute(self, plan: StepPlan) -> list[Sampled]:
        ready = list(plan.decode) + [c.seq for c in plan.prefill if c.completes_prompt]
        return [Sampled(seq, self.forced if seq.key == "bad" else self.eos) for seq in ready]

    def release(self, seq: Sequence) -> None:
        pass


def test_a_refused_token_ends_that_request_with_one_error_and_the_batch_goes_on(tokenizer: Any, info: ModelInfo) -> None:
    letter = tokenizer.encode("x")[0]  # a JSON object cannot start with "x"
    engine = Engine(RefusedTokenRunner(letter, info.eos_token_ids[0]), tokenizer, info, settings=Settings())
    engine.add(ask("bad", schema(SCHEMA)))
    engine.add(ask("good"))
    out = drain(engine)
    assert len(out["bad"]) == 1 and isinstance(out["bad"][0], Error) and "dead end" in out["bad"][0].message
    assert isinstance(out["good"][-1], Finish) and out["good"][-1].reason is FinishReason.STOP


def test_a_grammar_that_does_not_compile_is_one_error_from_add(tiny: LlamaForCausalLM, tokenizer: Any, info: ModelInfo) -> None:
    engine = make_engine(tiny, tokenizer, info)
    [emission] = engine.add(ask("broken", Constraint(kind=ConstraintKind.LARK, text="start: nowhere", param="grammar")))
    assert isinstance(emission.delta, Error) and "nowhere" in emission.delta.message
    assert not engine.has_work() and engine.active_ids() == []


def test_the_compiled_grammar_cache_is_bounded_and_reused(tokenizer: Any, info: ModelInfo) -> None:
    grammars = Grammars.for_model(tokenizer, info.eos_token_ids)
    grammars.cache_size = 2
    texts = [constraint_grammar(Constraint(kind=ConstraintKind.CHOICE, choices=(c,))) for c in "abc"]
    for text in [*texts, texts[2], texts[1]]:
        assert not grammars.matcher(text).is_error()
    assert grammars.cached == 2 and grammars.compiles == 3  # "c" and "b" were reused from the cache


def test_rows_without_a_matcher_do_no_mask_work(tokenizer: Any, info: ModelInfo) -> None:
    logits = torch.randn(2, len(tokenizer))
    free = SamplerRow(params=SamplingParams(temperature=0.0))
    assert sample(logits, [free, free]).mask_s == 0.0
    matcher = Grammars.for_model(tokenizer, info.eos_token_ids).matcher(constraint_grammar(Constraint(kind=ConstraintKind.REGEX, text="7")))
    processed = process_logits(logits, [free, replace(free, grammar=matcher)])
    assert torch.equal(processed[0], process_logits(logits[:1], [free])[0])
    assert processed[1].isfinite().nonzero().flatten().tolist() == [tokenizer.convert_tokens_to_ids("7")]


CALL_TEXT = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city":"Paris"}}</tool_call>'


class ScriptRunner:
    """Emits a fixed text's tokens (then EOS) for every sequence, whatever the masks say."""

    def __init__(self, tokens: list[int], eos: int) -> None:
        self.tokens, self.eos = tokens, eos
        self.num_blocks, self.block_size, self.max_len = 64, 16, 256

    def execute(self, plan: StepPlan) -> list[Sampled]:
        ready = list(plan.decode) + [c.seq for c in plan.prefill if c.completes_prompt]
        return [Sampled(s, self.tokens[len(s.output)] if len(s.output) < len(self.tokens) else self.eos) for s in ready]

    def release(self, seq: Sequence) -> None:
        pass


def tool_request() -> Request:
    from shared.ir import ToolSpec

    spec = ToolSpec(name="get_weather", parameters_json=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
    return replace(ask("t"), tools=(spec,), tool_choice="auto")


# Per family: a call as its `auto` grammar lets it through (compact JSON), and the text before it.
FAMILY_CALLS = {
    "hermes": (CALL_TEXT, "Checking."),
    "llama3": ('{"name":"get_weather","parameters":{"city":"Paris"}}', ""),
    "mistral": ('Checking.[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris"}}]', "Checking."),
}


@pytest.mark.parametrize("family", sorted(FAMILY_CALLS))
def test_a_tool_call_resumed_mid_arguments_continues_the_same_call(family: str, tokenizer: Any, info: ModelInfo) -> None:
    from shared.deltas import ToolCallArgs, ToolCallStart

    script, before = FAMILY_CALLS[family]
    tokens = tokenizer.encode(script)
    settings = Settings(tool_parser=family)
    whole = drain(engine := Engine(ScriptRunner(tokens, info.eos_token_ids[0]), tokenizer, info, settings=settings), engine.add(tool_request()))["t"]
    assert text_of(whole) == before and whole[-1].reason is FinishReason.TOOL_CALLS
    start = next(d for d in whole if isinstance(d, ToolCallStart))
    assert (start.id, start.name) == ("call_t_0", "get_weather")
    assert "".join(d.arguments for d in whole if isinstance(d, ToolCallArgs)) == '{"city":"Paris"}'
    emitted = [t for d in whole for t in d.token_ids]
    assert emitted in ([*tokens, info.eos_token_ids[0]], tokens)  # every token in exactly one delta (a complete grammar ends before EOS)
    cut = len(tokens) - 6  # inside the arguments
    counts = [sum(len(x.token_ids) for x in whole[: i + 1]) for i in range(len(whole))]
    delivered = whole[: next(i for i, c in enumerate(counts) if c > cut)]  # what attempt 1 wrote before dying
    resume = tuple(t for d in delivered for t in d.token_ids)
    engine = Engine(ScriptRunner(tokens, info.eos_token_ids[0]), tokenizer, info, settings=settings)
    rest = drain(engine, engine.add(tool_request(), attempt=2, resume=resume))["t"]
    assert not any(isinstance(d, ToolCallStart) for d in rest)  # the call was already opened by attempt 1
    args = "".join(d.arguments for d in [*delivered, *rest] if isinstance(d, ToolCallArgs))
    assert args == '{"city":"Paris"}' and rest[-1].reason is FinishReason.TOOL_CALLS


def test_a_forced_custom_tool_call_streams_raw_input_that_matches_its_regex(tiny: LlamaForCausalLM, tokenizer: Any, info: ModelInfo) -> None:
    from shared.deltas import ToolCallArgs, ToolCallStart
    from shared.ir import ToolKind, ToolSpec

    pattern = r"[a-z]{2,6}@[a-z]{2,6}\.com"
    email = ToolSpec(name="send_to", kind=ToolKind.CUSTOM, input_format=Constraint(kind=ConstraintKind.REGEX, text=pattern, param="tools[0].format.definition"))
    engine = make_engine(tiny, tokenizer, info)  # the llama-free SmolLM2 template: hermes, as custom tools always are
    request = replace(tool_request(), tools=(email, *tool_request().tools), tool_choice="function:send_to", sampling=SamplingParams(temperature=0.0, max_tokens=48))
    out = drain(engine, engine.add(request))["t"]
    assert [d.name for d in out if isinstance(d, ToolCallStart)] == ["send_to"] and out[-1].reason is FinishReason.TOOL_CALLS
    assert re.fullmatch(pattern, "".join(d.arguments for d in out if isinstance(d, ToolCallArgs)))


@pytest.mark.parametrize("family", ["llama3", "mistral", "hermes"])
def test_a_required_call_from_a_noise_model_is_a_parsed_call_in_each_family(family: str, tiny: LlamaForCausalLM, tokenizer: Any, info: ModelInfo) -> None:
    from shared.deltas import ToolCallArgs, ToolCallStart

    runner = TorchRunner(tiny, max_len=256, kv_budget_mb=16, device=torch.device("cpu"), dtype=torch.float32)
    runner.eos_ids = info.eos_token_ids
    engine = Engine(runner, tokenizer, info, settings=Settings(tool_parser=family, max_tokens_per_step=256))
    from shared.ir import ToolSpec

    bounded = ToolSpec(name="get_weather", parameters_json=json.dumps({"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"], "additionalProperties": False}))
    request = replace(tool_request(), tools=(bounded,), tool_choice="required", parallel_tool_calls=False, sampling=SamplingParams(temperature=0.0, max_tokens=64))
    out = drain(engine, engine.add(request))["t"]
    assert out[-1].reason is FinishReason.TOOL_CALLS and text_of(out) == ""
    [start] = [d for d in out if isinstance(d, ToolCallStart)]
    assert start.name == "get_weather"
    assert json.loads("".join(d.arguments for d in out if isinstance(d, ToolCallArgs)))["city"] in ("Paris", "Rome")


def test_a_family_marker_that_is_a_special_token_reaches_the_parser(info: ModelInfo) -> None:
    from shared.deltas import ToolCallArgs, ToolCallStart

    settings = Settings.from_env(os.environ)
    _, folder = local_folder(settings.model, settings.model_cache)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    tokens = [marker, *tok.encode('[{"name":"get_weather","arguments":{"city":"Paris"}}]')]  # as the grammar writes it (compact)
    engine = Engine(ScriptRunner(tokens, info.eos_token_ids[0]), tok, info, settings=Settings(tool_parser="mistral"))
    out = drain(engine, engine.add(replace(tool_request(), tool_choice="auto")))["t"]
    assert [d.name for d in out if isinstance(d, ToolCallStart)] == ["get_weather"]
    assert "".join(d.arguments for d in out if isinstance(d, ToolCallArgs)) == '{"city":"Paris"}' and text_of(out) == ""
    plain = Engine(ScriptRunner(tokens, info.eos_token_ids[0]), tok, info, settings=Settings(tool_parser="mistral"))
    free = drain(plain, plain.add(replace(ask("t"), sampling=SamplingParams(temperature=0.0, max_tokens=64))))["t"]
    assert "[TOOL_CALLS]" not in text_of(free)  # without tools, special tokens stay out of the text
