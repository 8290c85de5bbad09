"""The Responses API's WebSocket mode through the openai SDK's own client (`client.responses.connect()`) against
a live `met serve`: a response (text, or a forced tool call) streamed over the socket is the SSE stream of the
same request, event for event; `previous_response_id` continues a `store: false` response on the same socket;
bad input is an `error` event naming the parameter and the socket goes on; closing the socket cancels the
running response."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.resources.responses.responses import ResponsesConnection

from shared import keys
from shared.codec import decode_delta
from shared.deltas import Finish, FinishReason
from tests import openresponses

from ..conftest import LiveServer

pytestmark = pytest.mark.e2e

TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")
# Output the model cannot end early (constrained decoding allows no end before 4000 characters of story).
LONG_STORY: Any = {
    "format": {
        "type": "json_schema",
        "name": "story",
        "strict": True,
        "schema": {"type": "object", "properties": {"story": {"type": "string", "minLength": 4000}}, "required": ["story"], "additionalProperties": False},
    }
}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": False}


@pytest.fixture
def api(live_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def until_terminal(connection: ResponsesConnection) -> list[Any]:
    """The events of one response (or the error event answering its response.create), up to its terminal one."""
    events = [connection.recv()]
    while events[-1].type not in TERMINAL:
        events.append(connection.recv())
    for event in events:  # each against the Open Responses specification (tests/openresponses.py), as sent
        openresponses.check_ws_event(event.model_dump(mode="json", exclude_unset=True))
    return events


def sse(api: openai.OpenAI, body: dict[str, Any]) -> list[Any]:
    with api.responses.create(stream=True, **body) as stream:
        return list(stream)


def same_shape(event: Any, response_ids: tuple[str, ...]) -> str:
    """An event as JSON with what differs between two runs of one request blanked: the response's id (and the
    ids made from it), timestamps, the WebSocket lane and cached-token counts (a prefix-cache hit)."""
    text = json.dumps(event.model_dump(exclude={"stream_id"}), sort_keys=True)
    for rid in response_ids:
        text = text.replace(rid.removeprefix("resp_"), "ID")
    shape = json.loads(text)
    response = shape.get("response") or {}
    response.pop("created_at", None)
    response.pop("completed_at", None)
    if response.get("usage"):
        response["usage"].pop("input_tokens_details", None)
    return json.dumps(shape, sort_keys=True)


def assert_same_stream(over_ws: list[Any], over_sse: list[Any]) -> None:
    assert [e.type for e in over_ws] == [e.type for e in over_sse]
    assert [e.sequence_number for e in over_ws] == list(range(len(over_ws)))
    ids = (over_ws[0].response.id, over_sse[0].response.id)
    assert ids[0] != ids[1]
    assert [same_shape(e, ids) for e in over_ws] == [same_shape(e, ids) for e in over_sse]


def test_a_response_over_the_websocket_is_the_sse_stream_of_the_same_request(api: openai.OpenAI) -> None:
    body: Any = {"model": "m", "input": "Name the capital of France.", "temperature": 0, "max_output_tokens": 24}
    over_sse = sse(api, body)
    with api.responses.connect() as connection:
        connection.response.create(**body, stream_id="main")
        over_ws = until_terminal(connection)
    assert over_ws[0].type == "response.created" and over_ws[-1].type == over_sse[-1].type
    assert_same_stream(over_ws, over_sse)
    assert all(e.stream_id == "main" for e in over_ws)  # the lane is echoed on every event of its response
    final, reference = over_ws[-1].response, over_sse[-1].response
    assert final.output_text and final.output_text == reference.output_text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (reference.usage.input_tokens, reference.usage.output_tokens)


def test_a_forced_tool_call_over_the_websocket_is_the_sse_one(api: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "name": "get_weather", "description": "Current weather in a city.", "parameters": SCHEMA, "strict": True}]
    body: Any = {"model": "m", "input": "What is the weather in Paris?", "tools": tools, "tool_choice": {"type": "function", "name": "get_weather"}}
    body |= {"max_output_tokens": 60, "temperature": 0, "store": False}
    over_sse = sse(api, body)
    with api.responses.connect() as connection:
        connection.response.create(**body)
        over_ws = until_terminal(connection)
    assert_same_stream(over_ws, over_sse)
    [call] = [item for item in over_ws[-1].response.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)


def test_previous_response_id_continues_a_store_false_response_on_the_same_socket(api: openai.OpenAI) -> None:
    common: Any = {"model": "m", "temperature": 0, "max_output_tokens": 12, "store": False}
    with api.responses.connect() as connection:
        connection.response.create(**common, input="My name is Alice. Remember it.", instructions="Be kind.")
        first = until_terminal(connection)[-1].response
        connection.response.create(**common, input="What is my name?", previous_response_id=first.id)
        second = until_terminal(connection)[-1].response
        connection.response.create(**common, input="What is my name?")
        alone = until_terminal(connection)[-1].response
    assert {first.status, second.status, alone.status} <= {"completed", "incomplete"}  # (incomplete: at max_output_tokens)
    # the second prompt carries the first exchange (less its instructions): more than the turn alone, more than the first's output
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError) as caught:  # store: false kept it on that socket only
        api.responses.create(**common, input="x", previous_response_id=first.id)
    assert caught.value.param == "previous_response_id"


def test_bad_events_get_error_events_naming_the_parameter_and_the_socket_goes_on(api: openai.OpenAI, live_server: LiveServer) -> None:
    queued = live_server.redis().xlen(keys.REQUEST_STREAM)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"type": "response.create", "model": "m", "input": "hi", "max_output_tokens": "many"}, "max_output_tokens"),
        ({"type": "response.create", "model": "m"}, "input"),
        ({"type": "response.create", "model": "m", "input": "hi", "background": True}, "background"),
        ({"type": "response.create", "model": "m", "input": "hi", "stream_id": 7}, "stream_id"),
        ({"type": "response.cancel"}, "type"),
    ]
    with api.responses.connect() as connection:
        for event, param in bad:
            connection.send(event)  # type: ignore[arg-type]
            error = connection.recv()
            assert error.type == "error" and error.status == 400, error
            assert error.error.param == param and error.error.type == "invalid_request_error"
        connection.response.steer(input="Be brief.", previous_response_id="resp_x")
        steer = connection.recv()
        assert steer.type == "response.steer.failed" and steer.error.code == "steering_not_supported"
        assert live_server.redis().xlen(keys.REQUEST_STREAM) == queued  # nothing reached a worker
        connection.response.create(model="m", input="Say hi.", max_output_tokens=4, temperature=0)
        assert until_terminal(connection)[-1].type == "response.incomplete"


def test_response_creates_sent_together_run_one_after_another(api: openai.OpenAI) -> None:
    with api.responses.connect() as connection:
        for word in ("one", "two"):
            connection.response.create(model="m", input=f"Say {word}.", max_output_tokens=4, temperature=0, store=False)
        first, second = until_terminal(connection), until_terminal(connection)
    assert [e.sequence_number for e in first + second] == [*range(len(first)), *range(len(second))]  # never interleaved
    assert first[0].response.id != second[0].response.id


def test_closing_the_socket_cancels_the_running_response(api: openai.OpenAI, live_server: LiveServer) -> None:
    with api.responses.connect() as connection:
        connection.response.create(model="m", input="Write a very long story about dragons.", max_output_tokens=3000, text=LONG_STORY)
        rid = connection.recv().response.id.removeprefix("resp_")  # type: ignore[union-attr]
        while connection.recv().type != "response.output_text.delta":
            pass
    r = live_server.redis()
    deadline = time.monotonic() + 60
    while r.hget(keys.request_meta(rid), "outcome") is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.hget(keys.request_meta(rid), "outcome") == b"cancelled"
    entries: Any = r.xrange(keys.delta_stream(rid))
    final = decode_delta(entries[-1][1][b"d"])
    assert isinstance(final, Finish) and final.reason is FinishReason.CANCELLED
    assert final.usage.completion_tokens < 2000  # stopped well before max_output_tokens
