"""HTTP routes of the Files, Batches and Message Batches APIs, and the `LineRunner` that lets the
dispatcher turn batch lines into requests and results through the same Surface rows the interactive
routes use (so a line's result is exactly the body a non-streaming client of that route gets).

Owns: request bodies and query parameters of these routes, the caller scoping (a key sees only its
own files and batches; another key's id is a 404), and each protocol's result lines.
Must not: queue anything itself (ingest.batches.batch_dispatch does) or know storage keys (ingest.batches.files,
ingest.batches.batch_jobs do).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import orjson
from blacksheep import Content, Response
from blacksheep import Request as HttpRequest

from ingest.batches import batch_jobs, files
from ingest.batches.batch_jobs import ANTHROPIC, OPENAI
from ingest.http import file_refs
from ingest.http.auth import ANONYMOUS
from ingest.parsers import file_inputs
from ingest.parsers.cache_salt import cache_salt
from ingest.parsers.errors import error_body, failure
from shared.deltas import Finish, FinishReason, StreamDelta
from shared.errors import ApiError, invalid
from shared.ir import Protocol, Request
from shared.protocols import specs


def _json(body: Any, status: int = 200) -> Response:
    return Response(status, None, Content(b"application/json", orjson.dumps(body)))


def _jsonl(rows: list[dict[str, Any]]) -> Response:
    return Response(200, None, Content(b"application/x-jsonl", b"".join(orjson.dumps(r) + b"\n" for r in rows)))


def _route(http: HttpRequest, name: str) -> str:
    return str((http.route_values or {}).get(name) or "")


def _query(http: HttpRequest, name: str) -> str | None:
    values = http.query.get(name)
    return values[0] if values else None


def _limit(http: HttpRequest, default: int, hi: int) -> int:
    raw = _query(http, "limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= hi:
        raise invalid(f"Invalid value for 'limit': must be an integer from 1 to {hi}.", "limit")
    return int(raw)


class BatchLines:
    """The `LineRunner`: a line → its prepared request; a finished request → its result line."""

    def __init__(self, api: Any, surfaces: dict[Protocol, Any]) -> None:
        self.api = api
        self.surfaces = surfaces

    def _surface(self, doc: dict[str, Any]) -> Any:
        return self.surfaces[next(s.protocol for s in specs() if s.path == doc["endpoint"])]

    def check(self, endpoint: str, body: dict[str, Any]) -> None:
        """Validation at creation: the line's body goes through the route's parser and prompt checks, all but
        its `file_id` parts, which are read when the line is dispatched (`prepare`: a missing or refused file
        makes that line's result an error)."""
        self.request({"endpoint": endpoint}, {"body": file_inputs.without_references(body)}, "check")

    async def prepare(self, doc: dict[str, Any], line: dict[str, Any], request_id: str, *, size: int) -> Request:
        """`request` on the API node's tokenizing lanes (ingest.http.tokenizing): a line's prompt is parsed and
        rendered off the event loop like any body, a line over 1 MiB on the large lane, in turn with the
        interactive bodies there (busy: ApiError `overloaded`, and the dispatcher tries again later). Its
        `file_id` parts are first resolved from the batch owner's files (ingest.http.file_refs)."""
        if file_inputs.file_parts(line.get("body")):  # only a line with files has anything to read from the store
            resolved = await file_refs.resolve(self.api.redis, line["body"], owner=doc["owner"])
            line, size = {**line, "body": resolved.body}, size + resolved.added
        return await self.api.tokenizing.run(size, partial(self.request, doc, line, request_id))

    def request(self, doc: dict[str, Any], line: dict[str, Any], request_id: str) -> Request:
        """The prepared request IR of a line (raises ApiError when its body is refused). Blocking: on a
        tokenizing thread (`prepare`, and the checks at creation)."""
        surface = self._surface(doc)
        body = {k: v for k, v in line["body"].items() if k not in ("stream", "stream_options")}
        parsed: Request = surface.parse(body, request_id=request_id, created=time.time())
        if parsed.sampling.n > 1:
            param = "best_of" if (parsed.completion and parsed.completion.n < parsed.sampling.n) else "n"
            raise invalid(f"{param} > 1 is not supported in batch requests; send one line per choice.", param)
        expanded = surface.expand(body, parsed, self.api.renderer)  # legacy completions: one request per prompt
        if len(expanded) > 1:
            raise invalid("Several prompts are not supported in batch requests; send one line per prompt.", "prompt")
        salt = cache_salt(body, doc.get("owner", ANONYMOUS), self.api.settings.cache_salt)  # a check at creation has no owner yet
        parsed = replace(expanded[0], stream=False, priority=self.api.settings.batch_priority, cache_salt=salt)
        prepared: Request = self.api.prepare(parsed, body)
        return prepared

    def result(self, doc: dict[str, Any], line: dict[str, Any], request: Request, deltas: list[StreamDelta]) -> tuple[str, dict[str, Any]]:
        surface, cid = self._surface(doc), line["custom_id"]
        acc = surface.accumulator(request)
        for delta in deltas:
            acc.feed(delta)
        finish = next((d for d in deltas if isinstance(d, Finish)), None)
        if acc.error is not None:
            err = failure(acc.error)
            if doc["protocol"] == ANTHROPIC:
                return "errored", batch_jobs.anthropic_line(cid, "errored", error_body(Protocol.ANTHROPIC_MESSAGES, err))
            return "errored", batch_jobs.openai_line(cid, request.id, status_code=err.status, body=error_body(Protocol.OPENAI_CHAT, err))
        if finish is not None and finish.reason is FinishReason.CANCELLED:
            return "canceled", self.unrun(doc, line, request.id, "canceled")
        body = surface.combine(request, [acc])
        if doc["protocol"] == ANTHROPIC:
            return "succeeded", batch_jobs.anthropic_line(cid, "succeeded", body)
        return "succeeded", batch_jobs.openai_line(cid, request.id, status_code=200, body=body)

    def refused(self, doc: dict[str, Any], line: dict[str, Any], request_id: str, err: ApiError) -> dict[str, Any]:
        if doc["protocol"] == ANTHROPIC:
            return batch_jobs.anthropic_line(line["custom_id"], "errored", error_body(Protocol.ANTHROPIC_MESSAGES, err))
        return batch_jobs.openai_line(line["custom_id"], request_id, status_code=err.status, body=error_body(Protocol.OPENAI_CHAT, err))

    def unrun(self, doc: dict[str, Any], line: dict[str, Any], request_id: str, outcome: str) -> dict[str, Any]:
        if doc["protocol"] == ANTHROPIC:
            return batch_jobs.anthropic_line(line["custom_id"], outcome)
        code = "batch_cancelled" if outcome == "canceled" else "batch_expired"
        message = "The batch was cancelled before this request finished." if outcome == "canceled" else "The batch expired before this request ran."
        return batch_jobs.openai_unrun_line(line["custom_id"], request_id, code=code, message=message)


class BatchRoutes:
    """Handlers; each takes the routed request. `caller(http)` is the authenticated owner id."""

    def __init__(self, api: Any, lines: BatchLines, caller: Callable[[HttpRequest], str]) -> None:
        self.api = api
        self.redis = api.redis
        self.settings = api.settings
        self.lines = lines
        self.caller = caller

    # ---- OpenAI Files ---------------------------------------------------------------------------

    async def upload_file(self, http: HttpRequest) -> Response:
        owner = self.caller(http)
        await files.check_quota(self.redis, self.settings, owner, 1)  # a key already at its quota: refused before its body is read
        filename, purpose, data = await files.read_upload(http, self.settings)
        await files.check_quota(self.redis, self.settings, owner, len(data))
        return _json(await files.put(self.redis, self.settings, owner=owner, filename=filename, purpose=purpose, content=data))

    async def list_files(self, http: HttpRequest) -> Response:
        page = await files.listing(self.redis, owner=self.caller(http), purpose=_query(http, "purpose"), limit=_limit(http, 10_000, 10_000), after=_query(http, "after"))
        return _json(page)

    async def get_file(self, http: HttpRequest) -> Response:
        return _json(await files.get(self.redis, _route(http, "file_id"), owner=self.caller(http)))

    async def file_content(self, http: HttpRequest) -> Response:
        data = await files.content(self.redis, _route(http, "file_id"), owner=self.caller(http))
        return Response(200, None, Content(b"application/octet-stream", data))

    async def delete_file(self, http: HttpRequest) -> Response:
        return _json(await files.delete(self.redis, _route(http, "file_id"), owner=self.caller(http)))

    # ---- OpenAI Batches -------------------------------------------------------------------------

    async def create_batch(self, http: HttpRequest) -> Response:
        body = await self.api.read_json(http)
        if not isinstance(body, dict):
            raise invalid("The request body must be a JSON object.", None, "invalid_body")
        owner = self.caller(http)
        endpoint = body.get("endpoint")
        if endpoint not in batch_jobs.OPENAI_ENDPOINTS:
            raise invalid(f"Invalid value for 'endpoint': {endpoint!r}. Supported: {', '.join(batch_jobs.OPENAI_ENDPOINTS)}.", "endpoint")
        if body.get("completion_window") != "24h":
            raise invalid(f"Invalid value for 'completion_window': {body.get('completion_window')!r}. Supported: '24h'.", "completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values()) and len(metadata) <= 16):
            raise invalid("Invalid 'metadata': at most 16 string values.", "metadata")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise invalid("Missing required parameter: 'input_file_id'.", "input_file_id", "missing_required_parameter")
        try:
            data = await files.content(self.redis, file_id, owner=owner)
        except ApiError:
            raise invalid(f"Invalid 'input_file_id': no such file {file_id!r}.", "input_file_id", "invalid_file") from None
        check = partial(self.lines.check, endpoint)  # renders every line's prompt: on a tokenizing thread, not the event loop
        work = partial(batch_jobs.openai_lines, data, endpoint=endpoint, check=check, max_lines=self.settings.batch_max_lines)
        lines, errors = await self.api.tokenizing.run(len(data), work)
        record = {"protocol": OPENAI, "owner": owner, "endpoint": endpoint, "input_file_id": file_id, "completion_window": "24h", "metadata": metadata, "errors": errors}
        doc = await batch_jobs.create(self.redis, self.settings, record=record, lines=[] if errors else lines)
        return _json(batch_jobs.openai_view(doc, await batch_jobs.counts(self.redis, doc["id"])))

    async def get_batch(self, http: HttpRequest) -> Response:
        doc = await batch_jobs.load(self.redis, _route(http, "batch_id"), owner=self.caller(http), protocol=OPENAI)
        return _json(batch_jobs.openai_view(doc, await batch_jobs.counts(self.redis, doc["id"])))

    async def list_batches(self, http: HttpRequest) -> Response:
        docs, more = await batch_jobs.listing(self.redis, owner=self.caller(http), protocol=OPENAI, limit=_limit(http, 20, 100), after=_query(http, "after"))
        data = [batch_jobs.openai_view(d, await batch_jobs.counts(self.redis, d["id"])) for d in docs]
        return _json({"object": "list", "data": data, "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None, "has_more": more})

    async def cancel_batch(self, http: HttpRequest) -> Response:
        doc = await self._cancel(http, OPENAI)
        return _json(batch_jobs.openai_view(doc, await batch_jobs.counts(self.redis, doc["id"])))

    async def _cancel(self, http: HttpRequest, protocol: str) -> dict[str, Any]:
        doc = await batch_jobs.load(self.redis, _route(http, "batch_id"), owner=self.caller(http), protocol=protocol)
        return await batch_jobs.update(self.redis, self.settings, doc["id"], only_from=("validating", "in_progress"), status="cancelling", cancelling_at=int(time.time()))

    # ---- Anthropic Message Batches --------------------------------------------------------------

    def _anthropic(self, http: HttpRequest, doc: dict[str, Any], tally: dict[str, int]) -> dict[str, Any]:
        return batch_jobs.anthropic_view(doc, tally, f"{http.scheme}://{http.host}")

    async def create_message_batch(self, http: HttpRequest) -> Response:
        lines = batch_jobs.anthropic_lines(await self.api.read_json(http), max_lines=self.settings.batch_max_lines)
        record = {"protocol": ANTHROPIC, "owner": self.caller(http), "endpoint": "/v1/messages"}
        doc = await batch_jobs.create(self.redis, self.settings, record=record, lines=lines)
        return _json(self._anthropic(http, doc, await batch_jobs.counts(self.redis, doc["id"])))

    async def get_message_batch(self, http: HttpRequest) -> Response:
        doc = await batch_jobs.load(self.redis, _route(http, "batch_id"), owner=self.caller(http), protocol=ANTHROPIC)
        return _json(self._anthropic(http, doc, await batch_jobs.counts(self.redis, doc["id"])))

    async def list_message_batches(self, http: HttpRequest) -> Response:
        docs, more = await batch_jobs.listing(self.redis, owner=self.caller(http), protocol=ANTHROPIC, limit=_limit(http, 20, 1000), after=_query(http, "after_id"))
        data = [self._anthropic(http, d, await batch_jobs.counts(self.redis, d["id"])) for d in docs]
        return _json({"data": data, "has_more": more, "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})

    async def cancel_message_batch(self, http: HttpRequest) -> Response:
        doc = await self._cancel(http, ANTHROPIC)
        return _json(self._anthropic(http, doc, await batch_jobs.counts(self.redis, doc["id"])))

    async def message_batch_results(self, http: HttpRequest) -> Response:
        doc = await batch_jobs.load(self.redis, _route(http, "batch_id"), owner=self.caller(http), protocol=ANTHROPIC)
        if doc["status"] not in batch_jobs.ENDED:
            raise invalid(f"Message batch {doc['id']} has not ended yet; its results are available once processing_status is 'ended'.", "batch_id")
        return _jsonl(await self._ordered_results(doc))

    async def delete_message_batch(self, http: HttpRequest) -> Response:
        doc = await batch_jobs.load(self.redis, _route(http, "batch_id"), owner=self.caller(http), protocol=ANTHROPIC)
        if doc["status"] not in batch_jobs.ENDED:
            raise invalid(f"Message batch {doc['id']} is still processing; cancel it first.", "batch_id")
        await batch_jobs.delete(self.redis, doc)
        return _json({"id": doc["id"], "type": "message_batch_deleted"})

    async def _ordered_results(self, doc: dict[str, Any]) -> list[dict[str, Any]]:
        results = await batch_jobs.results(self.redis, doc["id"])
        order = await batch_jobs.custom_ids(self.redis, doc["id"])
        return [results[cid]["result"] for cid in order if cid in results]
