"""`StreamDelta`: the provider-neutral events a worker appends to a request's delta stream.

Owns: the delta types, `FinishReason` (with the one per-protocol mapping table) and `Usage`.
Every delta carries `token_ids` (the tokens that produced it) and `attempt` (which claim of the
request wrote it): recovery needs both; encoders strip them unless the client asked for token ids.
Must not: know wire formats (encoders/) or storage field names (codec).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(enum.StrEnum):
    """Why generation ended. The single mapping table every encoder reads:

    ============== ================== ================ ===============================
    FinishReason   OpenAI chat        Anthropic        Responses status (reason)
    ============== ================== ================ ===============================
    STOP           "stop"             "end_turn"       completed
    STOP_SEQUENCE  "stop"             "stop_sequence"  completed
    LENGTH         "length"           "max_tokens"     incomplete (max_output_tokens)
    TOOL_CALLS     "tool_calls"       "tool_use"       completed
    REFUSAL        "content_filter"   "refusal"        incomplete (content_filter)
    CANCELLED      "stop"             "end_turn"       cancelled
    TIMEOUT        "length"           "max_tokens"     incomplete (max_output_tokens)
    ============== ================== ================ ===============================

    CANCELLED only reaches clients that are gone or that replay a dump; TIMEOUT is the per-request
    deadline, reported like a length cut since no protocol has a better word for it.

    A cancel has two sources, told apart by the cancel flag's value (shared/keys.py). A client that
    disconnected gets the quiet CANCELLED finish above, which reaches nobody. An operator's cancel
    (`met top`, `c`) is something the still-connected client must see as what it is, so the worker
    ends the request with `Error(kind=INTERNAL, message="...cancelled by the server's operator.")`,
    the same terminal shape as a server-side timeout with no worker finishing (`Error(kind=TIMEOUT)`,
    encoders/wire.py). Each protocol shows an Error thus (the official SDKs raise on each):

    ======================= ============================================== =========================
    OpenAI chat             Anthropic                                      Responses
    ======================= ============================================== =========================
    stream: a chunk         stream: ``event: error``,                      stream: ``response.failed``
    ``{"error": {message,   ``{"type":"error","error":{"type":"api_error", (status ``failed``,
    type: "api_error"}}``   "message"}}``; non-stream: HTTP 500 with that  ``error.code``
    then ``[DONE]``;        body                                           ``server_error``); no
    non-stream: HTTP 500                                                   stream: HTTP 500 error
    ``{"error": {...}}``                                                   body
    ======================= ============================================== =========================

    Responses' ``response.incomplete`` is not used for it: its only reasons are ``max_output_tokens``
    and ``content_filter``, neither of which is true of a cancel.
    """

    STOP = "stop"
    STOP_SEQUENCE = "stop_sequence"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    REFUSAL = "refusal"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"

    @property
    def openai(self) -> str:
        return _OPENAI[self]

    @property
    def anthropic(self) -> str:
        return _ANTHROPIC[self]

    @property
    def responses_status(self) -> str:
        return _RESPONSES[self][0]

    @property
    def responses_incomplete_reason(self) -> str | None:
        return _RESPONSES[self][1]


_OPENAI = {
    FinishReason.STOP: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.TOOL_CALLS: "tool_calls",
    FinishReason.REFUSAL: "content_filter",
    FinishReason.CANCELLED: "stop",
    FinishReason.TIMEOUT: "length",
}
_ANTHROPIC = {
    FinishReason.STOP: "end_turn",
    FinishReason.STOP_SEQUENCE: "stop_sequence",
    FinishReason.LENGTH: "max_tokens",
    FinishReason.TOOL_CALLS: "tool_use",
    FinishReason.REFUSAL: "refusal",
    FinishReason.CANCELLED: "end_turn",
    FinishReason.TIMEOUT: "max_tokens",
}
_RESPONSES: dict[FinishReason, tuple[str, str | None]] = {
    FinishReason.STOP: ("completed", None),
    FinishReason.STOP_SEQUENCE: ("completed", None),
    FinishReason.LENGTH: ("incomplete", "max_output_tokens"),
    FinishReason.TOOL_CALLS: ("completed", None),
    FinishReason.REFUSAL: ("incomplete", "content_filter"),
    FinishReason.CANCELLED: ("cancelled", None),
    FinishReason.TIMEOUT: ("incomplete", "max_output_tokens"),
}


class ErrorKind(enum.StrEnum):
    """What went wrong after a request was accepted (mapped to each protocol's error type)."""

    INTERNAL = "api_error"
    OVERLOADED = "overloaded_error"
    INVALID_REQUEST = "invalid_request_error"
    TIMEOUT = "timeout_error"


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLogprob:
    token: str
    token_id: int
    logprob: float
    top: tuple[tuple[str, int, float], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Content:
    """Answer text. `prompt_logprobs` (asked by `SamplingParams.prompt_logprobs`) rides on a first,
    text-less Content written when the request is admitted: one entry per prompt token, the first of
    which has nothing before it (its `logprob` is 0.0 and means nothing; encoders show null).
    `cached_tokens` (the prompt tokens read from the prefix cache) rides on the request's first generated
    delta, a text-less Content where the first is not text, so a stream's opening usage (Anthropic's
    `message_start`) splits the prompt as its final usage does; None on every other delta."""

    text: str
    token_ids: tuple[int, ...] = ()
    attempt: int = 1
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    cached_tokens: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Reasoning:
    """Reasoning text. The span's last delta (text "") carries `sealed`: the whole span's text sealed
    with the deployment's key (`shared.seal`), sent as Anthropic's `signature` and Responses'
    `encrypted_content`, and opened again when a client sends it back."""

    text: str
    sealed: str = ""
    token_ids: tuple[int, ...] = ()
    attempt: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallStart:
    index: int
    id: str
    name: str
    token_ids: tuple[int, ...] = ()
    attempt: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallArgs:
    index: int
    arguments: str
    token_ids: tuple[int, ...] = ()
    attempt: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Refusal:
    text: str
    token_ids: tuple[int, ...] = ()
    attempt: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Finish:
    """Terminal. `token_ids` holds generated tokens not attached to an earlier delta (held-back text);
    `at` the wall-clock time (Unix seconds) the producer finished the request (0.0: not recorded, as in
    dumps from before it was), shown as a Responses object's `completed_at`."""

    reason: FinishReason
    usage: Usage
    matched_stop: str | None = None
    token_ids: tuple[int, ...] = ()
    attempt: int = 1
    at: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Error:
    """Terminal. `message` is safe to show a client; no stack traces, no secrets."""

    message: str
    kind: ErrorKind = ErrorKind.INTERNAL
    attempt: int = 1


StreamDelta = Content | Reasoning | ToolCallStart | ToolCallArgs | Refusal | Finish | Error
TERMINAL = (Finish, Error)


Batch = list[StreamDelta]  # deltas read from a stream together (encoders.wire encodes and writes them as one)

def is_terminal(delta: StreamDelta) -> bool:
    return isinstance(delta, TERMINAL)
