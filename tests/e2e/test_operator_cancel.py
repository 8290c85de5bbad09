"""An operator's cancel (`met top`, `c`) reaches a still-connected client as what it is, on every
protocol: an error, never a normal stop (the shapes: the FinishReason docstring in shared/deltas.py).
The test sets the cancel flag exactly as `met top` does (cli/top_snapshot.cancel)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from redis.asyncio import Redis

from cli.top_snapshot import cancel
from shared import keys
from shared.dumps import display_status, parse_meta

from ..conftest import LiveServer

pytestmark = pytest.mark.e2e

LONG = "Count from 1 to 1000, one number per line."  # greedy SmolLM2 counts far past the cancel
MESSAGES: Any = [{"role": "user", "content": LONG}]
CANCELLED_BY_OPERATOR = "cancelled by the server's operator"


def operator_cancel(server: LiveServer, request_id: str) -> None:
    async def flag() -> None:
        redis = Redis.from_url(server.redis_url)
        try:
            await cancel(redis, request_id)
        finally:
            await redis.aclose()

    asyncio.run(flag())


def recorded_ids(server: LiveServer) -> set[str]:
    members: Any = server.redis().zrange(keys.REQUEST_INDEX, 0, -1)
    return {m.decode() for m in members}


@pytest.fixture
def sdk(live_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture
def claude(live_server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=live_server.base_url, api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def recorded_status(server: LiveServer, request_id: str) -> str:
    raw = server.redis().hgetall(keys.request_meta(request_id))
    return display_status(parse_meta(raw))


def test_openai_chat_stream_ends_with_an_error_event(live_server: LiveServer, sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1000, temperature=0, stream=True)
    first = next(iter(stream))
    operator_cancel(live_server, first.id.removeprefix("chatcmpl-"))
    with pytest.raises(openai.APIError, match=CANCELLED_BY_OPERATOR):
        finishes = [choice.finish_reason for chunk in stream for choice in chunk.choices if choice.finish_reason]
        pytest.fail(f"the stream ended normally with {finishes}")
    assert recorded_status(live_server, first.id.removeprefix("chatcmpl-")) == "cancelled"


def test_openai_chat_without_stream_gets_an_error_body(live_server: LiveServer, sdk: openai.OpenAI) -> None:
    before = recorded_ids(live_server)
    outcome: dict[str, Any] = {}

    def ask() -> None:
        try:
            outcome["answer"] = sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1000, temperature=0, extra_body={"ignore_eos": True})
        except openai.APIStatusError as exc:
            outcome["error"] = exc

    asker = threading.Thread(target=ask)
    asker.start()
    new: set[str] = set()
    while not new and asker.is_alive():  # the request is recorded once admitted
        new = recorded_ids(live_server) - before
        time.sleep(0.02)
    assert len(new) == 1, new
    operator_cancel(live_server, new.pop())
    asker.join(120)
    error = outcome.get("error")
    assert isinstance(error, openai.InternalServerError), outcome
    assert CANCELLED_BY_OPERATOR in error.message


def test_anthropic_stream_ends_with_an_error_event(live_server: LiveServer, claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model="m", messages=MESSAGES, max_tokens=1000) as stream:
        events = iter(stream)
        start = next(events)
        assert start.type == "message_start"
        next(events)
        operator_cancel(live_server, start.message.id.removeprefix("msg_"))
        with pytest.raises(anthropic.APIStatusError, match=CANCELLED_BY_OPERATOR) as raised:
            seen = [event.type for event in events]
            pytest.fail(f"the stream ended normally: {seen[-3:]}")
    assert raised.value.body["error"]["type"] == "api_error"  # type: ignore[index]


def test_responses_stream_ends_with_response_failed(live_server: LiveServer, sdk: openai.OpenAI) -> None:
    stream = sdk.responses.create(model="m", input=LONG, max_output_tokens=1000, temperature=0, stream=True)
    events = iter(stream)
    created = next(events)
    assert created.type == "response.created"
    operator_cancel(live_server, created.response.id.removeprefix("resp_"))
    terminal = [event for event in events if event.type in ("response.completed", "response.incomplete", "response.failed")]
    assert [event.type for event in terminal] == ["response.failed"]
    failed = terminal[0].response
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.code == "server_error" and CANCELLED_BY_OPERATOR in failed.error.message
