"""The hermes tool-call parser: model text in any chunking → the same Content / ToolCallStart / ToolCallArgs."""

from __future__ import annotations

import json

import pytest

from shared.deltas import Content, StreamDelta, ToolCallArgs, ToolCallStart
from workers.tool_parsers import Llama3Parser, MistralParser
from workers.tools import CallCap, HermesParser, RepeatGuard

TWO_CALLS = (
    'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}</tool_call>\n'
    '<tool_call>{"name":"get_time","arguments":{"tz":"CET"}}</tool_call>\n'
)


def feed(text: str, size: int) -> list[StreamDelta]:
    parser = HermesParser("call_r")
    out: list[StreamDelta] = []
    for i in range(0, len(text), size):
        out.extend(parser.push(text[i : i + size]))
    return out + parser.flush()


def summary(deltas: list[StreamDelta]) -> list[tuple[str, object]]:
    """Merge consecutive fragments of the same kind: what a client accumulates."""
    merged: list[tuple[str, object]] = []
    for d in deltas:
        if isinstance(d, ToolCallStart):
            merged.append(("start", (d.index, d.id, d.name)))
        elif isinstance(d, ToolCallArgs):
            if merged and merged[-1][0] == f"args{d.index}":
                merged[-1] = (merged[-1][0], str(merged[-1][1]) + d.arguments)
            else:
                merged.append((f"args{d.index}", d.arguments))
        elif isinstance(d, Content):
            if merged and merged[-1][0] == "text":
                merged[-1] = ("text", str(merged[-1][1]) + d.text)
            else:
                merged.append(("text", d.text))
    return merged


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_two_calls_parse_the_same_in_any_chunking(size: int) -> None:
    assert summary(feed(TWO_CALLS, size)) == [
        ("text", "Let me look."),
        ("start", (0, "call_r_0", "get_weather")),
        ("args0", '{"city": "Paris", "days": [1, 2]}'),
        ("start", (1, "call_r_1", "get_time")),
        ("args1", '{"tz":"CET"}'),
    ]


def test_the_name_streams_before_the_arguments_and_arguments_stream_in_pieces() -> None:
    deltas = feed(TWO_CALLS, 1)
    first_args = next(i for i, d in enumerate(deltas) if isinstance(d, ToolCallArgs))
    assert isinstance(deltas[first_args - 1], ToolCallStart)
    assert sum(isinstance(d, ToolCallArgs) and d.index == 0 for d in deltas) > 10  # fragments, not one blob
    assert all(json.loads(a) for k, a in summary(deltas) if k.startswith("args"))  # type: ignore[arg-type]


def test_text_that_only_looks_like_the_tag_is_released() -> None:
    assert summary(feed("a <tool b <tool_cal x", 1)) == [("text", "a <tool b <tool_cal x")]


def test_plain_text_passes_through_and_no_call_is_counted() -> None:
    parser = HermesParser("c")
    assert summary(parser.push("Hello") + parser.flush()) == [("text", "Hello")]
    assert parser.calls == 0


def test_an_unterminated_call_flushes_its_arguments() -> None:
    parser = HermesParser("c")
    deltas = parser.push('<tool_call>{"name": "f", "arguments": {"a": 1}') + parser.flush()
    assert summary(deltas) == [("start", (0, "c_0", "f")), ("args0", '{"a": 1}')]
    assert parser.calls == 1


# A call cut by max_tokens never leaks its markup as text (flush(cut=True)); the guard for forced calls
# with parallel calls allowed ends the turn at a repeated call.

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'


@pytest.mark.parametrize("tail", ['<tool_call>{"', "<tool_call>", "<tool_c", '<tool_call>{"name": "get_wea'])
def test_a_call_head_cut_by_max_tokens_is_dropped_not_shown(tail: str) -> None:
    parser = HermesParser("c")
    cut = summary(parser.push(CALL + tail) + parser.flush(cut=True))
    assert cut == [("start", (0, "c_0", "get_weather")), ("args0", '{"city": "Paris"}')]
    ended = HermesParser("c")  # the model ending there on its own: the text is what it wrote, as before
    assert "<tool_c" in str(summary(ended.push("x " + tail) + ended.flush()))


def test_llama3_and_mistral_heads_cut_by_max_tokens_are_dropped() -> None:
    llama = Llama3Parser("c")
    assert summary(llama.push('{"name": "get_wea') + llama.flush(cut=True)) == []
    mistral = MistralParser("c")
    assert summary(mistral.push('Sure.[TOOL_CALLS][{"name": "f') + mistral.flush(cut=True)) == [("text", "Sure.")]


def guarded(text: str, size: int, *, cut: bool) -> tuple[list[tuple[str, object]], bool]:
    guard = RepeatGuard(HermesParser("c"))
    out: list[StreamDelta] = []
    for i in range(0, len(text), size):
        out += guard.push(text[i : i + size])
        if guard.repeated:
            break
    out += guard.flush(cut=cut)
    return summary(out), guard.repeated


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_a_repeated_call_ends_the_turn_and_is_not_delivered(size: int) -> None:
    merged, repeated = guarded(CALL * 5, size, cut=False)
    assert repeated and merged == [("start", (0, "c_0", "get_weather")), ("args0", '{"city": "Paris"}')]


@pytest.mark.parametrize("size", [1, 1000])
def test_a_repeat_cut_mid_way_is_dropped_as_a_repeat(size: int) -> None:
    merged, repeated = guarded(CALL * 2 + '<tool_call>{"name": "get_weather", "arguments": {"ci', size, cut=True)
    assert repeated and merged == [("start", (0, "c_0", "get_weather")), ("args0", '{"city": "Paris"}')]


@pytest.mark.parametrize("size", [1, 1000])
def test_calls_that_differ_are_all_delivered(size: int) -> None:
    other = CALL.replace("Paris", "Pari") + CALL.replace("Paris", "Paris2") + CALL.replace("get_weather", "get_time")
    merged, repeated = guarded(CALL + other, size, cut=False)
    assert not repeated
    assert [m for m in merged if m[0].startswith("args")] == [
        ("args0", '{"city": "Paris"}'),
        ("args1", '{"city": "Pari"}'),
        ("args2", '{"city": "Paris2"}'),
        ("args3", '{"city": "Paris"}'),
    ]


@pytest.mark.parametrize("size", [1, 7, 1000])
def test_a_call_cap_ends_the_turn_at_the_cap_th_call_and_drops_later_ones(size: int) -> None:
    """`max_tool_calls`: the turn ends as the cap-th call closes; a later call in the same text never reaches the client."""
    text = TWO_CALLS + '<tool_call>{"name":"get_date","arguments":{}}</tool_call>\n'
    cap = CallCap(RepeatGuard(HermesParser("c")), 2)
    out: list[StreamDelta] = []
    ended_after = None
    for i in range(0, len(text), size):
        out += cap.push(text[i : i + size])
        if cap.ended and ended_after is None:
            ended_after = i + size
    out += cap.flush()
    merged = summary(out)
    assert [m[1][2] for m in merged if m[0] == "start"] == ["get_weather", "get_time"]  # type: ignore[index]
    assert cap.ended and cap.calls == 2
    assert ended_after is not None and ended_after <= len(TWO_CALLS) + size  # as soon as the second call closed
    uncapped = CallCap(HermesParser("c"), 3)
    assert [m[1][2] for m in summary(uncapped.push(text) + uncapped.flush()) if m[0] == "start"] == ["get_weather", "get_time", "get_date"]  # type: ignore[index]
