"""File inputs through a live `met serve` with the official SDKs: Responses `input_file` (inline, and by
`file_id` after an upload), a Chat `file` part and an Anthropic `document` block reach the prompt; a file the
server cannot read is a 400 naming the part, before anything is queued."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from shared import keys

from ..conftest import LiveServer, wait_for
from ..pdfs import pdf_with_text

pytestmark = pytest.mark.e2e

NOTES = "Grocery list: apples, pears, walnuts.\n"
FRUIT = json.dumps({"fruit": "kiwi", "count": 3})
PDF = pdf_with_text("The quarterly report says revenue grew.")
FILES = [  # (filename, media type, bytes, text the prompt must show)
    ("notes.txt", "text/plain", NOTES.encode(), "Grocery list: apples, pears, walnuts."),
    ("fruit.json", "application/json", FRUIT.encode(), FRUIT),
    ("report.pdf", "application/pdf", PDF, "--- page 1 ---\nThe quarterly report says revenue grew."),
]


@pytest.fixture
def api(live_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def data_url(media_type: str, data: bytes) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def asking(*parts: dict[str, Any]) -> Any:  # the SDK's input types, as plain JSON
    return [{"role": "user", "content": [{"type": "input_text", "text": "Read this."}, *parts]}]


def create(api: openai.OpenAI, *parts: dict[str, Any]) -> Any:
    return api.responses.create(model="m", input=asking(*parts), max_output_tokens=1, temperature=0, extra_body={"return_token_ids": True})


def prompt_text(live_server: LiveServer, ids: list[int]) -> str:
    answer = httpx.post(f"{live_server.base_url}/detokenize", json={"model": "m", "tokens": ids}, timeout=30)
    return str(answer.json()["prompt"])


def test_text_json_and_pdf_input_files_reach_the_prompt_streamed_and_not(api: openai.OpenAI, live_server: LiveServer) -> None:
    baseline = create(api).usage.input_tokens
    for name, media_type, data, shown in FILES:
        part = {"type": "input_file", "filename": name, "file_data": data_url(media_type, data)}
        created = create(api, part)
        prompt = prompt_text(live_server, created.model_extra["prompt_token_ids"])
        assert f'<file name="{name}">\n{shown}' in prompt
        with api.responses.stream(model="m", input=asking(part), max_output_tokens=1, temperature=0) as stream:
            events = list(stream)
        final = events[-1].response  # type: ignore[union-attr]  # the SDK's get_final_response() waits for response.completed only
        assert final.usage is not None and final.usage.input_tokens == created.usage.input_tokens > baseline
        assert api.responses.input_tokens.count(model="m", input=asking(part)).input_tokens == created.usage.input_tokens


def test_a_file_uploaded_with_purpose_user_data_is_read_by_file_id(api: openai.OpenAI) -> None:
    uploaded = api.files.create(file=("report.pdf", PDF), purpose="user_data")
    by_id = create(api, {"type": "input_file", "file_id": uploaded.id})
    inline = create(api, {"type": "input_file", "filename": "report.pdf", "file_data": data_url("application/pdf", PDF)})
    assert by_id.model_extra["prompt_token_ids"] == inline.model_extra["prompt_token_ids"]
    with pytest.raises(openai.NotFoundError) as caught:
        create(api, {"type": "input_file", "file_id": "file-0000"})
    assert caught.value.param == "input[0].content[1].file_id"


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "input_file", "filename": "cat.png", "file_data": data_url("image/png", b"\x89PNG\r\n\x1a\n")}, "input[0].content[1]"),
        ({"type": "input_file", "filename": "scan.pdf", "file_data": data_url("application/pdf", pdf_with_text(""))}, "input[0].content[1]"),
        ({"type": "input_file", "file_url": "https://example.com/report.pdf"}, "input[0].content[1].file_url"),
    ],
)
def test_a_file_the_server_cannot_read_is_a_400_naming_the_part_and_nothing_is_queued(
    api: openai.OpenAI, live_server: LiveServer, part: dict[str, Any], param: str
) -> None:
    r = live_server.redis()
    before = r.xlen(keys.REQUEST_STREAM)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            api.responses.create(model="m", input=asking(part), max_output_tokens=1, stream=stream)
        assert caught.value.param == param and "input[0].content[1]" in caught.value.message
    assert r.xlen(keys.REQUEST_STREAM) == before
    r.close()


def test_a_chat_file_part_and_an_anthropic_document_reach_the_prompt(api: openai.OpenAI, live_server: LiveServer) -> None:
    file_part = {"type": "file", "file": {"filename": "report.pdf", "file_data": data_url("application/pdf", PDF)}}
    chat_messages: Any = [{"role": "user", "content": [{"type": "text", "text": "Read this."}, file_part]}]
    chat = api.chat.completions.create(model="m", messages=chat_messages, max_tokens=1, extra_body={"return_token_ids": True})
    assert chat.model_extra is not None and FILES[2][3] in prompt_text(live_server, chat.model_extra["prompt_token_ids"])
    # the same message through Responses is the same prompt
    assert chat.model_extra["prompt_token_ids"] == create(api, {"type": "input_file", "filename": "report.pdf", "file_data": data_url("application/pdf", PDF)}).model_extra["prompt_token_ids"]
    with anthropic.Anthropic(base_url=live_server.base_url, api_key="unused", max_retries=0, timeout=120) as claude:
        document = {"type": "document", "title": "report.pdf", "source": {"type": "base64", "media_type": "application/pdf", "data": base64.b64encode(PDF).decode()}}
        messages: Any = [{"role": "user", "content": [{"type": "text", "text": "Read this."}, document]}]
        message = claude.messages.create(model="m", max_tokens=1, messages=messages)
        counted = claude.messages.count_tokens(model="m", messages=messages)
        alone = claude.messages.count_tokens(model="m", messages=[{"role": "user", "content": "Read this."}])
    usage = message.usage  # Anthropic's input_tokens leave out the prompt's cached blocks (the same prompt was just sent as chat)
    prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    assert prompt == counted.input_tokens > alone.input_tokens
    assert prompt == chat.usage.prompt_tokens  # type: ignore[union-attr]  # one IR, one prompt, whichever protocol carried the file


def test_a_batch_line_reads_its_file_by_id_when_it_runs_and_a_missing_file_errors_that_line_alone(api: openai.OpenAI) -> None:
    uploaded = api.files.create(file=("report.pdf", PDF), purpose="user_data")
    alone = create(api, {"type": "input_file", "file_id": uploaded.id})
    rows = [
        {"custom_id": cid, "method": "POST", "url": "/v1/responses", "body": {"model": "m", "input": asking({"type": "input_file", "file_id": fid}), "max_output_tokens": 1}}
        for cid, fid in (("has-file", uploaded.id), ("no-file", "file-0000"))
    ]
    lines = api.files.create(file=("lines.jsonl", "\n".join(json.dumps(r) for r in rows).encode()), purpose="batch")
    batch = api.batches.create(input_file_id=lines.id, endpoint="/v1/responses", completion_window="24h")
    done = wait_for("the batch to end", lambda: (b := api.batches.retrieve(batch.id)).status in ("completed", "failed") and b, timeout=240.0, interval=0.3)
    assert done.status == "completed" and done.output_file_id is not None and done.error_file_id is not None
    (out,) = [json.loads(x) for x in api.files.content(done.output_file_id).text.splitlines()]
    (err,) = [json.loads(x) for x in api.files.content(done.error_file_id).text.splitlines()]
    assert out["custom_id"] == "has-file" and out["response"]["body"]["usage"]["input_tokens"] == alone.usage.input_tokens
    assert err["custom_id"] == "no-file" and err["response"]["body"]["error"]["param"] == "input[0].content[1].file_id"
