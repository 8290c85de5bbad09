"""OpenAI chat encoder: recorded deltas → exact frames, stream rules, and the SDK's own chunk types."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from encoders.frames import Frame
from encoders.openai_chat import ChatCompletionAccumulator, ChatStreamEncoder, chat_completion_body
from shared.ir import Protocol

from .recorded import SCENARIOS, request

BASE = {"id": "chatcmpl-req01", "object": "chat.completion.chunk", "created": 1700000000, "model": "tiny-chat", "system_fingerprint": None}


def chunk(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
    return {**BASE, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}], **extra}


def run(scenario: str, **overrides: Any) -> list[Frame]:
    encoder = ChatStreamEncoder(request(Protocol.OPENAI_CHAT, stream=True, **overrides))
    frames = [f for d in SCENARIOS[scenario] for f in encoder.feed(d)]
    return frames + encoder.finish()


def payloads(frames: list[Frame]) -> list[Any]:
    return [f.data if f.data == "[DONE]" else json.loads(f.data) for f in frames]


def test_plain_text_golden_frames() -> None:
    assert payloads(run("plain_text")) == [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hello"}),
        chunk({"content": ", world"}),
        chunk({}, "stop"),
        "[DONE]",
    ]


def test_include_usage_adds_a_final_chunk_with_empty_choices() -> None:
    out = payloads(run("plain_text", include_usage=True))
    assert all(p["usage"] is None for p in out[:-2])
    assert out[-2] == {
        **BASE,
        "choices": [],
        "usage": {
            "prompt_tokens": 4,
            "completion_tokens": 4,
            "total_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0},
        },
    }
    assert out[-1] == "[DONE]"


def test_tool_call_first_delta_has_index_id_type_and_name() -> None:
    out = payloads(run("two_tool_calls"))
    calls = [p["choices"][0]["delta"]["tool_calls"][0] for p in out[:-1] if "tool_calls" in p["choices"][0]["delta"]]
    assert calls[0] == {"index": 0, "id": "toolu_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    assert calls[1] == {"index": 0, "function": {"arguments": '{"city": '}}
    assert calls[3] == {"index": 1, "id": "toolu_b", "type": "function", "function": {"name": "get_time", "arguments": ""}}
    assert out[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_error_mid_stream_sends_an_error_object_then_done() -> None:
    out = payloads(run("error_mid_stream"))
    assert out[-2] == {"error": {"message": "The worker ran out of memory.", "type": "overloaded_error", "param": None, "code": None}}
    assert out[-1] == "[DONE]"


def test_finish_is_idempotent_and_nothing_follows_done() -> None:
    encoder = ChatStreamEncoder(request(Protocol.OPENAI_CHAT, stream=True))
    for delta in SCENARIOS["plain_text"]:
        encoder.feed(delta)
    assert encoder.finish() == [] and encoder.feed(SCENARIOS["plain_text"][0]) == []


def test_return_token_ids_is_off_by_default_and_on_when_asked() -> None:
    assert "token_ids" not in json.dumps(payloads(run("plain_text"))[:-1])
    out = payloads(run("plain_text", return_token_ids=True))
    assert out[0]["choices"][0]["prompt_token_ids"] == [101, 102, 103, 104]
    assert [p["choices"][0].get("token_ids") for p in out[1:4]] == [[1], [2, 3], [4]]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_scenario_parses_as_sdk_chunks_with_shared_id_and_role_first(scenario: str) -> None:
    frames = run(scenario, include_usage=True)
    assert frames[-1].data == "[DONE]" and sum(f.data == "[DONE]" for f in frames) == 1
    chunks = [ChatCompletionChunk.model_validate(p) for p in payloads(frames)[:-1] if "error" not in p]
    assert len({(c.id, c.created, c.model) for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)


@pytest.mark.parametrize("scenario", ["plain_text", "two_tool_calls", "stop_sequence", "max_tokens"])
def test_non_streaming_body_matches_the_stream(scenario: str) -> None:
    req = request(Protocol.OPENAI_CHAT)
    acc = ChatCompletionAccumulator(req)
    for delta in SCENARIOS[scenario]:
        acc.feed(delta)
    body = ChatCompletion.model_validate(chat_completion_body(req, [acc]))
    streamed = payloads(run(scenario))
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in streamed[:-1])
    assert (body.choices[0].message.content or "") == text
    assert body.choices[0].finish_reason == next(p for p in streamed[:-1] if p["choices"][0]["finish_reason"])["choices"][0]["finish_reason"]
    if scenario == "two_tool_calls":
        calls = body.choices[0].message.tool_calls or []
        assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [  # type: ignore[union-attr]
            ("toolu_a", "get_weather", '{"city": "Paris"}'),
            ("toolu_b", "get_time", '{"tz": "CET"}'),
        ]


def test_sse_bytes_are_data_lines_with_a_blank_line_after_each() -> None:
    assert Frame('{"a":1}').to_sse() == b'data: {"a":1}\n\n'
    assert Frame('{"type":"ping"}', event="ping").to_sse() == b'event: ping\ndata: {"type":"ping"}\n\n'


def test_interleaved_parallel_calls_keep_their_indices_and_every_fragment() -> None:
    out = payloads(run("interleaved_parallel_calls"))
    calls = [c for p in out[1:-1] for c in p["choices"][0]["delta"].get("tool_calls", [])]
    assert calls == [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city": '}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": ""}},
        {"index": 1, "function": {"arguments": '{"tz": '}},
        {"index": 0, "function": {"arguments": '"Paris"}'}},
        {"index": 1, "function": {"arguments": '"CET"}'}},
    ]
    body = chat_completion_body(request(Protocol.OPENAI_CHAT), [_accumulated("interleaved_parallel_calls")])
    message = body["choices"][0]["message"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", '{"tz": "CET"}'),
    ]
    assert message["content"] == "Both. Done."
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def _accumulated(scenario: str) -> ChatCompletionAccumulator:
    acc = ChatCompletionAccumulator(request(Protocol.OPENAI_CHAT))
    for delta in SCENARIOS[scenario]:
        acc.feed(delta)
    return acc
def test_the_non_streaming_body_reports_the_cached_prompt_tokens_of_the_finish() -> None:
    from shared.deltas import Content, Finish, FinishReason, Usage

    req = request(Protocol.OPENAI_CHAT)
    acc = ChatCompletionAccumulator(req)
    for delta in (Content(text="hi"), Finish(reason=FinishReason.STOP, usage=Usage(prompt_tokens=40, completion_tokens=1, cached_tokens=32))):
        acc.feed(delta)
    body = ChatCompletion.model_validate(chat_completion_body(req, [acc]))
    assert body.usage is not None and body.usage.prompt_tokens_details is not None
    assert (body.usage.prompt_tokens, body.usage.prompt_tokens_details.cached_tokens) == (40, 32)


def test_reasoning_goes_out_under_both_names_and_the_seal_adds_no_chunk() -> None:
    chunks = payloads(run("sealed_reasoning_then_text"))
    deltas = [c["choices"][0]["delta"] for c in chunks if isinstance(c, dict) and c.get("choices")]
    reasoning = [d for d in deltas if "reasoning_content" in d]
    assert [(d["reasoning_content"], d["reasoning"]) for d in reasoning] == [("Six sevens", "Six sevens"), (" are 42.", " are 42.")]
    message = _accumulated("sealed_reasoning_then_text").choice()["message"]
    assert message["reasoning_content"] == message["reasoning"] == "Six sevens are 42."


def test_a_stop_sequence_finish_names_the_stop_as_vllms_stop_reason_streamed_and_not() -> None:
    [finish] = [p for p in payloads(run("stop_sequence")) if p != "[DONE]" and p["choices"][0]["finish_reason"]]
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["choices"][0]["stop_reason"] == "three"
    ChatCompletionChunk.model_validate(finish)
    whole = ChatCompletionAccumulator(request(Protocol.OPENAI_CHAT))
    for delta in SCENARIOS["stop_sequence"]:
        whole.feed(delta)
    assert whole.choice(0)["stop_reason"] == "three"
    [plain] = [p for p in payloads(run("plain_text")) if p != "[DONE]" and p["choices"][0]["finish_reason"]]
    assert "stop_reason" not in plain["choices"][0]  # only a stop sequence says which one


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_plain_text_chunk_spliced_into_its_template_is_byte_for_byte_the_chunk_built_whole(include_usage: bool) -> None:
    """The per-token fast path renders a text chunk's JSON once and splices each text in; whatever the text
    (quotes, escapes, control characters, astral characters, the marker itself) and whatever the model
    name holds, the frame is the one `_chunk` builds from the dict."""
    from shared.deltas import Content

    texts = ["Hello", ' "quoted" \\ back', "\x00", "\n\t\u2028", "🎉 日本", "", "}]}", '\\u0000"']
    for model in ("tiny-chat", 'odd "\x00" model'):
        encoder = ChatStreamEncoder(request(Protocol.OPENAI_CHAT, stream=True, model=model, include_usage=include_usage))
        encoder.feed(Content(text="warm", token_ids=(1,)))
        for text in texts:
            assert encoder._plain_text(text) == encoder._chunk({"content": text}), (model, text)
