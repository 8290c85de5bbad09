"""Stored Responses-API responses (`store: true`): what `previous_response_id` continues from and what
GET / DELETE /v1/responses/{id} serve. One JSON document per response, with a TTL.

The stored conversation is the request's messages (without its `instructions`, which OpenAI does not
carry over) plus the assistant turn the deltas produced.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import orjson
from redis.asyncio import Redis

from encoders.openai_responses import ResponseAccumulator, response_id
from ingest.openai_responses import previous_response_id, store_flag
from shared import keys
from shared.codec import VERSION, message_from_dict, message_to_dict
from shared.deltas import Content, StreamDelta, ToolCallArgs, ToolCallStart
from shared.errors import ApiError
from shared.ir import Message, Request, Role, TextPart, ToolCall, ToolKind, custom_tools
from shared.settings import Settings

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


async def save(redis: Redis, response_id: str, *, body: dict[str, Any], conversation: list[Message], ttl: int) -> None:
    doc = {"v": VERSION, "body": body, "conversation": [message_to_dict(m) for m in conversation]}
    await redis.set(keys.stored_response(response_id), orjson.dumps(doc), ex=ttl)


async def load(redis: Redis, response_id: str, *, param: str | None = None) -> tuple[dict[str, Any], list[Message]]:
    raw = await redis.get(keys.stored_response(response_id))
    if raw is None:
        raise ApiError(f"Response with id '{response_id}' not found.", status=404, param=param, kind="not_found", code="response_not_found")
    doc = orjson.loads(raw)
    return doc["body"], [message_from_dict(m) for m in doc["conversation"]]


async def delete(redis: Redis, response_id: str) -> None:
    if not await redis.delete(keys.stored_response(response_id)):
        raise ApiError(f"Response with id '{response_id}' not found.", status=404, kind="not_found", code="response_not_found")


async def begin(redis: Redis, settings: Settings, body: Any, parsed: Request) -> tuple[Request, Saver | None]:
    """The Responses session around one generation: `previous_response_id` puts the stored conversation
    before this request's messages; with `store` (the default) the returned saver keeps the finished
    response (for GET and a later `previous_response_id`): the whole conversation without this
    request's `instructions` (OpenAI does not carry them over), plus the assistant turn."""
    request = parsed
    previous = previous_response_id(body) if isinstance(body, dict) else None
    if previous is not None:
        _, conversation = await load(redis, previous, param="previous_response_id")
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
            await save(redis, response_id(final), body=acc.body(), conversation=conversation, ttl=settings.response_ttl)

    return request, save_deltas
