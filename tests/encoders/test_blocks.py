"""The block sequencer: one block open at a time over interleaved deltas, nothing dropped."""

from __future__ import annotations

from encoders.blocks import TOOL, BlockSequencer, Op
from shared.deltas import Content, ToolCallArgs, ToolCallStart


def trace(ops: list[Op]) -> list[tuple[str, int]]:
    return [(op.kind, op.index) for op in ops]


def test_a_second_call_is_held_until_the_first_calls_arguments_are_whole_json() -> None:
    seq = BlockSequencer()
    assert trace(seq.feed(ToolCallStart(index=0, id="a", name="f"), TOOL)) == [("open", 0)]
    assert trace(seq.feed(ToolCallArgs(index=0, arguments='{"x": '), TOOL)) == [("append", 0)]
    assert seq.feed(ToolCallStart(index=1, id="b", name="g"), TOOL) == []  # held: call 0 is not whole yet
    assert seq.feed(ToolCallArgs(index=1, arguments="{}"), TOOL) == []
    assert trace(seq.feed(ToolCallArgs(index=0, arguments="1}"), TOOL)) == [("append", 0), ("close", 0), ("open", 1), ("append", 1)]
    assert trace(seq.finish()) == [("close", 1)]


def test_text_joins_the_last_text_block_and_closes_once_something_follows() -> None:
    seq = BlockSequencer()
    assert trace(seq.feed(Content(text="a"), "text")) == [("open", 0)]
    assert trace(seq.feed(Content(text="b"), "text")) == [("append", 0)]
    assert trace(seq.feed(ToolCallStart(index=0, id="a", name="f"), TOOL)) == [("close", 0), ("open", 1)]


def test_a_call_cut_before_its_json_is_whole_still_closes_at_the_end_with_every_fragment() -> None:
    seq = BlockSequencer()
    seq.feed(ToolCallStart(index=0, id="a", name="f"), TOOL)
    seq.feed(ToolCallArgs(index=0, arguments='{"x": '), TOOL)
    held = seq.feed(Content(text="late"), "text")
    assert held == []
    assert trace(seq.finish()) == [("close", 0), ("open", 1), ("close", 1)]


def test_arguments_of_a_call_that_never_started_are_ignored() -> None:
    assert BlockSequencer().feed(ToolCallArgs(index=3, arguments="{}"), TOOL) == []
