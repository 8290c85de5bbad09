"""`met replay --against URL`: re-send a recorded request over HTTP and read the streamed answer back into deltas.

Owns: the request body sent (the recorded, redacted raw body with `stream: true` and
`return_token_ids: true`), the SSE reader (stdlib urllib, no extra dependency) and the three protocols'
frames → `StreamDelta`s, enough for `shared.dumps.compare`: text, generated token ids, finish reason.
Where token ids appear: chat puts `token_ids` on each content / reasoning chunk and on the finish chunk
(tool-call and refusal chunks carry none, so their tokens cannot be recovered); Anthropic puts them on
every `content_block_delta` and on `message_delta` (which flushes the rest); Responses on every text /
arguments delta, and the terminal response holds the whole list.
The server re-renders the prompt from the body (and a `previous_response_id` reloads a stored
conversation), so this path checks the whole pipeline but is only as exact as that rendering;
`--redis-url` replays the recorded prompt token ids themselves.
Must not: touch Redis.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import orjson

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
from shared.dumps import DumpRecord
from shared.ir import Protocol

RETRY_STATUSES = (429, 503, 529)
MAX_RETRIES = 120

_CHAT_REASONS = {r.openai: r for r in reversed(FinishReason)}
_ANTHROPIC_REASONS = {r.anthropic: r for r in reversed(FinishReason)}
_RESPONSES_REASONS = {(r.responses_status, r.responses_incomplete_reason): r for r in reversed(FinishReason)}


class ReplayHttpError(RuntimeError):
    """The server refused the replayed request (status and body in the message)."""


def replay_body(record: DumpRecord) -> dict[str, Any]:
    """The recorded body, streaming with token ids. A part of an `n` > 1 chat request becomes n=1 with the part's seed."""
    body: dict[str, Any] = orjson.loads(record.request.raw_body or "{}")
    body["stream"] = True
    body["return_token_ids"] = True
    if record.request.protocol is Protocol.OPENAI_CHAT:
        body.pop("stream_options", None)
        if isinstance(body.get("n"), int) and body["n"] > 1:
            body["n"] = 1
            body["seed"] = record.request.sampling.seed
    return body


def endpoint_url(base: str, endpoint: str) -> str:
    """`http://host:8000` or `http://host:8000/v1` + `/v1/chat/completions`."""
    base = base.rstrip("/")
    return (base.removesuffix("/v1") if endpoint.startswith("/v1/") else base) + endpoint


def post_and_read(record: DumpRecord, *, against: str, api_key: str | None, timeout: float) -> list[StreamDelta]:
    """POST the recorded body, wait out queue-full answers (Retry-After), and read the stream into deltas."""
    headers = {"content-type": "application/json", "accept": "text/event-stream"}
    if api_key:
        headers |= {"authorization": f"Bearer {api_key}", "x-api-key": api_key}
    data = orjson.dumps(replay_body(record))
    url = endpoint_url(against, record.request.endpoint)
    for _ in range(MAX_RETRIES):
        request = urllib.request.Request(url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return frames_to_deltas(record.request.protocol, read_sse(response))
        except urllib.error.HTTPError as err:
            if err.code not in RETRY_STATUSES:
                raise ReplayHttpError(f"{url} answered {err.code}: {err.read().decode(errors='replace')[:500]}") from None
            time.sleep(float(err.headers.get("retry-after") or 1))
    raise ReplayHttpError(f"{url} stayed at its queue limit")


def read_sse(lines: Any) -> Iterator[tuple[str | None, str]]:
    """(event, data) for each SSE event in a byte-line iterable; comments and pings are dropped."""
    event: str | None = None
    data: list[str] = []
    for raw in lines:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if data and event != "ping":
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data and event != "ping":
        yield event, "\n".join(data)


def frames_to_deltas(protocol: Protocol, frames: Iterator[tuple[str | None, str]]) -> list[StreamDelta]:
    readers = {Protocol.OPENAI_CHAT: _chat, Protocol.ANTHROPIC_MESSAGES: _anthropic, Protocol.OPENAI_RESPONSES: _responses, Protocol.OPENAI_COMPLETIONS: _completions}
    reader = readers[protocol]
    deltas: list[StreamDelta] = []
    for _event, data in frames:
        if data == "[DONE]":
            break
        deltas += reader(orjson.loads(data), deltas)
    return deltas


def _error(message: Any, kind: Any) -> Error:
    try:
        return Error(message=str(message), kind=ErrorKind(kind))
    except ValueError:
        return Error(message=str(message))


def _chat(payload: dict[str, Any], _seen: list[StreamDelta]) -> list[StreamDelta]:
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
            out.append(Refusal(text=delta["refusal"]))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                out.append(ToolCallStart(index=call["index"], id=call["id"], name=function.get("name", "")))
            if function.get("arguments"):
                out.append(ToolCallArgs(index=call["index"], arguments=function["arguments"]))
        if choice.get("finish_reason"):
            out.append(Finish(reason=_CHAT_REASONS[choice["finish_reason"]], usage=Usage(), token_ids=ids))
    return out


def _completions(payload: dict[str, Any], _seen: list[StreamDelta]) -> list[StreamDelta]:
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


def _anthropic(payload: dict[str, Any], _seen: list[StreamDelta]) -> list[StreamDelta]:
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


def _responses(payload: dict[str, Any], seen: list[StreamDelta]) -> list[StreamDelta]:
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
