"""Batch jobs: the OpenAI Batch API and Anthropic Message Batches over one record in Redis.

Owns: validating a batch's lines up front (OpenAI: the input file's JSONL; Anthropic: `requests`),
the batch record (`shared.keys.batch_doc`, one JSON document; lines in `batch_lines`; one result per
`custom_id` in `batch_results`, counted by outcome in the same Lua call that stores it, so a count is
never off after a restart), and each protocol's view of it: the OpenAI `batch` object and output /
error file lines, the Anthropic `message_batch` object and its results JSONL.
A line's request id is derived from the batch id and its `custom_id` (`line_request_id`), so a
dispatcher that restarts never queues a line twice and never loses one (ingest.batches.batch_dispatch).
Must not: queue or run anything (the dispatcher does).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from collections.abc import Callable, Collection
from datetime import UTC, datetime
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import WatchError

from ingest.batches.files import newest_after
from shared import keys
from shared.errors import ApiError, invalid
from shared.settings import Settings

OPENAI, ANTHROPIC = "openai", "anthropic"
OPENAI_ENDPOINTS = ("/v1/chat/completions", "/v1/responses", "/v1/completions")
OUTCOMES = ("succeeded", "errored", "canceled", "expired")
ENDED = ("completed", "failed", "expired", "cancelled")  # OpenAI statuses after which nothing runs
CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # Anthropic's rule for custom_id
MAX_REPORTED_ERRORS = 100

# Store one result per custom_id and count its outcome and tokens, atomically (all keys share the batch's hash tag).
_RECORD = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  redis.call('HINCRBY', KEYS[2], 'input_tokens', ARGV[4])
  redis.call('HINCRBY', KEYS[2], 'output_tokens', ARGV[5])
  return 1
end
return 0
"""


def line_request_id(batch_id: str, custom_id: str) -> str:
    return f"{batch_id}-{hashlib.sha256(custom_id.encode()).hexdigest()[:20]}"


def not_found(batch_id: str, protocol: str) -> ApiError:
    what = "message batch" if protocol == ANTHROPIC else "batch"
    return ApiError(f"No such {what}: {batch_id}", status=404, param="batch_id", kind="not_found", code="batch_not_found")


# ---- validation -----------------------------------------------------------------------------------


