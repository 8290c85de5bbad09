"""OpenAI Responses encoder: recorded deltas → events, checked by rule, by golden and by the official SDK."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from encoders.frames import Frame
from encoders.openai_responses import ResponseAccumulator, ResponsesStreamEncoder
from shared.deltas import Content, Error, Finish, FinishReason, Refusal, StreamDelta, ToolCallArgs, ToolCallStart, Usage
from shared.ir import Constraint, ConstraintKind, Protocol, Request, SamplingParams, Thinking, ToolKind, ToolSpec
from tests.encoders.recorded import PROMPT_IDS, SCENARIOS, request, usage

EVENT_ADAPTER: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
TERMINALS = {"response.completed", "response.incomplete", "response.failed"}

HEAD = ["response.created", "response.in_progress"]
ITEM_ADDED, ITEM_DONE, PART_ADDED, PART_DONE = (
    "response.output_item.added",
    "response.output_item.done",
    "response.content_part.added",
    "response.content_part.done",
)
TEXT_DELTA, TEXT_DONE = "response.output_text.delta", "response.output_text.done"
ARGS_DELTA, ARGS_DONE = "response.function_call_arguments.delta", "response.function_call_arguments.done"
CUSTOM_DELTA, CUSTOM_DONE = "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done"


def message_item(deltas: int) -> list[str]:
    return [ITEM_ADDED, PART_ADDED, *[TEXT_DELTA] * deltas, TEXT_DONE, PART_DONE, ITEM_DONE]


def call_item(deltas: int) -> list[str]:
    return [ITEM_ADDED, *[ARGS_DELTA] * deltas, ARGS_DONE, ITEM_DONE]


REASONING_ITEM = [
    ITEM_ADDED,
    PART_ADDED,
    "response.reasoning_text.delta",
    "response.reasoning_text.delta",
    "response.reasoning_text.done",
    PART_DONE,
    ITEM_DONE,
]
EXPECTED_EVENTS = {
    "plain_text": [*HEAD, *message_item(2), "response.completed"],
    "reasoning_then_text": [*HEAD, *REASONING_ITEM, *message_item(1), "response.completed"],
    "sealed_reasoning_then_text": [*HEAD, *REASONING_ITEM, *message_item(1), "response.completed"],
    "two_tool_calls": [*HEAD, *message_item(1), *call_item(2), *call_item(1), "response.completed"],
    "interleaved_parallel_calls": [*HEAD, *message_item(1), *call_item(2), *call_item(2), *message_item(1), "response.completed"],
    "stop_sequence": [*HEAD, *message_item(1), "response.completed"],
    "max_tokens": [*HEAD, *message_item(1), "response.incomplete"],
    "error_mid_stream": [*HEAD, *message_item(1), "error", "response.failed"],
}


SUMMARY_ADDED, SUMMARY_DONE = "response.reasoning_summary_part.added", "response.reasoning_summary_part.done"


def responses_request(**overrides: object) -> Request:
    return request(Protocol.OPENAI_RESPONSES, **overrides)


def replay(req: Request, deltas: list[StreamDelta]) -> list[Frame]:
    encoder = ResponsesStreamEncoder(req)
    frames = [frame for delta in deltas for frame in encoder.feed(delta)]
    return frames + encoder.finish()


def accumulate(req: Request, deltas: list[StreamDelta]) -> dict[str, Any]:
    acc = ResponseAccumulator(req)
    for delta in deltas:
        acc.feed(delta)
    return acc.body()


def payloads(frames: list[Frame]) -> list[dict[str, Any]]:
    return [orjson.loads(frame.data) for frame in frames]


def check_stream(frames: list[Frame]) -> None:
    """The Responses stream rules of DESIGN.md, on raw frames."""
    events = payloads(frames)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all(frame.event == event["type"] for frame, event in zip(frames, events, strict=True))
    names = [e["type"] for e in events]
    assert names[:2] == HEAD
    assert sum(name in TERMINALS for name in names) == 1 and names[-1] in TERMINALS
    assert names[-1] != "response.failed" or names[-2] == "error"
    done_items = _check_items(events[2:-1])
    terminal = events[-1]["response"]
    assert terminal["id"] == events[0]["response"]["id"]
    assert terminal["output"] == done_items
    if names[-1] != "response.failed":
        usage = terminal["usage"]
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        assert {"cached_tokens"} <= set(usage["input_tokens_details"]) and {"reasoning_tokens"} <= set(usage["output_tokens_details"])


def _check_items(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One item open at a time, contiguous output_index, parts added before deltas, every `.done` sent."""
    done: list[dict[str, Any]] = []
    item: dict[str, Any] | None = None
    part_open = False
    for event in events:
        kind = event["type"]
        if kind == ITEM_ADDED:
            assert item is None and event["output_index"] == len(done)
            item, part_open = event["item"], False
        elif kind == ITEM_DONE:
            assert item is not None and not part_open and event["output_index"] == len(done) and event["item"]["id"] == item["id"]
            done.append(event["item"])
            item = None
        elif kind == "error":
            assert item is None
        else:
            assert item is not None and (event["item_id"], event["output_index"]) == (item["id"], len(done))
            if kind in (PART_ADDED, SUMMARY_ADDED):
                assert not part_open
                part_open = True
            elif kind in (PART_DONE, SUMMARY_DONE):
                assert part_open
                part_open = False
            elif kind.endswith(".delta") and kind not in (ARGS_DELTA, CUSTOM_DELTA):
                assert part_open
    assert item is None
    return done


