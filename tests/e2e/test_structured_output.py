"""Structured output through a live `met serve` with the official SDKs: 20 schemas × 3 protocols (half of
them streamed), every output validates with `jsonschema`; the SDKs' `.parse()` helpers return objects;
the regex / choice / grammar extensions on every protocol; a grammar the tokenizer cannot compile is a
400 naming the parameter with nothing queued."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest

from shared import keys

from ..conftest import LiveServer
from .schemas import SCHEMAS

pytestmark = pytest.mark.e2e

MAX_TOKENS = 160


@pytest.fixture
def gpt(live_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="x", max_retries=0, timeout=300) as client:
        yield client


@pytest.fixture
def claude(live_server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=live_server.base_url, api_key="x", max_retries=0, timeout=300) as client:
        yield client


def chat_json(gpt: openai.OpenAI, prompt: str, schema: dict[str, Any], stream: bool) -> str:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    common: Any = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS, "temperature": 0.0, "response_format": fmt}
    if not stream:
        return gpt.chat.completions.create(**common).choices[0].message.content or ""
    return "".join(c.choices[0].delta.content or "" for c in gpt.chat.completions.create(**common, stream=True) if c.choices)


def responses_json(gpt: openai.OpenAI, prompt: str, schema: dict[str, Any], stream: bool) -> str:
    common: Any = {
        "model": "m",
        "input": prompt,
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
        "store": False,
    }
    if not stream:
        return gpt.responses.create(**common).output_text
    with gpt.responses.stream(**common) as events:
        return events.get_final_response().output_text


def messages_json(claude: anthropic.Anthropic, prompt: str, schema: dict[str, Any], stream: bool) -> str:
    common: Any = {
        "model": "m",
        "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": prompt}],
        "output_config": {"format": {"type": "json_schema", "schema": schema}},
        "extra_body": {"temperature": 0.0},
    }
    if not stream:
        message = claude.messages.create(**common)
    else:
        with claude.messages.stream(**common) as events:
            message = events.get_final_message()
    return "".join(b.text for b in message.content if b.type == "text")


@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_twenty_schemas_every_output_validates(protocol: str, gpt: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    ask: Callable[[str, dict[str, Any], bool], str] = {
        "chat": lambda p, s, st: chat_json(gpt, p, s, st),
        "responses": lambda p, s, st: responses_json(gpt, p, s, st),
        "messages": lambda p, s, st: messages_json(claude, p, s, st),
    }[protocol]
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        texts = list(pool.map(lambda i: ask(SCHEMAS[i][1], SCHEMAS[i][2], i % 2 == 0), range(len(SCHEMAS))))
    for (name, _, schema), text in zip(SCHEMAS, texts, strict=True):
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            raise AssertionError(f"{protocol}/{name}: {text!r}: {exc}") from None


class City(pydantic.BaseModel):
    # No numbers: the anthropic SDK's schema transform drops bounds (ge/le/max_length) into the
    # description, and an unbounded number lets a 135M model write digits until max_tokens.
    name: str
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]
    capital: bool


def test_the_openai_parse_helpers_return_objects(gpt: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "Describe Paris as JSON."}]
    parsed = gpt.chat.completions.parse(model="m", messages=question, response_format=City, temperature=0.0, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
    assert isinstance(parsed.choices[0].message.parsed, City)
    response = gpt.responses.parse(model="m", input="Describe Paris as JSON.", text_format=City, temperature=0.0, max_output_tokens=MAX_TOKENS, store=False)
    assert isinstance(response.output_parsed, City)


def test_the_anthropic_parse_helper_returns_an_object(claude: anthropic.Anthropic) -> None:
    parsed = claude.messages.parse(
        model="m", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": "Describe Paris as JSON."}], output_format=City, extra_body={"temperature": 0.0}
    )
    assert isinstance(parsed.parsed_output, City)


EXTENSIONS: list[tuple[dict[str, Any], Callable[[str], bool]]] = [
    ({"regex": r"[A-Z][a-z]{2,8} [0-9]{1,3}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", t) is not None),
    ({"choice": ["Paris", "Lyon", "Nice"]}, lambda t: t in ("Paris", "Lyon", "Nice")),
    ({"grammar": 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,4}/'}, lambda t: re.fullmatch(r"The answer is [0-9]{1,4}\.", t) is not None),
]


@pytest.mark.parametrize(("extra", "check"), EXTENSIONS, ids=["regex", "choice", "grammar"])
def test_the_extension_fields_constrain_every_protocol(extra: dict[str, Any], check: Callable[[str], bool], gpt: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"temperature": 0.0, **extra}
    chat = gpt.chat.completions.create(model="m", messages=prompt, max_tokens=30, extra_body=body).choices[0].message.content or ""  # type: ignore[arg-type]
    responses = gpt.responses.create(model="m", input=prompt, max_output_tokens=30, extra_body=body, store=False).output_text  # type: ignore[arg-type]
    message = claude.messages.create(model="m", max_tokens=30, messages=prompt, extra_body=body)  # type: ignore[arg-type]
    messages = "".join(b.text for b in message.content if b.type == "text")
    assert [check(t) for t in (chat, responses, messages)] == [True, True, True], (chat, responses, messages)


UNCOMPILABLE: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "grammar": "start: missing_rule"}, "grammar"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "regex": "[a-"}, "regex"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "text.format.schema"),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "regex": "(unclosed"}, "regex"),
]


@pytest.mark.parametrize(("path", "body", "param"), UNCOMPILABLE, ids=[u[2] + str(i) for i, u in enumerate(UNCOMPILABLE)])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_grammar_that_does_not_compile_is_a_400_naming_it_and_nothing_is_queued(
    live_server: LiveServer, path: str, body: dict[str, Any], param: str, stream: bool
) -> None:
    r = live_server.redis()
    before = r.xlen(keys.REQUEST_STREAM)
    response = httpx.post(f"{live_server.base_url}{path}", json={"model": "m", "stream": stream, **body}, timeout=60)
    assert response.status_code == 400 and response.headers["content-type"].startswith("application/json"), response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    if path != "/v1/messages":
        assert error["param"] == param
    else:
        assert param in error["message"]
    assert r.xlen(keys.REQUEST_STREAM) == before
    r.close()
