"""API-key authentication: which keys are configured, and whether a request carries one of them.

Owns: loading keys (`Settings.api_keys`, comma-separated, plus `Settings.api_keys_file`, one per line,
`#` comments), reading the client's key from `Authorization: Bearer <key>` or `x-api-key: <key>`, and
the constant-time comparison (sha256 digests compared with `hmac.compare_digest` against every
configured key, no early exit). A caller is named by `caller_id()` — a short digest of its key, never
the key — for rate-limit buckets and logs.

With no key configured every route is open: `met serve` on 127.0.0.1 without keys is for local use.
With any key configured every route but the public ones (/health, /ready) needs one; the app decides
by the handler the router picked (see `ingest.http.app.guarded`), never by re-reading the path.
Ownership: whatever a caller creates that others could name by id (stored responses, resumable streams,
files, batches) records its caller id as owner; `owns` is the one rule: with auth off everyone owns
everything (unchanged behaviour), with auth on only the creator does, and anyone else gets a 404, as
OpenAI answers for another organisation's response (no hint that the id exists).
Must not: log or store a key, or know routes.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shared.errors import ApiError
from shared.settings import Settings

ANONYMOUS = "anonymous"  # the caller id when no key is configured (one shared rate-limit bucket)
CALLER = "met.caller"  # ASGI scope key: the authenticated caller id (set by ingest.http.app.guarded)


def caller_of(http: Any) -> str:
    """The caller id `guarded` put in the request's scope (ANONYMOUS on public routes)."""
    scope: Any = http.scope
    return str((scope or {}).get(CALLER, ANONYMOUS))


def owns(caller: str, owner: str | None) -> bool:
    """Whether `caller` may see or change what `owner` created (see the module docstring)."""
    return caller == ANONYMOUS or owner == caller


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def caller_id(key: str) -> str:
    """A stable, non-reversible name for a key (its sha256 prefix): safe in Redis key names and logs."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def load_keys(settings: Settings) -> tuple[str, ...]:
    """Every configured key: `api_keys` (comma-separated), `admin_keys` (which are API keys too), then `api_keys_file` (one per line)."""
    keys = [k.strip() for k in f"{settings.api_keys},{settings.admin_keys}".split(",")]
    if settings.api_keys_file:
        for line in Path(settings.api_keys_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    return tuple(dict.fromkeys(k for k in keys if k))


def presented_keys(authorization: bytes | None, x_api_key: bytes | None) -> tuple[str, ...]:
    """The keys a client sent: `Authorization: Bearer <key>` (scheme case-insensitive) and/or `x-api-key`."""
    found = []
    if authorization:
        scheme, _, value = authorization.decode("latin-1").strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            found.append(value.strip())
    if x_api_key and x_api_key.strip():
        found.append(x_api_key.decode("latin-1").strip())
    return tuple(found)


class Authenticator:
    """Checks presented keys against the configured ones, in time independent of which (if any) matches."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(k) for k in keys)

    @classmethod
    def from_settings(cls, settings: Settings) -> Authenticator:
        return cls(load_keys(settings))

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def matches(self, key: str) -> bool:
        presented = _digest(key)
        found = False
        for digest in self._digests:  # every key, no early exit
            found |= hmac.compare_digest(presented, digest)
        return found

    def admits(self, authorization: bytes | None, x_api_key: bytes | None) -> bool:
        """Whether these headers would authenticate (open when no key is configured); never raises."""
        try:
            self.authenticate(authorization, x_api_key)
        except ApiError:
            return False
        return True

    def authenticate(self, authorization: bytes | None, x_api_key: bytes | None) -> str:
        """The caller id, or an `ApiError` 401. Open (ANONYMOUS) when no key is configured."""
        if not self.enabled:
            return ANONYMOUS
        presented = presented_keys(authorization, x_api_key)
        if not presented:
            raise ApiError(
                "Missing API key. Send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                status=401,
                kind="authentication",
                code="missing_api_key",
            )
        key = next((k for k in presented if self.matches(k)), None)
        if key is None:
            raise ApiError("Invalid API key.", status=401, kind="authentication", code="invalid_api_key")
        return caller_id(key)
