"""ingest/parsers/errors.py: an ApiError in each protocol's own shape and status; overload is each API's own
word for it (OpenAI 503 `server_error`, Anthropic 529 `overloaded_error`), a key's rate limit a 429 on both."""

from __future__ import annotations

import pytest

from ingest.parsers.errors import error_body, failure, status_for
from shared.deltas import Error, ErrorKind
from shared.errors import ApiError, invalid
from shared.ir import Protocol

OPENAI_SHAPED = (Protocol.OPENAI_CHAT, Protocol.OPENAI_RESPONSES, Protocol.OPENAI_COMPLETIONS)
QUEUE_FULL = ApiError("The server is at its queue limit.", status=429, kind="overloaded", code="queue_full", retry_after=1.0)
RATE_LIMITED = ApiError("Rate limit reached.", status=429, kind="rate_limit", code="rate_limit_exceeded", retry_after=3.0)


@pytest.mark.parametrize("protocol", OPENAI_SHAPED)
def test_overload_on_openai_routes_is_openais_503_server_error_and_a_rate_limit_stays_a_429(protocol: Protocol) -> None:
    assert status_for(protocol, QUEUE_FULL) == 503
    assert error_body(protocol, QUEUE_FULL) == {"error": {"message": QUEUE_FULL.message, "type": "server_error", "param": None, "code": "queue_full"}}
    assert status_for(protocol, RATE_LIMITED) == 429
    assert error_body(protocol, RATE_LIMITED)["error"]["type"] == "rate_limit_error"


def test_overload_on_anthropic_is_529_overloaded_error_and_a_rate_limit_a_429() -> None:
    assert status_for(Protocol.ANTHROPIC_MESSAGES, QUEUE_FULL) == 529
    assert error_body(Protocol.ANTHROPIC_MESSAGES, QUEUE_FULL) == {"type": "error", "error": {"type": "overloaded_error", "message": QUEUE_FULL.message}}
    assert status_for(Protocol.ANTHROPIC_MESSAGES, RATE_LIMITED) == 429
    assert error_body(Protocol.ANTHROPIC_MESSAGES, RATE_LIMITED)["error"]["type"] == "rate_limit_error"


def test_a_bad_parameter_is_named_in_each_shape() -> None:
    err = invalid("must be at most 2", "temperature", "invalid_value")
    assert error_body(Protocol.OPENAI_CHAT, err)["error"] == {"message": "must be at most 2", "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}
    assert error_body(Protocol.ANTHROPIC_MESSAGES, err)["error"] == {"type": "invalid_request_error", "message": "temperature: must be at most 2"}
    assert status_for(Protocol.ANTHROPIC_MESSAGES, err) == status_for(Protocol.OPENAI_CHAT, err) == 400


def test_a_generation_that_ended_overloaded_is_a_503_and_any_other_error_a_500() -> None:
    assert failure(Error(message="busy", kind=ErrorKind.OVERLOADED)).status == 503
    assert failure(Error(message="boom", kind=ErrorKind.INTERNAL)).status == 500
