"""The official `anthropic` SDK against a live `met serve`."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import pytest

from shared import keys

from ..conftest import LiveServer

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0.0}  # this SDK version no longer takes `temperature` as an argument; the API still does


@pytest.fixture
def claude(live_server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=live_server.base_url, api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def test_stream_final_message_equals_create_and_count_tokens_equals_input_usage(claude: anthropic.Anthropic) -> None:
    # "Be concise.", not "You are terse.": under that one the model's first token is a three-way tie
    # (fp32 logits 25.77 / 25.73 / 25.65, one bf16 step apart), so "Paris" depended on rounding.
    common = {"model": "SmolLM2-135M-Instruct", "max_tokens": 40, "messages": QUESTION, "extra_body": GREEDY, "system": "Be concise."}
    created = claude.messages.create(**common)  # type: ignore[call-overload]
    with claude.messages.stream(**common) as stream:  # type: ignore[call-overload]
        events = list(stream)
        final = stream.get_final_message()
    text = "".join(b.text for b in created.content if b.type == "text")
    assert "Paris" in text
    assert "".join(b.text for b in final.content if b.type == "text") == text
    assert final.stop_reason == created.stop_reason == "end_turn"
    assert final.usage.output_tokens == created.usage.output_tokens
    counted = claude.messages.count_tokens(model="SmolLM2-135M-Instruct", messages=QUESTION, system="Be concise.")  # type: ignore[arg-type]
    # The same prompt twice: the second reads its full blocks from the prefix cache, and input_tokens
    # counts only the rest (Anthropic's split); the sum is always the whole prompt.
    assert counted.input_tokens == created.usage.input_tokens + (created.usage.cache_read_input_tokens or 0) > 10
    assert counted.input_tokens == final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    assert (final.usage.cache_read_input_tokens or 0) >= 16
    # One stream, one split: message_start (sent before the text) already counts the cache hit.
    opening = next(e for e in events if e.type == "message_start").message.usage
    closing = next(e for e in events if e.type == "message_delta").usage
    assert (opening.input_tokens, opening.cache_read_input_tokens) == (closing.input_tokens, closing.cache_read_input_tokens)


def test_a_stop_sequence_hit_reports_stop_sequence_with_the_string(claude: anthropic.Anthropic) -> None:
    probe = claude.messages.create(model="m", max_tokens=30, messages=QUESTION, extra_body=GREEDY)  # type: ignore[arg-type]
    text = probe.content[0].text  # type: ignore[union-attr]
    stop = text.split()[2]  # a word the greedy answer is known to contain
    with claude.messages.stream(model="m", max_tokens=30, messages=QUESTION, extra_body=GREEDY, stop_sequences=[stop]) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


def test_max_tokens_reports_max_tokens(claude: anthropic.Anthropic) -> None:
    reply = claude.messages.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "Write an essay about rivers."}])
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 3


def test_claude_code_style_requests_are_accepted(live_server: LiveServer) -> None:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "max_tokens": 16,
        "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "system", "content": "Extra system text."},
            {"role": "user", "content": [{"type": "text", "text": "List files."}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "."}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a.py b.py"}]}]},
        ],
        "tools": [{"name": "ls", "description": "list files", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "metadata": {"user_id": "u-1"},
        "stream": True,
    }
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14", "x-api-key": "k"}
    with httpx.stream("POST", f"{live_server.base_url}/v1/messages?beta=true", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        events = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
    # `ping` keeps a slow prefill's connection alive and may come before message_start (which waits for the
    # worker's first delta: it carries the prefix-cache split); the SDKs skip pings wherever they come.
    events = [e for e in events if e != "ping"]
    assert events[0] == "message_start" and events[-1] == "message_stop" and "message_delta" in events


@pytest.mark.parametrize(
    ("body", "status", "mentions"),
    [
        ({"model": "m", "messages": QUESTION}, 400, "max_tokens"),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        ({"model": "m", "max_tokens": 5, "messages": QUESTION, "temperature": 7}, 400, "temperature"),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
            400,
            "image",
        ),
    ],
)
def test_bad_input_gets_the_anthropic_error_shape_before_any_stream(live_server: LiveServer, body: dict[str, object], status: int, mentions: str) -> None:
    r = live_server.redis()
    before = r.xlen(keys.REQUEST_STREAM)
    response = httpx.post(f"{live_server.base_url}/v1/messages", json={**body, "stream": True}, timeout=30)
    assert response.status_code == status and response.headers["content-type"].startswith("application/json")
    doc = response.json()
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error" and mentions in doc["error"]["message"]
    assert r.xlen(keys.REQUEST_STREAM) == before
    r.close()


def test_the_sdk_raises_its_own_bad_request_error(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="m", max_tokens=-1, messages=QUESTION)  # type: ignore[arg-type]
    assert "max_tokens" in str(caught.value)


def test_return_token_ids_on_the_anthropic_stream(live_server: LiveServer) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": QUESTION, "stream": True, "return_token_ids": True, "temperature": 0}
    with httpx.stream("POST", f"{live_server.base_url}/v1/messages", json=body, timeout=60) as response:
        data = [line for line in response.iter_lines() if line.startswith("data: ") and "text_delta" in line]
    assert data and all('"token_ids"' in line for line in data)
