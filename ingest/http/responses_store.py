"""Stored Responses-API responses (`store: true`): what `previous_response_id` continues from and what
GET / DELETE /v1/responses/{id} serve. One JSON document per response, with a TTL.

The stored conversation is the request's messages (without its `instructions`, which OpenAI does not
carry over) plus the assistant turn the deltas produced. A response with no document yet (running in
the background, or its API node died before saving it) is rebuilt from its recorded request and delta
stream, the truth the document is made from, until the dump expires; a `store: false` one never is.
Background responses (`background: true`) are saved by a follower task of the node that accepted them
and can be cancelled while they run. Every response belongs to the API key that created it (the document's
`owner`, else the recorded request's): for any other key GET, DELETE, cancel, a stream replay and a
`previous_response_id` naming it all answer 404, as OpenAI does (ingest.http.auth.owns).
The document also keeps the request's `input` as items with ids (`input_items`), which
GET /v1/responses/{id}/input_items lists (ingest.http.responses_compact).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from encoders.openai_responses import ResponseAccumulator, response_id
from ingest.http import storage
from ingest.http.auth import owns
from ingest.http.publish import LIFETIME_MARGIN_S, cancel, owner_of
from ingest.parsers.openai_responses import previous_response_id, store_flag
from shared import keys
from shared.codec import VERSION, decode_request, deltas_of, message_from_dict, message_to_dict
from shared.deltas import Content, StreamDelta, ToolCallArgs, ToolCallStart, is_terminal
from shared.errors import ApiError
from shared.ir import Message, Request, Role, TextPart, ToolCall, ToolKind, custom_tools
from shared.settings import Settings

log = logging.getLogger(__name__)
DELETED = b"deleted"  # the tombstone a DELETE leaves in place of the document
Saver = Callable[[Request, list[StreamDelta]], Awaitable[None]]  # (the request as queued, its deltas)


def assistant_turn(deltas: list[StreamDelta], custom: frozenset[str] = frozenset()) -> Message:
    """The assistant message a delta stream amounts to (text and tool calls; a call to a tool named in
    `custom` is a custom tool's call, its arguments the raw input)."""
    text = "".join(d.text for d in deltas if isinstance(d, Content))
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, ToolCallStart):
            calls[d.index] = [d.id, d.name, ""]
        elif isinstance(d, ToolCallArgs) and d.index in calls:
            calls[d.index][2] += d.arguments
    return Message(
        role=Role.ASSISTANT,
        content=(TextPart(text=text),) if text else (),
        tool_calls=tuple(
            ToolCall(id=c[0], name=c[1], arguments=c[2], kind=ToolKind.CUSTOM if c[1] in custom else ToolKind.FUNCTION) for _, c in sorted(calls.items())
        ),
    )


async def save(  # noqa: PLR0913 (keyword-only: the parts of one stored document)
    redis: Redis,
    response_id: str,
    *,
    body: dict[str, Any],
    conversation: list[Message],
    owner: str,
    quota: storage.Quota,
    input_items: list[dict[str, Any]] | None = None,
) -> None:
    """Store the response for `quota.response_s`, entered in `owner`'s storage ledger when the quota caps
    it (ingest.http.storage: the key's next request makes room if this took it past its cap)."""
    conversation_docs = [message_to_dict(m) for m in conversation]
    doc = orjson.dumps({"v": VERSION, "body": body, "conversation": conversation_docs, "owner": owner, "input": input_items or []})
    ttl = int(quota.response_s)
    await redis.set(keys.stored_response(response_id), doc, ex=ttl)
    if quota.cap:
        await storage.record(redis, owner, [(storage.RESPONSE + response_id, len(doc), time.time() + ttl)], keep_s=quota.keep_s)


