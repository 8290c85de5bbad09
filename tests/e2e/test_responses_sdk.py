"""The official `openai` SDK's Responses API against a live `met serve`."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from shared import keys

from ..conftest import LiveServer

pytestmark = pytest.mark.e2e


@pytest.fixture
def api(live_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def test_stream_final_response_equals_create(api: openai.OpenAI) -> None:
    common = {"model": "m", "input": "Name the capital of France.", "temperature": 0, "max_output_tokens": 40}  # Paris by 1.45 logits in float32 (test_openai_chat_sdk)
    created = api.responses.create(**common)  # type: ignore[call-overload]
    with api.responses.stream(**common) as stream:  # type: ignore[call-overload]
        events = [e.type for e in stream]
        final = stream.get_final_response()
    assert "Paris" in created.output_text
    assert final.output_text == created.output_text
    assert final.status == created.status == "completed"
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.completed"
    assert final.usage is not None and created.usage is not None and final.usage.input_tokens == created.usage.input_tokens
    cached = final.usage.input_tokens_details.cached_tokens  # the same prompt again: its full blocks come from the prefix cache
    assert 16 <= cached < final.usage.input_tokens and cached % 16 == 0


def test_previous_response_id_continues_the_conversation_and_responses_can_be_fetched_and_deleted(api: openai.OpenAI) -> None:
    first = api.responses.create(model="m", input="My name is Alice. Remember it.", instructions="Be kind.", temperature=0, max_output_tokens=20)
    second = api.responses.create(model="m", input="What is my name?", previous_response_id=first.id, temperature=0, max_output_tokens=20)
    alone = api.responses.create(model="m", input="What is my name?", temperature=0, max_output_tokens=20, store=False)
    assert first.usage is not None and second.usage is not None and alone.usage is not None
    # the second prompt carries the first exchange: its input is the first's input + output + the new turn
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > alone.usage.input_tokens
    assert second.previous_response_id == first.id
    fetched = api.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == first.output_text
    api.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as caught:
        api.responses.create(model="m", input="x", previous_response_id=first.id)
    assert caught.value.param == "previous_response_id"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(alone.id)  # store=false keeps nothing


def test_max_output_tokens_ends_incomplete(api: openai.OpenAI) -> None:
    with api.responses.stream(model="m", input="Write an essay about rivers.", max_output_tokens=4) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"  # the SDK's get_final_response() waits for response.completed only
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == "incomplete" and final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "input"),
        ({"input": "hi"}, "model"),
        ({"model": "m", "input": "hi", "max_output_tokens": "many"}, "max_output_tokens"),
        ({"model": "m", "input": [{"type": "bogus"}]}, "input[0].type"),
    ],
)
def test_bad_input_gets_the_openai_error_shape_before_any_stream(live_server: LiveServer, body: dict[str, object], param: str) -> None:
    r = live_server.redis()
    before = r.xlen(keys.REQUEST_STREAM)
    response = httpx.post(f"{live_server.base_url}/v1/responses", json={**body, "stream": True}, timeout=30)
    assert response.status_code == 400 and response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["param"] == param
    assert r.xlen(keys.REQUEST_STREAM) == before
    r.close()


def test_return_token_ids_on_the_responses_stream(live_server: LiveServer) -> None:
    body = {"model": "m", "input": "Hi", "max_output_tokens": 6, "stream": True, "return_token_ids": True}
    with httpx.stream("POST", f"{live_server.base_url}/v1/responses", json=body, timeout=60) as response:
        deltas = [line for line in response.iter_lines() if line.startswith("data: ") and "output_text.delta" in line]
    assert deltas and all('"token_ids"' in line for line in deltas)
