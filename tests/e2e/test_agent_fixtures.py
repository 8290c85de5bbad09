"""The requests Claude Code 2.1.332 and Codex 0.171.0 really send (tests/fixtures/agents/, recorded with
bench/record_agents.py) are accepted by a live server, streamed and not, and what comes back passes the
official SDKs' stream accumulators and response types. Every recorded field, header and query is sent
as recorded; the server's --max-output-tokens keeps generation short (agents ask for 32k-128k tokens).
Claude Code's turns were recorded in the agent tests' fixed folder with their model name and prompt
(bench/record_agents.py, RECORD_HOME / RECORD_MODEL), so its first turn is the very prompt that
test_agent_clis.py's full-mode run sends: the server prefills those ~12k tokens once for both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message
from openai.types.responses import Response

from ..conftest import AGENT_OUTPUT_CAP, LONG_CONTEXT, ROOT, LiveServer, http_errors

pytestmark = pytest.mark.e2e

FIXTURES = ROOT / "tests" / "fixtures" / "agents"
CLAUDE = sorted((FIXTURES / "claude_code").glob("*.json"))
CODEX = sorted((FIXTURES / "codex").glob("*.json"))
TRANSPORT_HEADERS = {"host", "content-length", "connection", "accept-encoding", "accept", "content-type"}


def recorded(path: Path) -> dict[str, Any]:
    """A recorded request as the agent sends it to this server: `recorded-model` (the model name the
    recorder's Codex config gave, bench/record_agents.py) becomes the served name a user configures."""
    record: dict[str, Any] = json.loads(path.read_text())
    record["headers"] = {k: v for k, v in record["headers"].items() if k not in TRANSPORT_HEADERS}
    if record["body"].get("model") == "recorded-model":
        record["body"]["model"] = "SmolLM2-135M-Instruct"
    return record


def test_the_recordings_hold_what_the_agents_really_send() -> None:
    """What the other tests rely on the recordings to exercise (so a re-recording cannot quietly lose it)."""
    first = recorded(CLAUDE[0])
    body = first["body"]
    assert first["query"] == {"beta": "true"} and len(first["headers"]["anthropic-beta"].split(",")) > 3
    assert body["max_tokens"] >= 32000 and body["thinking"]["type"] == "adaptive" and "context_management" in body
    assert any("cache_control" in block for block in body["system"]) and any(m["role"] == "system" for m in body["messages"])
    assert any(t.get("defer_loading") for t in body["tools"])
    later = recorded(CLAUDE[1])["body"]["messages"]
    assert any(b.get("type") == "tool_result" for m in later if isinstance(m["content"], list) for b in m["content"])
    codex = recorded(CODEX[0])["body"]
    assert {t["type"] for t in codex["tools"]} >= {"function", "namespace", "web_search"}
    assert codex["store"] is False and "max_output_tokens" not in codex
    assert [i.get("role") for i in codex["input"][:2]] == ["developer", "developer"]
    namespaced = recorded(CODEX[2])["body"]["input"]
    assert any(i.get("type") == "function_call" and i.get("namespace") == "multi_agent_v1" for i in namespaced)


@pytest.mark.parametrize("path", CLAUDE, ids=[p.stem for p in CLAUDE])
def test_claude_codes_requests_stream_through_the_sdk_accumulator(agents_server: LiveServer, path: Path) -> None:
    record = recorded(path)
    body = record["body"]
    errors = http_errors(agents_server)
    # The SDK's arguments are placeholders; extra_body puts back the recorded body whole (it wins over them).
    with (
        anthropic.Anthropic(base_url=agents_server.base_url, api_key="test", max_retries=0, timeout=600) as client,
        client.messages.stream(
            model=body["model"], max_tokens=1, messages=[], extra_body=body, extra_headers=record["headers"], extra_query=record["query"]
        ) as stream,
    ):
        final = stream.get_final_message()
    assert final.model == body["model"] and final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert final.usage.output_tokens <= AGENT_OUTPUT_CAP and final.content
    usage = final.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0) > 8192  # past the model's own context
    assert http_errors(agents_server) == errors