async def load(redis: Redis, response_id: str, *, caller: str, param: str | None = None) -> tuple[dict[str, Any], list[Message]]:
    """The response body and its conversation: the stored document, else rebuilt from the delta stream
    (a `previous_response_id` must name a finished one)."""
    doc = await _document(redis, response_id, caller=caller, param=param)
    if doc is not None:
        return doc["body"], [message_from_dict(m) for m in doc["conversation"]]
    recorded = await live(redis, response_id, caller=caller)
    if recorded is None:
        raise _not_found(response_id, param)
    request, deltas = recorded
    if param is not None and not (deltas and is_terminal(deltas[-1])):
        raise ApiError(f"Response '{response_id}' is still in progress.", status=400, param=param, kind="invalid_request_error", code="response_in_progress")
    return body_of(request, deltas), _conversation(request, deltas)


async def _document(redis: Redis, response_id: str, *, caller: str, param: str | None) -> dict[str, Any] | None:
    """The stored document, None when there is none yet (rebuild it from the deltas); 404 when deleted or
    not `caller`'s."""
    raw = await redis.get(keys.stored_response(response_id))
    if raw == DELETED:
        raise _not_found(response_id, param)
    if raw is None:
        return None
    doc: dict[str, Any] = orjson.loads(raw)
    if not owns(caller, doc.get("owner")):
        raise _not_found(response_id, param)
    return doc


async def input_of(redis: Redis, response_id: str, *, caller: str) -> list[dict[str, Any]]:
    """The response's `input` items with their ids (`input_items`): stored with it, or read from its
    recorded request while it has no document; 404 as `load`."""
    doc = await _document(redis, response_id, caller=caller, param=None)
    if doc is not None:
        items: list[dict[str, Any]] = doc.get("input", [])
        return items
    recorded = await live(redis, response_id, caller=caller)
    if recorded is None:
        raise _not_found(response_id, None)
    body = orjson.loads(recorded[0].raw_body) if recorded[0].raw_body else {}
    return input_items(body, response_id)


ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs", "compaction": "cmp"}


def input_items(body: Any, response_id: str) -> list[dict[str, Any]]:
    """A create body's `input` as items, as OpenAI lists them: a string is one user message; a message in
    the short form (`{"role", "content": "text"}`) gets `type`, `status` and a content part; an item without
    an `id` gets one made from `response_id` and its place (the same every time, so `after` pages)."""
    value = body.get("input") if isinstance(body, dict) else None
    raw = [{"role": "user", "content": value}] if isinstance(value, str) else value if isinstance(value, list) else []
    items = []
    for i, item in enumerate(x for x in raw if isinstance(x, dict)):
        kind = item.get("type", "message")
        out = {**item, "type": kind}
        if kind == "message":
            text_kind = "output_text" if item.get("role") == "assistant" else "input_text"
            content = item.get("content")
            out["content"] = [{"type": text_kind, "text": content}] if isinstance(content, str) else content
            out.setdefault("status", "completed")
        if not out.get("id"):
            out["id"] = f"{ITEM_PREFIXES.get(kind, 'item')}_{response_id.removeprefix('resp_')}{i:04d}"
        items.append(out)
    return items


async def live(redis: Redis, response_id: str, *, caller: str) -> tuple[Request, list[StreamDelta]] | None:
    """A stored response's recorded request and its deltas so far; None if unknown, expired, `store: false`
    or not `caller`'s."""
    rid = response_id.removeprefix("resp_")
    raw = await redis.get(keys.request_ir(rid))
    if raw is None or rid == response_id or not owns(caller, await owner_of(redis, rid)):
        return None
    request = decode_request(raw)
    body = orjson.loads(request.raw_body) if request.raw_body else {}
    if request.protocol.value != "openai_responses" or not store_flag(body if isinstance(body, dict) else {}):
        return None
    entries: Any = await redis.xrange(keys.delta_stream(rid))
    return request, deltas_of(entries)


