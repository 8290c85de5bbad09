"""Input limits checked before parsing, and per-caller rate limits shared across API nodes.

Owns:
- the body read with a size cap (`Settings.max_body_bytes`): `Content-Length` is checked first, then
  the bytes actually read (a chunked body has no length), → 413 (`too_large`); and with a time cap
  (`Settings.body_timeout` for the whole body, plus 1 s per MiB received, so a client trickling bytes
  cannot hold a connection and its buffer (slowloris) while a big body at a fair rate passes) → 408
  with `Connection: close`;
- what one request may store in Redis (`Settings.max_stored_request_bytes`): its encoded record, which
  is written twice (the request's IR key and its request-stream entry), for every part (each `n`
  choice and prompt is its own request) → 413 naming the limit. The client's raw body (with any
  unknown fields) is part of the record, so it is bounded too;
- JSON parsing with a nesting cap (`Settings.max_json_depth`), measured iteratively on the parsed
  value (orjson itself stops at 1024 levels, so nothing recurses deeper), → 400 naming the path
  where the depth is exceeded, or "body";
- token buckets per caller in Redis, one Lua script for both buckets (all or nothing), → 429 with
  Retry-After = seconds until enough tokens refill.

Rate limits: a bucket holds a full period's worth (`rate_limit_rpm` requests, `rate_limit_tpm`
tokens) and refills continuously over `rate_limit_period` seconds (60: per minute). A request is
charged at admission, before it is queued: one request, and prompt tokens + the completion tokens it
may produce (its `max_tokens`, or what the context leaves when it names none), since what it
will really generate is unknown then. Refused requests are charged nothing (one the queue then refuses
is refunded). An admitted request's answer carries OpenAI's `x-ratelimit-*` headers. The time is Redis' own
(`TIME`), so API nodes with skewed clocks share buckets correctly.
Must not: parse protocol fields (the parsers do) or know routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from blacksheep import Request as HttpRequest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared import keys
from shared.codec import encode_request
from shared.errors import ApiError, invalid
from shared.ir import Request
from shared.settings import Settings


def too_large(limit: int) -> ApiError:
    return ApiError(
        f"Request body too large: the limit is {limit} bytes.", status=413, kind="too_large", code="request_too_large"
    )


BODY_MIN_RATE = 2**20  # bytes/s: a body arriving at least this fast is never cut off by the body deadline


async def read_body(http: HttpRequest, max_bytes: int, *, timeout_s: float = 0.0) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed `max_bytes` (declared or read), or a
    408 when it has not all arrived by its deadline (0: none): `timeout_s` from the start, plus 1 s for
    each `BODY_MIN_RATE` bytes received (as Apache's mod_reqtimeout MinRate), so a trickle is cut off
    after about `timeout_s` while a big body sent at a fair rate always makes it."""
    declared = http.get_first_header(b"content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)
    body = bytearray()
    chunks: Any = http.stream()  # an async generator (blacksheep's stub says otherwise)
    start = asyncio.get_running_loop().time()
    try:
        async with asyncio.timeout(start + timeout_s if timeout_s > 0 else None) as deadline:
            async for chunk in chunks:
                if chunk:
                    body.extend(chunk)
                    if len(body) > max_bytes:
                        raise too_large(max_bytes)
                    if timeout_s > 0:
                        deadline.reschedule(start + timeout_s + len(body) / BODY_MIN_RATE)
    except TimeoutError:
        elapsed = asyncio.get_running_loop().time() - start
        raise ApiError(
            f"The request body did not arrive in time: {len(body)} bytes in {elapsed:.0f} s (the limit: {timeout_s:g} s "
            "plus 1 s per MiB received).",
            status=408,
            kind="timeout",
            code="request_timeout",
        ) from None
    return bytes(body)


def check_stored_size(parts: Sequence[Request], max_bytes: int) -> list[bytes]:
    """Each part's record as it will be stored, or 413 when queueing `parts` would store more than
    `max_bytes` in Redis (each part's record twice; 0: no limit)."""
    encoded = [encode_request(part) for part in parts]
    stored = 2 * sum(len(e) for e in encoded)
    if 0 < max_bytes < stored:
        raise ApiError(
            f"This request would store {stored} bytes ({len(parts)} part(s), each kept twice), more than the limit of "
            f"{max_bytes} bytes per request (max_stored_request_bytes). Send a smaller body or fewer choices (n).",
            status=413,
            kind="too_large",
            code="request_too_large",
        )
    return encoded


def parse_json(raw: bytes, max_depth: int) -> Any:
    """Parse a JSON body and check its nesting depth; errors name the parameter (or "body")."""
    try:
        value = orjson.loads(raw or b"")
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc):
            raise depth_error("body", max_depth) from None
        raise invalid(
            "We could not parse the JSON body of your request. Send a valid JSON object as the body.", None, "invalid_json"
        ) from None
    check_depth(value, max_depth)
    return value


def depth_error(param: str, max_depth: int) -> ApiError:
    return invalid(f"Invalid '{param}': JSON nested deeper than {max_depth} levels.", param, "json_too_deep")


def check_depth(value: Any, max_depth: int) -> None:
    """Raise naming the first container found past `max_depth` levels (the body itself is level 1).

    Iterative, with parent links instead of path strings, so a wide body costs no string building."""
    stack: list[tuple[Any, int, _Where | None]] = [(value, 1, None)]
    while stack:
        node, depth, where = stack.pop()
        if depth > max_depth:
            raise depth_error(_render(where), max_depth)
        if isinstance(node, dict):
            stack.extend((v, depth + 1, _Where(where, k)) for k, v in node.items() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1, _Where(where, i)) for i, v in enumerate(node) if isinstance(v, (dict, list)))


