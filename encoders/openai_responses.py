"""OpenAI Responses: deltas → `response.*` SSE events, or one `response` object.

Pure: input is the request IR (including `raw_body`, whose `instructions`, `previous_response_id`,
`store` and `text` are echoed when present) and its deltas. One state machine (`_ResponseState`) turns
deltas into events and keeps the output items, so the stream and the non-streaming body agree by
construction. Every event has `type` and a `sequence_number` from 0 (the stream encoder numbers them);
`response.created` then `response.in_progress` come first; output items get contiguous `output_index`es
and ids derived from the request id and index (`msg_…`, `fc_…`, `rs_…`); each item is added → parts and
deltas → every `.done` → `output_item.done`, one item open at a time (Reasoning → a reasoning item with
`reasoning_text` parts, Content → `output_text`, Refusal → a `refusal` part, a tool call → a
`function_call` item (a call to a namespaced function carries the client's own name and `namespace`,
from the request's `ToolSpec`), or, when the called name is one of the request's custom tools, a `custom_tool_call`
item whose `input` is the raw text the call's ToolCallArgs carry, streamed as
`response.custom_tool_call_input.delta` / `.done`). Exactly one terminal event: `response.completed`, `response.incomplete` (also for
CANCELLED, which has no stream event of its own; the status says `cancelled`), or for an Error an `error`
event then `response.failed`. Its `response.output` equals the streamed items. Arguments for a tool call
that is no longer the open item are dropped (workers emit each call's arguments before the next call).
Must not: do I/O, compute `output_text` (the SDK does), or expose token ids unless asked.

Size (~420 lines): the Responses stream's item and event state machine, whose items (message, reasoning,
function and custom tool calls) share one output index and sequence numbering.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson

from encoders.blocks import TOOL, BlockSequencer, Op
from encoders.frames import Frame, json_frame
from shared.deltas import (
    Content,
    Error,
    ErrorKind,
    Finish,
    Reasoning,
    Refusal,
    StreamDelta,
    TokenLogprob,
    ToolCallArgs,
    ToolCallStart,
    Usage,
)
from shared.ir import Request, ToolKind, ToolSpec, custom_tools

ITEM_PREFIX = {"message": "msg", "function_call": "fc", "custom_tool_call": "ctc", "reasoning": "rs"}
CALL_FIELD = {"function_call": ("arguments", "response.function_call_arguments"), "custom_tool_call": ("input", "response.custom_tool_call_input")}
PART_TEXT_KEY = {"output_text": "text", "refusal": "refusal", "reasoning_text": "text"}
PART_EVENT = {"output_text": "response.output_text", "refusal": "response.refusal", "reasoning_text": "response.reasoning_text"}
ERROR_CODES = {ErrorKind.INVALID_REQUEST: "invalid_prompt"}  # everything else: server_error
INCOMPLETE = "The stream ended before the response was complete."


def response_id(request: Request) -> str:
    return f"resp_{request.id}"


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def _echo(request: Request) -> dict[str, Any]:
    """The request fields the IR does not keep, from `raw_body` when the app recorded it."""
    try:
        body = orjson.loads(request.raw_body) if request.raw_body else {}
    except orjson.JSONDecodeError:
        body = {}
    body = body if isinstance(body, dict) else {}
    text = body.get("text")
    tier = body.get("service_tier")
    return {
        "instructions": body.get("instructions") if isinstance(body.get("instructions"), str) else None,
        "safety_identifier": _string_or_none(body.get("safety_identifier")),
        "prompt_cache_key": _string_or_none(body.get("prompt_cache_key")),
        # one tier here: `auto` and `default` are echoed as OpenAI echoes them, anything else ran as `default`
        "service_tier": tier if tier in ("auto", "default") else "default",
        "previous_response_id": body.get("previous_response_id") if isinstance(body.get("previous_response_id"), str) else None,
        "store": body["store"] if isinstance(body.get("store"), bool) else True,
        "background": body.get("background") is True,
        "text": _text_field(text),
    }


def _text_field(text: Any) -> dict[str, Any]:
    """The request's `text` as a response reports it: the format with every field the object has
    (a json_schema format's `description` null and `strict` false when not given), `verbosity` if set."""
    text = text if isinstance(text, dict) else {}
    fmt = text.get("format") if isinstance(text.get("format"), dict) else {"type": "text"}
    if fmt.get("type") == "json_schema":
        fmt = {
            "type": "json_schema",
            "name": fmt.get("name"),
            "description": _string_or_none(fmt.get("description")),
            "schema": fmt.get("schema"),
            "strict": fmt.get("strict") is True,
        }
    elif fmt.get("type") in ("text", "json_object"):
        fmt = {"type": fmt["type"]}
    out: dict[str, Any] = {"format": fmt}
    if text.get("verbosity") in ("low", "medium", "high"):
        out["verbosity"] = text["verbosity"]
    return out


def _string_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _tool_choice(request: Request) -> Any:
    choice = request.tool_choice
    if choice and choice.startswith("function:"):
        name = choice.removeprefix("function:")
        return {"type": "custom" if name in custom_tools(request) else "function", "name": name}
    return choice or "auto"


def _tool_json(tool: ToolSpec) -> dict[str, Any]:
    if tool.kind is ToolKind.CUSTOM:
        fmt = tool.input_format
        grammar = {"type": "grammar", "syntax": fmt.kind.value, "definition": fmt.text} if fmt is not None else {"type": "text"}
        return {"type": "custom", "name": tool.name, "description": tool.description or None, "format": grammar}
    return {"type": "function", "name": tool.client_name or tool.name, "description": tool.description or None, "parameters": orjson.loads(tool.parameters_json), "strict": None}


def _tools(tools: tuple[ToolSpec, ...]) -> list[dict[str, Any]]:
    """The offered tools as the client gave them: namespaced functions back inside their `namespace` tool
    (its description is not kept, so it is empty)."""
    out: list[dict[str, Any]] = []
    spaces: dict[str, dict[str, Any]] = {}
    for t in tools:
        function = _tool_json(t)
        if not t.namespace:
            out.append(function)
            continue
        if t.namespace not in spaces:
            spaces[t.namespace] = {"type": "namespace", "name": t.namespace, "description": "", "tools": []}
            out.append(spaces[t.namespace])
        spaces[t.namespace]["tools"].append(function)
    return out


class _ResponseState:
    """Deltas → event payloads (without sequence numbers), keeping the output items being built."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.items: list[dict[str, Any]] = []
        self.token_ids: list[int] = []
        self.terminal: dict[str, Any] | None = None  # the Response object the terminal event carried
        self.finish: Finish | None = None
        self.error: Error | None = None
        self._echo = _echo(request)
        self._reported = dict(request.reported_sampling)  # what the API node expects a worker to run where the request set nothing
        self._open: int | None = None  # output index of the open item
        self._custom = custom_tools(request)
        self._sequencer = BlockSequencer(raw=self._custom)  # one item open at a time, interleaved tool calls in order
        self._started = False
        self._pending_ids: list[int] = []

    def feed(self, delta: StreamDelta) -> list[dict[str, Any]]:
        if self.terminal is not None:
            return []
        events = self._start()
        if isinstance(delta, Error):
            self.error = delta
            return events + self._fail(delta.message, ERROR_CODES.get(delta.kind, "server_error"))
        self.token_ids.extend(delta.token_ids)
        self._pending_ids.extend(delta.token_ids)
        if isinstance(delta, Finish):
            status = "completed" if delta.reason.responses_status == "completed" else "incomplete"
            return events + self._apply(self._sequencer.finish(), last_status=status) + self._complete(delta)
        if isinstance(delta, Reasoning) and delta.sealed:
            return events + self._sealed(delta.sealed)
        if isinstance(delta, Content | Refusal | Reasoning) and not delta.text:
            return events
        group = "reasoning" if isinstance(delta, Reasoning) else TOOL if isinstance(delta, ToolCallStart | ToolCallArgs) else "message"
        return events + self._apply(self._sequencer.feed(delta, group))

    def _apply(self, ops: list[Op], *, last_status: str = "completed") -> list[dict[str, Any]]:
        """Ops → events; an item closed at the end takes the response's status if it is the last one."""
        events: list[dict[str, Any]] = []
        for op in ops:
            delta = op.delta
            if op.kind == "close":
                events += self._close(last_status if op.index == len(self.items) - 1 else "completed")
            elif isinstance(delta, ToolCallStart):
                kind = "custom_tool_call" if delta.name in self._custom else "function_call"
                events += self._add({"type": kind, "status": "in_progress", CALL_FIELD[kind][0]: "", "call_id": delta.id, **self._callee(delta.name)})
            elif isinstance(delta, ToolCallArgs):
                index = self._open
                assert index is not None
                key, event = CALL_FIELD[self.items[index]["type"]]
                self.items[index][key] += delta.arguments
                events.append(self._ids({"type": f"{event}.delta", **self._where(index), "delta": delta.arguments}))
            else:
                if op.kind == "open":
                    fields: dict[str, Any] = {"role": "assistant", "content": []}
                    if op.group == "reasoning":
                        fields = {"summary": [], "content": []}  # `encrypted_content` once sealed (`_sealed`): a string or absent
                    events += self._add({"type": op.group, "status": "in_progress", **fields})
                events += self._summary(delta.text) if isinstance(delta, Reasoning) and self.request.thinking.summary else self._text_delta(delta)
        return events

    def _sealed(self, sealed: str) -> list[dict[str, Any]]:
        """The span's sealed blob becomes the open reasoning item's `encrypted_content`, when the request
        asked for it (`include: ["reasoning.encrypted_content"]`); it is final at `output_item.done`."""
        if self.request.thinking.encrypted and self._open is not None and self.items[self._open]["type"] == "reasoning":
            self.items[self._open]["encrypted_content"] = sealed
        return []

    def _summary(self, text: str) -> list[dict[str, Any]]:
        """Reasoning as summary text (the request set `reasoning.summary`): one `summary_text` part; no
        summarizer runs, so the summary is the reasoning itself (docs/api.md, "Reasoning")."""
        assert self._open is not None
        index, events = self._open, []
        summary = self.items[index]["summary"]
        if not summary:
            summary.append({"type": "summary_text", "text": ""})
            events.append({"type": "response.reasoning_summary_part.added", **self._where(index), "summary_index": 0, "part": dict(summary[0])})
        summary[0]["text"] += text
        events.append(self._ids({"type": "response.reasoning_summary_text.delta", **self._where(index), "summary_index": 0, "delta": text}))
        return events

    def _close_summary(self, index: int) -> list[dict[str, Any]]:
        summary = self.items[index].get("summary") or []
        if not summary:
            return []
        where = {**self._where(index), "summary_index": 0}
        return [
            {"type": "response.reasoning_summary_text.done", **where, "text": summary[0]["text"]},
            {"type": "response.reasoning_summary_part.done", **where, "part": dict(summary[0])},
        ]


    def _callee(self, name: str) -> dict[str, str]:
        """The call's name as the client knows it: a namespaced function's own name plus its `namespace`."""
        spec = next((t for t in self.request.tools if t.name == name and t.namespace), None)
        return {"name": spec.client_name, "namespace": spec.namespace} if spec is not None else {"name": name}

    def _text_delta(self, delta: StreamDelta | None) -> list[dict[str, Any]]:
        if isinstance(delta, Content):
            return self._text("output_text", delta.text, _logprobs(delta.logprobs))
        if isinstance(delta, Refusal):
            return self._text("refusal", delta.text)
        assert isinstance(delta, Reasoning)
        return self._text("reasoning_text", delta.text)

    def fail_incomplete(self) -> list[dict[str, Any]]:
        """Terminal events for a stream cut before any terminal delta."""
        return [] if self.terminal is not None else self._start() + self._fail(INCOMPLETE, "server_error")

    def response(self, status: str, **terminal: Any) -> dict[str, Any]:
        r, s = self.request, self.request.sampling
        body: dict[str, Any] = {
            "id": response_id(r),
            "object": "response",
            "created_at": int(r.created),
            "completed_at": terminal.get("completed_at"),
            "status": status,
            "background": self._echo["background"],
            "error": terminal.get("error"),
            "incomplete_details": terminal.get("incomplete_details"),
            "instructions": self._echo["instructions"],
            "max_output_tokens": s.max_tokens,
            "metadata": dict(r.metadata),
            "model": r.model,
            "output": copy.deepcopy(self.items) if status != "in_progress" else [],
            "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": self._echo["previous_response_id"],
            "reasoning": {"effort": r.thinking.effort, "summary": r.thinking.summary},
            "store": self._echo["store"],
            "temperature": s.temperature if s.temperature is not None else self._reported.get("temperature"),
            "text": self._echo["text"],
            "tool_choice": _tool_choice(r),
            "tools": _tools(r.tools),
            "top_p": s.top_p if s.top_p is not None else self._reported.get("top_p"),
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "top_logprobs": s.top_logprobs,
            "max_tool_calls": r.max_tool_calls,
            "service_tier": self._echo["service_tier"],
            "safety_identifier": self._echo["safety_identifier"],
            "prompt_cache_key": self._echo["prompt_cache_key"],
            "truncation": "disabled",
            "usage": terminal.get("usage"),
            "user": None,
        }
        if r.return_token_ids and status != "in_progress":
            body["prompt_token_ids"] = list(r.prompt_token_ids)
            body["token_ids"] = list(self.token_ids)
        return body

    def _start(self) -> list[dict[str, Any]]:
        if self._started:
            return []
        self._started = True
        snapshot = self.response("in_progress")
        return [{"type": "response.created", "response": snapshot}, {"type": "response.in_progress", "response": copy.deepcopy(snapshot)}]

    def _text(self, part_type: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        assert self._open is not None
        index = self._open
        parts = self.items[index]["content"]
        if not parts or parts[-1]["type"] != part_type:
            events += self._close_part(index)
            parts.append(_empty_part(part_type))
            events.append(
                {
                    "type": "response.content_part.added",
                    **self._where(index),
                    "content_index": len(parts) - 1,
                    "part": _empty_part(part_type),
                }
            )
        parts[-1][PART_TEXT_KEY[part_type]] += text
        event: dict[str, Any] = {
            "type": f"{PART_EVENT[part_type]}.delta",
            **self._where(index),
            "content_index": len(parts) - 1,
            "delta": text,
        }
        if part_type == "output_text":
            event["logprobs"] = logprobs or []
            parts[-1]["logprobs"].extend(logprobs or [])
        events.append(self._ids(event))
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        index = self._open = len(self.items)
        self.items.append({"id": f"{ITEM_PREFIX[item['type']]}_{self.request.id}_{index}", **item})
        return [{"type": "response.output_item.added", "output_index": index, "item": copy.deepcopy(self.items[index])}]

    def _close_part(self, index: int) -> list[dict[str, Any]]:
        parts = self.items[index].get("content") or []
        if not parts:
            return []
        part, where = parts[-1], {**self._where(index), "content_index": len(parts) - 1}
        key = PART_TEXT_KEY[part["type"]]
        done: dict[str, Any] = {"type": f"{PART_EVENT[part['type']]}.done", **where, key: part[key]}
        if part["type"] == "output_text":
            done["logprobs"] = list(part["logprobs"])
        return [done, {"type": "response.content_part.done", **where, "part": dict(part)}]

    def _close(self, status: str) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        item = self.items[index]
        if item["type"] in CALL_FIELD:
            key, event = CALL_FIELD[item["type"]]
            events = [{"type": f"{event}.done", **self._where(index), key: item[key]}]
        else:
            events = self._close_summary(index) + self._close_part(index)
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)})
        return events

    def _complete(self, finish: Finish) -> list[dict[str, Any]]:
        self.finish = finish
        status, reason = finish.reason.responses_status, finish.reason.responses_incomplete_reason
        self.terminal = self.response(
            status,
            usage=usage_json(finish.usage),
            incomplete_details={"reason": reason} if reason else None,
            completed_at=int(finish.at) if finish.at and status == "completed" else None,
        )
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [{"type": kind, "response": self.terminal}]

    def _fail(self, message: str, code: str) -> list[dict[str, Any]]:
        events = self._close("incomplete")
        self.terminal = self.response("failed", error={"code": code, "message": message})
        return [
            *events,
            # OpenAI's shape (the SDK's ResponseErrorEvent): an `error` key would make the openai SDK raise on this
            # event instead of delivering response.failed (tests/openresponses.py notes the deviation)
            {"type": "error", "code": code, "message": message, "param": None},
            {"type": "response.failed", "response": self.terminal},
        ]

    def _where(self, index: int) -> dict[str, Any]:
        return {"item_id": self.items[index]["id"], "output_index": index}

    def _ids(self, event: dict[str, Any]) -> dict[str, Any]:
        if self.request.return_token_ids:
            event["token_ids"], self._pending_ids = self._pending_ids, []
        return event


