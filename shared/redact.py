"""Secrets never land in dumps or logs: redact credential-like fields from JSON-like values.

A field is a secret when its name says so (api_key, apiKey, authorization, password, secret,
access_token, ...). Token-count fields such as `max_tokens` are not secrets.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "[redacted]"
_SECRET = re.compile(r"(?i)(api[_-]?key|authorization|passw(or)?d|secret|access[_-]?token|refresh[_-]?token|bearer|credential|cookie)")


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
