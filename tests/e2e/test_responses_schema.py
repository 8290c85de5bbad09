"""The Responses object to the letter: every field of the Open Responses `ResponseResource`, true.

Every answer on /v1/responses in the whole suite is validated against the vendored specification as it
arrives (tests/openresponses.py, installed by tests/conftest.py); the tests here produce the cases the
rest of the suite may not (text, streamed and not, structured output, incomplete, background, tools with
`max_tool_calls`), check that the hook saw them, and check the values the schema cannot: the sampling
values that ran, the echoed request fields, `completed_at`, and that `max_tool_calls` caps the calls.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from models.files import DEFAULT_SAMPLING
from tests import openresponses

from ..conftest import LiveServer, wait_for

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": False}
WEATHER: Any = {"type": "function", "name": "get_weather", "description": "Current weather in a city.", "parameters": SCHEMA}


@pytest.fixture
def api(live_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def test_every_response_and_stream_event_is_checked_against_the_specification(api: openai.OpenAI) -> None:
    before = openresponses.checked.copy()
    echo: Any = {"prompt_cache_key": "session-7", "safety_identifier": "user-42", "service_tier": "auto", "extra_body": {"presence_penalty": 0.5, "frequency_penalty": 0.25}}
    created = api.responses.create(model="m", input="Name a color.", max_output_tokens=8, top_logprobs=2, **echo)
    with api.responses.stream(model="m", input="Name a color.", max_output_tokens=200, **echo) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert openresponses.checked["ResponseResource"] > before["ResponseResource"]  # the body of create
    for name in ("ResponseCreatedStreamingEvent", "ResponseInProgressStreamingEvent", "ResponseOutputTextDeltaStreamingEvent"):
        assert openresponses.checked[name] > before[name], name
    assert "response.completed" in types or "response.incomplete" in types
    for body in (created, final):
        # the values that ran: the default model's generation config, as no request set them
        assert (body.temperature, body.top_p) == (DEFAULT_SAMPLING["temperature"], DEFAULT_SAMPLING["top_p"])
        assert (body.prompt_cache_key, body.safety_identifier, body.service_tier) == ("session-7", "user-42", "auto")
        assert (getattr(body, "presence_penalty", None), getattr(body, "frequency_penalty", None)) == (0.5, 0.25)
        if body.status == "completed":
            assert body.completed_at is not None and body.created_at <= body.completed_at <= time.time() + 1
        else:
            assert body.completed_at is None
    assert created.top_logprobs == 2 and final.top_logprobs == 0
    assert created.output[0].content[0].logprobs and len(created.output[0].content[0].logprobs[0].top_logprobs) == 2
    chosen = api.responses.create(model="m", input="Name a color.", max_output_tokens=4, temperature=0.7, top_p=0.5, service_tier="priority")
    assert (chosen.temperature, chosen.top_p, chosen.service_tier) == (0.7, 0.5, "default")


def test_completed_incomplete_structured_and_retrieved_responses_validate(api: openai.OpenAI) -> None:
    done = api.responses.create(model="m", input="Say hi.", temperature=0, max_output_tokens=200)
    assert done.status == "completed" and done.completed_at is not None and done.completed_at >= done.created_at
    cut = api.responses.create(model="m", input="Write an essay about rivers.", temperature=0, max_output_tokens=4)
    assert cut.status == "incomplete" and cut.completed_at is None and cut.incomplete_details is not None
    fmt: Any = {"format": {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}}
    structured = api.responses.create(model="m", input="Where is the Eiffel tower?", text=fmt, temperature=0, max_output_tokens=40)
    assert structured.text.format.type == "json_schema"  # type: ignore[union-attr]
    before = openresponses.checked["ResponseResource"]
    assert api.responses.retrieve(done.id).completed_at == done.completed_at
    assert openresponses.checked["ResponseResource"] == before + 1


def test_a_background_response_validates_while_queued_running_and_done(api: openai.OpenAI) -> None:
    made = api.responses.create(model="m", input="Count to five.", background=True, temperature=0, max_output_tokens=12)
    assert made.status in ("queued", "in_progress") and made.completed_at is None
    done = wait_for("the background response", lambda: (r := api.responses.retrieve(made.id)).status not in ("queued", "in_progress") and r, timeout=120)
    assert done.background and done.status in ("completed", "incomplete")


def test_max_tool_calls_caps_the_calls_and_is_reported(api: openai.OpenAI) -> None:
    """Forced calls with parallel calls allowed let the default model write call after call; a cap of 1
    keeps the first and ends the turn there."""
    common: Any = {"model": "m", "input": "Weather in Paris, Rome and Oslo?", "tools": [WEATHER], "tool_choice": "required", "temperature": 0, "max_output_tokens": 300, "store": False}
    free = api.responses.create(**common)
    calls = [(i.name, i.arguments) for i in free.output if i.type == "function_call"]
    assert len(calls) >= 2, free.output  # the case the cap is for (greedy: the same every run)
    assert free.max_tool_calls is None
    capped = api.responses.create(**common, max_tool_calls=1)
    assert [(i.name, i.arguments) for i in capped.output if i.type == "function_call"] == calls[:1]
    assert capped.max_tool_calls == 1 and capped.status == "completed"
    assert capped.usage is not None and free.usage is not None and capped.usage.output_tokens < free.usage.output_tokens
    with api.responses.stream(**common, max_tool_calls=1) as stream:
        streamed = stream.get_final_response()
    assert [(i.name, i.arguments) for i in streamed.output if i.type == "function_call"] == calls[:1]


def test_a_client_that_hangs_up_on_a_non_streamed_response_is_one_log_line_not_a_traceback(live_server: LiveServer) -> None:
    body = {"model": "m", "input": "Write a long essay about rivers.", "max_output_tokens": 400}
    log = live_server.log()
    abandoned, tracebacks = log.count("status=abandoned"), log.count("Traceback") + log.count("Exception in ASGI application")
    for timeout in (0.05, 1.0):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{live_server.base_url}/v1/responses", json=body, timeout=timeout)
    wait_for("the abandoned requests' log lines", lambda: live_server.log().count("status=abandoned") >= abandoned + 2 or None, timeout=60)
    log = live_server.log()
    assert log.count("Traceback") + log.count("Exception in ASGI application") == tracebacks
