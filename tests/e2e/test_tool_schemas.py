"""No request is refused for a tool schema: every tool schema the agents send (Claude Code and Codex, each
recorded version) and every JSON Schema 2020-12 keyword, as a tool on all three protocols, through a live
`met serve` (simulated engine: what is checked is the API node's acceptance and the worker's grammar, not
the text). What the constraint engine cannot enforce is relaxed and named in `X-Metrale-Schema-Relaxed`;
a structured-output schema marked `strict: true` is the one place it stays a 400, naming the keyword and
where it is.

Before: `400 Invalid 'tools': at 18(6): failed to compile JSON schema: Unimplemented keys:
["propertyNames"]` for Claude Code 2.1.197 (what npm installs on Node 20), so it exited 1 on any server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import LONG_CONTEXT_FLAGS, ROOT, LiveServer, start_server, stop_server

pytestmark = pytest.mark.e2e

FIXTURES = ROOT / "tests" / "fixtures" / "agents"
RELAXED = "x-metrale-schema-relaxed"
NAME = "SmolLM2-135M-Instruct"


def agent_tools() -> dict[str, dict[str, Any]]:
    """Every function tool's schema in every recording, by "<agent folder>/<tool name>" (one per distinct schema)."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(FIXTURES.glob("*/*.json")):
        for tool in json.loads(path.read_text())["body"].get("tools") or []:
            for t in [tool, *(tool.get("tools") or [])]:  # Codex nests function tools in a namespace
                schema = t.get("input_schema") or t.get("parameters")
                if isinstance(schema, dict):
                    found.setdefault(f"{path.parent.name}/{t['name']}", schema)
    return found


def keyword(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"x": schema}, "required": ["x"]}