@pytest.mark.parametrize("path", CLAUDE, ids=[p.stem for p in CLAUDE])
def test_claude_codes_requests_are_answered_without_streaming(agents_server: LiveServer, path: Path) -> None:
    record = recorded(path)
    response = httpx.post(
        f"{agents_server.base_url}{record['path']}",
        params=record["query"],
        headers=record["headers"],
        json={**record["body"], "stream": False},
        timeout=600,
    )
    assert response.status_code == 200, response.text
    message = Message.model_validate(response.json())
    assert message.model == record["body"]["model"] and message.usage.output_tokens <= AGENT_OUTPUT_CAP


def test_claude_codes_cache_marked_prompt_is_read_from_the_prefix_cache_and_reported(agents_server: LiveServer) -> None:
    """The second request is as another conversation (or a later Claude Code's next request) sends it: its
    first system block, the attribution line, has another version suffix and a `cch` nonce. The server
    drops that line (ingest.parsers.anthropic_messages), so the system prompt and tools are still read
    from the cache; kept, the prompts would part at their ~10th token."""
    record = recorded(CLAUDE[1])
    url, body = f"{agents_server.base_url}{record['path']}", {**record["body"], "stream": False}
    header = body["system"][0]["text"]
    assert header.startswith("x-anthropic-billing-header: cc_version=2.1.332.")
    other = {**body, "system": [{**body["system"][0], "text": "x-anthropic-billing-header: cc_version=2.1.332.e07; cc_entrypoint=sdk-cli; cch=5b1f2;"}, *body["system"][1:]]}
    usages = [httpx.post(url, params=record["query"], headers=record["headers"], json=b, timeout=600).json()["usage"] for b in (body, other)]
    again = usages[1]  # the first may have filled the cache; the second reads all but the last, partial block
    assert again["cache_read_input_tokens"] > 12000 and again["cache_creation_input_tokens"] == 0
    assert again["input_tokens"] + again["cache_read_input_tokens"] == usages[0]["input_tokens"] + usages[0]["cache_read_input_tokens"]


@pytest.mark.parametrize("path", CODEX, ids=[p.stem for p in CODEX])
def test_codexs_requests_stream_through_the_sdk_accumulator(agents_server: LiveServer, path: Path) -> None:
    record = recorded(path)
    body = record["body"]
    errors = http_errors(agents_server)
    # Iterating runs every event through the SDK's stream state machine; get_final_response() only takes a
    # `response.completed`, and a turn cut by --max-output-tokens ends in `response.incomplete`.
    with (
        openai.OpenAI(base_url=f"{agents_server.base_url}/v1", api_key="test", max_retries=0, timeout=600) as client,
        client.responses.stream(model=body["model"], input=[], extra_body=body, extra_headers=record["headers"]) as stream,
    ):
        events = list(stream)
    terminal = events[-1]
    assert terminal.type in ("response.completed", "response.incomplete"), terminal
    final = terminal.response
    assert final.model == body["model"] and final.status in ("completed", "incomplete")
    assert final.usage is not None and final.usage.output_tokens <= AGENT_OUTPUT_CAP and final.output
    assert final.store is False
    assert http_errors(agents_server) == errors


@pytest.mark.parametrize("path", CODEX, ids=[p.stem for p in CODEX])
def test_codexs_requests_are_answered_without_streaming(agents_server: LiveServer, path: Path) -> None:
    record = recorded(path)
    response = httpx.post(f"{agents_server.base_url}/v1/responses", headers=record["headers"], json={**record["body"], "stream": False}, timeout=600)
    assert response.status_code == 200, response.text
    parsed = Response.model_validate(response.json())
    assert parsed.store is False and parsed.usage is not None and LONG_CONTEXT > parsed.usage.input_tokens > 8192  # past the model's own context

