"""OpenAI Chat Completions: deltas → `chat.completion.chunk` frames, or one `chat.completion` body.

Pure: input is the request IR and its deltas, nothing else. Chunks share id/created/model; the first
carries the role; a tool call's first chunk carries index, id, type and name; with
`stream_options.include_usage` every chunk has `usage: null` and a last chunk has `choices: []` and
the usage; the stream ends with `data: [DONE]`. An Error delta becomes `data: {"error": {...}}`
before `[DONE]`, as vLLM does. Reasoning goes out as `reasoning_content` (DeepSeek's and vLLM's
long-standing name) and, with the same text, as `reasoning` (the name newer vLLM and OpenRouter use),
so a client reading either name gets it; `completion_tokens_details.reasoning_tokens` counts it.
A finish on a stop sequence also says which one, as vLLM's `stop_reason` (so a gateway in front of this
server can report Anthropic's `stop_sequence`); other finishes carry no `stop_reason`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from encoders.fan_in import FanInEncoder
from encoders.frames import Frame, json_frame
from shared.deltas import (
    Content,
    Error,
    Finish,
    Reasoning,
    Refusal,
    StreamDelta,
    TokenLogprob,
    ToolCallArgs,
    ToolCallStart,
    Usage,
)
from shared.ir import Request

DONE = Frame("[DONE]")


class DoneOnce:
    """The close of a stream that ends with `data: [DONE]` (chat and legacy completions): with
    `include_usage`, a last chunk with `choices: []` and the usage, then `[DONE]`. A stream of several
    choices (n > 1, several prompts) is closed once for all of them (encoders.fan_in); its members
    are built with `closes=False`."""

    _done = False
    _base: dict[str, Any]
    _request: Request

    def close(self, usage: Usage | None) -> list[Frame]:
        """The usage chunk (when asked for, and there is a usage: not after an error), then `[DONE]`."""
        frames = (
            [json_frame({**self._base, "choices": [], "usage": usage_json(usage)})]
            if usage is not None and self._request.include_usage
            else []
        )
        return frames + self.finish()

    def finish(self) -> list[Frame]:
        """Close the stream: `[DONE]` once; later calls return nothing."""
        if self._done:
            return []
        self._done = True
        return [DONE]


def stop_reason(finish: Finish) -> dict[str, str]:
    """vLLM's `stop_reason` field of a choice: the stop sequence that ended it, when one did."""
    return {"stop_reason": finish.matched_stop} if finish.matched_stop is not None else {}


def completion_id(request: Request) -> str:
    return f"chatcmpl-{request.id}"


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def error_json(error: Error) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.kind.value, "param": None, "code": None}}


def logprobs_json(entries: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token.encode()),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, _id, lp in e.top],
            }
            for e in entries
        ]
    }


