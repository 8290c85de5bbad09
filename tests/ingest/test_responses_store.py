"""Responses sessions against a real Redis: what `previous_response_id` continues and what `store` keeps."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from ingest import openai_responses, responses_store
from shared.deltas import Content, Finish, FinishReason, Usage
from shared.errors import ApiError
from shared.ir import Role
from shared.settings import Settings

SETTINGS = Settings()


@pytest.fixture
async def redis(redis_server: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.rsplit("/", 1)[0] + "/11")
    await client.flushdb()
    yield client
    await client.aclose()


def parsed(body: dict[str, object], rid: str):  # type: ignore[no-untyped-def]
    return openai_responses.parse(body, request_id=rid, created=1.0)


async def run_turn(redis: Redis, body: dict[str, object], rid: str, answer: str):  # type: ignore[no-untyped-def]
    request, save = await responses_store.begin(redis, SETTINGS, body, parsed(body, rid))
    assert save is not None
    await save(request, [Content(text=answer), Finish(reason=FinishReason.STOP, usage=Usage())])
    return request


async def test_a_continued_turn_keeps_the_whole_conversation_but_never_the_instructions(redis: Redis) -> None:
    await run_turn(redis, {"model": "m", "input": "Hi", "instructions": "Be terse."}, "r1", "Hello.")
    second = {"model": "m", "input": "And?", "instructions": "Be kind.", "previous_response_id": "resp_r1"}
    request = await run_turn(redis, second, "r2", "More.")
    assert [(m.role, m.text) for m in request.messages] == [
        (Role.USER, "Hi"),
        (Role.ASSISTANT, "Hello."),
        (Role.SYSTEM, "Be kind."),
        (Role.USER, "And?"),
    ]
    _, stored = await responses_store.load(redis, "resp_r2")
    assert [(m.role, m.text) for m in stored] == [(Role.USER, "Hi"), (Role.ASSISTANT, "Hello."), (Role.USER, "And?"), (Role.ASSISTANT, "More.")]


async def test_store_false_keeps_nothing_and_an_unknown_previous_id_is_a_404_naming_the_parameter(redis: Redis) -> None:
    body = {"model": "m", "input": "Hi", "store": False}
    _, save = await responses_store.begin(redis, SETTINGS, body, parsed(body, "r3"))
    assert save is None
    missing = {"model": "m", "input": "Hi", "previous_response_id": "resp_nope"}
    with pytest.raises(ApiError) as err:
        await responses_store.begin(redis, SETTINGS, missing, parsed(missing, "r4"))
    assert err.value.status == 404 and err.value.param == "previous_response_id"
