"""encoders.sse_readers: each protocol's streamed payloads read back into the deltas they carry, the way
`met replay --against` reads a live server. Every case encodes deltas with the protocol's own stream
encoder (with `return_token_ids`, as a replay asks) and reads the payloads back with its reader."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from encoders import registry
from encoders.reencode import encode_frames
from shared.deltas import Content, Error, ErrorKind, Finish, FinishReason, Reasoning, StreamDelta, ToolCallArgs, ToolCallStart
from shared.dumps import compare, generated_token_ids, terminal_label
from shared.ir import Protocol

from .recorded import SCENARIOS, request, usage

READ = [Protocol.OPENAI_CHAT, Protocol.ANTHROPIC_MESSAGES, Protocol.OPENAI_RESPONSES, Protocol.OPENAI_COMPLETIONS]
WITH_TOOLS = [Protocol.OPENAI_CHAT, Protocol.ANTHROPIC_MESSAGES, Protocol.OPENAI_RESPONSES]  # completions' wire has no tool calls
TEXT_ONLY = ["plain_text", "stop_sequence", "max_tokens"]


def read_back(protocol: Protocol, deltas: list[StreamDelta]) -> list[StreamDelta]:
    """`deltas` through `protocol`'s stream encoder and back through its reader, payload by payload."""
    frames = encode_frames(request(protocol, return_token_ids=True), deltas, protocol)
    reader = registry.codec(protocol).sse_reader
    assert reader is not None
    seen: list[StreamDelta] = []
    for frame in frames:
        if frame.data and frame.data != "[DONE]":
            seen += reader(orjson.loads(frame.data), seen)
    return seen


def test_every_built_in_protocol_has_a_reader() -> None:
    assert all(registry.codec(protocol).sse_reader is not None for protocol in READ)


@pytest.mark.parametrize("scenario", TEXT_ONLY)
@pytest.mark.parametrize("protocol", READ, ids=lambda p: p.value)
def test_text_token_ids_and_finish_read_back_as_they_were_sent(protocol: Protocol, scenario: str) -> None:
    recorded = SCENARIOS[scenario]
    comparison = compare(recorded, read_back(protocol, recorded), protocol=protocol)
    assert comparison.matches, comparison.diff
    assert comparison.new_tokens == len(generated_token_ids(recorded)) > 0


@pytest.mark.parametrize("protocol", WITH_TOOLS, ids=lambda p: p.value)
def test_reasoning_reads_back_as_reasoning_not_as_the_answer(protocol: Protocol) -> None:
    recorded = SCENARIOS["reasoning_then_text"]
    read = read_back(protocol, recorded)
    assert "".join(d.text for d in read if isinstance(d, Reasoning)) == "The user greets me."
    assert "".join(d.text for d in read if isinstance(d, Content)) == "Hi!"
    assert compare(recorded, read, protocol=protocol).matches


@pytest.mark.parametrize("scenario", ["two_tool_calls", "interleaved_parallel_calls"])
@pytest.mark.parametrize("protocol", WITH_TOOLS, ids=lambda p: p.value)
def test_tool_calls_read_back_with_their_id_name_and_whole_arguments(protocol: Protocol, scenario: str) -> None:
    recorded = SCENARIOS[scenario]
    read = read_back(protocol, recorded)
    starts = {d.index: (d.id, d.name) for d in read if isinstance(d, ToolCallStart)}
    sent = [(d.id, d.name) for d in recorded if isinstance(d, ToolCallStart)]
    assert sorted(starts.values()) == sorted(sent)
    for index, (call_id, _) in starts.items():
        args = "".join(d.arguments for d in read if isinstance(d, ToolCallArgs) and d.index == index)
        sent_index = next(d.index for d in recorded if isinstance(d, ToolCallStart) and d.id == call_id)
        assert orjson.loads(args) == orjson.loads("".join(d.arguments for d in recorded if isinstance(d, ToolCallArgs) and d.index == sent_index))
    assert terminal_label(read, protocol) == terminal_label(recorded, protocol)
    assert generated_token_ids(read) == generated_token_ids(recorded)  # a call's own tokens too (chat: on its chunks)


@pytest.mark.parametrize("protocol", READ, ids=lambda p: p.value)
def test_an_error_mid_stream_ends_the_read_with_an_error_after_the_text(protocol: Protocol) -> None:
    read = read_back(protocol, SCENARIOS["error_mid_stream"])
    assert isinstance(read[-1], Error) and read[-1].message
    assert "".join(d.text for d in read if isinstance(d, Content)) == "Partial"


@pytest.mark.parametrize("protocol", [Protocol.OPENAI_CHAT, Protocol.ANTHROPIC_MESSAGES, Protocol.OPENAI_COMPLETIONS], ids=lambda p: p.value)
def test_an_errors_kind_survives_where_the_wire_carries_it(protocol: Protocol) -> None:
    deltas = [Content(text="x", token_ids=(1,)), Error(message="bad request", kind=ErrorKind.INVALID_REQUEST)]
    read = read_back(protocol, deltas)
    assert isinstance(read[-1], Error) and read[-1].kind is ErrorKind.INVALID_REQUEST


@pytest.mark.parametrize("reason", list(FinishReason), ids=lambda r: r.value)
@pytest.mark.parametrize("protocol", READ, ids=lambda p: p.value)
def test_every_finish_reason_reads_back_as_the_protocol_reports_it(protocol: Protocol, reason: FinishReason) -> None:
    """The wire does not tell every reason apart (chat says `stop` for a stop sequence too), so the read
    reason is compared in the protocol's own words (`ProtocolSpec.finish_label`), as `met replay` does."""
    deltas: list[StreamDelta] = [Content(text="a", token_ids=(7,)), Finish(reason=reason, usage=usage(2), token_ids=(8,))]
    if reason in (FinishReason.TOOL_CALLS,) and protocol is not Protocol.OPENAI_COMPLETIONS:
        deltas.insert(1, ToolCallStart(index=0, id="call_1", name="f", token_ids=(9,)))
        deltas.insert(2, ToolCallArgs(index=0, arguments="{}"))
    read = read_back(protocol, deltas)
    assert terminal_label(read, protocol) == terminal_label(deltas, protocol)
    assert generated_token_ids(read) == generated_token_ids(deltas)


def test_responses_takes_the_held_back_ids_from_the_terminal_response_not_twice() -> None:
    """The terminal response lists every id; the reader adds only those no delta event carried."""
    deltas: list[StreamDelta] = [Content(text="ab", token_ids=(1, 2)), Finish(reason=FinishReason.STOP, usage=usage(3), token_ids=(3,))]
    read = read_back(Protocol.OPENAI_RESPONSES, deltas)
    assert generated_token_ids(read) == [1, 2, 3]
    assert generated_token_ids(read_back(Protocol.OPENAI_RESPONSES, [replace(deltas[0], token_ids=()), deltas[1]])) == [3]
