"""OpenAI chat parser: body → IR, and bad input → an error naming the parameter."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from ingest.parsers.openai_chat import parse
from shared.errors import ApiError
from shared.ir import Message, Protocol, Role, SamplingParams, TextPart, Thinking, ToolCall, ToolSpec


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def parsed(**fields: Any) -> Any:
    return parse(body(**fields), request_id="r1", created=5.0)


def test_a_full_body_maps_onto_the_ir() -> None:
    req = parse(
        {
            "model": "SmolLM2",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "text", "text": "Use French."}]},
                {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": " in Paris?"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "max_completion_tokens": 64,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 7,
            "stop": "END",
            "stream": True,
            "stream_options": {"include_usage": True},
            "tools": [{"type": "function", "function": {"name": "w", "description": "weather", "parameters": {"type": "object"}}}],
            "user": "someone",
            "unknown_field": {"ignored": True},
        },
        request_id="r1",
        created=5.0,
    )
    assert req.protocol is Protocol.OPENAI_CHAT and req.model == "SmolLM2" and req.id == "r1" and req.created == 5.0
    assert req.messages == (
        Message(role=Role.SYSTEM, content=(TextPart(text="Be brief."),)),
        Message(role=Role.DEVELOPER, content=(TextPart(text="Use French."),)),
        Message(role=Role.USER, content=(TextPart(text="Weather"), TextPart(text=" in Paris?"))),
        Message(role=Role.ASSISTANT, tool_calls=(ToolCall(id="c1", name="w", arguments="{}"),)),
        Message(role=Role.TOOL, content=(TextPart(text="sunny"),), tool_call_id="c1"),
    )
    assert req.sampling == SamplingParams(temperature=0.5, top_p=0.9, seed=7, max_tokens=64, stop=("END",))
    assert req.stream and req.include_usage
    assert req.tools == (ToolSpec(name="w", description="weather", parameters_json='{"type":"object"}'),)


def test_max_tokens_is_accepted_as_the_legacy_name_and_stop_as_a_list() -> None:
    req = parsed(max_tokens=10, stop=["a", "bc"])
    assert req.sampling.max_tokens == 10 and req.sampling.stop == ("a", "bc")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": None}, "model"),
        ({"messages": None}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"model": 3}, "model"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"n": 17}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**12}, "max_tokens"),
        ({"max_tokens": "100"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop[0]"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"speculative": "no"}, "speculative"),
    ],
)
def test_bad_input_names_the_parameter(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse({**body(), **fields}, request_id="r", created=0.0)
    assert caught.value.status == 400 and caught.value.param == param
    assert caught.value.message


def test_a_body_that_is_not_an_object_is_rejected() -> None:
    with pytest.raises(ApiError) as caught:
        parse([1, 2], request_id="r", created=0.0)
    assert caught.value.status == 400


def test_the_fields_agent_frameworks_send_are_accepted() -> None:
    extras = {
        "reasoning_effort": "low",
        "verbosity": "low",
        "prompt_cache_key": "k",
        "safety_identifier": "user-1",
        "store": False,
        "service_tier": "auto",
        "modalities": ["text"],
        "user": "u",
    }
    with_extras = parsed(**extras)
    assert with_extras.thinking == Thinking(effort="low")  # reasoning_effort is the reasoning budget; the rest change nothing
    assert replace(with_extras, thinking=Thinking()) == parsed()
    framed = parsed(stream=True, stream_options={"include_usage": True}, parallel_tool_calls=False, metadata={"run": "r1"})
    assert (framed.include_usage, framed.parallel_tool_calls, framed.metadata) == (True, False, (("run", "r1"),))


def test_a_request_may_opt_out_of_speculative_decoding_on_every_protocol() -> None:
    from ingest.parsers.anthropic_messages import parse as parse_anthropic
    from ingest.parsers.openai_responses import parse as parse_responses

    assert parsed().sampling.speculative is True
    assert parsed(speculative=False).sampling.speculative is False
    responses = parse_responses({"model": "m", "input": "hi", "speculative": False}, request_id="r", created=0.0)
    anthropic = parse_anthropic({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "speculative": False}, request_id="r", created=0.0)
    assert responses.sampling.speculative is False and anthropic.sampling.speculative is False
