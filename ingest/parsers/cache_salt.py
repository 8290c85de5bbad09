"""Prefix-cache isolation (pure): which requests may share cached KV blocks.

A prefix-cache hit is visible to the client (`cached_tokens`, and in time to first token), so a shared
cache lets one caller learn whether another sent a given prompt. As vLLM does, a request may carry a
`cache_salt` (any non-empty string): blocks are reused only between requests with the same salt. On top
of that, `--cache-salt` sets the deployment's rule: `per-key` salts every request with its caller's id
(its API key's digest), so keys never share blocks; `none` shares across keys; `auto` (the default) is
`per-key` when API keys are configured and `none` when they are not (one caller). The worker folds the
salt into the first block's key (workers.scheduler), so everything after it differs too.
"""

from __future__ import annotations

from typing import Any

from ingest.http.auth import ANONYMOUS
from shared.errors import invalid

MAX_SALT_CHARS = 256


def cache_salt(body: Any, owner: str, policy: str) -> str:
    """The salt of a request with `body` made by `owner` under `policy` ("" = the shared cache)."""
    given = body.get("cache_salt") if isinstance(body, dict) else None
    if given is not None and (not isinstance(given, str) or not given or len(given) > MAX_SALT_CHARS):
        raise invalid(f"'cache_salt' must be a non-empty string of at most {MAX_SALT_CHARS} characters.", "cache_salt", "invalid_value")
    per_key = policy == "per-key" or (policy == "auto" and owner != ANONYMOUS)
    parts = ([f"key:{owner}"] if per_key else []) + ([f"salt:{given}"] if given else [])
    return "\n".join(parts)
