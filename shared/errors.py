"""Errors a parser or admission raises, before anything reaches Redis.

Owns: the protocol-neutral `ApiError`; ingest renders it in the protocol's own shape
(OpenAI `{"error": {...}}`, Anthropic `{"type": "error", "error": {...}}`).
"""

from __future__ import annotations


class ApiError(Exception):
    """A client-facing error. `kind` is the neutral category; each protocol maps it to its own type."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        kind: str = "invalid_request",
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.kind = kind  # invalid_request | authentication | permission | not_found | rate_limit | overloaded | too_large | timeout | internal
        self.code = code
        self.retry_after = retry_after


def invalid(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(message, status=400, param=param, kind="invalid_request", code=code)
