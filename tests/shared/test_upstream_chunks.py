"""The pure upstream-chunk parser (shared/upstream_chunks.py) on recorded and hand-written streams:
each `tests/fixtures/upstream/<name>.sse` must parse into `<name>.deltas.json`, however the bytes are cut."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from shared.deltas import Content, Error, ErrorKind, Finish, FinishReason, StreamDelta, ToolCallArgs, ToolCallStart
from shared.upstream_chunks import CUT_MESSAGE, UpstreamStream, refusal

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "upstream"
STREAMS = sorted(p.stem for p in FIXTURES.glob("*.sse"))
STOPS = {"metrale_stop_sequence": (" 6",), "llamacpp_stop_sequence": (".",)}


def as_json(delta: StreamDelta) -> dict[str, Any]:
    # `at` (a Finish's time) is stamped by the gateway worker, not the parser: 0.0 here, left out like the other unset fields
    return {"type": type(delta).__name__, **{k: v for k, v in dataclasses.asdict(delta).items() if v not in ((), None, "") and (k, v) != ("at", 0.0)}}


def parse(raw: bytes, *, piece: int = 0, stops: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    parser = UpstreamStream(stops=stops, call_id_prefix="call_test")
    deltas: list[StreamDelta] = []
    for start in range(0, len(raw), piece or len(raw) or 1):
        deltas += parser.feed(raw[start : start + (piece or len(raw))])
    deltas += parser.end()
    return [as_json(d) for d in deltas]


def test_the_fixture_folder_holds_every_kind_of_stream_the_issue_names() -> None:
    kinds = {name.split("_", 1)[0] for name in STREAMS}
    assert {"metrale", "llamacpp", "spec", "handcut"} <= kinds, STREAMS
    assert "spec_interleaved_parallel_tool_calls" in STREAMS and "handcut_stream_cut_mid_event" in STREAMS


@pytest.mark.parametrize("name", STREAMS)
def test_each_recorded_stream_parses_into_its_golden_deltas(name: str) -> None:
    raw = (FIXTURES / f"{name}.sse").read_bytes()
    golden = json.loads((FIXTURES / f"{name}.deltas.json").read_text())
    assert parse(raw, stops=STOPS.get(name, ())) == golden


@pytest.mark.parametrize("name", STREAMS)
@pytest.mark.parametrize("piece", [1, 7, 100])
def test_the_deltas_do_not_depend_on_how_the_socket_cut_the_bytes(name: str, piece: int) -> None:
    raw = (FIXTURES / f"{name}.sse").read_bytes()
    assert parse(raw, piece=piece, stops=STOPS.get(name, ())) == parse(raw, stops=STOPS.get(name, ()))


@pytest.mark.parametrize("name", STREAMS)
def test_every_stream_ends_with_exactly_one_terminal_delta_and_nothing_after_it(name: str) -> None:
    deltas = parse((FIXTURES / f"{name}.sse").read_bytes())
    terminals = [i for i, d in enumerate(deltas) if d["type"] in ("Finish", "Error")]
    assert terminals == [len(deltas) - 1]


def test_interleaved_parallel_tool_calls_keep_every_argument_fragment_by_index() -> None:
    parser = UpstreamStream()
    deltas = parser.feed((FIXTURES / "spec_interleaved_parallel_tool_calls.sse").read_bytes())
    starts = [(d.index, d.id, d.name) for d in deltas if isinstance(d, ToolCallStart)]
    assert starts == [(0, "call_a", "get_weather"), (1, "call_b", "get_time")]
    args = {i: "".join(d.arguments for d in deltas if isinstance(d, ToolCallArgs) and d.index == i) for i in (0, 1)}
    assert args == {0: '{"city": "Paris"}', 1: '{"zone": "CET"}'}
    assert [type(d).__name__ for d in deltas][2:4] == ["ToolCallArgs", "ToolCallArgs"]  # interleaved as sent
    finish = deltas[-1]
    assert isinstance(finish, Finish) and finish.reason is FinishReason.TOOL_CALLS and finish.usage.completion_tokens == 17


def test_a_stream_cut_mid_event_ends_with_one_error_after_the_text_that_arrived() -> None:
    deltas = parse((FIXTURES / "handcut_stream_cut_mid_event.sse").read_bytes())
    assert deltas[-1] == {"type": "Error", "message": CUT_MESSAGE, "kind": "api_error", "attempt": 1}
    assert all(d["type"] == "Content" for d in deltas[:-1]) and deltas[:-1]


def test_fragments_before_the_name_are_held_until_the_call_starts() -> None:
    chunks = [
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 3, "function": {"arguments": '{"a"'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 3, "id": "x", "function": {"name": "f", "arguments": ": 1}"}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 1, "completion_tokens": 2}},
    ]
    raw = b"".join(b"data: " + json.dumps(c).encode() + b"\r\n\r\n" for c in chunks) + b"data: [DONE]\r\n\r\n"
    deltas = UpstreamStream(attempt=4).feed(raw)
    assert deltas[:2] == [ToolCallStart(index=0, id="x", name="f", attempt=4), ToolCallArgs(index=0, arguments='{"a": 1}', attempt=4)]
    assert isinstance(deltas[2], Finish) and deltas[2].reason is FinishReason.TOOL_CALLS  # "stop" after a call


def test_vllm_stop_reason_names_the_matched_stop_sequence() -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "1, 2"}, "finish_reason": "stop", "stop_reason": ", 3"}]}
    deltas = UpstreamStream(stops=(", 3",)).feed(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
    assert deltas[0] == Content(text="1, 2")
    assert isinstance(deltas[1], Finish) and (deltas[1].reason, deltas[1].matched_stop) == (FinishReason.STOP_SEQUENCE, ", 3")


def test_an_event_that_is_not_json_and_an_error_event_each_end_the_stream_with_one_error() -> None:
    assert isinstance(UpstreamStream().feed(b"data: {not json\n\n")[0], Error)
    deltas = UpstreamStream().feed(b'event: error\ndata: {"message": "overloaded"}\n\ndata: {"choices": []}\n\n')
    assert len(deltas) == 1 and isinstance(deltas[0], Error) and "overloaded" in deltas[0].message


def test_reasoning_refusal_and_logprobs_map_to_their_deltas() -> None:
    delta = {"reasoning_content": "think", "content": "A", "refusal": "no"}
    logprobs = {"content": [{"token": "A", "logprob": -0.5, "top_logprobs": [{"token": "A", "logprob": -0.5}, {"token": "B", "logprob": -1.5}]}]}
    chunk = {"choices": [{"index": 0, "delta": delta, "logprobs": logprobs}]}
    deltas = UpstreamStream().feed(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    assert [type(d).__name__ for d in deltas] == ["Reasoning", "Content", "Refusal"]
    content = deltas[1]
    assert isinstance(content, Content) and content.logprobs[0].logprob == -0.5 and content.logprobs[0].top[1] == ("B", -1, -1.5)
    assert UpstreamStream().feed(b'data: {"choices": [{"index": 0, "delta": {"reasoning": "r"}}]}\n\n')[0].text == "r"  # type: ignore[union-attr]


def test_an_upstream_refusal_is_told_in_our_words_leaking_neither_credentials_nor_internals() -> None:
    internals = b'{"error": {"message": "Traceback: /srv/vllm/engine.py line 12, key sk-upstream-secret"}}'
    assert refusal(429, b"slow down") == (ErrorKind.OVERLOADED, "The upstream is overloaded (429); retry shortly.")
    assert refusal(503, internals)[0] is ErrorKind.OVERLOADED
    for status in (401, 403, 500, 502):
        kind, message = refusal(status, internals)
        assert kind is ErrorKind.INTERNAL and str(status) in message
        assert "Traceback" not in message and "sk-upstream-secret" not in message
    kind, message = refusal(400, b'{"error": {"message": "This model\'s maximum context length is 4096 tokens.", "type": "BadRequestError"}}')
    assert kind is ErrorKind.INVALID_REQUEST and message == "The upstream refused the request (400): This model's maximum context length is 4096 tokens."
    assert refusal(422, b"not json at all") == (ErrorKind.INVALID_REQUEST, "The upstream refused the request (422): not json at all")
