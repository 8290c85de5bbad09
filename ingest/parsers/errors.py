"""Render an `ApiError` in the shape of the protocol the client spoke.

OpenAI (chat and Responses): `{"error": {"message", "type", "param", "code"}}`; overload (a full queue,
a busy tokenizer) is OpenAI's own 503 `server_error` ("The server is overloaded"), not a 429
`rate_limit_error`, which OpenAI keeps for a key's own limits.
Anthropic: `{"type": "error", "error": {"type", "message"}}` with its own type names and 529 for overload.
"""

from __future__ import annotations

from typing import Any

from shared.deltas import Error, ErrorKind
from shared.errors import ApiError
from shared.ir import Protocol
from shared.protocols import ANTHROPIC_ERRORS, spec

_OPENAI_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "rate_limit": "rate_limit_error",
    "overloaded": "server_error",
    "too_large": "invalid_request_error",
    "timeout": "invalid_request_error",
    "unavailable": "service_unavailable_error",
    "internal": "server_error",
}
_ANTHROPIC_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "rate_limit": "rate_limit_error",
    "overloaded": "overloaded_error",
    "too_large": "request_too_large",
    "timeout": "timeout_error",
    "unavailable": "api_error",
    "internal": "api_error",
}


def error_body(protocol: Protocol, err: ApiError) -> dict[str, Any]:
    """`err` in the error-body shape of `protocol` (its spec's `errors`: OpenAI's or Anthropic's)."""
    if spec(protocol).errors == ANTHROPIC_ERRORS:
        message = f"{err.param}: {err.message}" if err.param and err.param not in err.message else err.message
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(err.kind, "api_error"), "message": message}}
    return {"error": {"message": err.message, "type": _OPENAI_TYPES.get(err.kind, "server_error"), "param": err.param, "code": err.code}}


def status_for(protocol: Protocol, err: ApiError) -> int:
    if err.kind == "overloaded":
        return 529 if spec(protocol).errors == ANTHROPIC_ERRORS else 503
    return err.status


def failure(error: Error) -> ApiError:
    """A non-streaming request whose generation ended in an Error delta: 503 when the server was
    overloaded (the client may retry), 500 otherwise."""
    if error.kind is ErrorKind.OVERLOADED:
        return ApiError(error.message, status=503, kind="overloaded")
    return ApiError(error.message, status=500, kind="internal")
