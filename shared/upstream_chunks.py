"""The upstream's chat stream → `StreamDelta`s: a pure parser (bytes in, deltas out; no I/O).

A gateway worker (workers/gateway.py) feeds this the raw bytes of an OpenAI-compatible
`/v1/chat/completions` stream (`stream: true`, `stream_options.include_usage`), in whatever pieces the
socket delivers, and appends what comes out to the request's delta stream:

- `delta.content` → Content; `delta.reasoning_content` / `delta.reasoning` → Reasoning;
  `delta.refusal` → Refusal; `choices[0].logprobs.content` rides on the Content it belongs to.
- `delta.tool_calls[]` → ToolCallStart (once per upstream `index`, numbered 0, 1, … in order of first
  appearance) and ToolCallArgs (every fragment, by index; interleaved calls stay interleaved: the
  encoders place arguments by index, encoders/blocks.py). Fragments that arrive before their call's
  name are held until the name comes, never dropped.
- `finish_reason` + the usage chunk → one Finish, written at `data: [DONE]` (or at the end of the bytes
  once both were seen); vLLM's `stop_reason` names the matched stop sequence.
- An `{"error": …}` payload, `event: error`, a payload that is not JSON, or bytes that end before the
  stream finished (a cut mid-event included) → one Error. Nothing follows a terminal delta.

The SSE framing (lines, `data:` fields joined, dispatch on a blank line, `:` comments) is hand-written
here because this module must stay pure: httpx-sse decodes from a live httpx response and keeps its
line decoder private, and the framing itself is a dozen lines of the HTML spec's event-stream grammar.
Must not: open sockets, read Redis, or know about attempts' fencing (the caller stamps `attempt`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    TokenLogprob,
    ToolCallArgs,
    ToolCallStart,
    Usage,
)

_FINISH = {
    "stop": FinishReason.STOP,
    "eos": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "tool_calls": FinishReason.TOOL_CALLS,
    "function_call": FinishReason.TOOL_CALLS,
    "content_filter": FinishReason.REFUSAL,
}
CUT_MESSAGE = "The upstream's stream ended before the response was complete."


@dataclass
class _Call:
    index: int  # ours: 0, 1, … in order of first appearance
    id: str = ""
    name: str = ""
    started: bool = False
    held: list[str] = field(default_factory=list)  # argument fragments that came before the name


@dataclass
class UpstreamStream:
    """One upstream response. `feed(bytes)` → deltas; `end()` when the bytes stop → the terminal delta
    if none was produced yet. `stops`: the request's stop sequences (to recognise vLLM's `stop_reason`)."""

    attempt: int = 1
    stops: tuple[str, ...] = ()
    call_id_prefix: str = "call"
    done: bool = False
    _buffer: bytes = b""
    _data: list[str] = field(default_factory=list)
    _event: str = ""
    _calls: dict[int, _Call] = field(default_factory=dict)
    _finish: FinishReason | None = None
    _matched: str | None = None
    _usage: Usage | None = None

    @property
    def saw_usage(self) -> bool:
        """The upstream sent a usage chunk (llama-cpp-python's server, for one, ignores `include_usage`)."""
        return self._usage is not None

    def feed(self, data: bytes) -> list[StreamDelta]:
        out: list[StreamDelta] = []
        self._buffer += data
        while not self.done:
            line, sep, rest = _split_line(self._buffer)
            if not sep:
                break
            self._buffer = rest
            self._line(line.decode("utf-8", errors="replace"), out)
        return out

    def end(self) -> list[StreamDelta]:
        """The bytes ended (the upstream closed, or the connection broke)."""
        if self.done:
            return []
        out: list[StreamDelta] = []
        if self._finish is not None and self._usage is not None and not self._buffer.strip() and not self._data:
            self._terminate(self._finish_delta(), out)  # complete, only the `[DONE]` sentinel missing
        else:
            self._terminate(Error(message=CUT_MESSAGE, kind=ErrorKind.INTERNAL, attempt=self.attempt), out)
        return out

    # ---- SSE framing ----------------------------------------------------------------------------

    def _line(self, line: str, out: list[StreamDelta]) -> None:
        if not line:
            data, event = "\n".join(self._data), self._event
            self._data, self._event = [], ""
            if data or event:
                self._dispatch(event, data, out)
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value

    def _dispatch(self, event: str, data: str, out: list[StreamDelta]) -> None:
        if data.strip() == "[DONE]":
            self._terminate(self._finish_delta() if self._finish is not None else _cut(self.attempt), out)
            return
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            self._terminate(Error(message="The upstream sent an event that is not JSON.", attempt=self.attempt), out)
            return
        if event == "error" or (isinstance(chunk, dict) and chunk.get("error")):
            self._terminate(Error(message=f"The upstream failed: {upstream_error_message(chunk)}", attempt=self.attempt), out)
            return
        if isinstance(chunk, dict):
            self._chunk(chunk, out)

    # ---- chunks ---------------------------------------------------------------------------------

    def _chunk(self, chunk: dict[str, Any], out: list[StreamDelta]) -> None:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage = _usage(usage)
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # n > 1 never reaches an upstream: ingest fans it out into separate requests
            delta = choice.get("delta") or {}
            self._delta(delta, _logprobs(choice.get("logprobs")), out)
            reason = choice.get("finish_reason")
            if reason:
                self._finish = _FINISH.get(str(reason), FinishReason.STOP)
                stop_reason = choice.get("stop_reason")
                if self._finish is FinishReason.STOP and isinstance(stop_reason, str) and stop_reason in self.stops:
                    self._finish, self._matched = FinishReason.STOP_SEQUENCE, stop_reason

    def _delta(self, delta: dict[str, Any], logprobs: tuple[TokenLogprob, ...], out: list[StreamDelta]) -> None:
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            out.append(Reasoning(text=reasoning, attempt=self.attempt))
        content = delta.get("content")
        if isinstance(content, str) and (content or logprobs):
            out.append(Content(text=content, logprobs=logprobs, attempt=self.attempt))
        refusal = delta.get("refusal")
        if isinstance(refusal, str) and refusal:
            out.append(Refusal(text=refusal, attempt=self.attempt))
        for call in delta.get("tool_calls") or []:
            if isinstance(call, dict):
                self._tool_call(call, out)

    def _tool_call(self, fragment: dict[str, Any], out: list[StreamDelta]) -> None:
        key = int(fragment.get("index", 0) or 0)
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = _Call(index=len(self._calls))
        function = fragment.get("function") or {}
        call.id = call.id or str(fragment.get("id") or "")
        call.name = call.name or str(function.get("name") or "")
        arguments = function.get("arguments")
        if isinstance(arguments, dict):  # a few servers send the arguments parsed
            arguments = orjson.dumps(arguments).decode()
        if isinstance(arguments, str) and arguments:
            call.held.append(arguments)
        if not call.started and call.name:
            call.started = True
            out.append(ToolCallStart(index=call.index, id=call.id or f"{self.call_id_prefix}_{call.index}", name=call.name, attempt=self.attempt))
        if call.started and call.held:
            out.append(ToolCallArgs(index=call.index, arguments="".join(call.held), attempt=self.attempt))
            call.held.clear()

    def _finish_delta(self) -> Finish:
        reason = self._finish or FinishReason.STOP
        if reason in (FinishReason.STOP, FinishReason.STOP_SEQUENCE) and any(c.started for c in self._calls.values()):
            reason = FinishReason.TOOL_CALLS  # some servers say "stop" after a forced (named) tool call
        return Finish(reason=reason, usage=self._usage or Usage(), matched_stop=self._matched, attempt=self.attempt)

    def _terminate(self, delta: Finish | Error, out: list[StreamDelta]) -> None:
        self.done = True
        out.append(delta)


def _split_line(buffer: bytes) -> tuple[bytes, bytes, bytes]:
    """The first line of `buffer` and what follows; SSE lines end in \\n, \\r\\n or \\r."""
    for i, byte in enumerate(buffer):
        if byte == 0x0A:
            return buffer[:i], b"\n", buffer[i + 1 :]
        if byte == 0x0D:
            if i + 1 == len(buffer):
                return buffer, b"", b""  # a \r at the end may be the first half of \r\n: wait
            return buffer[:i], b"\r", buffer[i + 2 :] if buffer[i + 1] == 0x0A else buffer[i + 1 :]
    return buffer, b"", b""


def _cut(attempt: int) -> Error:
    return Error(message=CUT_MESSAGE, kind=ErrorKind.INTERNAL, attempt=attempt)


def upstream_error_message(payload: Any) -> str:
    """The message of an OpenAI-shaped error body (`{"error": {"message": …}}`, or `{"error": "…"}`), cut short."""
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    if isinstance(error, dict):
        error = error.get("message") or error.get("type") or error
    text = error if isinstance(error, str) else orjson.dumps(error).decode()
    return text[:300]


def refusal(status: int, body: bytes) -> tuple[ErrorKind, str]:
    """What a client is told when the upstream answers a request with an error status, in our own words:
    overload (429, 503) is ours to report as overload (the client may retry); the upstream's own 4xx
    message (a bad parameter, a prompt too long) is the client's to read, cut short; a refused credential
    (401, 403) and a 5xx are the gateway's problem, not the client's, so their bodies (which may carry
    the upstream's internals) stay in the gateway's log and the client gets the status only."""
    if status in (429, 503):
        return ErrorKind.OVERLOADED, f"The upstream is overloaded ({status}); retry shortly."
    if status in (401, 403):
        return ErrorKind.INTERNAL, f"The upstream refused the gateway's credentials ({status}); the server's operator must fix its key."
    if status >= 500:
        return ErrorKind.INTERNAL, f"The upstream failed ({status})."
    try:
        detail = upstream_error_message(orjson.loads(body))
    except orjson.JSONDecodeError:
        detail = body.decode(errors="replace")[:300]
    return ErrorKind.INVALID_REQUEST, f"The upstream refused the request ({status}): {detail}"


def _usage(raw: dict[str, Any]) -> Usage:
    prompt_details = raw.get("prompt_tokens_details") or {}
    completion_details = raw.get("completion_tokens_details") or {}
    return Usage(
        prompt_tokens=int(raw.get("prompt_tokens") or 0),
        completion_tokens=int(raw.get("completion_tokens") or 0),
        cached_tokens=int(prompt_details.get("cached_tokens") or 0) if isinstance(prompt_details, dict) else 0,
        reasoning_tokens=int(completion_details.get("reasoning_tokens") or 0) if isinstance(completion_details, dict) else 0,
    )


def _logprobs(raw: Any) -> tuple[TokenLogprob, ...]:
    """`choices[0].logprobs.content` → TokenLogprob entries. The upstream's token ids are not sent (its
    tokenizer is not ours): `token_id` is -1."""
    if not isinstance(raw, dict) or not isinstance(raw.get("content"), list):
        return ()
    out = []
    for entry in raw["content"]:
        if not isinstance(entry, dict):
            continue
        top = tuple((str(t.get("token", "")), -1, float(t.get("logprob", 0.0))) for t in entry.get("top_logprobs") or [] if isinstance(t, dict))
        out.append(TokenLogprob(token=str(entry.get("token", "")), token_id=-1, logprob=float(entry.get("logprob", 0.0)), top=top))
    return tuple(out)