def body_of(request: Request, deltas: list[StreamDelta]) -> dict[str, Any]:
    """The Response object these deltas amount to; `queued` before any delta of a background response."""
    acc = ResponseAccumulator(request)
    for delta in deltas:
        acc.feed(delta)
    body = acc.body()
    if not deltas and body["background"]:
        body["status"] = "queued"
    return body


async def cancel_background(redis: Redis, response_id: str, *, caller: str, wait_s: float = 10.0) -> dict[str, Any]:
    """Cancel a running background response and return it once ended (or as it stands after `wait_s`)."""
    recorded = await live(redis, response_id, caller=caller)
    if recorded is None:
        raise _not_found(response_id, None)
    request, deltas = recorded
    if not body_of(request, []).get("background"):
        raise ApiError("Only responses created with background=true can be cancelled.", status=400, kind="invalid_request_error", code="not_background")
    if not (deltas and is_terminal(deltas[-1])):
        await cancel(redis, request.id)
        end = asyncio.get_running_loop().time() + wait_s
        while asyncio.get_running_loop().time() < end and not (deltas and is_terminal(deltas[-1])):
            await asyncio.sleep(0.1)
            again = await live(redis, response_id, caller=caller)
            deltas = again[1] if again is not None else deltas
    return body_of(request, deltas)


def _conversation(request: Request, deltas: list[StreamDelta]) -> list[Message]:
    """As `begin` saves it: without this request's `instructions` (the last system message with its text)."""
    body = orjson.loads(request.raw_body) if request.raw_body else {}
    instructions = body.get("instructions") if isinstance(body, dict) else None
    messages = list(request.messages)
    at = [i for i, m in enumerate(messages) if instructions is not None and m.role is Role.SYSTEM and m.text == instructions]
    if at:
        del messages[at[-1]]
    return [*messages, assistant_turn(deltas, custom_tools(request))]


def _not_found(response_id: str, param: str | None) -> ApiError:
    return ApiError(f"Response with id '{response_id}' not found.", status=404, param=param, kind="not_found", code="response_not_found")


async def delete(redis: Redis, response_id: str, *, caller: str, ttl: int) -> None:
    """Forget a response: a tombstone replaces its document, so it is not rebuilt from its deltas either."""
    await load(redis, response_id, caller=caller)  # 404 unless it exists and is the caller's
    await redis.set(keys.stored_response(response_id), DELETED, ex=ttl)


async def begin(redis: Redis, settings: Settings, body: Any, parsed: Request, caller: str) -> tuple[Request, Saver | None]:
    """The Responses session around one generation: `previous_response_id` puts the stored conversation
    before this request's messages; with `store` (the default) the returned saver keeps the finished
    response (for GET and a later `previous_response_id`): the whole conversation without this
    request's `instructions` (OpenAI does not carry them over), plus the assistant turn."""
    request = parsed
    previous = previous_response_id(body) if isinstance(body, dict) else None
    if previous is not None:
        _, conversation = await load(redis, previous, caller=caller, param="previous_response_id")
        request = replace(parsed, messages=(*conversation, *parsed.messages))
    if not isinstance(body, dict) or not store_flag(body):
        return request, None
    instructions = parsed.messages[0] if body.get("instructions") is not None else None

    async def save_deltas(final: Request, deltas: list[StreamDelta]) -> None:
        acc = ResponseAccumulator(final)
        for delta in deltas:
            acc.feed(delta)
        if acc.error is None:
            conversation = [m for m in final.messages if m is not instructions] + [assistant_turn(deltas, custom_tools(final))]
            try:
                quota = storage.Quota.from_settings(settings, margin_s=LIFETIME_MARGIN_S)
                rid = response_id(final)
                await save(redis, rid, body=acc.body(), conversation=conversation, owner=caller, quota=quota, input_items=input_items(body, rid))
            except RedisError as exc:  # the client still gets its terminal event; GET rebuilds it from the deltas
                log.error("could not store response %s: %s", response_id(final), type(exc).__name__)

    return request, save_deltas
