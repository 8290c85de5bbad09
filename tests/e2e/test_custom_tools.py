"""Responses custom (free-form) tools through a live `met serve` with the official openai SDK: a forced
call whose raw input matches the tool's regex / Lark grammar, the SDK's stream accumulation equal to the
non-streamed object, the `custom_tool_call_output` sent back for a text answer; a grammar that does not
compile is a 400 naming `tools[i].format.definition`, nothing queued."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from shared import keys

from ..conftest import LiveServer

pytestmark = pytest.mark.e2e

EMAIL = r"[a-z]{3,8}@example\.com"
EMAIL_TOOL = {"type": "custom", "name": "send_to", "description": "The address to mail the report to.", "format": {"type": "grammar", "syntax": "regex", "definition": EMAIL}}
QUERY_LARK = 'start: "SELECT " COL " FROM users WHERE id = " NUM\nCOL: "id" | "name" | "email"\nNUM: /[1-9][0-9]{0,2}/'
QUERY = r"SELECT (id|name|email) FROM users WHERE id = [1-9][0-9]{0,2}"  # the same language, to check with
QUERY_TOOL = {"type": "custom", "name": "run_sql", "description": "Run one SQL query.", "format": {"type": "grammar", "syntax": "lark", "definition": QUERY_LARK}}
FUNCTION = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}


@pytest.fixture
def gpt(live_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="x", max_retries=0, timeout=300) as client:
        yield client


def calls(response: Any) -> list[tuple[str, str, str]]:
    return [(i.type, i.name, i.input) for i in response.output if i.type == "custom_tool_call"]


@pytest.mark.parametrize(("tool", "pattern"), [(EMAIL_TOOL, EMAIL), (QUERY_TOOL, QUERY)], ids=["regex", "lark"])
def test_a_forced_custom_call_matches_its_grammar_and_the_stream_equals_create(gpt: openai.OpenAI, tool: dict[str, Any], pattern: str) -> None:
    common: Any = {
        "model": "m",
        "input": "Mail the weekly report to the team lead, and look up user 7.",
        "tools": [FUNCTION, tool, {"type": "web_search"}],
        "tool_choice": {"type": "custom", "name": tool["name"]},
        "max_output_tokens": 40,
        "temperature": 0.0,
        "store": False,
    }
    created = gpt.responses.create(**common)
    with gpt.responses.stream(**common) as stream:
        final = stream.get_final_response()
    assert created.status == final.status == "completed"
    assert calls(created) == calls(final)
    [call] = [i for i in created.output if i.type == "custom_tool_call"]
    assert call.name == tool["name"] and re.fullmatch(pattern, call.input), call.input
    assert call.id and call.id.startswith("ctc_") and call.call_id
    assert created.tool_choice.type == "custom" and [t.type for t in created.tools] == ["function", "custom"]  # type: ignore[union-attr]
    follow: Any = [
        {"role": "user", "content": common["input"]},
        {"type": "custom_tool_call", "call_id": call.call_id, "name": call.name, "input": call.input},
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Sent."},
    ]
    answer = gpt.responses.create(model="m", input=follow, tools=common["tools"], tool_choice="none", max_output_tokens=30, temperature=0.0, store=False)
    assert answer.output_text and not calls(answer)


def test_a_custom_grammar_that_does_not_compile_is_a_400_naming_it_and_nothing_is_queued(live_server: LiveServer) -> None:
    r = live_server.redis()
    before = r.xlen(keys.REQUEST_STREAM)
    bad = {"type": "custom", "name": "q", "format": {"type": "grammar", "syntax": "lark", "definition": "start: nowhere"}}
    body = {"model": "m", "input": "x", "stream": True, "tools": [FUNCTION, bad]}
    response = httpx.post(f"{live_server.base_url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tools[1].format.definition"
    assert r.xlen(keys.REQUEST_STREAM) == before
    r.close()