def sdk_replay(frames: list[Frame]) -> list[Any]:
    """Every event the official SDK's stream state hands back for the frames (validated by the SDK's types)."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    return [out for event in payloads(frames) for out in state.handle_event(EVENT_ADAPTER.validate_python(event))]


def drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_none(v) for v in value]
    return value


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_each_recorded_stream_sends_the_expected_events_in_a_valid_order(scenario: str) -> None:
    frames = replay(responses_request(), SCENARIOS[scenario])
    assert [frame.event for frame in frames] == EXPECTED_EVENTS[scenario]
    check_stream(frames)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_sdk_accumulates_each_stream_into_the_non_streaming_body(scenario: str) -> None:
    req = responses_request()
    body = accumulate(req, SCENARIOS[scenario])
    events = sdk_replay(replay(req, SCENARIOS[scenario]))
    final = events[-1].response
    assert final.model_dump(mode="json", exclude_none=True) == drop_none(body)
    # The SDK's own running snapshots (built from deltas alone) agree with the body's items too.
    for item in body["output"]:
        text_snapshots = [e.snapshot for e in events if e.type == TEXT_DELTA and e.item_id == item["id"]]
        args_snapshots = [e.snapshot for e in events if e.type == ARGS_DELTA and e.item_id == item["id"]]
        if item["type"] == "message":
            assert text_snapshots[-1] == item["content"][0]["text"]
        if item["type"] == "function_call":
            assert args_snapshots[-1] == item["arguments"]


def test_plain_text_ends_completed_with_usage_and_the_sdk_output_text() -> None:
    req = responses_request()
    events = sdk_replay(replay(req, SCENARIOS["plain_text"]))
    final = events[-1].response
    assert (final.status, final.output_text, final.id) == ("completed", "Hello, world", "resp_req01")
    assert final.usage is not None and (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (4, 4, 8)


def test_summary_mode_streams_reasoning_as_summary_text_and_include_returns_the_seal_as_encrypted_content() -> None:
    req = responses_request(thinking=Thinking(summary="auto", encrypted=True, effort="low"))
    deltas = SCENARIOS["sealed_reasoning_then_text"]
    frames = replay(req, deltas)
    check_stream(frames)
    assert [f.event for f in frames][2:9] == [
        ITEM_ADDED,
        SUMMARY_ADDED,
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        SUMMARY_DONE,
        ITEM_DONE,
    ]
    body = accumulate(req, deltas)
    item = body["output"][0]
    assert item["summary"] == [{"type": "summary_text", "text": "Six sevens are 42."}] and item["content"] == []
    assert item["encrypted_content"] == "bWV0MVNFQUxFRA=="
    assert body["reasoning"] == {"effort": "low", "summary": "auto"}
    final = sdk_replay(frames)[-1].response
    assert final.model_dump(mode="json", exclude_none=True) == drop_none(body)
    assert "encrypted_content" not in accumulate(responses_request(), deltas)["output"][0]  # not included unless asked


def test_reasoning_is_an_item_before_the_message_it_explains() -> None:
    body = accumulate(responses_request(), SCENARIOS["reasoning_then_text"])
    assert [(item["type"], item["id"]) for item in body["output"]] == [("reasoning", "rs_req01_0"), ("message", "msg_req01_1")]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "The user greets me."}]
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}


def test_tool_calls_are_function_call_items_with_the_call_ids() -> None:
    body = accumulate(responses_request(), SCENARIOS["two_tool_calls"])
    calls = [item for item in body["output"] if item["type"] == "function_call"]
    assert [(c["id"], c["call_id"], c["name"], c["arguments"], c["status"]) for c in calls] == [
        ("fc_req01_1", "toolu_a", "get_weather", '{"city": "Paris"}', "completed"),
        ("fc_req01_2", "toolu_b", "get_time", '{"tz": "CET"}', "completed"),
    ]


def test_a_stop_sequence_completes_and_a_length_cut_is_incomplete() -> None:
    assert accumulate(responses_request(), SCENARIOS["stop_sequence"])["status"] == "completed"
    cut = accumulate(responses_request(), SCENARIOS["max_tokens"])
    assert (cut["status"], cut["incomplete_details"], cut["output"][0]["status"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
        "incomplete",
    )


def test_a_refusal_is_a_refusal_part_and_an_incomplete_content_filter_response() -> None:
    deltas: list[StreamDelta] = [
        Refusal(text="I can't help with that."),
        Finish(reason=FinishReason.REFUSAL, usage=Usage(prompt_tokens=4, completion_tokens=6)),
    ]
    frames = replay(responses_request(), deltas)
    check_stream(frames)
    assert "response.refusal.delta" in [f.event for f in frames] and "response.refusal.done" in [f.event for f in frames]
    body = accumulate(responses_request(), deltas)
    assert body["output"][0]["content"] == [{"type": "refusal", "refusal": "I can't help with that."}]
    assert body["incomplete_details"] == {"reason": "content_filter"}
    assert sdk_replay(frames)[-1].response.model_dump(mode="json", exclude_none=True) == drop_none(body)


def test_an_error_is_an_error_event_then_a_failed_response_and_nothing_after() -> None:
    encoder = ResponsesStreamEncoder(responses_request())
    events = payloads([f for d in SCENARIOS["error_mid_stream"] for f in encoder.feed(d)])
    assert {k: events[-2][k] for k in ("type", "code", "message")} == {
        "type": "error",
        "code": "server_error",
        "message": "The worker ran out of memory.",
    }
    failed = events[-1]["response"]
    assert (failed["status"], failed["error"]) == ("failed", {"code": "server_error", "message": "The worker ran out of memory."})
    assert encoder.feed(Content(text="late")) == [] and encoder.finish() == [] and encoder.finish() == []
    acc = ResponseAccumulator(responses_request())
    for delta in SCENARIOS["error_mid_stream"]:
        acc.feed(delta)
    assert acc.error is not None and acc.finish is None and acc.body()["status"] == "failed"


def test_finish_is_idempotent_and_fails_a_cut_stream() -> None:
    encoder = ResponsesStreamEncoder(responses_request())
    frames = encoder.feed(Content(text="half")) + encoder.finish()
    check_stream(frames)
    assert [f.event for f in frames][-2:] == ["error", "response.failed"]
    assert encoder.finish() == [] and encoder.feed(Content(text="more")) == []


def test_an_error_before_any_output_still_opens_with_response_created() -> None:
    frames = replay(responses_request(), [Error(message="No worker.")])
    assert [f.event for f in frames] == [*HEAD, "error", "response.failed"]
    check_stream(frames)


def test_a_cancelled_request_ends_with_one_incomplete_event_carrying_status_cancelled() -> None:
    frames = replay(
        responses_request(), [Content(text="x"), Finish(reason=FinishReason.CANCELLED, usage=Usage(prompt_tokens=4, completion_tokens=1))]
    )
    check_stream(frames)
    assert frames[-1].event == "response.incomplete" and orjson.loads(frames[-1].data)["response"]["status"] == "cancelled"


def test_the_response_object_echoes_the_request_settings() -> None:
    req = responses_request(
        sampling=SamplingParams(temperature=0.2, top_p=0.9, max_tokens=64),
        tools=(ToolSpec(name="get_weather", description="Weather now.", parameters_json='{"type":"object"}'),),
        tool_choice="function:get_weather",
        parallel_tool_calls=False,
        metadata=(("team", "search"),),
        raw_body='{"instructions": "Be brief.", "previous_response_id": "resp_prev", "store": false}',
    )
    created = payloads(replay(req, SCENARIOS["plain_text"]))[0]["response"]
    assert {
        k: created[k]
        for k in (
            "instructions",
            "previous_response_id",
            "store",
            "temperature",
            "top_p",
            "max_output_tokens",
            "parallel_tool_calls",
            "metadata",
        )
    } == {
        "instructions": "Be brief.",
        "previous_response_id": "resp_prev",
        "store": False,
        "temperature": 0.2,
        "top_p": 0.9,
        "max_output_tokens": 64,
        "parallel_tool_calls": False,
        "metadata": {"team": "search"},
    }
    assert created["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert created["tools"] == [
        {"type": "function", "name": "get_weather", "description": "Weather now.", "parameters": {"type": "object"}, "strict": None}
    ]
    sdk_replay(replay(req, SCENARIOS["two_tool_calls"]))


def test_token_ids_never_appear_unless_the_request_asked() -> None:
    for scenario in SCENARIOS.values():
        assert all(b"token_ids" not in frame.data.encode() for frame in replay(responses_request(), scenario))
        assert "token_ids" not in accumulate(responses_request(), scenario)


def test_with_return_token_ids_deltas_carry_their_tokens_and_the_response_carries_all() -> None:
    req = responses_request(return_token_ids=True)
    deltas = SCENARIOS["two_tool_calls"]
    events = payloads(replay(req, deltas))
    expected = [t for d in deltas if not isinstance(d, Error) for t in d.token_ids]
    assert [t for e in events for t in e.get("token_ids", [])] == expected
    assert events[-1]["response"]["token_ids"] == expected and events[-1]["response"]["prompt_token_ids"] == list(PROMPT_IDS)
    assert accumulate(req, deltas)["token_ids"] == expected


def test_golden_plain_text_frames() -> None:
    """Expected events written from the Responses streaming docs, not from the encoder's output."""
    deltas: list[StreamDelta] = [
        Content(text="Hi"),
        Content(text=" there"),
        Finish(reason=FinishReason.STOP, usage=Usage(prompt_tokens=4, completion_tokens=2, cached_tokens=1), at=1700000003.7),
    ]
    response = {
        "id": "resp_req01",
        "object": "response",
        "created_at": 1700000000,
        "completed_at": None,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "metadata": {},
        "model": "tiny-chat",
        "output": [],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": True,
        "temperature": None,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "top_logprobs": 0,
        "max_tool_calls": None,
        "service_tier": "default",
        "safety_identifier": None,
        "prompt_cache_key": None,
        "truncation": "disabled",
        "usage": None,
        "user": None,
    }
    where = {"item_id": "msg_req01_0", "output_index": 0}
    empty_text = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    final_text = {"type": "output_text", "text": "Hi there", "annotations": [], "logprobs": []}
    item = {"id": "msg_req01_0", "type": "message", "status": "in_progress", "role": "assistant", "content": []}
    done_item = item | {"status": "completed", "content": [final_text]}
    usage = {
        "input_tokens": 4,
        "input_tokens_details": {"cached_tokens": 1, "cache_write_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 6,
    }
    completed = response | {"status": "completed", "completed_at": 1700000003, "output": [done_item], "usage": usage}
    expected = [
        {"type": "response.created", "response": response},
        {"type": "response.in_progress", "response": response},
        {"type": "response.output_item.added", "output_index": 0, "item": item},
        {"type": "response.content_part.added", **where, "content_index": 0, "part": empty_text},
        {"type": "response.output_text.delta", **where, "content_index": 0, "delta": "Hi", "logprobs": []},
        {"type": "response.output_text.delta", **where, "content_index": 0, "delta": " there", "logprobs": []},
        {"type": "response.output_text.done", **where, "content_index": 0, "text": "Hi there", "logprobs": []},
        {"type": "response.content_part.done", **where, "content_index": 0, "part": final_text},
        {"type": "response.output_item.done", "output_index": 0, "item": done_item},
        {"type": "response.completed", "response": completed},
    ]
    frames = replay(responses_request(), deltas)
    assert [(f.event, orjson.loads(f.data)) for f in frames] == [(e["type"], e | {"sequence_number": n}) for n, e in enumerate(expected)]
    assert accumulate(responses_request(), deltas) == completed


def test_a_tool_call_start_with_no_arguments_still_sends_every_done_event() -> None:
    frames = replay(
        responses_request(), [ToolCallStart(index=0, id="call_x", name="ping"), Finish(reason=FinishReason.TOOL_CALLS, usage=Usage())]
    )
    check_stream(frames)
    assert [f.event for f in frames] == [*HEAD, *call_item(0), "response.completed"]


def test_interleaved_parallel_calls_become_whole_function_call_items_in_call_order() -> None:
    req = responses_request()
    frames = replay(req, SCENARIOS["interleaved_parallel_calls"])
    check_stream(frames)
    output = payloads(frames)[-1]["response"]["output"]
    assert [(i["type"], i.get("name"), i.get("arguments")) for i in output] == [
        ("message", None, None),
        ("function_call", "get_weather", '{"city": "Paris"}'),
        ("function_call", "get_time", '{"tz": "CET"}'),
        ("message", None, None),
    ]
    assert [i["call_id"] for i in output if i["type"] == "function_call"] == ["call_a", "call_b"]
    assert accumulate(req, SCENARIOS["interleaved_parallel_calls"])["output"] == output


PATCH = "*** Begin Patch\n*** Update File: a.py\n-x = {\n+x = [\n*** End Patch"
CUSTOM_TOOLS = (
    ToolSpec(name="apply_patch", description="Edit files.", kind=ToolKind.CUSTOM, input_format=Constraint(kind=ConstraintKind.LARK, text='start: "***" /(.|\\n)*/')),
    ToolSpec(name="note", kind=ToolKind.CUSTOM),
    ToolSpec(name="get_time", parameters_json='{"type":"object"}'),
)
CUSTOM_CALLS: list[StreamDelta] = [
    Content(text="Patching.", token_ids=(1,)),
    ToolCallStart(index=0, id="call_req01_0", name="apply_patch", token_ids=(2,)),
    ToolCallArgs(index=0, arguments=PATCH[:20], token_ids=(3,)),
    ToolCallArgs(index=0, arguments=PATCH[20:], token_ids=(4,)),
    ToolCallStart(index=1, id="call_req01_1", name="get_time", token_ids=(5,)),
    ToolCallArgs(index=1, arguments='{"tz": "CET"}', token_ids=(6,)),
    Finish(reason=FinishReason.TOOL_CALLS, usage=usage(7)),
]


def test_a_call_to_a_custom_tool_is_a_custom_tool_call_item_with_its_raw_input_streamed() -> None:
    req = responses_request(tools=CUSTOM_TOOLS, tool_choice="function:apply_patch")
    frames = replay(req, CUSTOM_CALLS)
    assert [f.event for f in frames] == [*HEAD, *message_item(1), ITEM_ADDED, CUSTOM_DELTA, CUSTOM_DELTA, CUSTOM_DONE, ITEM_DONE, *call_item(1), "response.completed"]
    check_stream(frames)
    events = payloads(frames)
    deltas = [e for e in events if e["type"] == CUSTOM_DELTA]
    assert [set(e) for e in deltas] == [{"type", "item_id", "output_index", "delta", "sequence_number"}] * 2
    [done] = [e for e in events if e["type"] == CUSTOM_DONE]
    assert (done["item_id"], done["output_index"], done["input"]) == ("ctc_req01_1", 1, PATCH)
    body = accumulate(req, CUSTOM_CALLS)
    custom = body["output"][1]
    assert custom == {"id": "ctc_req01_1", "type": "custom_tool_call", "status": "completed", "input": PATCH, "call_id": "call_req01_0", "name": "apply_patch"}
    assert body["output"][2]["type"] == "function_call" and body["output"][2]["arguments"] == '{"tz": "CET"}'
    assert body["tool_choice"] == {"type": "custom", "name": "apply_patch"}
    assert body["tools"][0] == {"type": "custom", "name": "apply_patch", "description": "Edit files.", "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "***" /(.|\\n)*/'}}
    assert body["tools"][1]["format"] == {"type": "text"}


def test_the_sdk_accumulates_a_custom_tool_call_stream_into_the_non_streaming_body() -> None:
    req = responses_request(tools=CUSTOM_TOOLS, tool_choice="required")
    body = accumulate(req, CUSTOM_CALLS)
    final = sdk_replay(replay(req, CUSTOM_CALLS))[-1].response
    assert final.model_dump(mode="json", exclude_none=True) == drop_none(body)
    [call] = [item for item in final.output if item.type == "custom_tool_call"]
    assert (call.name, call.input, call.call_id) == ("apply_patch", PATCH, "call_req01_0")


def test_a_call_to_a_namespaced_function_is_handed_back_under_the_clients_name_and_namespace() -> None:
    spec = ToolSpec(name="multi_agent_v1__close_agent", namespace="multi_agent_v1", client_name="close_agent")
    req = responses_request(tools=(spec, ToolSpec(name="exec_command")))
    deltas: list[StreamDelta] = [
        ToolCallStart(index=0, id="call_a", name="multi_agent_v1__close_agent"),
        ToolCallStart(index=1, id="call_b", name="exec_command"),
        Finish(reason=FinishReason.TOOL_CALLS, usage=Usage()),
    ]
    frames = replay(req, deltas)
    check_stream(frames)
    output = payloads(frames)[-1]["response"]["output"]
    assert [(i["name"], i.get("namespace")) for i in output] == [("close_agent", "multi_agent_v1"), ("exec_command", None)]
    assert payloads(frames)[len(HEAD)]["item"]["namespace"] == "multi_agent_v1"  # already on output_item.added
    assert accumulate(req, deltas)["output"] == output
    tools = payloads(frames)[-1]["response"]["tools"]
    assert [(t["type"], t["name"]) for t in tools] == [("namespace", "multi_agent_v1"), ("function", "exec_command")]
    assert [t["name"] for t in tools[0]["tools"]] == ["close_agent"]
