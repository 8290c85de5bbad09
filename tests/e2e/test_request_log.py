"""The access log: one line per finished request at the API node (id, protocol, model, status, tokens,
TTFT, total, client address), never the body or a key; the JSON form for log shippers."""

from __future__ import annotations

import logging
import time

import anthropic
import httpx
import openai
import orjson
import pytest

from cli.logs import JsonFormatter
from ingest.http.request_log import RequestTiming, log_finished
from shared.deltas import Finish, FinishReason, Usage
from shared.ir import Message, Protocol, Request, Role, TextPart

from ..conftest import LiveServer

SECRET = "sk-access-log-secret-body"


def lines_of(server: LiveServer, request_id: str) -> list[str]:
    return [line for line in server.log().splitlines() if "met.requests" in line and request_id in line]


@pytest.mark.e2e
def test_each_finished_request_gets_one_line_without_its_body_or_key(live_server: LiveServer) -> None:
    with openai.OpenAI(base_url=live_server.base_url + "/v1", api_key=SECRET + "-key", max_retries=0, timeout=120) as sdk:
        chat = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": f"Say hi. {SECRET}"}], max_tokens=3, temperature=0)
    chat_id = chat.id.removeprefix("chatcmpl-")
    (line,) = lines_of(live_server, chat_id)
    assert f"{chat_id} openai_chat model=m status={chat.choices[0].finish_reason}" in line
    assert chat.usage is not None
    assert f"prompt_tokens={chat.usage.prompt_tokens} output_tokens={chat.usage.completion_tokens}" in line
    assert "ttft=" in line and "ttft=-" not in line and " total=" in line and line.endswith("client=127.0.0.1")
    messages = anthropic.Anthropic(base_url=live_server.base_url, api_key="unused", max_retries=0, timeout=120)
    with messages, messages.messages.stream(model="claude-x", messages=[{"role": "user", "content": "Hi"}], max_tokens=2) as stream:
        final = stream.get_final_message()
    (streamed,) = lines_of(live_server, final.id.removeprefix("msg_"))
    assert "anthropic_messages model=claude-x status=" in streamed and "output_tokens=" in streamed
    assert SECRET not in live_server.log()


@pytest.mark.e2e
def test_a_client_that_leaves_early_is_logged_as_abandoned(live_server: LiveServer) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Count to 500."}], "max_tokens": 400, "stream": True}
    with httpx.stream("POST", live_server.base_url + "/v1/chat/completions", json=body, timeout=120) as response:
        request_id = response.headers["x-request-id"]
        next(response.iter_lines())
    for _ in range(400):  # the server notices the disconnect on its next write
        if lines_of(live_server, request_id):
            break
        time.sleep(0.05)
    (line,) = lines_of(live_server, request_id)
    assert "status=abandoned" in line or "status=cancelled" in line


def test_the_json_format_carries_every_field_as_a_key(caplog: pytest.LogCaptureFixture) -> None:
    request = Request(
        id="abc123",
        protocol=Protocol.OPENAI_RESPONSES,
        model="m",
        messages=(Message(role=Role.USER, content=(TextPart(text=SECRET),)),),
        prompt_token_ids=(1, 2, 3),
        created=100.0,
    )
    finish = Finish(reason=FinishReason.LENGTH, usage=Usage(prompt_tokens=3, completion_tokens=8))
    with caplog.at_level(logging.INFO, logger="met.requests"):
        log_finished(request, finish, RequestTiming(client="10.0.0.7", first_at=100.25), now=101.5)
    (record,) = caplog.records
    entry = orjson.loads(JsonFormatter().format(record))
    assert entry["logger"] == "met.requests" and entry["level"] == "INFO"
    expected = {"request_id": "abc123", "protocol": "openai_responses", "model": "m", "status": "length", "prompt_tokens": 3, "output_tokens": 8}
    assert {k: entry[k] for k in expected} == expected
    assert (entry["ttft_s"], entry["total_s"], entry["client"]) == (0.25, 1.5, "10.0.0.7")
    assert SECRET not in entry["message"] and SECRET not in str(entry)
