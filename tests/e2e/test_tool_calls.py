"""Tool calls through a live `met serve` with the official SDKs, on each protocol, streamed and not: a
forced call with schema-valid arguments, the SDK's stream accumulation equal to the non-streamed
object, the result sent back, a text answer. Bad tool input is a 400 naming the parameter, nothing queued."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest

from shared import keys

from ..conftest import ROOT, LiveServer

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": False}
QUESTION = "What is the weather in Paris?"
RESULT = "Sunny, 21 degrees Celsius."
GREEDY = {"temperature": 0.0}


@pytest.fixture
def gpt(live_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="x", max_retries=0, timeout=300) as client:
        yield client


@pytest.fixture
def claude(live_server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=live_server.base_url, api_key="x", max_retries=0, timeout=300) as client:
        yield client


def test_openai_chat_forced_call_stream_equals_create_and_the_result_round_trips(gpt: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.", "parameters": SCHEMA}}]
    messages: Any = [{"role": "user", "content": QUESTION}]
    common: Any = {"model": "m", "messages": messages, "tools": tools, "max_tokens": 60, "temperature": 0.0}
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    created = gpt.chat.completions.create(**common, tool_choice=choice)
    with gpt.chat.completions.stream(**common, tool_choice=choice) as stream:
        streamed = stream.get_final_completion()
    for completion in (created, streamed):
        assert completion.choices[0].finish_reason == "tool_calls"
    [call] = created.choices[0].message.tool_calls or []
    [scall] = streamed.choices[0].message.tool_calls or []
    assert call.type == scall.type == "function"
    assert (call.function.name, call.function.arguments) == (scall.function.name, scall.function.arguments)  # type: ignore[union-attr]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)  # type: ignore[union-attr]
    follow = [*messages, created.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    answer = gpt.chat.completions.create(model="m", messages=follow, tools=tools, tool_choice="none", max_tokens=40, temperature=0.0)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
    assert not answer.choices[0].message.tool_calls


def test_anthropic_forced_tool_use_final_message_equals_create_and_the_result_round_trips(claude: anthropic.Anthropic) -> None:
    tools: Any = [{"name": "get_weather", "description": "Current weather in a city.", "input_schema": SCHEMA}]
    messages: Any = [{"role": "user", "content": QUESTION}]
    common: Any = {"model": "m", "max_tokens": 60, "messages": messages, "tools": tools, "tool_choice": {"type": "tool", "name": "get_weather"}, "extra_body": GREEDY}
    created = claude.messages.create(**common)
    with claude.messages.stream(**common) as stream:
        final = stream.get_final_message()
    assert created.stop_reason == final.stop_reason == "tool_use"
    uses = [b for b in created.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in uses] == [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    [use] = uses
    assert use.name == "get_weather"
    jsonschema.validate(use.input, SCHEMA)
    follow = [
        *messages,
        {"role": "assistant", "content": [b.model_dump() for b in created.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": RESULT}]}]},
    ]
    answer = claude.messages.create(model="m", max_tokens=40, messages=follow, tools=tools, tool_choice={"type": "none"}, extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text" and answer.content[0].text


def test_responses_forced_function_call_final_response_equals_create_and_the_output_round_trips(gpt: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "name": "get_weather", "description": "Current weather in a city.", "parameters": SCHEMA, "strict": True}, {"type": "web_search"}]
    common: Any = {"model": "m", "input": QUESTION, "tools": tools, "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 60, "temperature": 0.0, "store": False}
    created = gpt.responses.create(**common)
    with gpt.responses.stream(**common) as stream:
        final = stream.get_final_response()
    calls = [i for i in created.output if i.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in final.output if c.type == "function_call"]
    assert created.status == final.status == "completed"
    [call] = calls
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    follow: Any = [
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": RESULT},
    ]
    answer = gpt.responses.create(model="m", input=follow, tools=tools, tool_choice="none", max_output_tokens=40, temperature=0.0, store=False)
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]


def test_required_with_parallel_calls_off_gives_exactly_one_call(gpt: openai.OpenAI) -> None:
    tools: Any = [
        {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["CET", "UTC"]}}, "required": ["tz"], "additionalProperties": False}}},
    ]
    reply = gpt.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather and time in Paris?"}], tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0.0
    )
    calls = reply.choices[0].message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")  # type: ignore[union-attr]
    assert reply.choices[0].finish_reason == "tool_calls"


class GetWeather(pydantic.BaseModel):
    """Current weather in a city."""

    city: str


MARKUP = ("<tool_call>", "</tool_call>", '{"name"')


def test_a_forced_call_with_parallel_calls_allowed_ends_without_markup_on_all_three_protocols(gpt: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    """`required` (Anthropic: `any`) with parallel calls allowed and room for many: the grammar lets calls
    follow calls, and the default model writes the same call again and again; the turn ends at the first
    repeat (`workers.tools.RepeatGuard`) with whole calls, finish `tool_calls`, and no call markup as text.
    The SDKs' stream helpers accept it: the Python SDK's `chat.completions.stream` raises
    LengthFinishReasonError on a `length` finish, and parses each call's arguments into the pydantic tool."""
    question = "What is the weather in Paris?"
    with gpt.chat.completions.stream(
        model="m", messages=[{"role": "user", "content": question}], tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required", max_tokens=300, temperature=0.0, stream_options={"include_usage": True}
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not any(m in (choice.message.content or "") for m in MARKUP), choice.message.content
    calls = choice.message.tool_calls or []
    assert calls and all(isinstance(c.function.parsed_arguments, GetWeather) for c in calls)  # type: ignore[union-attr]
    assert len({(c.function.name, c.function.arguments) for c in calls}) == len(calls)  # type: ignore[union-attr]  # no repeat delivered
    assert final.usage is not None and final.usage.completion_tokens < 300

    tools: Any = [{"name": "get_weather", "description": "Current weather in a city.", "input_schema": SCHEMA}]
    with claude.messages.stream(model="m", max_tokens=300, messages=[{"role": "user", "content": question}], tools=tools, tool_choice={"type": "any"}, extra_body={"temperature": 0.0}) as astream:
        message = astream.get_final_message()
    assert message.stop_reason == "tool_use", message
    assert not any(m in b.text for b in message.content if b.type == "text" for m in MARKUP), message.content
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and len({json.dumps(u.input, sort_keys=True) for u in uses}) == len(uses)

    rtools: Any = [{"type": "function", "name": "get_weather", "description": "Current weather in a city.", "parameters": SCHEMA}]
    with gpt.responses.stream(model="m", input=question, tools=rtools, tool_choice="required", max_output_tokens=300, temperature=0.0, store=False) as rstream:
        response = rstream.get_final_response()
    assert response.status == "completed", response
    assert not any(m in response.output_text for m in MARKUP), response.output_text
    fcalls = [i for i in response.output if i.type == "function_call"]
    assert fcalls and len({i.arguments for i in fcalls}) == len(fcalls)


def test_the_openai_node_stream_helper_accepts_a_forced_call_with_parallel_calls_allowed(live_server: LiveServer) -> None:
    """The same forced call through openai-node's `chat.completions.stream(...).finalChatCompletion()`,
    which throws LengthFinishReasonError when the turn ends at `length` (what it did before a repeated
    call ended the turn) and parses strict tools' arguments."""
    sdk = ROOT / ".tools" / "agents" / "node_modules" / "openai"
    if not sdk.exists():
        pytest.fail(f"{sdk} is missing: run ./dev test (it installs the openai-node SDK with the agent CLIs)")
    script = ROOT / "tests" / "e2e" / "node" / "forced_call_stream.mjs"
    done = subprocess.run(["node", str(script), f"{live_server.base_url}/v1", (sdk / "index.mjs").as_uri()], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    final = json.loads(done.stdout.strip().splitlines()[-1])
    choice = final["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert not any(m in (choice["message"].get("content") or "") for m in MARKUP)
    calls = choice["message"]["tool_calls"]
    assert calls and all(c["function"]["parsed_arguments"]["city"] for c in calls)
    assert len({c["function"]["arguments"] for c in calls}) == len(calls)


FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"tools": [FN], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]}, "tools[0].function.parameters"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/responses", {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name"),
    ("/v1/responses", {"tools": [{"type": "function", "name": "x" * 65}]}, "tools[0].name"),
    ("/v1/responses", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/messages", {"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice.name"),
    ("/v1/messages", {"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools[0].input_schema"),
    ("/v1/messages", {"tool_choice": {"type": "any"}}, "tool_choice"),
]
BASE = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "x"}]},
    "/v1/responses": {"model": "m", "input": "x"},
    "/v1/messages": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]},
}


