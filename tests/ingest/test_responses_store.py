"""Responses sessions against a real Redis: what `previous_response_id` continues and what `store` keeps."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from ingest.http import responses_store
from ingest.http.auth import ANONYMOUS
from ingest.parsers import openai_responses
from shared.deltas import Content, Finish, FinishReason, Usage
from shared.errors import ApiError
from shared.ir import Role
from shared.settings import Settings

from ..conftest import redis_db

SETTINGS = Settings()


@pytest.fixture
async def redis(redis_server: str) -> AsyncIterator[Redis]:
    async with redis_db(redis_server, 11) as client:
        yield client


def parsed(body: dict[str, object], rid: str):  # type: ignore[no-untyped-def]
    return openai_responses.parse(body, request_id=rid, created=1.0)


async def run_turn(redis: Redis, body: dict[str, object], rid: str, answer: str, caller: str = ANONYMOUS):  # type: ignore[no-untyped-def]
    request, save = await responses_store.begin(redis, SETTINGS, body, parsed(body, rid), caller)
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
    _, stored = await responses_store.load(redis, "resp_r2", caller=ANONYMOUS)
    assert [(m.role, m.text) for m in stored] == [(Role.USER, "Hi"), (Role.ASSISTANT, "Hello."), (Role.USER, "And?"), (Role.ASSISTANT, "More.")]


async def test_store_false_keeps_nothing_and_an_unknown_previous_id_is_a_404_naming_the_parameter(redis: Redis) -> None:
    body = {"model": "m", "input": "Hi", "store": False}
    _, save = await responses_store.begin(redis, SETTINGS, body, parsed(body, "r3"), ANONYMOUS)
    assert save is None
    missing = {"model": "m", "input": "Hi", "previous_response_id": "resp_nope"}
    with pytest.raises(ApiError) as err:
        await responses_store.begin(redis, SETTINGS, missing, parsed(missing, "r4"), ANONYMOUS)
    assert err.value.status == 404 and err.value.param == "previous_response_id"


async def test_a_failed_save_does_not_raise_so_the_client_still_gets_its_terminal_event() -> None:
    from cli.embedded_redis import free_port

    gone = Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    body = {"model": "m", "input": "Hi"}
    request, save = await responses_store.begin(gone, SETTINGS, body, parsed(body, "r5"), ANONYMOUS)
    assert save is not None
    await save(request, [Content(text="Hello."), Finish(reason=FinishReason.STOP, usage=Usage())])
    await gone.aclose()


async def test_a_response_without_its_document_is_rebuilt_from_its_deltas_and_a_delete_stays_deleted(redis: Redis) -> None:
    from dataclasses import replace

    from ingest.http.publish import submit
    from shared import keys
    from shared.codec import encode_delta

    body = {"model": "m", "input": "Hi", "instructions": "Be terse."}
    request = replace(parsed(body, "r6"), raw_body='{"model":"m","input":"Hi","instructions":"Be terse."}')
    await submit(redis, request)
    running, _ = await responses_store.load(redis, "resp_r6", caller=ANONYMOUS)
    assert running["status"] == "in_progress" and running["output"] == []
    for delta in (Content(text="Hello."), Finish(reason=FinishReason.STOP, usage=Usage(completion_tokens=2))):
        await redis.xadd(keys.delta_stream("r6"), {"d": encode_delta(delta)})
    done, conversation = await responses_store.load(redis, "resp_r6", caller=ANONYMOUS, param="previous_response_id")
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "Hello."
    assert [(m.role, m.text) for m in conversation] == [(Role.USER, "Hi"), (Role.ASSISTANT, "Hello.")]
    await responses_store.delete(redis, "resp_r6", caller=ANONYMOUS, ttl=60)
    with pytest.raises(ApiError) as err:
        await responses_store.load(redis, "resp_r6", caller=ANONYMOUS)
    assert err.value.status == 404


async def test_a_response_belongs_to_the_key_that_made_it_and_is_a_404_for_any_other(redis: Redis) -> None:
    from dataclasses import replace

    from ingest.http.publish import submit
    from shared import keys

    await run_turn(redis, {"model": "m", "input": "Hi"}, "o1", "Hello.", caller="key-a")
    for caller, ok in (("key-a", True), ("key-b", False), (ANONYMOUS, True)):  # ANONYMOUS: a server without keys
        if ok:
            body, _ = await responses_store.load(redis, "resp_o1", caller=caller)
            assert body["id"] == "resp_o1"
            continue
        with pytest.raises(ApiError) as err:
            await responses_store.load(redis, "resp_o1", caller=caller)
        assert err.value.status == 404
    theirs = {"model": "m", "input": "And?", "previous_response_id": "resp_o1"}
    with pytest.raises(ApiError) as err:
        await responses_store.begin(redis, SETTINGS, theirs, parsed(theirs, "o2"), "key-b")
    assert err.value.status == 404 and err.value.param == "previous_response_id"
    with pytest.raises(ApiError) as err:
        await responses_store.delete(redis, "resp_o1", caller="key-b", ttl=60)
    assert err.value.status == 404
    assert (await responses_store.load(redis, "resp_o1", caller="key-a"))[0]["status"] == "completed"  # B's delete did nothing

    running = replace(parsed({"model": "m", "input": "Hi", "background": True}, "o3"), raw_body='{"model":"m","input":"Hi","background":true}')
    await submit(redis, running, owner="key-a")  # no document yet: rebuilt from the recorded request, scoped by its owner
    assert await responses_store.live(redis, "resp_o3", caller="key-b") is None
    assert await responses_store.live(redis, "resp_o3", caller="key-a") is not None
    with pytest.raises(ApiError) as err:
        await responses_store.cancel_background(redis, "resp_o3", caller="key-b", wait_s=0)
    assert err.value.status == 404
    assert await redis.get(keys.cancel_flag("o3")) is None  # nothing was cancelled for B


async def test_a_stream_is_resumed_only_by_the_key_that_made_it(redis: Redis) -> None:
    from dataclasses import replace

    from ingest.http import resume
    from ingest.http.publish import submit
    from shared.ir import Protocol

    stream = replace(parsed({"model": "m", "input": "Hi", "stream": True}, "s1"), stream=True)
    await submit(redis, stream, owner="key-a")
    assert (await resume.load(redis, "s1", Protocol.OPENAI_RESPONSES, caller="key-a")).id == "s1"
    assert (await resume.load(redis, "s1", Protocol.OPENAI_RESPONSES, caller=ANONYMOUS)).id == "s1"
    with pytest.raises(ApiError) as err:
        await resume.load(redis, "s1", Protocol.OPENAI_RESPONSES, caller="key-b")
    assert err.value.status == 404 and err.value.code == "stream_not_found"
