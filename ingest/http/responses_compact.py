"""Responses compaction, input items and input token counts: POST /v1/responses/compact,
GET /v1/responses/{id}/input_items and POST /v1/responses/input_tokens.

Compaction (`client.responses.compact`) is a real generation through the normal pipeline: the body (model,
input, instructions, previous_response_id) becomes a create body with `COMPACT_PROMPT` appended as a last
user message, greedy, at most `COMPACT_MAX_TOKENS` tokens, not stored, queued with `Api.submit` and
collected like any request (it shows in the request log and dumps as a /v1/responses request). What it
keeps and drops, as OpenAI describes its own: the answer's `output` is every user message of the
conversation (the previous response's and this `input`'s, verbatim, with ids) and one `compaction` item
whose `encrypted_content` is the model's summary sealed with the deployment's seal (shared.seal, as
reasoning's `encrypted_content`); assistant turns, tool calls and their outputs, reasoning, system /
developer messages and earlier compaction items are dropped: only the summary carries them on. A later
request that sends the `compaction` item back gets the summary, opened, as a user message (`SUMMARY_PREFIX`
and the text) in its place (`open_compactions`, called by `Api.prepare`); one that does not open (another
deployment's key, tampered) is dropped with a log line, as sealed reasoning that does not open is dropped.
The summary is as good as the model: the default 135M model's is poor. `usage` is the compaction call's.

input_tokens counts the prompt a create with the same body would render (same parse, previous response,
tools, instructions, opened sealed items), charged like count_tokens: one request, no tokens.
input_items lists a stored response's `input` (ingest.http.responses_store.input_of), paged as OpenAI does.
Must not: parse Responses bodies itself (ingest.parsers.openai_responses does) or encode streams.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from blacksheep import Request as HttpRequest
from blacksheep import Response

from encoders.openai_responses import response_id
from ingest.http import responses_store
from ingest.http.auth import caller_of
from ingest.http.limits import parse_json
from ingest.http.surfaces import RESPONSES
from ingest.parsers import fields as f
from ingest.parsers.errors import failure
from ingest.parsers.openai_responses import COMPACTION, is_compaction, previous_response_id
from shared.deltas import Content
from shared.errors import ApiError, invalid
from shared.ir import ImagePart, Message, Request, Role, TextPart
from shared.seal import Sealer, open_reasoning

if TYPE_CHECKING:
    from ingest.http.app import Api

log = logging.getLogger("met.api")

COMPACT_PROMPT = (
    "Stop here and write a summary of the conversation above for whoever continues it: the user's goal and "
    "constraints, what has been done and decided so far, and what remains to do. Write only the summary."
)
COMPACT_MAX_TOKENS = 512  # the summary's bound (the context may clamp it further)
SUMMARY_PREFIX = "Summary of the earlier conversation, which was compacted:\n"
COMPACT_FIELDS = ("model", "instructions", "previous_response_id", "prompt_cache_key")  # what a compact body shares with a create
PAGE_DEFAULT, PAGE_MAX = 20, 100


def compaction_body(body: Any) -> dict[str, Any]:
    """The create body a compact body becomes: its fields, `COMPACT_PROMPT` after its input, greedy,
    bounded, not stored. An input of the wrong type is left for the parser to name."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", None, "invalid_body")
    prompt = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": COMPACT_PROMPT}]}
    value = body.get("input")
    if value is None and previous_response_id(body) is None:
        f.require(body, "input")  # nothing to compact
    items = [prompt] if value is None else [{"role": "user", "content": value}, prompt] if isinstance(value, str) else [*value, prompt] if isinstance(value, list) else value
    create = {k: body[k] for k in COMPACT_FIELDS if body.get(k) is not None}
    return create | {"input": items, "store": False, "temperature": 0, "max_output_tokens": COMPACT_MAX_TOKENS}


def user_items(previous: list[Message], body: dict[str, Any], rid: str) -> list[dict[str, Any]]:
    """The user messages a compaction keeps: the previous response's (but for opened summaries), then
    this body's input's, verbatim, as items with ids (ingest.http.responses_store.input_items)."""
    earlier = [{"role": "user", "content": [_part(p) for p in m.content]} for m in previous if m.role is Role.USER and m.name != COMPACTION]
    value = body.get("input")
    given = [{"role": "user", "content": value}] if isinstance(value, str) else value if isinstance(value, list) else []
    items = responses_store.input_items({"input": [*earlier, *given]}, rid)
    return [item for item in items if item["type"] == "message" and item.get("role") == "user"]


def _part(part: Any) -> dict[str, Any]:
    if isinstance(part, ImagePart):
        return {"type": "input_image", "image_url": part.url, "detail": "auto"}
    return {"type": "input_text", "text": part.text}


