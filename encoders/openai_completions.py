"""OpenAI legacy Completions: deltas → `text_completion` chunks, or one `text_completion` body.

Pure: input is the request IR and its deltas, nothing else. Chunks share id/created/model and carry
`choices: [{index, text, logprobs, finish_reason}]`; the finish comes on a chunk of its own; with
`stream_options.include_usage` every chunk has `usage: null` and a last one has `choices: []` and the
usage; the stream ends with `data: [DONE]`. An Error delta becomes `data: {"error": {...}}` before
`[DONE]`, as on chat. `echo` puts the prompt's text before the first generated text (the stream's
first chunk), and with logprobs the prompt's tokens lead the logprobs (the first one null, as
OpenAI's are; from the worker's text-less first Content). Logprobs take the legacy shape: `{tokens, token_logprobs, top_logprobs (one
token → logprob dict per position, the sampled token always in it, so up to k+1 entries), text_offset
(each token's offset in the choice's text, the echoed prompt included)}`.

With several prompts and `best_of`, the body keeps, per prompt, the `n` candidates with the highest
cumulative logprob, indexed `prompt_index * n + i` as OpenAI does; usage counts every generated
candidate (they were all computed) and each prompt once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from encoders.fan_in import FanInEncoder
from encoders.frames import Frame, json_frame
from encoders.openai_chat import DoneOnce, error_json, usage_json
from shared.deltas import Content, Error, Finish, StreamDelta, TokenLogprob, Usage
from shared.ir import Request, TextCompletion

FLOOR = -9999.0  # JSON has no -inf: a token the sampler ruled out is reported at this logprob, as vLLM does


def completion_id(request: Request) -> str:
    return f"cmpl-{request.id}"


def _spec(request: Request) -> TextCompletion:
    return request.completion or TextCompletion()


def legacy_logprobs(
    entries: tuple[TokenLogprob, ...] | list[TokenLogprob], *, offset: int, top: int, prompt: tuple[TokenLogprob, ...] = ()
) -> tuple[dict[str, Any], int]:
    """The legacy logprobs object for these tokens, their text starting at `offset`; and the offset
    after them. `prompt` (echo): the prompt's tokens first, from offset 0, the first with null
    logprob and alternatives (nothing precedes it); then `entries` from `offset` (the prompt's length)."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    prompt_offset = 0
    for i, e in enumerate(prompt):
        _append(out, e, top=top, offset=prompt_offset, scored=i > 0)
        prompt_offset += len(e.token)
    for e in entries:
        _append(out, e, top=top, offset=offset, scored=True)
        offset += len(e.token)
    return out, offset


def _append(out: dict[str, list[Any]], e: TokenLogprob, *, top: int, offset: int, scored: bool) -> None:
    alternatives = {t: max(lp, FLOOR) for t, _id, lp in e.top[:top]}
    alternatives.setdefault(e.token, max(e.logprob, FLOOR))
    out["tokens"].append(e.token)
    out["token_logprobs"].append(max(e.logprob, FLOOR) if scored else None)
    out["top_logprobs"].append(alternatives if scored else None)
    out["text_offset"].append(offset)


class CompletionStreamEncoder(DoneOnce):
    """Deltas → SSE frames for one streaming completion (one prompt, one choice: `index`; `closes=False`:
    one choice of several, whose stream is closed by encoders.fan_in)."""

    def __init__(self, request: Request, *, index: int = 0, closes: bool = True) -> None:
        self._request = request
        self._index = index
        self._closes = closes
        self._base = {"id": completion_id(request), "object": "text_completion", "created": int(request.created), "model": request.model, "system_fingerprint": None}
        self._echo_pending = _spec(request).echo
        self._offset = 0
        self._first = True
        self._done = False

    def _chunk(self, text: str, *, logprobs: dict[str, Any] | None = None, finish_reason: str | None = None, token_ids: tuple[int, ...] = ()) -> Frame:
        choice: dict[str, Any] = {"index": self._index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if self._request.return_token_ids:
            if self._first:
                choice["prompt_token_ids"] = list(self._request.prompt_token_ids)
            choice["token_ids"] = list(token_ids)
        self._first = False
        payload: dict[str, Any] = {**self._base, "choices": [choice]}
        if self._request.include_usage:
            payload["usage"] = None
        return json_frame(payload)

    def opening(self) -> list[Frame]:
        """Nothing goes before a choice's first text (the echo rides on it)."""
        return []

    def _echo(self) -> str:
        if not self._echo_pending:
            return ""
        self._echo_pending = False
        self._offset = len(_spec(self._request).text)
        return _spec(self._request).text

    def feed(self, delta: StreamDelta) -> list[Frame]:
        if self._done:
            return []
        if isinstance(delta, Content):
            return self._content(delta)
        if isinstance(delta, Finish):
            frames = [self._chunk(self._echo(), finish_reason=delta.reason.openai, token_ids=delta.token_ids)]
            return frames + self.close(delta.usage) if self._closes else frames
        if isinstance(delta, Error):
            return [json_frame(error_json(delta)), *(self.close(None) if self._closes else [])]
        return []  # no tools, reasoning or refusals on a raw completion: the worker writes none

    def _content(self, delta: Content) -> list[Frame]:
        prompt = delta.prompt_logprobs if self._echo_pending else ()  # once: a resumed attempt may score the prompt again
        text = self._echo() + delta.text
        logprobs = None
        top = _spec(self._request).logprobs
        if top is not None and (prompt or delta.logprobs or text):
            logprobs, self._offset = legacy_logprobs(delta.logprobs, offset=self._offset, top=top, prompt=prompt)
        if not (text or delta.token_ids or logprobs):
            return []
        return [self._chunk(text, logprobs=logprobs, token_ids=delta.token_ids)]


class CompletionAccumulator:
    """Deltas → one choice of a non-streaming completion (one candidate of one prompt)."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._prompt_logprobs: tuple[TokenLogprob, ...] = ()
        self._token_ids: list[int] = []
        self.finish: Finish | None = None
        self.error: Error | None = None

    def feed(self, delta: StreamDelta) -> None:
        if isinstance(delta, Content):
            self._text.append(delta.text)
            self._logprobs.extend(delta.logprobs)
            self._prompt_logprobs = self._prompt_logprobs or delta.prompt_logprobs
        elif isinstance(delta, Finish):
            self.finish = delta
        elif isinstance(delta, Error):
            self.error = delta
        if not isinstance(delta, Error):
            self._token_ids.extend(delta.token_ids)

    @property
    def cumulative_logprob(self) -> float:
        return sum(e.logprob for e in self._logprobs)

    @property
    def usage(self) -> Usage:
        return self.finish.usage if self.finish else Usage()

    def choice(self, index: int) -> dict[str, Any]:
        spec = _spec(self.request)
        echo = spec.text if spec.echo else ""
        prompt = self._prompt_logprobs if spec.echo else ()
        logprobs = None if spec.logprobs is None else legacy_logprobs(self._logprobs, offset=len(echo), top=spec.logprobs, prompt=prompt)[0]
        choice: dict[str, Any] = {"index": index, "text": echo + "".join(self._text), "logprobs": logprobs, "finish_reason": self.finish.reason.openai if self.finish else None}
        if self.request.return_token_ids:
            choice["prompt_token_ids"] = list(self.request.prompt_token_ids)
            choice["token_ids"] = self._token_ids
        return choice

    def body(self) -> dict[str, Any]:
        return completion_body(self.request, [self])


def prompts_usage(usages: list[tuple[int, Usage]]) -> Usage:
    """The usage of several prompts' candidates: each prompt once, every candidate's completion."""
    first: dict[int, Usage] = {}
    for prompt_index, usage in usages:
        first.setdefault(prompt_index, usage)
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in first.values()),
        completion_tokens=sum(u.completion_tokens for _, u in usages),
        cached_tokens=sum(u.cached_tokens for u in first.values()),
    )


def completion_body(request: Request, accs: list[CompletionAccumulator]) -> dict[str, Any]:
    """The `text_completion` body over every prompt's candidates (in prompt order, as fanned out)."""
    groups: dict[int, list[CompletionAccumulator]] = {}
    for acc in accs:
        groups.setdefault(_spec(acc.request).prompt_index, []).append(acc)
    n = _spec(request).n
    choices: list[dict[str, Any]] = []
    for prompt_index in sorted(groups):
        candidates = groups[prompt_index]
        if len(candidates) > n:  # best_of: the n most likely
            candidates = sorted(candidates, key=lambda a: a.cumulative_logprob, reverse=True)[:n]
        choices.extend(acc.choice(prompt_index * n + i) for i, acc in enumerate(candidates))
    usage = prompts_usage([(_spec(a.request).prompt_index, a.usage) for a in accs])
    return {
        "id": completion_id(request),
        "object": "text_completion",
        "created": int(request.created),
        "model": request.model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": usage_json(usage),
    }


def choices_encoder(request: Request, parts: list[Request]) -> FanInEncoder:
    """The stream of several prompts' choices (n each; `best_of` is not streamed): part i is choice
    i (`prompt_index * n + j`, the fan-out's order), every chunk under the request's id."""
    members = [CompletionStreamEncoder(replace(part, id=request.id), index=i, closes=False) for i, part in enumerate(parts)]
    return FanInEncoder(members, lambda usages: prompts_usage([(_spec(p).prompt_index, u) for p, u in zip(parts, usages, strict=True)]))