@dataclass(frozen=True, slots=True)
class _Where:
    parent: _Where | None
    key: str | int


def _render(where: _Where | None) -> str:
    parts: list[str | int] = []
    while where is not None:
        parts.append(where.key)
        where = where.parent
    if not parts:
        return "body"
    out = "body" if isinstance(parts[-1], int) else ""  # a top-level array: body[0]...
    for key in reversed(parts):
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out


# Both buckets of one caller, all or nothing. KEYS: request bucket, token bucket.
# ARGV: period (s), request capacity, token capacity, request cost, token cost; a capacity of 0 = unlimited.
# Returns {1, "0", requests left, tokens left} when admitted, {0, wait_seconds} when refused, {-1, "0"} when
# the cost exceeds a capacity. Negative costs give back (a refund, never past the capacity).
_CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local period = tonumber(ARGV[1])
local state = {}
local wait = 0
for i = 1, 2 do
  local cap = tonumber(ARGV[1 + i])
  local cost = tonumber(ARGV[3 + i])
  if cap > 0 then
    if cost > cap then return {-1, "0"} end
    local h = redis.call('HMGET', KEYS[i], 'tokens', 'ts')
    local level = tonumber(h[1]) or cap
    local ts = tonumber(h[2]) or now
    local rate = cap / period
    level = math.min(cap, level + math.max(0, now - ts) * rate)
    if level < cost then wait = math.max(wait, (cost - level) / rate) end
    state[i] = math.min(cap, level - cost)
  end
end
if wait > 0 then return {0, tostring(wait)} end
for i = 1, 2 do
  if state[i] ~= nil then
    redis.call('HSET', KEYS[i], 'tokens', tostring(state[i]), 'ts', tostring(now))
    redis.call('PEXPIRE', KEYS[i], math.ceil(period * 2000))
  end
end
return {1, "0", tostring(state[1] or -1), tostring(state[2] or -1)}
"""


@dataclass(frozen=True, slots=True)
class Charged:
    """What a charge took and what the caller's buckets hold after it (-1: that bucket is unlimited)."""

    tokens: int = 0
    requests_left: float = -1
    tokens_left: float = -1


class RateLimiter:
    """Per-caller request and token buckets in Redis (see the module docstring for the policy)."""

    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.redis = redis
        self.rpm = max(0, settings.rate_limit_rpm)
        self.tpm = max(0, settings.rate_limit_tpm)
        self.period = settings.rate_limit_period if settings.rate_limit_period > 0 else 60.0
        self._script: Any = redis.register_script(_CHARGE)

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm)

    async def charge(self, caller: str, *, tokens: int) -> Charged:
        """Take one request and `tokens` tokens from `caller`'s buckets, or raise a 429."""
        if not self.enabled:
            return Charged(tokens)
        buckets = [keys.rate_limit_bucket(caller, "requests"), keys.rate_limit_bucket(caller, "tokens")]
        try:
            status, wait, *left = await self._script(keys=buckets, args=[self.period, self.rpm, self.tpm, 1, tokens])
        except RedisError:
            raise ApiError("The rate limiter is unavailable; try again shortly.", status=503, kind="unavailable", code="queue_unavailable") from None
        status = int(status)
        if status == 1:
            return Charged(tokens, float(left[0]), float(left[1]))
        if status < 0:
            raise ApiError(
                f"This request needs {tokens} tokens, more than the rate limit of {self.tpm} tokens per {self._per()} allows.",
                status=429,
                kind="rate_limit",
                code="rate_limit_exceeded",
            )
        retry_after = max(1, math.ceil(float(wait)))
        raise ApiError(
            f"Rate limit reached ({self._limits()}). Retry in {retry_after} s.",
            status=429,
            kind="rate_limit",
            code="rate_limit_exceeded",
            retry_after=retry_after,
        )

    async def refund(self, caller: str, charged: Charged) -> None:
        """Give back what `charge` took for a request that was then refused (the queue was full): a
        refused request costs its key nothing. Best effort: a Redis error leaves the charge."""
        if not self.enabled:
            return
        buckets = [keys.rate_limit_bucket(caller, "requests"), keys.rate_limit_bucket(caller, "tokens")]
        with contextlib.suppress(RedisError):
            await self._script(keys=buckets, args=[self.period, self.rpm, self.tpm, -1, -charged.tokens])

    def headers(self, charged: Charged) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*` headers for an admitted request (none when no limit is set): each
        bucket's size, what is left after this request, and when it is full again."""
        out: dict[str, str] = {}
        for name, cap, left in (("requests", self.rpm, charged.requests_left), ("tokens", self.tpm, charged.tokens_left)):
            if cap and left >= 0:
                out[f"x-ratelimit-limit-{name}"] = str(cap)
                out[f"x-ratelimit-remaining-{name}"] = str(math.floor(left))
                out[f"x-ratelimit-reset-{name}"] = f"{(cap - left) * self.period / cap:.3f}s"
        return out

    def _per(self) -> str:
        return "minute" if self.period == 60 else f"{self.period:g} s"

    def _limits(self) -> str:
        parts = [f"{self.rpm} requests" if self.rpm else "", f"{self.tpm} tokens" if self.tpm else ""]
        return " and ".join(p for p in parts if p) + f" per {self._per()}"
