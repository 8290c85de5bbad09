"""Anthropic Messages encoder: recorded deltas → frames, checked by rule, by golden and by the official SDK."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from encoders.anthropic_messages import MessageAccumulator, MessagesStreamEncoder, error_frame, unsealed_signature
from encoders.frames import Frame
from shared.deltas import Content, Error, ErrorKind, Finish, FinishReason, Reasoning, StreamDelta, Usage
from shared.ir import Protocol, Request, Thinking
from tests.encoders.recorded import PROMPT_IDS, SCENARIOS, request

STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal"}
DELTA_TYPES = {"text": {"text_delta"}, "thinking": {"thinking_delta", "signature_delta"}, "tool_use": {"input_json_delta"}}
EVENT_ADAPTER: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)

START, DELTA, STOP = "content_block_start", "content_block_delta", "content_block_stop"
EXPECTED_EVENTS = {
    "plain_text": ["message_start", START, DELTA, DELTA, STOP, "message_delta", "message_stop"],
    "reasoning_then_text": ["message_start", START, DELTA, DELTA, DELTA, STOP, START, DELTA, STOP, "message_delta", "message_stop"],
    "sealed_reasoning_then_text": ["message_start", START, DELTA, DELTA, DELTA, STOP, START, DELTA, STOP, "message_delta", "message_stop"],
    "two_tool_calls": ["message_start", START, DELTA, STOP, START, DELTA, DELTA, STOP, START, DELTA, STOP, "message_delta", "message_stop"],
    "interleaved_parallel_calls": [
        "message_start", START, DELTA, STOP, START, DELTA, DELTA, STOP, START, DELTA, DELTA, STOP, START, DELTA, STOP, "message_delta", "message_stop",
    ],
    "stop_sequence": ["message_start", START, DELTA, STOP, "message_delta", "message_stop"],
    "max_tokens": ["message_start", START, DELTA, STOP, "message_delta", "message_stop"],
    "error_mid_stream": ["message_start", START, DELTA, "error"],
}


def anthropic_request(**overrides: object) -> Request:
    return request(Protocol.ANTHROPIC_MESSAGES, **overrides)


def replay(req: Request, deltas: list[StreamDelta]) -> list[Frame]:
    encoder = MessagesStreamEncoder(req)
    frames = [frame for delta in deltas for frame in encoder.feed(delta)]
    return frames + encoder.finish()


def accumulate(req: Request, deltas: list[StreamDelta]) -> dict[str, Any]:
    acc = MessageAccumulator(req)
    for delta in deltas:
        acc.feed(delta)
    return acc.body()


def payloads(frames: list[Frame]) -> list[dict[str, Any]]:
    return [orjson.loads(frame.data) for frame in frames]


def check_stream(frames: list[Frame]) -> None:
    """The Anthropic stream rules of DESIGN.md, on raw frames."""
    events = payloads(frames)
    assert all(frame.event == event["type"] for frame, event in zip(frames, events, strict=True))
    names = [event["type"] for event in events]
    assert names[-1] in ("message_stop", "error")
    assert "error" not in names[:-1]
    if names == ["error"]:
        return
    assert names[0] == "message_start" and names.count("message_start") == 1
    open_index: int | None = None
    kinds: list[str] = []
    signed = False
    for event in events[1:]:
        kind = event["type"]
        if kind == START:
            assert open_index is None and event["index"] == len(kinds)
            open_index, signed = event["index"], False
            kinds.append(event["content_block"]["type"])
        elif kind == DELTA:
            assert event["index"] == open_index and not signed
            assert event["delta"]["type"] in DELTA_TYPES[kinds[event["index"]]]
            signed = event["delta"]["type"] == "signature_delta"
        elif kind == STOP:
            assert event["index"] == open_index
            assert signed or kinds[event["index"]] != "thinking"
            open_index = None
        elif kind == "message_delta":
            assert open_index is None and event["delta"]["stop_reason"] in STOP_REASONS
            assert set(event["usage"]) >= {"input_tokens", "output_tokens"}
    if names[-1] == "message_stop":
        assert names[-2] == "message_delta" and names.count("message_delta") == 1


def sdk_message(frames: list[Frame]) -> dict[str, Any]:
    """What the official SDK's stream accumulator builds from the frames (up to an error event)."""
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for event in payloads(frames):
        if event["type"] == "error":
            break
        snapshot = accumulate_event(event=EVENT_ADAPTER.validate_python(event), current_snapshot=snapshot, json_bufs=json_bufs)
    assert snapshot is not None
    return dict(snapshot.model_dump(mode="json", exclude_none=True))


def drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_none(v) for v in value]
    return value


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_each_recorded_stream_sends_the_expected_events_in_a_valid_order(scenario: str) -> None:
    frames = replay(anthropic_request(), SCENARIOS[scenario])
    assert [frame.event for frame in frames] == EXPECTED_EVENTS[scenario]
    check_stream(frames)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_sdk_accumulates_each_stream_into_the_non_streaming_body(scenario: str) -> None:
    req = anthropic_request()
    body = accumulate(req, SCENARIOS[scenario])
    assert sdk_message(replay(req, SCENARIOS[scenario])) == drop_none(body)


def test_message_start_splits_the_prompt_as_message_delta_does_after_a_cache_hit() -> None:
    """The first delta says how much of the prompt came from the prefix cache; both usages agree."""
    deltas = [Content(text="Hi", token_ids=(7,), cached_tokens=2), Finish(reason=FinishReason.STOP, usage=Usage(prompt_tokens=len(PROMPT_IDS), completion_tokens=1, cached_tokens=2))]
    events = payloads(replay(anthropic_request(), deltas))
    start, end = events[0]["message"]["usage"], events[-2]["usage"]
    assert start["cache_read_input_tokens"] == end["cache_read_input_tokens"] == 2
    assert start["input_tokens"] == end["input_tokens"] == len(PROMPT_IDS) - 2


def test_plain_text_payloads_carry_the_message_text_and_cumulative_usage() -> None:
    events = payloads(replay(anthropic_request(), SCENARIOS["plain_text"]))
    assert events[0]["message"]["id"] == "msg_req01"
    assert events[0]["message"]["usage"] == {"input_tokens": len(PROMPT_IDS), "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    assert events[1]["content_block"] == {"type": "text", "text": ""}
    assert [e["delta"]["text"] for e in events if e["type"] == DELTA] == ["Hello", ", world"]
    assert events[-2] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"input_tokens": len(PROMPT_IDS), "output_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
    }


def test_a_matched_stop_sequence_is_reported_with_its_text() -> None:
    events = payloads(replay(anthropic_request(), SCENARIOS["stop_sequence"]))
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "three"}
    body = accumulate(anthropic_request(), SCENARIOS["stop_sequence"])
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "three")


def test_a_length_cut_reports_max_tokens() -> None:
    events = payloads(replay(anthropic_request(), SCENARIOS["max_tokens"]))
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}


def test_tool_calls_become_tool_use_blocks_whose_json_deltas_rebuild_the_input() -> None:
    req = anthropic_request()
    events = payloads(replay(req, SCENARIOS["two_tool_calls"]))
    starts = [e["content_block"] for e in events if e["type"] == START]
    assert starts == [
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {}},
        {"type": "tool_use", "id": "toolu_b", "name": "get_time", "input": {}},
    ]
    json_for_a = "".join(e["delta"]["partial_json"] for e in events if e["type"] == DELTA and e["index"] == 1)
    assert orjson.loads(json_for_a) == {"city": "Paris"}
    body = accumulate(req, SCENARIOS["two_tool_calls"])
    assert body["stop_reason"] == "tool_use"
    assert [b.get("input") for b in body["content"]] == [None, {"city": "Paris"}, {"tz": "CET"}]


def test_a_thinking_block_is_signed_before_it_stops_and_the_body_carries_the_same_signature() -> None:
    req = anthropic_request()
    events = payloads(replay(req, SCENARIOS["reasoning_then_text"]))
    assert [e["delta"] for e in events[2:5]] == [
        {"type": "thinking_delta", "thinking": "The user greets"},
        {"type": "thinking_delta", "thinking": " me."},
        {"type": "signature_delta", "signature": unsealed_signature(req, 0)},
    ]
    body = accumulate(req, SCENARIOS["reasoning_then_text"])
    assert body["content"][0] == {"type": "thinking", "thinking": "The user greets me.", "signature": unsealed_signature(req, 0)}


def test_a_sealed_span_signs_its_block_with_the_seal_and_omitted_display_sends_the_seal_alone() -> None:
    deltas = SCENARIOS["sealed_reasoning_then_text"]
    seal = "bWV0MVNFQUxFRA=="
    shown = payloads(replay(anthropic_request(), deltas))
    assert [e["delta"] for e in shown if e["type"] == DELTA][:3] == [
        {"type": "thinking_delta", "thinking": "Six sevens"},
        {"type": "thinking_delta", "thinking": " are 42."},
        {"type": "signature_delta", "signature": seal},
    ]
    omitted = anthropic_request(thinking=Thinking(enabled=True, omitted=True))
    frames = replay(omitted, deltas)
    check_stream(frames)
    events = payloads(frames)
    assert [e["type"] for e in events] == ["message_start", START, DELTA, STOP, START, DELTA, STOP, "message_delta", "message_stop"]
    assert events[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert events[2]["delta"] == {"type": "signature_delta", "signature": seal}
    body = accumulate(omitted, deltas)
    assert body["content"] == [{"type": "thinking", "thinking": "", "signature": seal}, {"type": "text", "text": "42"}]
    assert body["usage"]["output_tokens"] == 5


def test_an_error_mid_stream_is_an_error_event_with_nothing_after() -> None:
    encoder = MessagesStreamEncoder(anthropic_request())
    frames = [f for d in SCENARIOS["error_mid_stream"] for f in encoder.feed(d)]
    assert payloads(frames)[-1] == {"type": "error", "error": {"type": "overloaded_error", "message": "The worker ran out of memory."}}
    assert encoder.feed(Content(text="late")) == [] and encoder.finish() == [] and encoder.finish() == []
    acc = MessageAccumulator(anthropic_request())
    for delta in SCENARIOS["error_mid_stream"]:
        acc.feed(delta)
    assert acc.error is not None and acc.finish is None


def test_an_error_before_any_output_is_the_only_event() -> None:
    frames = replay(anthropic_request(), [Error(message="No worker.", kind=ErrorKind.TIMEOUT)])
    assert [(f.event, orjson.loads(f.data)) for f in frames] == [
        ("error", {"type": "error", "error": {"type": "timeout_error", "message": "No worker."}})
    ]


def test_finish_is_idempotent_and_closes_a_cut_stream_with_an_error() -> None:
    encoder = MessagesStreamEncoder(anthropic_request())
    encoder.feed(Content(text="half"))
    closing = encoder.finish()
    assert [f.event for f in closing] == ["error"]
    assert orjson.loads(closing[0].data)["error"]["type"] == "api_error"
    assert encoder.finish() == [] and encoder.feed(Content(text="more")) == []
    done = MessagesStreamEncoder(anthropic_request())
    replayed = [f for d in SCENARIOS["plain_text"] for f in done.feed(d)]
    assert replayed[-1].event == "message_stop" and done.finish() == [] and done.finish() == []


def test_ping_and_error_frames_use_named_events() -> None:
    assert MessagesStreamEncoder(anthropic_request()).ping().to_sse() == b'event: ping\ndata: {"type":"ping"}\n\n'
    frame = error_frame(Error(message="boom"))
    assert (frame.event, orjson.loads(frame.data)) == ("error", {"type": "error", "error": {"type": "api_error", "message": "boom"}})


def test_token_ids_never_appear_unless_the_request_asked() -> None:
    for scenario in SCENARIOS.values():
        frames = replay(anthropic_request(), scenario)
        assert all(b"token_ids" not in frame.data.encode() for frame in frames)
        assert "token_ids" not in accumulate(anthropic_request(), scenario)


def test_with_return_token_ids_every_generated_token_is_reported_once() -> None:
    req = anthropic_request(return_token_ids=True)
    deltas = SCENARIOS["two_tool_calls"]
    events = payloads(replay(req, deltas))
    expected = [t for d in deltas if not isinstance(d, Error) for t in d.token_ids]
    assert [t for e in events for t in e.get("token_ids", [])] == expected
    assert all(
        "token_ids" in e for e in events if e["type"] in (DELTA, "message_delta") and e.get("delta", {}).get("type") != "signature_delta"
    )
    assert events[0]["message"]["prompt_token_ids"] == list(PROMPT_IDS)
    body = accumulate(req, deltas)
    assert (body["token_ids"], body["prompt_token_ids"]) == (expected, list(PROMPT_IDS))


def test_golden_reasoning_then_text_frames() -> None:
    """Expected frames written from the Messages streaming docs, not from the encoder's output."""
    deltas: list[StreamDelta] = [
        Reasoning(text="Think."),
        Content(text="Hi"),
        Content(text=""),
        Content(text=" there"),
        Finish(reason=FinishReason.STOP, usage=Usage(prompt_tokens=4, completion_tokens=6)),
    ]
    signature = hashlib.sha256(b"req01:0").hexdigest()
    message = {
        "id": "msg_req01",
        "type": "message",
        "role": "assistant",
        "model": "tiny-chat",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 4, "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
    }
    expected = [
        ("message_start", {"type": "message_start", "message": message}),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
        ),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Think."}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": signature}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("content_block_start", {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Hi"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": " there"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"input_tokens": 4, "output_tokens": 6, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    frames = replay(anthropic_request(), deltas)
    assert [(f.event, orjson.loads(f.data)) for f in frames] == expected
    assert frames[-1].to_sse() == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    assert accumulate(anthropic_request(), deltas) == message | {
        "content": [{"type": "thinking", "thinking": "Think.", "signature": signature}, {"type": "text", "text": "Hi there"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 4, "output_tokens": 6, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
    }


def test_interleaved_parallel_calls_stream_one_block_at_a_time_and_drop_no_argument() -> None:
    req = anthropic_request()
    events = payloads(replay(req, SCENARIOS["interleaved_parallel_calls"]))
    starts = [e["content_block"] for e in events if e["type"] == START]
    assert [(b["type"], b.get("name")) for b in starts] == [("text", None), ("tool_use", "get_weather"), ("tool_use", "get_time"), ("text", None)]
    json_by_block: dict[int, str] = {}
    for e in events:
        if e["type"] == DELTA and e["delta"]["type"] == "input_json_delta":
            json_by_block[e["index"]] = json_by_block.get(e["index"], "") + e["delta"]["partial_json"]
    assert json_by_block == {1: '{"city": "Paris"}', 2: '{"tz": "CET"}'}
    content = accumulate(req, SCENARIOS["interleaved_parallel_calls"])["content"]
    assert [b.get("input") for b in content] == [None, {"city": "Paris"}, {"tz": "CET"}, None]
    assert [b.get("text") for b in content] == ["Both.", None, None, " Done."]
def test_cached_prompt_tokens_are_reported_as_cache_reads_and_left_out_of_input_tokens() -> None:
    finish = Finish(reason=FinishReason.STOP, usage=Usage(prompt_tokens=40, completion_tokens=3, cached_tokens=32))
    req = anthropic_request()
    deltas: list[StreamDelta] = [Content(text="abc"), finish]
    message_delta = next(e for e in payloads(replay(req, deltas)) if e["type"] == "message_delta")
    expected = {"input_tokens": 8, "output_tokens": 3, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 32}
    assert message_delta["usage"] == expected
    assert accumulate(req, deltas)["usage"] == expected == sdk_message(replay(req, deltas))["usage"]