def open_compactions(request: Request, sealer: Sealer | None) -> Request:
    """Each compaction item (ingest.parsers.openai_responses.compaction) → a user message holding its
    summary (`SUMMARY_PREFIX` and the text), named `COMPACTION`; one that does not open with this
    deployment's key, or any with no sealer yet, is dropped with a log line."""
    if not any(is_compaction(m) for m in request.messages):
        return request
    messages = []
    for message in request.messages:
        if not is_compaction(message):
            messages.append(message)
            continue
        text = next((sealer.open(blob) for mark, blob in message.sealed_reasoning if mark == COMPACTION), None) if sealer else None
        if text is None:
            log.info("request %s: a compaction item that does not open with this deployment's key was dropped", request.id)
            continue
        messages.append(Message(role=Role.USER, name=COMPACTION, content=(TextPart(text=SUMMARY_PREFIX + text),)))
    return replace(request, messages=tuple(messages))


def page(items: list[dict[str, Any]], query: dict[str, list[str]]) -> dict[str, Any]:
    """OpenAI's list of input items: `order` (desc by default), `after` an item id, `limit` 1-100 (20)."""
    raw_limit = query.get("limit", [str(PAGE_DEFAULT)])[0]
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= PAGE_MAX:
        raise invalid(f"Invalid 'limit': expected an integer from 1 to {PAGE_MAX}, got {raw_limit!r}.", "limit", "invalid_value")
    order = query.get("order", ["desc"])[0]
    if order not in ("asc", "desc"):
        raise invalid(f"Invalid value: {order!r}. Supported values are: 'asc' and 'desc'.", "order", "invalid_value")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after", [None])[0]
    if after is not None:
        at = next((i for i, item in enumerate(ordered) if item.get("id") == after), None)
        if at is None:
            raise invalid(f"No input item with id '{after}' in this response.", "after", "invalid_value")
        ordered = ordered[at + 1 :]
    data = ordered[: int(raw_limit)]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(ordered) > len(data),
    }


class CompactionRoutes:
    """POST /v1/responses/compact, POST /v1/responses/input_tokens and GET /v1/responses/{id}/input_items."""

    def __init__(self, api: Api) -> None:
        self.api = api

    async def compact(self, http: HttpRequest) -> Response:
        """Summarize the conversation with one generation (see the module docstring) and answer OpenAI's
        `response.compaction` object."""
        api = self.api
        raw = await api.read_raw(http)
        body = parse_json(raw, api.settings.max_json_depth)
        create = compaction_body(body)
        if api.sealer is None:
            raise ApiError("The deployment's seal is not loaded yet (Redis unreachable); retry shortly.", status=503, kind="unavailable", code="seal_unavailable")
        sealer = api.sealer
        queued = await api.submit(http, RESPONSES, create, size=len(raw))
        request = queued.request
        deltas = await api.collect(http, request, api.presence(http))
        acc = RESPONSES.accumulator(request)
        for delta in deltas:
            acc.feed(delta)
        if acc.error is not None:
            raise failure(acc.error)
        summary = "".join(d.text for d in deltas if isinstance(d, Content)).strip()
        previous = previous_response_id(body)
        earlier = (await responses_store.load(api.redis, previous, caller=caller_of(http), param="previous_response_id"))[1] if previous else []
        compaction = {"type": "compaction", "id": f"cmp_{request.id}", "encrypted_content": sealer.seal(summary)}
        answer = {
            "id": response_id(request),
            "object": "response.compaction",
            "created_at": int(request.created),
            "output": [*user_items(earlier, body, response_id(request)), compaction],
            "usage": acc.body()["usage"],
        }
        return api.json(answer, headers=api.limiter.headers(queued.charged))

    async def input_tokens(self, http: HttpRequest) -> Response:
        """The prompt tokens a create with this body would use; `model` may be left out (the served one)."""
        api = self.api
        raw = await api.read_raw(http)
        body = parse_json(raw, api.settings.max_json_depth)
        if isinstance(body, dict) and body.get("model") is None:
            body = {**body, "model": api.model_name}
        caller = caller_of(http)
        await api.limiter.charge(caller, tokens=0)  # before any parsing (file parts) or tokenizing
        parsed = await api.parse_body(RESPONSES.parse, body, size=len(raw), caller=caller)
        api.check_model(parsed)
        request, _ = await RESPONSES.session(api.redis, api.settings, body, parsed, caller)
        opened = open_reasoning(open_compactions(request, api.sealer), api.sealer)
        return api.json({"object": "response.input_tokens", "input_tokens": await api.tokenizing.count(len(raw), opened)})

    async def input_items(self, http: HttpRequest) -> Response:
        """A stored response's input items, paged (`limit`, `order`, `after`; `include` is accepted: every
        field is always included)."""
        rid = str((http.route_values or {}).get("response_id") or "")
        items = await responses_store.input_of(self.api.redis, rid, caller=caller_of(http))
        return self.api.json(page(items, {k: v for k, v in http.query.items()}))
