"""Replaying over HTTP: every protocol's stream, read back, gives the recorded token ids, text and finish reason."""

from __future__ import annotations

import io

import orjson
import pytest

from cli.replay_http import endpoint_url, frames_to_deltas, read_sse, replay_body
from encoders.reencode import encode_sse
from shared.dumps import DumpRecord, compare
from shared.ir import Protocol, SamplingParams

from ..encoders.recorded import SCENARIOS, request

# Chat streams carry no token ids on tool-call chunks, so the tool scenarios cannot be read back exactly
# there; interleaved parallel calls are put in block order by the Anthropic and Responses encoders, so
# their text reads back in that order, not in generation order (tests/encoders cover that scenario).
CASES = [
    (p, s)
    for p in Protocol
    for s in sorted(SCENARIOS)
    if s != "interleaved_parallel_calls"
    and not (p is Protocol.OPENAI_CHAT and s == "two_tool_calls")
    and not (p is Protocol.OPENAI_COMPLETIONS and ("reasoning" in s or "tool" in s))  # legacy completions carry text only
]


@pytest.mark.parametrize(("protocol", "scenario"), CASES)
def test_a_stream_with_token_ids_reads_back_into_the_recorded_output(protocol: Protocol, scenario: str) -> None:
    req = request(protocol, return_token_ids=True)
    wire = encode_sse(req, SCENARIOS[scenario], protocol)
    deltas = frames_to_deltas(protocol, read_sse(io.BytesIO(wire)))
    result = compare(SCENARIOS[scenario], deltas, protocol=protocol)
    assert result.matches, result.diff


def test_pings_and_comments_are_not_events() -> None:
    wire = b': ping\n\nevent: ping\ndata: {"type":"ping"}\n\ndata: {"a":1}\n\n'
    assert list(read_sse(io.BytesIO(wire))) == [(None, '{"a":1}')]


def test_the_replayed_body_streams_with_token_ids_and_a_fan_out_part_keeps_its_seed() -> None:
    body = {"model": "m", "messages": [], "n": 3, "seed": 11, "stream_options": {"include_usage": True}}
    req = request(Protocol.OPENAI_CHAT, id="abc-2", raw_body=orjson.dumps(body).decode(), sampling=SamplingParams(seed=13, n=1))
    sent = replay_body(DumpRecord(id=req.id, request=req, deltas=()))
    assert sent == {"model": "m", "messages": [], "n": 1, "seed": 13, "stream": True, "return_token_ids": True}


@pytest.mark.parametrize("base", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"])
def test_the_endpoint_joins_a_base_url_with_or_without_v1(base: str) -> None:
    assert endpoint_url(base, "/v1/messages") == "http://h:8000/v1/messages"
