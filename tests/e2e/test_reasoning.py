"""Reasoning through a live `met serve` with the official SDKs, on a model that reasons: the tiny random
Qwen3 of tests/thinking_model.py, whose template opens `<think>` in the prompt. Its text is noise and it
never closes a span by itself, so every answer here comes after the worker forced `</think>` at the
budget (`--max-thinking-tokens 16` caps every budget), and the answer is the `regex` extension's doing.
A later turn sends the reasoning back (Anthropic thinking blocks, Responses `encrypted_content`): a blob
this deployment sealed reaches the prompt (more input tokens), a tampered one is dropped, never a 400."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.thinking_model import build_thinking_model

from ..conftest import LiveServer, start_server, stop_server

pytestmark = pytest.mark.e2e

CAP = 16
ANSWER = "The answer is 42."
PATTERN = r"The answer is 42\."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = build_thinking_model(tmp_path_factory.mktemp("thinking-model"))
    live = start_server(
        tmp_path_factory.mktemp("thinking-serve"),
        *("--model", str(folder), "--kv-budget-mb", "64", "--max-thinking-tokens", str(CAP)),
    )
    yield live
    stop_server(live)


@pytest.fixture
def oai(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
def claude(server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as client:
        yield client


def test_chat_reasoning_is_capped_counted_and_streamed_under_both_names(oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "thinking",
        "messages": [{"role": "user", "content": "What is six times seven?"}],
        "max_tokens": 64,
        "reasoning_effort": "high",
        "extra_body": {"regex": PATTERN},
    }
    done = oai.chat.completions.create(**kwargs)
    message = done.choices[0].message
    assert message.content == ANSWER and done.choices[0].finish_reason == "stop"
    assert done.usage is not None and done.usage.completion_tokens_details is not None
    assert done.usage.completion_tokens_details.reasoning_tokens == CAP  # "high" is 8192, capped at 16
    extra = message.model_extra or {}
    assert extra["reasoning_content"] == extra["reasoning"] and extra["reasoning"]
    with oai.chat.completions.stream(**kwargs) as stream:
        chunks = list(stream)
        final = stream.get_final_completion()
    streamed = "".join((c.chunk.choices[0].delta.model_extra or {}).get("reasoning_content", "") for c in chunks if c.type == "chunk" and c.chunk.choices)
    assert streamed and final.choices[0].message.content == ANSWER
    off = oai.chat.completions.create(**{**kwargs, "reasoning_effort": "none"})
    assert off.choices[0].message.content == ANSWER and "reasoning_content" not in (off.choices[0].message.model_extra or {})
    assert off.usage is not None and off.usage.completion_tokens_details is not None and off.usage.completion_tokens_details.reasoning_tokens == 0


def test_anthropic_thinking_blocks_are_signed_stream_like_create_and_come_back_only_when_the_signature_verifies(claude: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is six times seven?"}]
    kwargs: dict[str, Any] = {"model": "thinking", "max_tokens": 64, "thinking": {"type": "enabled", "budget_tokens": 8}, "extra_body": {"regex": PATTERN}}
    made = claude.messages.create(messages=ask, **kwargs)  # type: ignore[arg-type]
    assert [b.type for b in made.content] == ["thinking", "text"] and made.stop_reason == "end_turn"
    thinking, text = made.content
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature and text.type == "text" and text.text == ANSWER
    with claude.messages.stream(messages=ask, **kwargs) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text"] and streamed.content[1].text == ANSWER  # type: ignore[union-attr]

    def follow_up(block: dict[str, Any]) -> int:
        history = [*ask, {"role": "assistant", "content": [block, {"type": "text", "text": ANSWER}]}, {"role": "user", "content": "And six times eight?"}]
        reply = claude.messages.create(messages=history, **kwargs)  # type: ignore[arg-type]
        return reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)

    signed = {"type": "thinking", "thinking": thinking.thinking, "signature": thinking.signature}
    verified = follow_up(signed)
    tampered = follow_up({**signed, "signature": thinking.signature[:-8] + "AAAAAAA="})
    forged = follow_up({**signed, "thinking": thinking.thinking + " forged"})
    assert verified > tampered == forged  # the verified span is in the prompt; the others were dropped
    omitted = claude.messages.create(messages=ask, **{**kwargs, "thinking": {"type": "adaptive", "display": "omitted"}})  # type: ignore[arg-type]
    block = omitted.content[0]
    assert block.type == "thinking" and block.thinking == "" and block.signature
    assert follow_up({"type": "thinking", "thinking": "", "signature": block.signature}) > tampered  # restored from the seal alone


def test_responses_summary_and_encrypted_content_carry_reasoning_across_a_stateless_turn(oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "thinking",
        "max_output_tokens": 64,
        "reasoning": {"effort": "low", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "store": False,
        "extra_body": {"regex": PATTERN},
    }
    first: list[Any] = [{"role": "user", "content": "What is six times seven?"}]
    made = oai.responses.create(input=first, **kwargs)
    assert [item.type for item in made.output] == ["reasoning", "message"] and made.output_text == ANSWER
    reasoning = made.output[0]
    assert reasoning.type == "reasoning" and reasoning.summary and reasoning.summary[0].text and reasoning.encrypted_content
    assert made.usage is not None and made.usage.output_tokens_details.reasoning_tokens == CAP
    with oai.responses.stream(input=first, **kwargs) as stream:
        events = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert "response.reasoning_summary_text.delta" in events and streamed.output_text == ANSWER
    assert streamed.output[0].type == "reasoning" and streamed.output[0].encrypted_content

    def follow_up(item: dict[str, Any]) -> int:
        history = [*first, item, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "And six times eight?"}]
        reply = oai.responses.create(input=history, **kwargs)
        assert reply.usage is not None
        return reply.usage.input_tokens

    item = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}
    assert follow_up(item) > follow_up({**item, "encrypted_content": "bWV0MQ" + "A" * 60})


def test_a_bad_reasoning_effort_is_a_400_naming_the_parameter_on_each_protocol(oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    with pytest.raises(openai.BadRequestError) as chat:
        oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=4, reasoning_effort="huge")  # type: ignore[arg-type]
    assert chat.value.body["param"] == "reasoning_effort"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as responses:
        oai.responses.create(model="m", input="x", max_output_tokens=4, reasoning={"effort": "huge"})  # type: ignore[typeddict-item]
    assert responses.value.body["param"] == "reasoning.effort"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as messages:
        claude.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x"}], extra_body={"output_config": {"effort": "huge"}})
    assert "output_config.effort" in str(messages.value)
