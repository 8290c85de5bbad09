"""The codec: every IR type and delta survives a round trip; foreign or newer payloads are refused."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from shared.codec import CodecError, decode_delta, decode_request, encode_delta, encode_request
from shared.deltas import Content, Error, ErrorKind, Finish, FinishReason, TokenLogprob, Usage
from shared.ir import (
    Constraint,
    ConstraintKind,
    ImagePart,
    Message,
    Protocol,
    Request,
    Role,
    SamplingParams,
    TextCompletion,
    TextPart,
    ToolCall,
    ToolKind,
    ToolSpec,
)

from ..encoders.recorded import SCENARIOS


def test_a_full_request_round_trips() -> None:
    request = Request(
        id="abc",
        protocol=Protocol.ANTHROPIC_MESSAGES,
        model="m",
        messages=(
            Message(role=Role.SYSTEM, content=(TextPart(text="sys"),)),
            Message(role=Role.USER, content=(TextPart(text="look"), ImagePart(url="data:image/png;base64,AA", media_type="image/png"))),
            Message(role=Role.ASSISTANT, tool_calls=(ToolCall(id="t1", name="f", arguments='{"a":1}'),), reasoning="hmm"),
            Message(role=Role.TOOL, content=(TextPart(text="42"),), tool_call_id="t1"),
            Message(role=Role.ASSISTANT, tool_calls=(ToolCall(id="t2", name="patch", arguments="raw *** text", kind=ToolKind.CUSTOM),)),
        ),
        sampling=SamplingParams(temperature=0.2, seed=9, stop=("x", "y"), logit_bias=((5, -100.0),), max_tokens=7, stop_token_ids=(3,)),
        stream=True,
        tools=(
            ToolSpec(name="f", description="d", parameters_json="{}"),
            ToolSpec(name="patch", kind=ToolKind.CUSTOM, input_format=Constraint(kind=ConstraintKind.LARK, text='start: "x"', param="tools[1].format.definition")),
            ToolSpec(name="note", kind=ToolKind.CUSTOM),
        ),
        tool_choice="required",
        constraint=Constraint(kind=ConstraintKind.CHOICE, choices=("yes", "no"), param="choice"),
        metadata=(("user_id", "u"),),
        prompt_token_ids=(1, 2, 3),
        created=12.5,
        raw_body='{"x":1}',
    )
    decoded = decode_request(encode_request(request))
    assert decoded == request
    assert decoded.tools[1].kind is ToolKind.CUSTOM and decoded.messages[-1].tool_calls[0].kind is ToolKind.CUSTOM


@pytest.mark.parametrize(
    "completion",
    [TextCompletion(text="Once upon", echo=True, n=2, logprobs=0), TextCompletion(text="5 6", token_ids=(5, 6), prompt_index=3, logprobs=None)],
    ids=["text prompt", "token-id prompt"],
)
def test_a_raw_completion_prompt_round_trips(completion: TextCompletion) -> None:
    request = Request(id="c", protocol=Protocol.OPENAI_COMPLETIONS, model="m", messages=(), completion=completion, sampling=SamplingParams(n=4, logprobs=True))
    decoded = decode_request(encode_request(request))
    assert decoded == request and isinstance(decoded.completion, TextCompletion) and isinstance(decoded.completion.token_ids, tuple)


@pytest.mark.parametrize("kind", list(ConstraintKind))
def test_every_constraint_kind_round_trips(kind: ConstraintKind) -> None:
    constraint = Constraint(kind=kind, text='{"type":"object"}', param="response_format")
    request = Request(id="c", protocol=Protocol.OPENAI_CHAT, model="m", messages=(), constraint=constraint)
    decoded = decode_request(encode_request(request))
    assert decoded.constraint == constraint and isinstance(decoded.constraint.kind, ConstraintKind)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_recorded_delta_round_trips(scenario: str) -> None:
    for delta in SCENARIOS[scenario]:
        assert decode_delta(encode_delta(delta)) == delta


def test_logprobs_and_error_kinds_round_trip() -> None:
    content = Content(text="a", token_ids=(1,), attempt=2, logprobs=(TokenLogprob(token="a", token_id=1, logprob=-0.5, top=(("a", 1, -0.5),)),))
    assert decode_delta(encode_delta(content)) == content
    scored = Content(text="", prompt_logprobs=(TokenLogprob(token="The", token_id=504, logprob=0.0), TokenLogprob(token=" cat", token_id=9, logprob=-3.5, top=((" dog", 7, -1.0),))))
    assert decode_delta(encode_delta(scored)) == scored
    assert "prompt_logprobs" not in orjson.loads(encode_delta(content))  # absent unless carried
    opening = Content(text="Hi", token_ids=(5,), cached_tokens=32)
    assert decode_delta(encode_delta(opening)) == opening
    assert decode_delta(encode_delta(replace(opening, cached_tokens=0))).cached_tokens == 0  # zero is said, not dropped
    assert "cached_tokens" not in orjson.loads(encode_delta(content))
    error = Error(message="boom", kind=ErrorKind.TIMEOUT, attempt=3)
    assert decode_delta(encode_delta(error)) == error


def test_every_stored_event_carries_version_token_ids_and_attempt() -> None:
    doc = orjson.loads(encode_delta(Finish(reason=FinishReason.STOP, usage=Usage(prompt_tokens=1), token_ids=(2,), attempt=4)))
    assert doc["v"] == 1 and doc["t"] == "finish" and doc["token_ids"] == [2] and doc["attempt"] == 4


@pytest.mark.parametrize("raw", [b'{"v": 2, "t": "content", "text": "x"}', b'{"t": "content", "text": "x"}', b'{"v": 1, "t": "nope"}', b"[1]"])
def test_foreign_or_newer_payloads_are_refused(raw: bytes) -> None:
    with pytest.raises(CodecError):
        decode_delta(raw)


def test_fields_a_newer_minor_version_added_inside_nested_values_are_ignored_not_a_crash() -> None:
    import orjson

    from shared.codec import decode_delta, decode_request

    request = orjson.dumps(
        {"v": 1, "id": "r", "protocol": "openai_chat", "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "lang": "en"}]}]}
    )
    assert decode_request(request).messages[0].text == "hi"
    finish = orjson.dumps({"v": 1, "t": "finish", "reason": "stop", "usage": {"prompt_tokens": 3, "audio_tokens": 9}})
    assert decode_delta(finish).usage.prompt_tokens == 3  # type: ignore[union-attr]