@pytest.mark.parametrize(("path", "extra", "param"), BAD, ids=[f"{b[0].split('/')[-1]}-{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_tool_input_is_a_400_naming_the_parameter_and_nothing_is_queued(live_server: LiveServer, path: str, extra: dict[str, Any], param: str) -> None:
    r = live_server.redis()
    before = r.xlen(keys.REQUEST_STREAM)
    response = httpx.post(f"{live_server.base_url}{path}", json={**BASE[path], "stream": True, **extra}, timeout=60)
    assert response.status_code == 400 and response.headers["content-type"].startswith("application/json"), response.text
    doc = response.json()
    if path == "/v1/messages":
        assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error" and param in doc["error"]["message"]
    else:
        assert doc["error"]["type"] == "invalid_request_error" and doc["error"]["param"] == param
    assert r.xlen(keys.REQUEST_STREAM) == before
    r.close()


def test_auto_gives_text_or_schema_valid_calls_and_the_stream_matches(gpt: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.", "parameters": SCHEMA}}]
    common: Any = {"model": "m", "messages": [{"role": "user", "content": QUESTION}], "tools": tools, "max_tokens": 60, "temperature": 0.0}
    want = gpt.chat.completions.create(**common).choices[0]
    text, finish, calls_seen = "", None, {}  # the stream, accumulated by hand (the SDK helper refuses a length cut with tools)
    for chunk in gpt.chat.completions.create(**common, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                entry = calls_seen.setdefault(d.index, ["", ""])
                entry[0] += (d.function.name or "") if d.function else ""
                entry[1] += (d.function.arguments or "") if d.function else ""
    assert (finish, text or None) == (want.finish_reason, want.message.content)
    calls = want.message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == [tuple(v) for _, v in sorted(calls_seen.items())]  # type: ignore[union-attr]
    if calls:
        assert want.finish_reason == "tool_calls"
        for call in calls:
            assert call.function.name == "get_weather"  # type: ignore[union-attr]
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA)  # type: ignore[union-attr]
    else:
        assert want.message.content and "<tool_call>" not in want.message.content