def _empty_part(part_type: str) -> dict[str, Any]:
    if part_type == "output_text":
        return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return {"type": part_type, PART_TEXT_KEY[part_type]: ""}


class ResponsesStreamEncoder:
    """Deltas → SSE frames for one streaming Responses request (`event:` = `type`, as OpenAI sends)."""

    def __init__(self, request: Request) -> None:
        self._state = _ResponseState(request)
        self._sequence = 0
        self._closed = False

    def feed(self, delta: StreamDelta) -> list[Frame]:
        if self._closed:
            return []
        frames = self._frames(self._state.feed(delta))
        self._closed = self._state.terminal is not None
        return frames

    def finish(self) -> list[Frame]:
        """Close the stream. After a terminal delta: nothing. Without one, `error` + `response.failed`."""
        if self._closed:
            return []
        self._closed = True
        return self._frames(self._state.fail_incomplete())

    def _frames(self, events: list[dict[str, Any]]) -> list[Frame]:
        frames = []
        for event in events:
            event["sequence_number"] = self._sequence
            self._sequence += 1
            frames.append(json_frame(event, event["type"]))
        return frames


class ResponseAccumulator:
    """Deltas → the `response` object of a non-streaming request (the one a terminal event would carry)."""

    def __init__(self, request: Request) -> None:
        self._state = _ResponseState(request)

    def feed(self, delta: StreamDelta) -> None:
        self._state.feed(delta)

    @property
    def finish(self) -> Finish | None:
        return self._state.finish

    @property
    def error(self) -> Error | None:
        return self._state.error

    def body(self) -> dict[str, Any]:
        """The terminal Response object, or an in-progress snapshot with the items so far if none came yet."""
        if self._state.terminal is not None:
            return self._state.terminal
        return {**self._state.response("in_progress"), "output": copy.deepcopy(self._state.items)}


def _logprobs(entries: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
    """Responses' logprob entries: token, logprob, bytes, top_logprobs (requested with `top_logprobs`)."""
    return [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": list(e.token.encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, _id, lp in e.top],
        }
        for e in entries
    ]
