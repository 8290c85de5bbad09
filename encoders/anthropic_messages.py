"""Anthropic Messages: deltas → SSE frames (`event:` = `data.type`), or one `message` body.

Pure: input is the request IR and its deltas, nothing else. One state machine (`_MessageState`) turns
deltas into event payloads and keeps the content blocks, so the stream and the non-streaming body agree
by construction. `message_start` comes first and once; blocks are indexed 0, 1, 2…, each
`content_block_start` → deltas → `content_block_stop`, one open at a time (Content and Refusal → text,
Reasoning → thinking with a `signature_delta` before its stop (the span's seal, shared.seal: the API
node opens it when the block comes back; `display: "omitted"` sends the block with no text), a tool call → tool_use with
`input_json_delta`s); Finish → `message_delta` (stop reason, cumulative usage) then `message_stop`;
Error → `event: error` and nothing after. Parallel tool calls whose argument fragments interleave are
put in order by `encoders.blocks` (one block open at a time; nothing dropped, later blocks held).
Usage follows Anthropic's split: `input_tokens` are the prompt tokens not read from the prefix cache,
`cache_read_input_tokens` those that were (`Usage.cached_tokens` at the finish; `message_start` takes the
same split from the request's first delta, `Content.cached_tokens`, so both events agree; a gateway
worker learns it only at the finish, where `message_start` counts the whole prompt as input). So
`message_start` waits for the first delta; a prefill longer than the ping interval sends `ping` events
before it (the SDKs skip pings wherever they come). `cache_creation_input_tokens` is always 0 (our
cache fills itself, nothing is billed for writing it).
Must not: do I/O, or expose token ids unless the request asked (`return_token_ids`, an extension).
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from encoders.blocks import TOOL, BlockSequencer, Op
from encoders.frames import Frame, json_frame
from shared.deltas import Content, Error, Finish, FinishReason, Reasoning, Refusal, StreamDelta, ToolCallArgs, ToolCallStart, Usage
from shared.ir import Request

PING = Frame('{"type":"ping"}', "ping")
INCOMPLETE = "The stream ended before the response was complete."


def message_id(request: Request) -> str:
    return f"msg_{request.id}"


def unsealed_signature(request: Request, index: int) -> str:
    """The signature of a thinking block whose span came without a seal (a worker with no key, an old
    dump): opaque and deterministic; sent back, it does not verify, so the block is dropped."""
    return hashlib.sha256(f"{request.id}:{index}".encode()).hexdigest()


def error_body(message: str, error_type: str = "api_error") -> dict[str, Any]:
    """Anthropic's error shape (ingest.parsers.errors renders an ingest `ApiError` the same way)."""
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_frame(error: Error) -> Frame:
    # ErrorKind values are Anthropic's own error types.
    return json_frame(error_body(error.message, error.kind.value), "error")


