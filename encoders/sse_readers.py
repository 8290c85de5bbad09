"""The inverse of the stream encoders: a protocol's streamed payloads (one SSE `data:` JSON each) → the
`StreamDelta`s they carry, enough for `shared.dumps.compare` (text, generated token ids, finish reason).
Each protocol's codec row names its reader (encoders.registry); `met replay --against` reads with it.

Where token ids appear: chat puts `token_ids` on every chunk's choice (text, reasoning, refusal, tool
call, finish; a chunk holds one call); Anthropic puts them on
every `content_block_delta` and on `message_delta` (which flushes the rest); Responses on every text /
arguments delta, and the terminal response holds the whole list.
Must not: do I/O.
"""

from __future__ import annotations

from typing import Any

from shared.deltas import (
    Content,
    Error,
    ErrorKind,
    Finish,
    FinishReason,
    Reasoning,
    Refusal,
    StreamDelta,
    ToolCallArgs,
    ToolCallStart,
    Usage,
)

_CHAT_REASONS = {r.openai: r for r in reversed(FinishReason)}
_ANTHROPIC_REASONS = {r.anthropic: r for r in reversed(FinishReason)}
_RESPONSES_REASONS = {(r.responses_status, r.responses_incomplete_reason): r for r in reversed(FinishReason)}


def _error(message: Any, kind: Any) -> Error:
    try:
        return Error(message=str(message), kind=ErrorKind(kind))
    except ValueError:
        return Error(message=str(message))


def chat(payload: dict[str, Any], _seen: list[StreamDelta]) -> list[StreamDelta]:
    if "error" in payload:
        return [_error(payload["error"].get("message"), payload["error"].get("type"))]
    out: list[StreamDelta] = []
    for choice in payload.get("choices") or []:
        delta, ids = choice.get("delta") or {}, tuple(choice.get("token_ids") or ())
        if delta.get("content") is not None:
            out.append(Content(text=delta["content"], token_ids=ids))
        elif delta.get("reasoning_content") is not None:
            out.append(Reasoning(text=delta["reasoning_content"], token_ids=ids))
        elif delta.get("refusal") is not None:
            out.append(Refusal(text=delta["refusal"], token_ids=ids))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                out.append(ToolCallStart(index=call["index"], id=call["id"], name=function.get("name", ""), token_ids=ids))
                ids = ()
            if function.get("arguments") or ids:
                out.append(ToolCallArgs(index=call["index"], arguments=function.get("arguments") or "", token_ids=ids))
                ids = ()
        if choice.get("finish_reason"):
            out.append(Finish(reason=_CHAT_REASONS[choice["finish_reason"]], usage=Usage(), token_ids=ids))
    return out


def completions(payload: dict[str, Any], _seen: list[StreamDelta]) -> list[StreamDelta]:
    """Legacy completions chunks: text only (the wire has no reasoning or tool calls)."""
    if "error" in payload:
        return [_error(payload["error"].get("message"), payload["error"].get("type"))]
    out: list[StreamDelta] = []
    for choice in payload.get("choices") or []:
        ids = tuple(choice.get("token_ids") or ())
        if choice.get("finish_reason"):
            if choice.get("text"):
                out.append(Content(text=choice["text"]))
            out.append(Finish(reason=_CHAT_REASONS[choice["finish_reason"]], usage=Usage(), token_ids=ids))
        elif choice.get("text") or ids:
            out.append(Content(text=choice.get("text") or "", token_ids=ids))
    return out


def anthropic(payload: dict[str, Any], _seen: list[StreamDelta]) -> list[StreamDelta]:
    kind, ids = payload.get("type"), tuple(payload.get("token_ids") or ())
    if kind == "error":
        return [_error(payload["error"].get("message"), payload["error"].get("type"))]
    if kind == "content_block_start" and payload["content_block"].get("type") == "tool_use":
        block = payload["content_block"]
        return [ToolCallStart(index=payload["index"], id=block["id"], name=block["name"])]
    if kind == "content_block_delta":
        delta = payload["delta"]
        if delta["type"] == "text_delta":
            return [Content(text=delta["text"], token_ids=ids)]
        if delta["type"] == "thinking_delta":
            return [Reasoning(text=delta["thinking"], token_ids=ids)]
        if delta["type"] == "input_json_delta":
            return [ToolCallArgs(index=payload["index"], arguments=delta["partial_json"], token_ids=ids)]
        return [Content(text="", token_ids=ids)] if ids else []
    if kind == "message_delta":
        stop = payload["delta"]
        return [Finish(reason=_ANTHROPIC_REASONS[stop["stop_reason"]], usage=Usage(), matched_stop=stop.get("stop_sequence"), token_ids=ids)]
    return []


_RESPONSES_TEXT = {"response.output_text.delta": Content, "response.refusal.delta": Refusal, "response.reasoning_text.delta": Reasoning}


def responses(payload: dict[str, Any], seen: list[StreamDelta]) -> list[StreamDelta]:
    kind, ids = payload.get("type"), tuple(payload.get("token_ids") or ())
    if kind in _RESPONSES_TEXT:
        cls = _RESPONSES_TEXT[kind]
        return [cls(text=payload["delta"], token_ids=ids)]
    if kind == "response.output_item.added" and payload["item"].get("type") == "function_call":
        item = payload["item"]
        return [ToolCallStart(index=payload["output_index"], id=item["call_id"], name=item["name"])]
    if kind == "response.function_call_arguments.delta":
        return [ToolCallArgs(index=payload["output_index"], arguments=payload["delta"], token_ids=ids)]
    if kind in ("response.completed", "response.incomplete"):
        response = payload["response"]
        reason = (response.get("incomplete_details") or {}).get("reason")
        so_far = sum(len(d.token_ids) for d in seen if not isinstance(d, Error))
        rest = tuple((response.get("token_ids") or [])[so_far:])
        return [Finish(reason=_RESPONSES_REASONS[(response["status"], reason)], usage=Usage(), token_ids=rest)]
    if kind == "response.failed":
        error = payload["response"].get("error") or {}
        return [Error(message=str(error.get("message", "")), kind=ErrorKind.INVALID_REQUEST if error.get("code") == "invalid_prompt" else ErrorKind.INTERNAL)]
    return []
