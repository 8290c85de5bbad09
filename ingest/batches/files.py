"""The OpenAI Files API, kept in Redis so that every API node reads the same files.

Owns: upload (multipart `file` + `purpose`), list, get, content and delete, each scoped to the caller
(another key's file is a 404), and the storage helpers batch jobs use for their input and output files.
A file is two keys (`shared.keys.file_meta` / `file_content`) with the retention TTL; its size is bounded
by `--max-file-mb` (Redis holds strings up to 512 MB; the default 200 MB stays well under it), and what one
key keeps by `--max-files-mb-per-key` (checked at upload, `check_quota`).
Must not: parse batch lines (ingest.batches.batch_jobs does).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import orjson
from blacksheep import Request as HttpRequest
from blacksheep.multipart import parse_multipart
from redis.asyncio import Redis

from ingest.http.limits import read_body
from shared import keys
from shared.errors import ApiError, invalid
from shared.settings import Settings

PURPOSES = ("batch", "user_data", "fine-tune", "assistants", "vision", "evals")
OUTPUT_PURPOSE = "batch_output"


def not_found(file_id: str) -> ApiError:
    return ApiError(f"No such File object: {file_id}", status=404, param="file_id", kind="not_found", code="file_not_found")


async def put(redis: Redis, settings: Settings, *, owner: str, filename: str, purpose: str, content: bytes) -> dict[str, Any]:
    """Store a file; returns its File object."""
    file_id = "file-" + secrets.token_hex(12)
    now = int(time.time())
    doc = {
        "id": file_id,
        "object": "file",
        "bytes": len(content),
        "created_at": now,
        "expires_at": now + settings.batch_retention,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "status_details": None,
    }
    ttl = settings.batch_retention
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hset(keys.file_meta(file_id), mapping={"doc": orjson.dumps(doc), "owner": owner})
        pipe.expire(keys.file_meta(file_id), ttl)
        pipe.set(keys.file_content(file_id), content, ex=ttl)
        pipe.zadd(keys.files_of(owner), {file_id: now})
        await pipe.execute()
    return doc


async def stored_bytes(redis: Redis, owner: str) -> int:
    """The bytes of every file `owner` keeps now (expired ones, whose meta is gone, are dropped from its
    index on the way): one ZRANGE and one pipelined HGET per file."""
    raw: Any = await redis.zrange(keys.files_of(owner), 0, -1)
    ids = [i.decode() for i in raw]
    if not ids:
        return 0
    async with redis.pipeline(transaction=False) as pipe:
        for file_id in ids:
            pipe.hget(keys.file_meta(file_id), "doc")
        docs = await pipe.execute()
    gone = [file_id for file_id, doc in zip(ids, docs, strict=True) if doc is None]
    if gone:
        await redis.zrem(keys.files_of(owner), *gone)
    return sum(int(orjson.loads(doc)["bytes"]) for doc in docs if doc is not None)


async def check_quota(redis: Redis, settings: Settings, owner: str, adding: int) -> None:
    """A 413 when `owner`'s stored files plus `adding` bytes pass `--max-files-mb-per-key` (0: no cap).
    Checked at upload (two concurrent uploads may both pass it by up to one file)."""
    cap = settings.max_files_mb_per_key * 2**20
    if cap and await stored_bytes(redis, owner) + adding > cap:
        raise ApiError(
            f"File storage quota exceeded: this key may keep {settings.max_files_mb_per_key} MB of files (--max-files-mb-per-key); "
            "delete files (DELETE /v1/files/{file_id}) or wait for them to expire.",
            status=413,
            param="file",
            kind="too_large",
            code="storage_quota_exceeded",
        )


async def get(redis: Redis, file_id: str, *, owner: str) -> dict[str, Any]:
    raw: Any = await redis.hmget(keys.file_meta(file_id), ["doc", "owner"])
    if raw[0] is None or bytes(raw[1]).decode() != owner:
        raise not_found(file_id)
    doc: dict[str, Any] = orjson.loads(raw[0])
    return doc


async def content(redis: Redis, file_id: str, *, owner: str) -> bytes:
    await get(redis, file_id, owner=owner)
    data: Any = await redis.get(keys.file_content(file_id))
    if data is None:
        raise not_found(file_id)
    return bytes(data)


async def delete(redis: Redis, file_id: str, *, owner: str) -> dict[str, Any]:
    await get(redis, file_id, owner=owner)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.delete(keys.file_meta(file_id), keys.file_content(file_id))
        pipe.zrem(keys.files_of(owner), file_id)
        await pipe.execute()
    return {"id": file_id, "object": "file", "deleted": True}


async def listing(redis: Redis, *, owner: str, purpose: str | None, limit: int, after: str | None) -> dict[str, Any]:
    """Newest first, OpenAI's cursor pagination (`after` = the last id of the previous page)."""
    ids = await newest_after(redis, keys.files_of(owner), after)
    docs = []
    for file_id in ids:
        try:
            doc = await get(redis, file_id, owner=owner)
        except ApiError:
            await redis.zrem(keys.files_of(owner), file_id)  # expired
            continue
        if purpose is None or doc["purpose"] == purpose:
            docs.append(doc)
        if len(docs) > limit:
            break
    page = docs[:limit]
    return {"object": "list", "data": page, "has_more": len(docs) > limit, "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}


async def read_upload(http: HttpRequest, settings: Settings) -> tuple[str, str, bytes]:
    """(filename, purpose, bytes) of a multipart upload, each part named in errors. The body is read as
    every body is (ingest.http.limits.read_body): within the size limit as it arrives, declared or chunked
    (413), and the body deadline (408), never spooled to disk; then parsed (blacksheep's parser, off the
    event loop: a 200 MB upload is a few hundred ms of splitting)."""
    limit = settings.max_file_mb * 2**20
    too_big = ApiError(f"File too large: the limit is {settings.max_file_mb} MB (--max-file-mb).", status=413, param="file", kind="too_large", code="file_too_large")
    ctype = http.get_first_header(b"content-type") or b""
    if not ctype.startswith(b"multipart/form-data"):
        raise invalid("Uploads must be multipart/form-data with a `file` and a `purpose` field.", "file", "invalid_content_type")
    try:
        body = await read_body(http, limit + 2**16, timeout_s=settings.body_timeout)  # the file plus its form's framing
    except ApiError as err:
        raise too_big if err.kind == "too_large" else err from None
    parts = {part.name.decode(): part for part in await asyncio.to_thread(lambda: list(parse_multipart(body)))}
    purpose_part, file_part = parts.get("purpose"), parts.get("file")
    if purpose_part is None:
        raise invalid("Missing required parameter: 'purpose'.", "purpose", "missing_required_parameter")
    purpose = purpose_part.data.decode(errors="replace").strip()
    if purpose not in PURPOSES:
        raise invalid(f"Invalid value for 'purpose': {purpose!r}. Supported values: {', '.join(PURPOSES)}.", "purpose", "invalid_value")
    if file_part is None:
        raise invalid("Missing required parameter: 'file'.", "file", "missing_required_parameter")
    if len(file_part.data) > limit:
        raise too_big
    filename = (file_part.file_name or b"upload").decode(errors="replace")
    return filename, purpose, bytes(file_part.data)


async def newest_after(redis: Redis, index: str, after: str | None) -> list[str]:
    """The ids of a by-creation sorted set, newest first, after the cursor `after` (OpenAI's pagination)."""
    raw: Any = await redis.zrevrange(index, 0, -1)
    ids = [i.decode() for i in raw]
    if after is None:
        return ids
    return ids[ids.index(after) + 1 :] if after in ids else []