class _MessageState:
    """Deltas → event payloads, keeping the content blocks of the message being built."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.blocks: list[dict[str, Any]] = []
        self.finish: Finish | None = None
        self.error: Error | None = None
        self.token_ids: list[int] = []
        self._args: dict[int, list[str]] = {}  # block index → input JSON pieces
        self._signatures: dict[int, str] = {}  # thinking block index → its span's seal
        self._sequencer = BlockSequencer()
        self._open: int | None = None
        self._started = False
        self._cached = 0  # prompt tokens read from the prefix cache (the first delta says: shared.deltas.Content)
        self._pending_ids: list[int] = []  # token ids not yet attached to a streamed payload

    @property
    def ended(self) -> bool:
        return self.finish is not None or self.error is not None

    def feed(self, delta: StreamDelta) -> list[dict[str, Any]]:
        if self.ended:
            return []
        if isinstance(delta, Error):
            self.error = delta
            return [error_body(delta.message, delta.kind.value)]
        self.token_ids.extend(delta.token_ids)
        self._pending_ids.extend(delta.token_ids)
        if not self._started and isinstance(delta, Content) and delta.cached_tokens is not None:
            self._cached = delta.cached_tokens
        events = self._start()
        if isinstance(delta, Finish):
            self.finish = delta
            events += self._apply(self._sequencer.finish())
            return [*events, self._message_delta(delta), {"type": "message_stop"}]
        if isinstance(delta, Reasoning) and (delta.sealed or self.request.thinking.omitted):
            return events + self._thinking_seal(delta)
        if isinstance(delta, Content | Refusal | Reasoning) and not delta.text:
            return events
        group = "thinking" if isinstance(delta, Reasoning) else TOOL if isinstance(delta, ToolCallStart | ToolCallArgs) else "text"
        return events + self._apply(self._sequencer.feed(delta, group))

    def _thinking_seal(self, delta: Reasoning) -> list[dict[str, Any]]:
        """The span's seal becomes its block's signature. With `display: "omitted"` the text stays out of
        the response (it lives in the seal) and the seal alone opens an empty thinking block."""
        if not delta.sealed:
            return []  # omitted text
        events = self._apply(self._sequencer.feed(Reasoning(text=""), "thinking"))
        if self._open is not None and self.blocks[self._open]["type"] == "thinking":
            self._signatures[self._open] = delta.sealed
        return events

    def _apply(self, ops: list[Op]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for op in ops:
            if op.kind == "close":
                events += self._close()
                continue
            if op.kind == "open":
                if isinstance(op.delta, ToolCallStart):
                    events += self._open_block({"type": "tool_use", "id": op.delta.id, "name": op.delta.name, "input": {}})
                    continue
                events += self._open_block({"type": op.group, op.group: ""} | ({"signature": ""} if op.group == "thinking" else {}))
            events += self._append(op.group, op.delta)
        return events

    def message(self, *, streaming: bool) -> dict[str, Any]:
        """The Message object: empty with null stop reason for `message_start`, else what was built so far."""
        r, done = self.request, self.finish
        usage = _usage(done.usage if done else Usage(prompt_tokens=len(r.prompt_token_ids), cached_tokens=self._cached))
        body: dict[str, Any] = {
            "id": message_id(r),
            "type": "message",
            "role": "assistant",
            "model": r.model,
            "content": [] if streaming else [self._final_block(i) for i in range(len(self.blocks))],
            "stop_reason": done.reason.anthropic if done else None,
            "stop_sequence": _stop_sequence(done),
            "usage": usage,
        }
        if r.return_token_ids:
            body["prompt_token_ids"] = list(r.prompt_token_ids)
            if not streaming:
                body["token_ids"] = self.token_ids
        return body

    def _start(self) -> list[dict[str, Any]]:
        if self._started:
            return []
        self._started = True
        return [{"type": "message_start", "message": self.message(streaming=True)}]

    def _append(self, kind: str, delta: StreamDelta | None) -> list[dict[str, Any]]:
        assert self._open is not None
        if isinstance(delta, ToolCallArgs):
            self._args[self._open].append(delta.arguments)
            return [self._delta({"type": "input_json_delta", "partial_json": delta.arguments})]
        text = getattr(delta, "text", "")
        if not text:
            return []  # an omitted thinking block: opened by its seal, no text
        self.blocks[self._open][kind] += text
        return [self._delta({"type": f"{kind}_delta", kind: text})]

    def _open_block(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self._open = len(self.blocks)
        self.blocks.append(block)
        if block["type"] == "tool_use":
            self._args[self._open] = []
        return [{"type": "content_block_start", "index": self._open, "content_block": dict(block)}]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        events: list[dict[str, Any]] = []
        if self.blocks[index]["type"] == "thinking":
            self.blocks[index]["signature"] = self._signature(index)
            events.append(
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "signature_delta", "signature": self.blocks[index]["signature"]},
                }
            )
        events.append({"type": "content_block_stop", "index": index})
        return events

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return self._with_ids({"type": "content_block_delta", "index": self._open, "delta": delta})

    def _message_delta(self, finish: Finish) -> dict[str, Any]:
        usage = _usage(finish.usage)
        return self._with_ids(
            {
                "type": "message_delta",
                "delta": {"stop_reason": finish.reason.anthropic, "stop_sequence": _stop_sequence(finish)},
                "usage": usage,
            }
        )

    def _with_ids(self, payload: dict[str, Any]) -> dict[str, Any]:
        if self.request.return_token_ids:
            payload["token_ids"], self._pending_ids = self._pending_ids, []
        return payload

    def _final_block(self, index: int) -> dict[str, Any]:
        block = dict(self.blocks[index])
        if block["type"] == "tool_use":
            block["input"] = _tool_input("".join(self._args[index]))
        elif block["type"] == "thinking":
            block["signature"] = self._signature(index)
        return block

    def _signature(self, index: int) -> str:
        return self._signatures.get(index) or unsealed_signature(self.request, index)


def _stop_sequence(finish: Finish | None) -> str | None:
    return finish.matched_stop if finish is not None and finish.reason is FinishReason.STOP_SEQUENCE else None


def _tool_input(arguments: str) -> dict[str, Any]:
    """The call's input object; arguments that are not a JSON object (a model slip) become `{}`."""
    try:
        value = orjson.loads(arguments) if arguments else {}
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesStreamEncoder:
    """Deltas → SSE frames for one streaming Messages request."""

    def __init__(self, request: Request) -> None:
        self._state = _MessageState(request)
        self._closed = False

    def feed(self, delta: StreamDelta) -> list[Frame]:
        if self._closed:
            return []
        frames = [json_frame(event, event["type"]) for event in self._state.feed(delta)]
        if self._state.ended:
            self._closed = True
        return frames

    def finish(self) -> list[Frame]:
        """Close the stream. After a terminal delta: nothing. Without one, an `error` event, so a cut stream never reads as complete."""
        if self._closed:
            return []
        self._closed = True
        return [json_frame(error_body(INCOMPLETE), "error")]

    def ping(self) -> Frame:
        return PING


class MessageAccumulator:
    """Deltas → the one `message` body of a non-streaming request; `error` is set when an Error delta came."""

    def __init__(self, request: Request) -> None:
        self._state = _MessageState(request)

    def feed(self, delta: StreamDelta) -> None:
        self._state.feed(delta)

    @property
    def finish(self) -> Finish | None:
        return self._state.finish

    @property
    def error(self) -> Error | None:
        return self._state.error

    def body(self) -> dict[str, Any]:
        return self._state.message(streaming=False)


def _usage(usage: Usage) -> dict[str, int]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }
