"""Recorded delta sequences every protocol encoder is replayed against (shapes a worker really emits)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shared.deltas import (
    Content,
    Error,
    ErrorKind,
    Finish,
    FinishReason,
    Reasoning,
    StreamDelta,
    ToolCallArgs,
    ToolCallStart,
    Usage,
)
from shared.ir import Protocol, Request

PROMPT_IDS = (101, 102, 103, 104)


def request(protocol: Protocol, **overrides: Any) -> Request:
    base = Request(id="req01", protocol=protocol, model="tiny-chat", messages=(), created=1_700_000_000.75, prompt_token_ids=PROMPT_IDS)
    return replace(base, **overrides)


def usage(completion: int, *, reasoning: int = 0, cached: int = 0) -> Usage:
    return Usage(prompt_tokens=len(PROMPT_IDS), completion_tokens=completion, reasoning_tokens=reasoning, cached_tokens=cached)


SCENARIOS: dict[str, list[StreamDelta]] = {
    "plain_text": [
        Content(text="Hello", token_ids=(1,)),
        Content(text=", world", token_ids=(2, 3)),
        Finish(reason=FinishReason.STOP, usage=usage(4), token_ids=(4,)),
    ],
    "reasoning_then_text": [
        Reasoning(text="The user greets", token_ids=(10, 11)),
        Reasoning(text=" me.", token_ids=(12,)),
        Content(text="Hi!", token_ids=(13,)),
        Finish(reason=FinishReason.STOP, usage=usage(5, reasoning=3)),
    ],
    "sealed_reasoning_then_text": [  # a worker with the deployment key: the span's seal closes it
        Reasoning(text="Six sevens", token_ids=(10, 11)),
        Reasoning(text=" are 42.", token_ids=(12,)),
        Reasoning(text="", sealed="bWV0MVNFQUxFRA==", token_ids=(13,)),
        Content(text="42", token_ids=(14,)),
        Finish(reason=FinishReason.STOP, usage=usage(5, reasoning=3)),
    ],
    "two_tool_calls": [
        Content(text="Checking both.", token_ids=(20,)),
        ToolCallStart(index=0, id="toolu_a", name="get_weather", token_ids=(21,)),
        ToolCallArgs(index=0, arguments='{"city": ', token_ids=(22,)),
        ToolCallArgs(index=0, arguments='"Paris"}', token_ids=(23,)),
        ToolCallStart(index=1, id="toolu_b", name="get_time", token_ids=(24,)),
        ToolCallArgs(index=1, arguments='{"tz": "CET"}', token_ids=(25,)),
        Finish(reason=FinishReason.TOOL_CALLS, usage=usage(7)),
    ],
    # Two parallel calls whose argument fragments interleave, then text after the calls started.
    "interleaved_parallel_calls": [
        Content(text="Both.", token_ids=(60,)),
        ToolCallStart(index=0, id="call_a", name="get_weather", token_ids=(61,)),
        ToolCallArgs(index=0, arguments='{"city": ', token_ids=(62,)),
        ToolCallStart(index=1, id="call_b", name="get_time", token_ids=(63,)),
        ToolCallArgs(index=1, arguments='{"tz": ', token_ids=(64,)),
        ToolCallArgs(index=0, arguments='"Paris"}', token_ids=(65,)),
        Content(text=" Done.", token_ids=(66,)),
        ToolCallArgs(index=1, arguments='"CET"}', token_ids=(67,)),
        Finish(reason=FinishReason.TOOL_CALLS, usage=usage(8)),
    ],
    "stop_sequence": [
        Content(text="one, two", token_ids=(30, 31)),
        Finish(reason=FinishReason.STOP_SEQUENCE, usage=usage(3), matched_stop="three", token_ids=(32,)),
    ],
    "max_tokens": [
        Content(text="This answer is cut", token_ids=(40, 41, 42)),
        Finish(reason=FinishReason.LENGTH, usage=usage(3)),
    ],
    "error_mid_stream": [
        Content(text="Partial", token_ids=(50,)),
        Error(message="The worker ran out of memory.", kind=ErrorKind.OVERLOADED),
    ],
}