# One schema per JSON Schema 2020-12 keyword (the core and validation vocabularies, applicators, unevaluated,
# format, content, meta-data); the tool's argument `x` uses it.
KEYWORDS: dict[str, dict[str, Any]] = {
    "type": keyword({"type": "string"}),
    "enum": keyword({"enum": ["a", "b"]}),
    "const": keyword({"const": 3}),
    "multipleOf": keyword({"type": "number", "multipleOf": 0.5}),
    "maximum": keyword({"type": "integer", "maximum": 9}),
    "exclusiveMaximum": keyword({"type": "integer", "exclusiveMaximum": 9}),
    "minimum": keyword({"type": "integer", "minimum": 1}),
    "exclusiveMinimum": keyword({"type": "integer", "exclusiveMinimum": 1}),
    "maxLength": keyword({"type": "string", "maxLength": 8}),
    "minLength": keyword({"type": "string", "minLength": 1}),
    "pattern": keyword({"type": "string", "pattern": "^[a-z]+$"}),
    "maxItems": keyword({"type": "array", "maxItems": 3}),
    "minItems": keyword({"type": "array", "minItems": 1}),
    "uniqueItems": keyword({"type": "array", "items": {"type": "string"}, "uniqueItems": True}),
    "maxContains": keyword({"type": "array", "contains": {"type": "string"}, "maxContains": 2}),
    "minContains": keyword({"type": "array", "contains": {"type": "string"}, "minContains": 1}),
    "maxProperties": keyword({"type": "object", "maxProperties": 2}),
    "minProperties": keyword({"type": "object", "minProperties": 1}),
    "required": keyword({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}),
    "dependentRequired": keyword({"type": "object", "dependentRequired": {"a": ["b"]}}),
    "properties": keyword({"type": "object", "properties": {"a": {"type": "integer"}}}),
    "patternProperties": keyword({"type": "object", "patternProperties": {"^s_": {"type": "string"}}}),
    "additionalProperties": keyword({"type": "object", "additionalProperties": {"type": "integer"}}),
    "propertyNames": keyword({"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {}}),
    "items": keyword({"type": "array", "items": {"type": "integer"}}),
    "prefixItems": keyword({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]}),
    "contains": keyword({"type": "array", "contains": {"const": 1}}),
    "allOf": keyword({"allOf": [{"type": "string"}, {"maxLength": 5}]}),
    "anyOf": keyword({"anyOf": [{"type": "string"}, {"type": "integer"}]}),
    "oneOf": keyword({"oneOf": [{"type": "string"}, {"type": "integer"}]}),
    "not": keyword({"not": {"type": "null"}}),
    "if/then/else": keyword({"if": {"type": "string"}, "then": {"minLength": 1}, "else": {"type": "integer"}}),
    "dependentSchemas": keyword({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}),
    "unevaluatedItems": keyword({"type": "array", "prefixItems": [{"type": "string"}], "unevaluatedItems": False}),
    "unevaluatedProperties": keyword({"type": "object", "properties": {"a": {"type": "string"}}, "unevaluatedProperties": False}),
    "$ref/$defs": {"type": "object", "$defs": {"id": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/id"}}, "required": ["x"]},
    "recursive $ref": {"type": "object", "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}}, "properties": {"x": {"$ref": "#/$defs/node"}}},
    "$anchor": {"type": "object", "$defs": {"a": {"$anchor": "leaf", "type": "string"}}, "properties": {"x": {"$ref": "#leaf"}}},
    "$dynamicRef/$dynamicAnchor": {"type": "object", "$defs": {"a": {"$dynamicAnchor": "t", "type": "string"}}, "properties": {"x": {"$dynamicRef": "#t"}}},
    "$id/$schema/$comment": {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.com/t", "$comment": "c", **keyword({"type": "string"})},
    "format": keyword({"type": "string", "format": "date-time"}),
    "format (unknown)": keyword({"type": "string", "format": "x-custom"}),
    "contentEncoding/contentMediaType/contentSchema": keyword({"type": "string", "contentEncoding": "base64", "contentMediaType": "application/json", "contentSchema": {"type": "object"}}),
    "title/description/default/examples": keyword({"type": "string", "title": "X", "description": "d", "default": "a", "examples": ["b"]}),
    "deprecated/readOnly/writeOnly": keyword({"type": "string", "deprecated": True, "readOnly": True, "writeOnly": False}),
}
UNENFORCEABLE = {  # what llguidance 1.9 leaves out (the rest it enforces)
    *("uniqueItems", "maxContains", "minContains", "dependentRequired", "propertyNames", "contains", "not", "if/then/else", "dependentSchemas"),
    *("unevaluatedItems", "unevaluatedProperties", "$dynamicRef/$dynamicAnchor"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The simulated engine (no model): the API node and the worker's grammars are what is exercised. The
    agents' prompts (~9-13k tokens) need the long-context window; unknown model names are a 404 here."""
    args = ["--model-impl", "sim", "--sim-step-ms", "1", *LONG_CONTEXT_FLAGS, "--model-alias", f"claude-*={NAME}"]
    server = start_server(tmp_path_factory.mktemp("schemas"), "--workers", "1", *args, env={"MET_ACCEPT_ANY_MODEL": "0"})
    yield server
    stop_server(server)


def post_with_tool(http: httpx.Client, protocol: str, name: str, schema: dict[str, Any]) -> httpx.Response:
    user = [{"role": "user", "content": "Call the tool."}]
    if protocol == "chat":
        tools = [{"type": "function", "function": {"name": name, "description": "A tool.", "parameters": schema}}]
        return http.post("/v1/chat/completions", json={"model": NAME, "messages": user, "tools": tools, "max_tokens": 2})
    if protocol == "messages":
        tools = [{"name": name, "description": "A tool.", "input_schema": schema}]
        return http.post("/v1/messages", json={"model": NAME, "messages": user, "tools": tools, "max_tokens": 2})
    tools = [{"type": "function", "name": name, "description": "A tool.", "parameters": schema}]
    return http.post("/v1/responses", json={"model": NAME, "input": "Call the tool.", "tools": tools, "max_output_tokens": 2})


def tool_name(label: str) -> str:
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in label)[:64]


@pytest.mark.parametrize("protocol", ["chat", "messages", "responses"])
def test_every_tool_schema_the_agents_send_and_every_2020_12_keyword_is_accepted(server: LiveServer, protocol: str) -> None:
    corpus = {**agent_tools(), **{f"keyword {k}": v for k, v in KEYWORDS.items()}}
    assert any(k.startswith("claude_code_2.1.197/TaskCreate") for k in corpus)  # the schema that was refused
    refused, relaxed = {}, {}
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        for label, schema in corpus.items():
            answer = post_with_tool(http, protocol, tool_name(label.split("/")[-1]), schema)
            if answer.status_code != 200:
                refused[label] = f"{answer.status_code} {answer.text[:200]}"
            elif RELAXED in answer.headers:
                relaxed[label] = answer.headers[RELAXED]
    assert refused == {}
    relaxed_keywords = {label.removeprefix("keyword ") for label in relaxed if label.startswith("keyword ")}
    assert relaxed_keywords == UNENFORCEABLE
    assert "'propertyNames' at /properties/metadata" in relaxed["claude_code_2.1.197/TaskCreate"]


def test_every_recorded_agent_request_of_every_version_is_answered_on_its_own_protocol(server: LiveServer) -> None:
    """Each recording (Claude Code 2.1.197 and the pinned newest, Codex 0.160.0 and the pinned newest) posted
    as the agent sent it (its model name: claude-* is an alias; Codex's recorder named its model
    `recorded-model`, a user names the served one), not streamed, with a short output cap."""
    answered = {}
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        for path in sorted(FIXTURES.glob("*/*.json")):
            record = json.loads(path.read_text())
            body = {**record["body"], "stream": False}
            body["model"] = NAME if body.get("model") == "recorded-model" else body["model"]
            body.update({"max_tokens": 4} if "messages" in body else {"max_output_tokens": 16})
            answer = http.post(record["path"], json=body, params=record.get("query") or {})
            answered[f"{path.parent.name}/{path.name}"] = (answer.status_code, answer.headers.get(RELAXED, "")[:80])
    assert {k: v[0] for k, v in answered.items()} == dict.fromkeys(answered, 200), answered
    assert answered["claude_code_2.1.197/01_first_turn.json"][1].startswith("TaskCreate: 'propertyNames'")


def test_a_strict_response_format_that_cannot_be_enforced_is_a_400_naming_the_keyword_and_where(server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}, "required": ["tags"]}
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    with chat, pytest.raises(openai.BadRequestError) as refused:
        chat.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "Tags?"}],
            max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}},
        )
    error = refused.value.body["error"] if isinstance(refused.value.body, dict) and "error" in refused.value.body else refused.value.body
    assert error["param"] == "response_format.json_schema.schema"
    assert "'uniqueItems' at /properties/tags" in error["message"]
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        loose_format = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
        loose_body = {"model": NAME, "messages": [{"role": "user", "content": "Tags?"}], "max_tokens": 4, "stream": True, "response_format": loose_format}
        with http.stream("POST", "/v1/chat/completions", json=loose_body) as loose:  # streamed: the simulated text is no JSON; the answer's headers are the point
            loose.read()
        strict_responses = http.post(
            "/v1/responses", json={"model": NAME, "input": "Tags?", "max_output_tokens": 16, "text": {"format": {"type": "json_schema", "name": "t", "schema": schema, "strict": True}}}
        )
    assert loose.status_code == 200, loose.text
    assert loose.headers[RELAXED] == "response_format.json_schema.schema: 'uniqueItems' at /properties/tags"
    assert strict_responses.status_code == 400 and strict_responses.json()["error"]["param"] == "text.format.schema"


def test_an_unknown_model_name_is_a_404_in_each_protocols_shape_and_an_alias_is_served(server: LiveServer, tmp_path: Path) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        listed = [m["id"] for m in http.get("/v1/models").json()["data"]]
        card = http.get("/v1/models/claude-haiku-4-5").json()
    assert listed == [NAME, "claude-*"] and card["parent"] == NAME
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    with chat, pytest.raises(openai.NotFoundError) as missing:
        chat.chat.completions.create(model="gpt-nothing", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert missing.value.body["param"] == "model" and missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    with claude:
        with pytest.raises(anthropic.NotFoundError) as missing_messages:
            claude.messages.create(model="gemini-x", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        served = claude.messages.create(model="claude-opus-4-8", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert missing_messages.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert served.model == "claude-opus-4-8" and served.stop_reason == "max_tokens"