class ChatStreamEncoder(DoneOnce):
    """Deltas → SSE frames for one streaming chat request (choice `index`; `closes=False`: one choice
    of several, whose stream is closed by encoders.fan_in)."""

    def __init__(self, request: Request, *, index: int = 0, closes: bool = True) -> None:
        self._request = request
        self._index = index
        self._closes = closes
        self._base = {
            "id": completion_id(request),
            "object": "chat.completion.chunk",
            "created": int(request.created),
            "model": request.model,
            "system_fingerprint": None,
        }
        self._role_sent = False
        self._done = False
        self._text_template: tuple[str, str] | None = None  # a plain text chunk's JSON around its content

    def _chunk(self, delta: dict[str, Any], *, finish_reason: str | None = None, extra: dict[str, Any] | None = None) -> Frame:
        choice: dict[str, Any] = {"index": self._index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if extra:
            choice.update(extra)
        payload = {**self._base, "choices": [choice]}
        if self._request.include_usage:
            payload["usage"] = None
        return json_frame(payload)

    def opening(self) -> list[Frame]:
        """The first chunk (the role), once; a stream of several choices sends every choice's first."""
        return self._role_frames()

    def _role_frames(self) -> list[Frame]:
        if self._role_sent:
            return []
        self._role_sent = True
        extra = {"prompt_token_ids": list(self._request.prompt_token_ids)} if self._request.return_token_ids else None
        return [self._chunk({"role": "assistant", "content": ""}, extra=extra)]

    def _token_extra(self, token_ids: tuple[int, ...]) -> dict[str, Any] | None:
        return {"token_ids": list(token_ids)} if self._request.return_token_ids else None

    def feed(self, delta: StreamDelta) -> list[Frame]:
        if self._done:
            return []
        frames = self._role_frames()
        if isinstance(delta, Content | Reasoning):
            frames += self._text_chunk(delta)
        elif isinstance(delta, Refusal):
            frames.append(self._chunk({"refusal": delta.text}, extra=self._token_extra(delta.token_ids)))
        elif isinstance(delta, ToolCallStart):
            call = {"index": delta.index, "id": delta.id, "type": "function", "function": {"name": delta.name, "arguments": ""}}
            frames.append(self._chunk({"tool_calls": [call]}, extra=self._token_extra(delta.token_ids)))
        elif isinstance(delta, ToolCallArgs):
            call = {"index": delta.index, "function": {"arguments": delta.arguments}}
            frames.append(self._chunk({"tool_calls": [call]}, extra=self._token_extra(delta.token_ids)))
        elif isinstance(delta, Finish):
            frames.append(self._chunk({}, finish_reason=delta.reason.openai, extra={**stop_reason(delta), **(self._token_extra(delta.token_ids) or {})}))
            if self._closes:
                frames.extend(self.close(delta.usage))
        elif isinstance(delta, Error):
            frames.append(json_frame(error_json(delta)))
            if self._closes:
                frames.extend(self.close(None))
        return frames

    def _text_chunk(self, delta: Content | Reasoning) -> list[Frame]:
        """A text chunk; none for a delta with neither text nor token ids to carry (a span's sealed
        delta: chat has no field for the seal)."""
        extra = self._token_extra(delta.token_ids) or {}
        if isinstance(delta, Content) and delta.logprobs:
            extra["logprobs"] = logprobs_json(delta.logprobs)
        if not (delta.text or extra):
            return []
        if not extra and isinstance(delta, Content):
            return [self._plain_text(delta.text)]
        fields = {"content": delta.text} if isinstance(delta, Content) else {"reasoning_content": delta.text, "reasoning": delta.text}
        return [self._chunk(fields, extra=extra or None)]

    def _plain_text(self, text: str) -> Frame:
        """The most common chunk (text, nothing else), the same bytes as `_chunk({"content": text})`: the
        rest of its JSON is the same for every token, so it is rendered once and the text spliced in."""
        if self._text_template is None:
            marker = orjson.dumps("\x00").decode()  # a string no JSON text of ours ends with, but this one
            data = self._chunk({"content": "\x00"}).data
            cut = data.rindex(marker)  # the content is the last string in the chunk (a model name may hold anything)
            self._text_template = (data[:cut], data[cut + len(marker) :])
        before, after = self._text_template
        return Frame(before + orjson.dumps(text).decode() + after)


class ChatCompletionAccumulator:
    """Deltas → the one `chat.completion` body of a non-streaming request (n choices by index)."""

    def __init__(self, request: Request) -> None:
        self._request = request
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._refusal: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self.finish: Finish | None = None
        self.error: Error | None = None

    def feed(self, delta: StreamDelta) -> None:
        if isinstance(delta, Content):
            self._text.append(delta.text)
            self._logprobs.extend(delta.logprobs)
        elif isinstance(delta, Reasoning):
            self._reasoning.append(delta.text)
        elif isinstance(delta, Refusal):
            self._refusal.append(delta.text)
        elif isinstance(delta, ToolCallStart):
            self._calls[delta.index] = {"id": delta.id, "type": "function", "function": {"name": delta.name, "arguments": ""}}
        elif isinstance(delta, ToolCallArgs):
            self._calls[delta.index]["function"]["arguments"] += delta.arguments
        elif isinstance(delta, Finish):
            self.finish = delta
        elif isinstance(delta, Error):
            self.error = delta
        if not isinstance(delta, Error):
            self._token_ids.extend(delta.token_ids)

    def choice(self, index: int = 0) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._text) if self._text or not self._calls else None}
        message["refusal"] = "".join(self._refusal) if self._refusal else None
        if self._reasoning:
            message["reasoning_content"] = message["reasoning"] = "".join(self._reasoning)
        if self._calls:
            message["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "logprobs": logprobs_json(tuple(self._logprobs)) if self._request.sampling.logprobs else None,
            "finish_reason": self.finish.reason.openai if self.finish else None,
            **(stop_reason(self.finish) if self.finish else {}),
        }
        if self._request.return_token_ids:
            choice["token_ids"] = self._token_ids
        return choice

    @property
    def usage(self) -> Usage:
        return self.finish.usage if self.finish else Usage()

    def body(self) -> dict[str, Any]:
        return chat_completion_body(self._request, [self])


def choices_usage(usages: list[Usage]) -> Usage:
    """The usage of n choices of one prompt: the prompt once, the completion tokens of every choice."""
    first = usages[0] if usages else Usage()
    return Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=first.cached_tokens,
        reasoning_tokens=sum(u.reasoning_tokens for u in usages),
    )


def chat_completion_body(request: Request, choices: list[ChatCompletionAccumulator]) -> dict[str, Any]:
    """Assemble the `chat.completion` body; usage sums completion tokens over the n choices."""
    usage = choices_usage([c.usage for c in choices])
    body: dict[str, Any] = {
        "id": completion_id(request),
        "object": "chat.completion",
        "created": int(request.created),
        "model": request.model,
        "system_fingerprint": None,
        "choices": [acc.choice(i) for i, acc in enumerate(choices)],
        "usage": usage_json(usage),
    }
    if request.return_token_ids:
        body["prompt_token_ids"] = list(request.prompt_token_ids)
    return body


def choices_encoder(request: Request, parts: list[Request]) -> FanInEncoder:
    """The stream of n > 1 choices: choice i from part i, every chunk under the request's id."""
    members = [ChatStreamEncoder(replace(part, id=request.id), index=i, closes=False) for i, part in enumerate(parts)]
    return FanInEncoder(members, choices_usage)
