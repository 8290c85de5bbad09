"""`file_id` references in a body, resolved from the caller's files before the body is parsed.

Owns: finding the Responses `input_file` and Chat `file` parts that name an uploaded file by `file_id`
(ingest.parsers.file_inputs.file_parts), loading each from the Files store (ingest.batches.files; a key
reads only its own files: another key's id, an unknown or an expired one is OpenAI's 404 naming the part's
`file_id`), the size limits checked on the stored size before anything is loaded, and a copy of the body
whose parts carry each file as a `file_data` data URL (and its stored `filename`), so the parsers, which do
no I/O, read it as they read inline data. The client's body is left as sent: it is what the request
records (`raw_body`), ids and all.
Must not: read a file's contents (ingest.parsers.file_inputs does, inside the parser).
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from ingest.batches import files
from ingest.parsers import file_inputs
from shared.errors import ApiError, invalid


@dataclass(frozen=True, slots=True)
class Resolved:
    """The body to parse; `files`: its file parts, inline or resolved (0: nothing to extract); `added`: the
    bytes the resolved files brought in."""

    body: Any
    files: int = 0
    added: int = 0


async def resolve(redis: Redis, body: Any, *, owner: str) -> Resolved:
    """`body` with every `file_id` part carrying `owner`'s file as `file_data` (the body itself when none does)."""
    refs = file_inputs.file_parts(body)
    total = 0
    for ref in refs:
        named = file_inputs.file_reference(ref)
        if named is None:
            continue
        param, file_id = named
        doc = await _stored(redis, file_id, owner=owner, param=param)
        total += int(doc["bytes"])
        if int(doc["bytes"]) > file_inputs.MAX_FILE_BYTES:
            raise file_inputs.too_large(ref.where)
        if total > file_inputs.MAX_REQUEST_FILE_BYTES:
            raise invalid(
                f"Invalid '{ref.where}': the files of one request may hold at most {file_inputs.MAX_REQUEST_FILE_BYTES // 2**20} MB together.",
                ref.where,
                "files_too_large",
            )
        data = await _content(redis, file_id, owner=owner, param=param)
        data_url = "data:application/octet-stream;base64," + (await asyncio.to_thread(base64.b64encode, data)).decode("ascii")
        body = file_inputs.with_file_data(body, ref, data_url=data_url, filename=str(doc.get("filename") or ""))
    return Resolved(body, files=len(refs), added=total)


async def _stored(redis: Redis, file_id: str, *, owner: str, param: str) -> dict[str, Any]:
    try:
        return await files.get(redis, file_id, owner=owner)
    except ApiError as err:
        raise _not_found(err, param) from None


async def _content(redis: Redis, file_id: str, *, owner: str, param: str) -> bytes:
    try:
        return await files.content(redis, file_id, owner=owner)
    except ApiError as err:  # deleted or expired since its File object was read
        raise _not_found(err, param) from None


def _not_found(err: ApiError, param: str) -> ApiError:
    return ApiError(err.message, status=err.status, param=param, kind=err.kind, code=err.code)