class _BadLine(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def openai_lines(content: bytes, *, endpoint: str, check: Callable[[dict[str, Any]], None], max_lines: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(lines, errors) of an OpenAI batch input file. Every line is checked: JSON, `custom_id` (present,
    unique), `method` POST, `url` equal to the batch's endpoint, and a body the protocol's parser accepts
    (`check` raises its ApiError). Errors name the 1-based line and the parameter, as OpenAI's do."""
    raw_lines = [(n, raw) for n, raw in enumerate(content.splitlines(), start=1) if raw.strip()]
    if not raw_lines:
        return [], [{"code": "empty_file", "message": "The input file has no request lines.", "param": None, "line": None}]
    if len(raw_lines) > max_lines:
        message = f"The input file has {len(raw_lines)} lines; a batch may hold at most {max_lines}."
        return [], [{"code": "too_many_lines", "message": message, "param": None, "line": max_lines + 1}]
    lines: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, raw in raw_lines:
        try:
            lines.append(_openai_line(raw, endpoint=endpoint, check=check, seen=seen))
        except _BadLine as bad:
            errors.append({"code": bad.code, "message": bad.message, "param": bad.param, "line": number})
    return lines, errors[:MAX_REPORTED_ERRORS]


def _openai_line(raw: bytes, *, endpoint: str, check: Callable[[dict[str, Any]], None], seen: set[str]) -> dict[str, Any]:
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise _BadLine("invalid_json_line", "This line is not parseable as valid JSON.") from None
    if not isinstance(line, dict):
        raise _BadLine("invalid_json_line", "Each line must be a JSON object.")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _BadLine("missing_required_parameter", "Missing required parameter: 'custom_id'.", "custom_id")
    if custom_id in seen:
        raise _BadLine("duplicate_custom_id", f"The custom_id {custom_id!r} appears more than once in this batch.", "custom_id")
    seen.add(custom_id)
    if line.get("method") != "POST":
        raise _BadLine("invalid_method", f"Invalid value for 'method': {line.get('method')!r}. Only POST is supported.", "method")
    if line.get("url") != endpoint:
        raise _BadLine("mismatched_url", f"The url {line.get('url')!r} does not match the batch's endpoint {endpoint!r}.", "url")
    body = line.get("body")
    if not isinstance(body, dict):
        raise _BadLine("missing_required_parameter", "Missing required parameter: 'body'.", "body")
    try:
        check(body)
    except ApiError as err:
        raise _BadLine("invalid_request", err.message, f"body.{err.param}" if err.param else "body") from None
    return {"custom_id": custom_id, "body": body}


def anthropic_lines(body: Any, *, max_lines: int) -> list[dict[str, Any]]:
    """The lines of `POST /v1/messages/batches`. Shape errors are a 400 naming the request; a `params`
    body the Messages parser rejects becomes that request's `errored` result, as Anthropic does."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", None, "invalid_body")
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise invalid("requests: must be a non-empty array.", "requests")
    if len(requests) > max_lines:
        raise invalid(f"requests: a batch may hold at most {max_lines} requests, got {len(requests)}.", "requests")
    lines, seen = [], set()
    for i, item in enumerate(requests):
        if not isinstance(item, dict):
            raise invalid(f"requests[{i}]: must be an object with custom_id and params.", f"requests[{i}]")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not CUSTOM_ID.match(custom_id):
            raise invalid(f"requests[{i}].custom_id: must be 1-64 characters of letters, digits, '_' and '-'.", f"requests[{i}].custom_id")
        if custom_id in seen:
            raise invalid(f"requests[{i}].custom_id: {custom_id!r} is used by more than one request.", f"requests[{i}].custom_id")
        seen.add(custom_id)
        if not isinstance(item.get("params"), dict):
            raise invalid(f"requests[{i}].params: must be an object (a Messages request body).", f"requests[{i}].params")
        lines.append({"custom_id": custom_id, "body": item["params"]})
    return lines


# ---- the record ------------------------------------------------------------------------------------


async def create(redis: Redis, settings: Settings, *, record: dict[str, Any], lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Store a new batch (already validated; `record` holds protocol, owner and protocol fields)."""
    prefix = "msgbatch_" if record["protocol"] == ANTHROPIC else "batch_"
    now = int(time.time())
    doc = {
        "id": prefix + secrets.token_hex(12),
        "created_at": now,
        "expires_at": now + (86400 if record["protocol"] == OPENAI else settings.batch_retention),
        "status": "validating" if lines else "failed",
        "total": len(lines),
        **record,
    }
    if doc["status"] == "failed":
        doc["failed_at"] = now
    bid, ttl = doc["id"], settings.batch_retention
    # The batch's own keys first, then the global set that makes dispatchers look at it: on a Redis
    # Cluster the two halves live on different nodes and one pipeline would send them concurrently, and
    # a dispatcher that saw the id before the doc existed would drop it as expired (bus/connect.py).
    async with redis.pipeline(transaction=False) as pipe:
        pipe.set(keys.batch_doc(bid), orjson.dumps(doc), ex=ttl)
        if lines:
            pipe.rpush(keys.batch_lines(bid), *(orjson.dumps(line) for line in lines))
            pipe.expire(keys.batch_lines(bid), ttl)
        await pipe.execute()
    async with redis.pipeline(transaction=False) as pipe:
        if lines:
            pipe.sadd(keys.BATCHES_ACTIVE, bid)
        pipe.zadd(keys.batches_of(doc["owner"]), {bid: now})
        await pipe.execute()
    return doc


async def load(redis: Redis, batch_id: str, *, owner: str | None = None, protocol: str | None = None) -> dict[str, Any]:
    """The record; a 404 when it is missing, another owner's, or (with `protocol`) of the other API."""
    raw = await redis.get(keys.batch_doc(batch_id))
    doc: dict[str, Any] | None = orjson.loads(raw) if raw is not None else None
    if doc is None or (owner is not None and doc["owner"] != owner) or (protocol is not None and doc["protocol"] != protocol):
        raise not_found(batch_id, protocol or OPENAI)
    return doc


async def update(redis: Redis, settings: Settings, batch_id: str, *, only_from: Collection[str] | None = None, **changes: Any) -> dict[str, Any]:
    """Apply `changes` to the record as one compare-and-set (WATCH / MULTI: a record changed meanwhile,
    by another node's dispatcher or a cancel route, is read again and the change retried, never written
    over). With `only_from`, only while its status is one of those; otherwise it is returned unchanged,
    so a cancel that comes after the dispatcher finished the batch cannot strand it in `cancelling`."""
    key = keys.batch_doc(batch_id)
    async with redis.pipeline(transaction=True) as pipe:
        while True:
            try:
                await pipe.watch(key)
                raw = await pipe.get(key)
                if raw is None:
                    raise not_found(batch_id, OPENAI)
                doc: dict[str, Any] = orjson.loads(raw)
                if only_from is not None and doc["status"] not in only_from:
                    await pipe.unwatch()
                    return doc
                doc.update(changes)
                pipe.multi()
                pipe.set(key, orjson.dumps(doc), ex=settings.batch_retention)
                await pipe.execute()
                return doc
            except WatchError:
                continue  # changed between the read and the write: read it again


async def record_result(redis: Redis, batch_id: str, custom_id: str, *, outcome: str, result: dict[str, Any], tokens: tuple[int, int] = (0, 0)) -> bool:
    """Store a line's result once (a second write for the same custom_id changes nothing); True if new.
    `tokens`: (prompt, completion) of the line, added to the batch's usage."""
    doc = orjson.dumps({"outcome": outcome, "result": result})
    written = await redis.eval(_RECORD, 2, keys.batch_results(batch_id), keys.batch_counts(batch_id), custom_id, doc, outcome, *tokens)
    return bool(written)


async def counts(redis: Redis, batch_id: str) -> dict[str, int]:
    """Lines per outcome, plus `input_tokens` / `output_tokens` over the finished lines."""
    raw: Any = await redis.hgetall(keys.batch_counts(batch_id))
    got = {k.decode(): int(v) for k, v in raw.items()}
    return {name: got.get(name, 0) for name in (*OUTCOMES, "input_tokens", "output_tokens")}


async def results(redis: Redis, batch_id: str) -> dict[str, dict[str, Any]]:
    raw: Any = await redis.hgetall(keys.batch_results(batch_id))
    return {k.decode(): orjson.loads(v) for k, v in raw.items()}


async def listing(redis: Redis, *, owner: str, protocol: str, limit: int, after: str | None) -> tuple[list[dict[str, Any]], bool]:
    ids = await newest_after(redis, keys.batches_of(owner), after)
    docs = []
    for bid in ids:
        try:
            docs.append(await load(redis, bid, owner=owner, protocol=protocol))
        except ApiError:
            continue
        if len(docs) > limit:
            break
    return docs[:limit], len(docs) > limit


# ---- protocol views --------------------------------------------------------------------------------


def openai_view(doc: dict[str, Any], tally: dict[str, int]) -> dict[str, Any]:
    return {
        "id": doc["id"],
        "object": "batch",
        "endpoint": doc["endpoint"],
        "errors": {"object": "list", "data": doc["errors"]} if doc.get("errors") else None,
        "input_file_id": doc["input_file_id"],
        "completion_window": doc["completion_window"],
        "status": doc["status"],
        "output_file_id": doc.get("output_file_id"),
        "error_file_id": doc.get("error_file_id"),
        "created_at": doc["created_at"],
        **{f"{t}_at": doc.get(f"{t}_at") for t in ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")},
        "expires_at": doc["expires_at"],
        "request_counts": {"total": doc["total"], "completed": tally["succeeded"], "failed": tally["errored"]},
        "usage": {
            "input_tokens": tally["input_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": tally["output_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": tally["input_tokens"] + tally["output_tokens"],
        },
        "metadata": doc.get("metadata"),
    }


def anthropic_view(doc: dict[str, Any], tally: dict[str, int], base_url: str) -> dict[str, Any]:
    done = sum(tally.values())
    ended = doc["status"] in ENDED
    status = "ended" if ended else "canceling" if doc["status"] == "cancelling" else "in_progress"
    return {
        "id": doc["id"],
        "type": "message_batch",
        "processing_status": status,
        "request_counts": {"processing": max(0, doc["total"] - done), "succeeded": tally["succeeded"], "errored": tally["errored"], "canceled": tally["canceled"], "expired": tally["expired"]},
        "ended_at": _rfc3339(doc.get("ended_at")),
        "created_at": _rfc3339(doc["created_at"]),
        "expires_at": _rfc3339(doc["expires_at"]),
        "archived_at": None,
        "cancel_initiated_at": _rfc3339(doc.get("cancelling_at")),
        "results_url": f"{base_url}/v1/messages/batches/{doc['id']}/results" if ended else None,
    }


def _rfc3339(ts: float | None) -> str | None:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z") if ts is not None else None


def openai_line(custom_id: str, request_id: str, *, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    """A line of the output (200) or error file, in OpenAI's format."""
    return {"id": f"batch_req_{request_id}", "custom_id": custom_id, "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": None}


def openai_unrun_line(custom_id: str, request_id: str, *, code: str, message: str) -> dict[str, Any]:
    """An error-file line for a request that never ran (the batch was cancelled or expired first)."""
    return {"id": f"batch_req_{request_id}", "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}


def anthropic_line(custom_id: str, outcome: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
    """A results-JSONL line: succeeded (payload: the message), errored (payload: the error body), canceled, expired."""
    result: dict[str, Any] = {"type": outcome}
    if outcome == "succeeded":
        result["message"] = payload
    elif outcome == "errored":
        result["error"] = payload
    return {"custom_id": custom_id, "result": result}



async def custom_ids(redis: Redis, batch_id: str) -> list[str]:
    """The batch's custom_ids in input order."""
    raw: Any = await redis.lrange(keys.batch_lines(batch_id), 0, -1)
    return [orjson.loads(r)["custom_id"] for r in raw]


async def delete(redis: Redis, doc: dict[str, Any]) -> None:
    bid = doc["id"]
    async with redis.pipeline(transaction=False) as pipe:
        pipe.delete(keys.batch_doc(bid), keys.batch_lines(bid), keys.batch_results(bid), keys.batch_counts(bid), keys.batch_lease(bid))
        pipe.zrem(keys.batches_of(doc["owner"]), bid)
        pipe.srem(keys.BATCHES_ACTIVE, bid)
        await pipe.execute()
