"""Re-encoding: every recorded stream as every protocol's SSE, whatever protocol it was recorded in;
positions, determinism (ids and timestamps from the request alone), cut streams, and the text carried over."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson
import pytest

from encoders import registry
from encoders.frames import Frame
from encoders.reencode import encode_frames, encode_sse
from shared.deltas import is_terminal
from shared.ir import Protocol, Request

from .recorded import SCENARIOS, request

PROTOCOLS = list(Protocol)
# An Anthropic thinking block that came without a seal gets a signature that is a digest of the request id:
# derived from it, but not as text, so the id-swap check below leaves that scenario out.
TEXTUAL_IDS = sorted(name for name in SCENARIOS if name != "reasoning_then_text")


def sse_events(data: bytes) -> list[dict[str, str]]:
    """Each SSE event's fields (id, event, data, and `:` for a comment), in the order they came."""
    assert data.endswith(b"\n\n")
    events = []
    for block in data.decode().split("\n\n")[:-1]:
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            name, _, value = line.partition(": ")
            fields[name] = value
        events.append(fields)
    return events


def streamed_text(protocol: Protocol, frames: list[Frame]) -> str:
    """The answer text a client of `protocol` reads from the stream."""
    payloads = [orjson.loads(f.data) for f in frames if f.data and f.data != "[DONE]"]
    if protocol is Protocol.OPENAI_CHAT:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in payloads if c.get("choices"))
    if protocol is Protocol.OPENAI_COMPLETIONS:
        return "".join(c["choices"][0]["text"] for c in payloads if c.get("choices"))
    if protocol is Protocol.ANTHROPIC_MESSAGES:
        return "".join(p["delta"]["text"] for p in payloads if p["type"] == "content_block_delta" and p["delta"]["type"] == "text_delta")
    return "".join(p["delta"] for p in payloads if p["type"] == "response.output_text.delta")


def test_every_protocol_has_a_codec() -> None:
    assert all(registry.codec(p).protocol is p for p in Protocol)


@pytest.mark.parametrize("target", PROTOCOLS, ids=str)
def test_the_encoder_sees_the_recorded_request_with_only_its_protocol_switched(target: Protocol, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Request] = []
    real = registry.codec(target).stream_encoder

    def recording(req: Request) -> Any:
        seen.append(req)
        return real(req)

    monkeypatch.setitem(registry._CODECS, target, replace(registry.codec(target), stream_encoder=recording))
    source = Protocol.OPENAI_CHAT if target is not Protocol.OPENAI_CHAT else Protocol.ANTHROPIC_MESSAGES
    recorded = request(source, include_usage=True, return_token_ids=True, raw_body='{"model":"tiny-chat"}')
    encode_sse(recorded, SCENARIOS["plain_text"], target)
    assert seen == [replace(recorded, protocol=target)]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("target", PROTOCOLS, ids=str)
def test_the_output_depends_on_the_target_protocol_not_the_recorded_one(target: Protocol, scenario: str) -> None:
    outputs = {source: encode_sse(request(source), SCENARIOS[scenario], target) for source in PROTOCOLS}
    assert len(set(outputs.values())) == 1, f"differs by recorded protocol: {sorted(outputs)}"


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("target", PROTOCOLS, ids=str)
def test_each_event_carries_its_position_from_zero_and_no_keep_alive(target: Protocol, scenario: str) -> None:
    req = request(Protocol.OPENAI_CHAT)
    events = sse_events(encode_sse(req, SCENARIOS[scenario], target))
    assert [e["id"] for e in events] == [str(i) for i in range(len(encode_frames(req, SCENARIOS[scenario], target)))]
    assert all(next(iter(e)) == "id" for e in events)  # `id:` is the first line of each event
    assert not any(e.get("event") == "ping" or ":" in e or "" in e for e in events)


@pytest.mark.parametrize("target", PROTOCOLS, ids=str)
def test_the_recorded_text_arrives_in_every_protocol(target: Protocol) -> None:
    frames = encode_frames(request(Protocol.ANTHROPIC_MESSAGES), SCENARIOS["plain_text"], target)
    assert streamed_text(target, frames) == "Hello, world"


@pytest.mark.parametrize("target", PROTOCOLS, ids=str)
def test_the_same_record_always_gives_the_same_bytes(target: Protocol) -> None:
    req = request(target)
    for deltas in SCENARIOS.values():
        assert encode_sse(req, deltas, target) == encode_sse(req, list(deltas), target)


@pytest.mark.parametrize("scenario", TEXTUAL_IDS)
@pytest.mark.parametrize("target", PROTOCOLS, ids=str)
def test_ids_and_timestamps_come_from_the_recorded_request_alone(target: Protocol, scenario: str) -> None:
    deltas = SCENARIOS[scenario]
    original = encode_sse(request(target), deltas, target)
    assert b"req01" in original
    assert (b"1700000000" in original) is (target is not Protocol.ANTHROPIC_MESSAGES)  # Messages has no timestamp
    other_id = encode_sse(request(target, id="zq9x"), deltas, target)
    assert other_id.replace(b"zq9x", b"req01") == original and b"req01" not in other_id
    other_time = encode_sse(request(target, created=1_800_000_123.2), deltas, target)
    assert other_time.replace(b"1800000123", b"1700000000") == original and b"1700000000" not in other_time


@pytest.mark.parametrize("target", PROTOCOLS, ids=str)
def test_deltas_may_come_from_a_one_shot_iterator(target: Protocol) -> None:
    deltas = SCENARIOS["two_tool_calls"]
    assert encode_frames(request(target), iter(deltas), target) == encode_frames(request(target), deltas, target)


# How a stream with no recorded terminal event ends, per protocol: the last frames the encoder's `finish()` adds.
CUT_CLOSE: dict[Protocol, list[tuple[str | None, str]]] = {
    Protocol.OPENAI_CHAT: [(None, "[DONE]")],
    Protocol.OPENAI_COMPLETIONS: [(None, "[DONE]")],
    Protocol.ANTHROPIC_MESSAGES: [("error", "error")],
    Protocol.OPENAI_RESPONSES: [("error", "error"), ("response.failed", "response.failed")],
}


def frame_kind(frame: Frame) -> tuple[str | None, str]:
    """(SSE event name, data `type` or the raw data when it is not a JSON object)."""
    if frame.data.startswith("{"):
        return frame.event, str(orjson.loads(frame.data).get("type", ""))
    return frame.event, frame.data


def common_prefix(a: list[Frame], b: list[Frame]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("target", PROTOCOLS, ids=str)
def test_a_record_cut_before_its_terminal_event_streams_the_same_start_then_closes_as_cut(target: Protocol, scenario: str) -> None:
    full_deltas = SCENARIOS[scenario]
    assert is_terminal(full_deltas[-1])
    req = request(target)
    full = encode_frames(req, full_deltas, target)
    cut = encode_frames(req, full_deltas[:-1], target)
    close = CUT_CLOSE[target]
    assert [frame_kind(f) for f in cut[-len(close) :]] == close
    before_close = cut[: -len(close)]
    # What streamed before the cut is what the full record streams; past that, only the closing of what
    # was still open (Responses' `.done` events, its items marked incomplete) may differ.
    closing = before_close[common_prefix(before_close, full) :]
    assert all(frame_kind(f)[1].endswith(".done") for f in closing), [frame_kind(f) for f in closing]
    assert all(orjson.loads(f.data)["item"]["status"] == "incomplete" for f in closing if frame_kind(f)[1] == "response.output_item.done")
