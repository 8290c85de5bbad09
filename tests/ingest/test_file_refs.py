"""`file_id` references resolved from a real Redis's Files store before parsing: a key's own files only,
every refusal naming the part's `file_id`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from ingest.batches import files
from ingest.http import file_refs
from ingest.parsers import file_inputs, openai_chat, openai_responses
from shared.errors import ApiError
from shared.settings import Settings

from ..conftest import redis_db
from ..pdfs import pdf_with_text

SETTINGS = Settings()


@pytest.fixture
async def redis(redis_server: str) -> AsyncIterator[Redis]:
    async with redis_db(redis_server, 12) as client:
        yield client


def responses_body(file_id: str) -> dict[str, Any]:
    return {"model": "m", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": file_id}, {"type": "input_text", "text": "Sum up."}]}]}


async def test_a_keys_own_file_is_carried_into_the_parsed_prompt_and_the_clients_body_is_left_as_sent(redis: Redis) -> None:
    doc = await files.put(redis, SETTINGS, owner="alice", filename="minutes.pdf", purpose="user_data", content=pdf_with_text("Meeting minutes"))
    body = responses_body(doc["id"])
    resolved = await file_refs.resolve(redis, body, owner="alice")
    assert (resolved.files, resolved.added) == (1, doc["bytes"])
    request = openai_responses.parse(resolved.body, request_id="r", created=1.0)
    assert '<file name="minutes.pdf">\n--- page 1 ---\nMeeting minutes\n</file>' in request.messages[0].text
    assert body == responses_body(doc["id"])
    chat = {"model": "m", "messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": doc["id"]}}]}]}
    chat_request = openai_chat.parse((await file_refs.resolve(redis, chat, owner="alice")).body, request_id="r", created=1.0)
    assert chat_request.messages[0].text == request.messages[0].content[0].text  # type: ignore[union-attr]


async def test_another_keys_file_and_an_unknown_id_are_404s_naming_the_parts_file_id(redis: Redis) -> None:
    doc = await files.put(redis, SETTINGS, owner="alice", filename="a.txt", purpose="user_data", content=b"private")
    for owner, file_id in (("bob", doc["id"]), ("alice", "file-nope")):
        with pytest.raises(ApiError) as caught:
            await file_refs.resolve(redis, responses_body(file_id), owner=owner)
        assert (caught.value.status, caught.value.param, caught.value.code) == (404, "input[0].content[0].file_id", "file_not_found")
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "file", "file": {"file_id": doc["id"]}}]}]}
    with pytest.raises(ApiError) as caught:
        await file_refs.resolve(redis, chat, owner="bob")
    assert caught.value.param == "messages[0].content[1].file.file_id"


async def test_a_stored_file_over_the_limit_is_refused_before_it_is_read(redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = await files.put(redis, SETTINGS, owner="alice", filename="big.txt", purpose="user_data", content=b"x" * 100)
    monkeypatch.setattr(file_inputs, "MAX_FILE_BYTES", 50)
    with pytest.raises(ApiError) as caught:
        await file_refs.resolve(redis, responses_body(doc["id"]), owner="alice")
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, "input[0].content[0]", "file_too_large")


async def test_a_body_without_file_ids_is_returned_as_it_is(redis: Redis) -> None:
    body = {"model": "m", "input": "hi"}
    assert await file_refs.resolve(redis, body, owner="alice") == file_refs.Resolved(body)
