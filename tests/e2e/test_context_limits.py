"""Context limits through live servers: `--max-model-len` defaults to the model's own context; a
`max_tokens` past what the context leaves is clamped (default) or refused (`--strict-max-tokens`, in
Anthropic's own words on /v1/messages); a prompt that does not fit is refused; a refusal queues nothing.
Two small-context servers (`--max-model-len 128`) keep every prompt here a few dozen tokens."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from shared import keys

from ..conftest import LiveServer, http_errors, start_server, stop_server

pytestmark = pytest.mark.e2e

CONTEXT = 128
HI = [{"role": "user", "content": "Say hi."}]
LONG = [{"role": "user", "content": "word " * 400}]
CLAUDE_RETRY = re.compile(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)")  # Claude Code 2.1.332's regex


@pytest.fixture(scope="module")
def clamping(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("clamp"), "--workers", "1", "--max-model-len", str(CONTEXT), "--kv-budget-mb", "256")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(
        tmp_path_factory.mktemp("strict"), "--workers", "1", "--max-model-len", str(CONTEXT), "--strict-max-tokens", "--kv-budget-mb", "256"
    )
    yield server
    stop_server(server)


def queued(server: LiveServer) -> int:
    r = server.redis()
    try:
        return int(r.xlen(keys.REQUEST_STREAM))
    finally:
        r.close()


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def test_the_default_max_model_len_is_the_models_own_context(live_server: LiveServer) -> None:
    (card,) = httpx.get(f"{live_server.base_url}/v1/models", timeout=10).json()["data"]
    assert card["max_model_len"] == 8192  # SmolLM2-135M-Instruct's max_position_embeddings


def test_a_max_tokens_past_the_context_is_clamped_on_every_protocol(clamping: LiveServer) -> None:
    with openai.OpenAI(base_url=f"{clamping.base_url}/v1", api_key="x", max_retries=0, timeout=120) as chat:
        completion = chat.chat.completions.create(model="m", messages=HI, max_tokens=100_000, temperature=0)
        response = chat.responses.create(model="m", input="Say hi.", max_output_tokens=100_000, temperature=0)
    assert completion.usage is not None and completion.usage.total_tokens <= CONTEXT
    assert response.usage is not None and response.usage.total_tokens <= CONTEXT
    assert response.max_output_tokens == CONTEXT - response.usage.input_tokens  # the clamped limit is what runs
    claude = anthropic.Anthropic(base_url=clamping.base_url, api_key="x", max_retries=0, timeout=120)
    with claude, claude.messages.stream(model="claude-opus-5-5", max_tokens=128_000, messages=HI, extra_body={"temperature": 0}) as stream:
        message = stream.get_final_message()
    assert message.model == "claude-opus-5-5" and message.usage.input_tokens + message.usage.output_tokens <= CONTEXT
    assert message.stop_reason in ("end_turn", "max_tokens")


def test_a_clamped_request_that_reaches_the_context_finishes_with_length(clamping: LiveServer) -> None:
    body = {"model": "m", "messages": HI, "max_tokens": 100_000, "ignore_eos": True}
    choice = post(clamping, "/v1/chat/completions", body).json()
    assert choice["choices"][0]["finish_reason"] == "length"
    assert choice["usage"]["prompt_tokens"] + choice["usage"]["completion_tokens"] == CONTEXT


def test_strict_refuses_on_anthropic_in_the_words_claude_code_parses(strict: LiveServer) -> None:
    before, errors = queued(strict), http_errors(strict).get("400", 0)
    prompt = post(strict, "/v1/messages/count_tokens", {"model": "m", "messages": HI}).json()["input_tokens"]
    for stream in (False, True):
        response = post(strict, "/v1/messages", {"model": "m", "messages": HI, "max_tokens": 32000, "stream": stream})
        assert response.status_code == 400 and response.headers["content-type"].startswith("application/json")
        body = response.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        match = CLAUDE_RETRY.search(body["error"]["message"])
        assert match is not None and match.groups() == (str(prompt), "32000", str(CONTEXT)), body
        assert body["error"]["message"].endswith("decrease input length or `max_tokens` and try again")
    assert queued(strict) == before and http_errors(strict)["400"] == errors + 2
    fits = post(strict, "/v1/messages", {"model": "m", "messages": HI, "max_tokens": CONTEXT - prompt})
    assert fits.status_code == 200, fits.text


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"model": "m", "messages": HI, "max_tokens": 32000}, "max_tokens"),
    ("/v1/responses", {"model": "m", "input": "Say hi.", "max_output_tokens": 32000}, "max_output_tokens"),
], ids=["chat", "responses"])
def test_strict_refuses_on_openai_surfaces_naming_the_output_limit(strict: LiveServer, path: str, body: dict[str, Any], param: str) -> None:
    before = queued(strict)
    response = post(strict, path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, "context_length_exceeded")
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    assert queued(strict) == before


def test_a_prompt_that_does_not_fit_is_refused_in_each_protocols_shape(clamping: LiveServer) -> None:
    before = queued(clamping)
    anthropic_error = post(clamping, "/v1/messages", {"model": "m", "messages": LONG, "max_tokens": 10}).json()
    assert anthropic_error["type"] == "error" and anthropic_error["error"]["type"] == "invalid_request_error"
    assert re.fullmatch(rf"prompt is too long: \d+ tokens > {CONTEXT} maximum", anthropic_error["error"]["message"])  # one number on every protocol
    chat = post(clamping, "/v1/chat/completions", {"model": "m", "messages": LONG}).json()["error"]
    assert (chat["param"], chat["code"]) == ("messages", "context_length_exceeded")
    responses = post(clamping, "/v1/responses", {"model": "m", "input": LONG[0]["content"]}).json()["error"]
    assert (responses["param"], responses["code"]) == ("input", "context_length_exceeded")
    assert queued(clamping) == before
