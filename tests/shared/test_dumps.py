"""Dump records: round trips, redaction, the replay comparison and re-encoding into every protocol."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from encoders.anthropic_messages import MessagesStreamEncoder
from encoders.reencode import encode_sse
from shared.codec import CodecError
from shared.deltas import Content, Error, Finish, FinishReason, StreamDelta
from shared.dumps import (
    DumpRecord,
    compare,
    display_status,
    parse_meta,
    read_records,
    record_from_dict,
    record_to_dict,
    record_to_line,
    terminal_label,
)
from shared.ir import Message, Protocol, Role, SamplingParams, TextPart, ToolCall
from shared.redact import REDACTED

from ..encoders.recorded import SCENARIOS, request, usage

META = {"status": "finished", "worker": "w1", "attempt": 2, "received_at": 1.5, "finished_at": 2.5, "outcome": "stop"}


def record(scenario: str = "plain_text", protocol: Protocol = Protocol.OPENAI_CHAT, **overrides: object) -> DumpRecord:
    req = request(protocol, **{"sampling": SamplingParams(temperature=0.0, seed=7), "raw_body": '{"model":"m"}', **overrides})
    return DumpRecord(id=req.id, request=req, deltas=tuple(SCENARIOS[scenario]), meta=dict(META))


def frames(data: bytes) -> list[tuple[str | None, str]]:
    """(event, data) per SSE event."""
    out = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines.get("event"), lines.get("data", "")))
    return out


# ---- records -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_record_survives_a_jsonl_round_trip(scenario: str) -> None:
    original = record(scenario)
    (again,) = read_records([record_to_line(original)])
    assert again == original


def test_the_record_dict_has_the_documented_shape() -> None:
    doc = record_to_dict(record())
    assert sorted(doc) == ["deltas", "id", "meta", "outcome", "request", "v"]
    assert doc["v"] == 1 and doc["id"] == "req01" and doc["outcome"] == "stop"
    assert doc["deltas"][0] == {"v": 1, "t": "content", "text": "Hello", "token_ids": [1], "attempt": 1, "logprobs": []}
    assert doc["meta"]["attempt"] == 2 and doc["meta"]["worker"] == "w1"


def test_the_outcome_falls_back_to_the_terminal_delta_and_is_none_while_running() -> None:
    assert replace(record("error_mid_stream"), meta={}).outcome == "error:overloaded_error"
    assert replace(record(), meta={}, deltas=(Content(text="x"),)).outcome is None


def test_a_newer_dump_version_is_refused() -> None:
    doc = record_to_dict(record())
    with pytest.raises(CodecError):
        record_from_dict({**doc, "v": 2})


def test_secrets_in_the_body_metadata_and_tool_arguments_are_redacted() -> None:
    messages = (
        Message(role=Role.USER, content=(TextPart(text="hi"),)),
        Message(role=Role.ASSISTANT, tool_calls=(ToolCall(id="c1", name="login", arguments='{"user":"bo","password":"hunter2"}'),)),
    )
    body = '{"model":"m","extra":{"api_key":"sk-live-123"},"messages":[]}'
    secret = record(raw_body=body, metadata=(("api_key", "sk-meta-456"), ("user", "bo")), messages=messages)
    line = record_to_line(secret)
    for value in (b"sk-live-123", b"sk-meta-456", b"hunter2"):
        assert value not in line
    doc = orjson.loads(line)
    assert orjson.loads(doc["request"]["raw_body"])["extra"]["api_key"] == REDACTED
    assert doc["request"]["metadata"] == [["api_key", REDACTED], ["user", "bo"]]


def test_a_clean_raw_body_is_kept_byte_for_byte() -> None:
    body = '{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":5}'
    assert record_to_dict(record(raw_body=body))["request"]["raw_body"] == body


def test_the_meta_hash_is_typed_and_statuses_split_by_outcome() -> None:
    meta = parse_meta({b"status": b"finished", b"attempt": b"2", b"received_at": b"1700000000.5", b"outcome": b"cancelled", b"new": b"x"})
    assert meta == {"status": "finished", "attempt": 2, "received_at": 1700000000.5, "outcome": "cancelled", "new": "x"}
    assert display_status(meta) == "cancelled"
    assert display_status({"status": "finished", "outcome": "error:api_error"}) == "error"
    assert display_status({"status": "running"}) == "running"
    assert display_status({}) == "expired"


# ---- compare -------------------------------------------------------------------------------------------


def test_identical_deltas_match_with_no_diff() -> None:
    result = compare(SCENARIOS["two_tool_calls"], list(SCENARIOS["two_tool_calls"]))
    assert result.matches and result.diff == "" and result.first_divergent_token is None
    assert result.recorded_tokens == result.new_tokens == 6


def test_a_changed_token_is_reported_with_its_index_and_the_text_around_it() -> None:
    recorded: list[StreamDelta] = [
        Content(text="The capital of France", token_ids=(1, 2, 3, 4)),
        Content(text=" is Paris.", token_ids=(5, 6, 7)),
        Finish(reason=FinishReason.STOP, usage=usage(7)),
    ]
    new: list[StreamDelta] = [recorded[0], Content(text=" is Lyon.", token_ids=(5, 9, 7)), recorded[2]]
    result = compare(recorded, new)
    assert not result.matches and result.first_divergent_token == 5
    assert result.diff.splitlines() == [
        "first divergent token: #5 (token 6 recorded, token 9 now)",
        'text before:  "The capital of France is "',
        'recorded:     "Paris."',
        'now:          "Lyon."',
    ]


def test_a_shorter_replay_diverges_where_it_ends_and_names_both_finish_reasons() -> None:
    recorded = SCENARIOS["max_tokens"]
    new: list[StreamDelta] = [Content(text="This answer", token_ids=(40, 41)), Finish(reason=FinishReason.STOP, usage=usage(2))]
    result = compare(recorded, new)
    assert result.first_divergent_token == 2
    assert "(token 42 recorded, ended now)" in result.diff
    assert "finish reason: length recorded, stop now" in result.diff


def test_same_tokens_with_different_text_do_not_match() -> None:
    new = [Content(text="Hullo", token_ids=(1,)), *SCENARIOS["plain_text"][1:]]
    result = compare(SCENARIOS["plain_text"], new)
    assert not result.matches and result.first_divergent_token is None
    assert "token ids agree, but the text differs" in result.diff


def test_finish_reasons_compare_in_a_protocols_own_words_when_asked() -> None:
    stop_sequence = SCENARIOS["stop_sequence"]
    plain_stop: list[StreamDelta] = [*stop_sequence[:-1], replace(stop_sequence[-1], reason=FinishReason.STOP)]
    assert not compare(stop_sequence, plain_stop).matches
    assert compare(stop_sequence, plain_stop, protocol=Protocol.OPENAI_CHAT).matches  # both "stop" on the chat wire
    assert not compare(stop_sequence, plain_stop, protocol=Protocol.ANTHROPIC_MESSAGES).matches


def test_an_error_and_a_missing_terminal_are_finish_differences() -> None:
    result = compare(SCENARIOS["error_mid_stream"], SCENARIOS["error_mid_stream"][:1])
    assert not result.matches and "finish reason: error:overloaded_error recorded, unfinished now" in result.diff
    assert compare([Error(message="x")], [Error(message="y")]).matches


# ---- encode_sse ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_clients_own_protocol_gives_the_encoders_exact_bytes(scenario: str) -> None:
    rec = record(scenario, Protocol.ANTHROPIC_MESSAGES)
    encoder = MessagesStreamEncoder(rec.request)
    served = [f for d in rec.deltas for f in encoder.feed(d)] + encoder.finish()
    expected = b"".join(f.to_sse(position) for position, f in enumerate(served))  # each with its position, as served
    assert encode_sse(rec.request, rec.deltas, Protocol.ANTHROPIC_MESSAGES) == expected


def test_a_chat_record_re_encodes_as_anthropic_events() -> None:
    rec = record("plain_text", Protocol.OPENAI_CHAT)
    events = frames(encode_sse(rec.request, rec.deltas, Protocol.ANTHROPIC_MESSAGES))
    assert [e for e, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(orjson.loads(data)["type"] == event for event, data in events)
    assert orjson.loads(events[0][1])["message"]["id"] == "msg_req01"


def test_an_anthropic_record_re_encodes_as_responses_events_numbered_from_zero() -> None:
    rec = record("two_tool_calls", Protocol.ANTHROPIC_MESSAGES)
    payloads = [orjson.loads(data) for _, data in frames(encode_sse(rec.request, rec.deltas, Protocol.OPENAI_RESPONSES))]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert payloads[0]["type"] == "response.created" and payloads[-1]["type"] == "response.completed"
    assert payloads[-1]["response"]["id"] == "resp_req01" and payloads[-1]["response"]["created_at"] == 1_700_000_000


def test_a_responses_record_re_encodes_as_chat_chunks_ending_in_done() -> None:
    rec = record("max_tokens", Protocol.OPENAI_RESPONSES)
    events = frames(encode_sse(rec.request, rec.deltas, Protocol.OPENAI_CHAT))
    assert events[-1] == (None, "[DONE]")
    chunks = [orjson.loads(data) for _, data in events[:-1]]
    assert {c["id"] for c in chunks} == {"chatcmpl-req01"} and {c["created"] for c in chunks} == {1_700_000_000}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stream_cut_before_its_terminal_event_ends_as_a_cut_stream() -> None:
    rec = record("plain_text", Protocol.ANTHROPIC_MESSAGES)
    events = frames(encode_sse(rec.request, rec.deltas[:2], Protocol.ANTHROPIC_MESSAGES))
    assert events[-1][0] == "error"


def test_a_completions_outcome_is_said_in_openai_words() -> None:
    deltas = SCENARIOS["stop_sequence"]
    assert terminal_label(deltas, Protocol.OPENAI_COMPLETIONS) == "stop" and terminal_label(deltas) == "stop_sequence"
