"""Redaction by field name: credentials of every common spelling go, token counts stay."""

from __future__ import annotations

import pytest

from shared.redact import REDACTED, is_secret, redact


@pytest.mark.parametrize(
    "name",
    ["api_key", "apiKey", "x-api-key", "Authorization", "auth", "auth_header", "password", "client_secret", "private_key",
     "privateKey", "access_token", "refresh_token", "hf_token", "token", "authToken", "id_token", "cookie", "credentials"],
)  # fmt: skip
def test_credential_names_are_secrets(name: str) -> None:
    assert is_secret(name)


@pytest.mark.parametrize(
    "name",
    ["max_tokens", "max_completion_tokens", "budget_tokens", "token_ids", "prompt_tokens", "top_logprobs", "author", "tokens", "stop_token_ids"],
)
def test_token_counts_and_ordinary_names_are_not(name: str) -> None:
    assert not is_secret(name)


def test_redact_walks_nested_values() -> None:
    body = {"max_tokens": 5, "metadata": {"hf_token": "hf_canary", "user": "u"}, "tools": [{"auth": {"k": "v"}, "name": "t"}]}
    assert redact(body) == {"max_tokens": 5, "metadata": {"hf_token": REDACTED, "user": "u"}, "tools": [{"auth": REDACTED, "name": "t"}]}
