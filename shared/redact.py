"""Secrets never land in dumps or logs: redact credential-like fields from JSON-like values.

A field is a secret when its name says so (api_key, apiKey, authorization, auth, password, secret,
private_key, cookie, credential, and any name ending in `token`: access_token, hf_token, authToken).
Token-count fields such as `max_tokens` or `token_ids` are not secrets (plural, or `token` not last).
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "[redacted]"
_SECRET = re.compile(r"(?i)(api[_-]?key|authorization|\bauth\b|auth[_-]|passw(or)?d|secret|private[_-]?key|bearer|credential|cookie|token$)")


def is_secret(name: str) -> bool:
    return bool(_SECRET.search(name))


def redact(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: REDACTED if isinstance(k, str) and is_secret(k) else redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def redact_url(url: str) -> str:
    """redis://user:pass@host → redis://user:[redacted]@host"""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1" + REDACTED + "@", url)
