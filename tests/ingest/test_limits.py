"""Input limits before parsing (body size, JSON depth), the parsers' array and range limits in every
protocol, and the Redis token buckets (trip, Retry-After, recovery) against a real Redis."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from ingest.http.limits import RateLimiter, check_depth, parse_json, read_body
from ingest.parsers import anthropic_messages, openai_chat, openai_responses
from ingest.parsers.errors import error_body, status_for
from shared import keys
from shared.errors import ApiError
from shared.ir import Protocol
from shared.settings import Settings

from ..conftest import LiveServer

# ---- body size ----------------------------------------------------------------------------------


class FakeHttp:
    """What `read_body` uses of a blacksheep request: one header and the body stream."""

    def __init__(self, chunks: list[bytes], content_length: int | None = None) -> None:
        self.chunks = chunks
        self.content_length = content_length
        self.read_chunks = 0

    def get_first_header(self, name: bytes) -> bytes | None:
        assert name == b"content-length"
        return None if self.content_length is None else str(self.content_length).encode()

    async def stream(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.read_chunks += 1
            yield chunk


def too_large(http: FakeHttp, limit: int) -> ApiError:
    with pytest.raises(ApiError) as caught:
        asyncio.run(read_body(http, limit))  # type: ignore[arg-type]
    return caught.value


def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    http = FakeHttp([b"x" * 10], content_length=11)
    err = too_large(http, 10)
    assert (err.status, err.kind, err.code) == (413, "too_large", "request_too_large")
    assert http.read_chunks == 0


def test_a_chunked_body_is_cut_off_as_soon_as_it_passes_the_limit() -> None:
    http = FakeHttp([b"x" * 4] * 100)
    assert too_large(http, 10).status == 413
    assert http.read_chunks == 3


def test_a_body_that_lies_about_its_length_is_still_measured() -> None:
    assert too_large(FakeHttp([b"x" * 8, b"x" * 8], content_length=5), 10).status == 413


def test_a_body_within_the_limit_is_returned_whole() -> None:
    assert asyncio.run(read_body(FakeHttp([b"ab", b"", b"cd"], content_length=4), 4)) == b"abcd"  # type: ignore[arg-type]


def test_too_large_is_request_too_large_for_anthropic_and_invalid_request_for_openai() -> None:
    err = ApiError("too big", status=413, kind="too_large", code="request_too_large")
    assert error_body(Protocol.ANTHROPIC_MESSAGES, err)["error"]["type"] == "request_too_large"
    assert error_body(Protocol.OPENAI_CHAT, err)["error"] == {"message": "too big", "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    assert status_for(Protocol.ANTHROPIC_MESSAGES, err) == status_for(Protocol.OPENAI_CHAT, err) == 413


# ---- JSON depth ---------------------------------------------------------------------------------


def depth_error(raw: bytes, max_depth: int) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_json(raw, max_depth)
    assert caught.value.status == 400 and caught.value.code == "json_too_deep"
    return caught.value


def nested(levels: int) -> Any:
    value: Any = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def test_the_depth_error_names_the_path_where_the_limit_is_passed() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "x": {"y": [[1]]}}]}]}'
    assert parse_json(body, 8)["model"] == "m"
    assert depth_error(body, 7).param == "messages[0].content[0].x.y[0]"
    assert depth_error(body, 3).param == "messages[0].content"
    assert depth_error(b"[[[]]]", 2).param == "body[0][0]"


def test_json_deeper_than_the_parser_allows_is_named_body() -> None:
    err = depth_error(b"[" * 5000 + b"]" * 5000, 64)
    assert err.param == "body" and "64" in err.message


def test_the_depth_check_is_iterative() -> None:
    check_depth(nested(100_000), 100_001)  # far past the interpreter's recursion limit
    with pytest.raises(ApiError):
        check_depth(nested(100_000), 99_999)


def test_a_wide_shallow_body_passes() -> None:
    check_depth({"messages": [{"role": "user", "content": "x"}] * 50_000}, 3)


def test_malformed_json_is_still_invalid_json() -> None:
    with pytest.raises(ApiError) as caught:
        parse_json(b'{"model": ', 64)
    assert caught.value.code == "invalid_json" and caught.value.param is None


# ---- the parsers' limits, in every protocol --------------------------------------------------------

Parser = Callable[..., Any]
USER = {"role": "user", "content": "hi"}
CHAT = {"model": "m", "messages": [USER]}
ANTHROPIC = {"model": "m", "max_tokens": 8, "messages": [USER]}
RESPONSES = {"model": "m", "input": "hi"}
FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {}}}

LIMIT_CASES: list[tuple[str, Parser, dict[str, Any], str]] = [
    ("chat messages", openai_chat.parse, {**CHAT, "messages": [USER] * 2049}, "messages"),
    ("chat tools", openai_chat.parse, {**CHAT, "tools": [FUNCTION] * 129}, "tools"),
    ("chat stop", openai_chat.parse, {**CHAT, "stop": ["x"] * 17}, "stop"),
    ("chat stop_token_ids", openai_chat.parse, {**CHAT, "stop_token_ids": [1] * 65}, "stop_token_ids"),
    ("chat content parts", openai_chat.parse, {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 4097}]}, "messages[0].content"),
    ("chat max_tokens", openai_chat.parse, {**CHAT, "max_tokens": 10**7}, "max_tokens"),
    ("chat max_completion_tokens", openai_chat.parse, {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat n", openai_chat.parse, {**CHAT, "n": 17}, "n"),
    ("chat top_logprobs", openai_chat.parse, {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat logit_bias size", openai_chat.parse, {**CHAT, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("chat logit_bias value", openai_chat.parse, {**CHAT, "logit_bias": {"5": 101}}, "logit_bias.5"),
    ("chat metadata", openai_chat.parse, {**CHAT, "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ("anthropic messages", anthropic_messages.parse, {**ANTHROPIC, "messages": [USER] * 2049}, "messages"),
    ("anthropic tools", anthropic_messages.parse, {**ANTHROPIC, "tools": [{"name": "f", "input_schema": {}}] * 129}, "tools"),
    ("anthropic stop_sequences", anthropic_messages.parse, {**ANTHROPIC, "stop_sequences": ["x"] * 17}, "stop_sequences"),
    ("anthropic max_tokens", anthropic_messages.parse, {**ANTHROPIC, "max_tokens": 10**7}, "max_tokens"),
    ("anthropic top_k", anthropic_messages.parse, {**ANTHROPIC, "top_k": -1}, "top_k"),
    ("anthropic content blocks", anthropic_messages.parse, {**ANTHROPIC, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 4097}]}, "messages[0].content"),
    ("responses input", openai_responses.parse, {**RESPONSES, "input": [USER] * 2049}, "input"),
    ("responses tools", openai_responses.parse, {**RESPONSES, "tools": [{"type": "function", "name": "f"}] * 129}, "tools"),
    ("responses max_output_tokens", openai_responses.parse, {**RESPONSES, "max_output_tokens": 10**7}, "max_output_tokens"),
    ("responses metadata", openai_responses.parse, {**RESPONSES, "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
]


@pytest.mark.parametrize(("name", "parse", "body", "param"), LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES])
def test_each_limit_is_a_400_naming_its_parameter(name: str, parse: Parser, body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse(body, request_id="r", created=0.0)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def test_anthropic_errors_name_the_parameter_in_the_message() -> None:
    with pytest.raises(ApiError) as caught:
        anthropic_messages.parse({**ANTHROPIC, "stop_sequences": ["x"] * 17}, request_id="r", created=0.0)
    assert error_body(Protocol.ANTHROPIC_MESSAGES, caught.value)["error"]["message"].startswith("Invalid 'stop_sequences'")


# ---- rate limits (real Redis) ---------------------------------------------------------------------


@pytest.fixture
async def redis(redis_server: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.rsplit("/", 1)[0] + "/7")
    yield client
    await client.aclose()


def rate_error(outcome: BaseException | None) -> ApiError:
    assert isinstance(outcome, ApiError) and outcome.status == 429 and outcome.kind == "rate_limit", outcome
    return outcome


async def charge(limiter: RateLimiter, caller: str, tokens: int = 1) -> ApiError | None:
    try:
        await limiter.charge(caller, tokens=tokens)
    except ApiError as err:
        return err
    return None


async def test_requests_per_period_trip_with_retry_after_and_recover(redis: Redis) -> None:
    limiter = RateLimiter(redis, Settings(rate_limit_rpm=2, rate_limit_period=1.0))
    caller = secrets.token_hex(4)
    assert await charge(limiter, caller) is None
    assert await charge(limiter, caller) is None
    refused = rate_error(await charge(limiter, caller))
    assert refused.retry_after == 1  # one request refills in half a second: rounded up to whole seconds
    assert await charge(limiter, secrets.token_hex(4)) is None  # buckets are per caller
    await asyncio.sleep(0.6)
    assert await charge(limiter, caller) is None
    assert await redis.ttl(keys.rate_limit_bucket(caller, "requests")) in (1, 2)


async def test_tokens_per_period_trip_and_a_refused_request_costs_nothing(redis: Redis) -> None:
    limiter = RateLimiter(redis, Settings(rate_limit_rpm=100, rate_limit_tpm=1000, rate_limit_period=10.0))
    caller = secrets.token_hex(4)
    assert await charge(limiter, caller, 800) is None
    refused = rate_error(await charge(limiter, caller, 500))
    assert refused.retry_after == 3  # 300 missing at 100 tokens/s
    assert await charge(limiter, caller, 150) is None  # the refusal took nothing
    levels = await redis.hget(keys.rate_limit_bucket(caller, "requests"), "tokens")
    assert 97.9 < float(levels or 0) <= 98.1  # two requests charged, not three


async def test_a_refund_gives_back_what_a_charge_took_and_headers_say_what_is_left(redis: Redis) -> None:
    """A request the queue refuses after its charge is refunded (ingest.http.app); admitted answers carry OpenAI's
    x-ratelimit-* headers."""
    limiter = RateLimiter(redis, Settings(rate_limit_rpm=10, rate_limit_tpm=1000, rate_limit_period=60.0))
    caller = secrets.token_hex(4)
    charged = await limiter.charge(caller, tokens=600)
    headers = limiter.headers(charged)
    assert headers["x-ratelimit-limit-tokens"] == "1000" and headers["x-ratelimit-remaining-tokens"] in ("400", "399")
    assert headers["x-ratelimit-limit-requests"] == "10" and headers["x-ratelimit-remaining-requests"] in ("9", "8")
    assert 35.9 < float(headers["x-ratelimit-reset-tokens"].removesuffix("s")) <= 36.1  # 600 tokens to refill at 1000 per 60 s
    await limiter.refund(caller, charged)
    assert await charge(limiter, caller, 1000) is None  # the whole bucket again: the refused request cost nothing
    full = float(await redis.hget(keys.rate_limit_bucket(caller, "requests"), "tokens") or 0)
    assert 8.9 < full <= 9.1  # one request charged (this last one), not two
    assert RateLimiter(redis, Settings()).headers(charged) == {}  # no limits: no headers


async def test_a_request_bigger_than_the_whole_bucket_is_refused_without_retry_after(redis: Redis) -> None:
    limiter = RateLimiter(redis, Settings(rate_limit_tpm=100))
    err = rate_error(await charge(limiter, secrets.token_hex(4), 101))
    assert err.retry_after is None and "101" in err.message


async def test_no_limits_configured_means_no_redis_calls(redis: Redis) -> None:
    limiter = RateLimiter(redis, Settings())
    assert not limiter.enabled
    caller = secrets.token_hex(4)
    for _ in range(5):
        assert await charge(limiter, caller, 10**9) is None
    assert not await redis.exists(keys.rate_limit_bucket(caller, "requests"))


# ---- through the live server (default limits) ----------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize(("path", "shape"), [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")])
def test_a_33_mib_body_is_a_413_at_the_default_limit(live_server: LiveServer, path: str, shape: str) -> None:
    body = b'{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "' + b"a" * (33 * 2**20) + b'"}]}'
    response = httpx.post(live_server.base_url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == ("request_too_large" if shape == "anthropic" else "invalid_request_error")
