"""The protocol registry, encoder half: each protocol's `Codec`, the pure state machines that turn its
delta stream into its wire (streamed and whole) and read its stream back. Read by ingest (the routes),
encoders.reencode (dumps, `met replay --encode-only`) and cli (`met replay --against`).

A protocol's row (ingest.http.surfaces.register) carries its codec; the four built-in codecs are below.
Must not: do I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from encoders import anthropic_messages as messages_enc
from encoders import openai_chat as chat_enc
from encoders import openai_completions as completions_enc
from encoders import openai_responses as response_enc
from encoders import sse_readers
from encoders.fan_in import FanInEncoder
from encoders.frames import Frame
from shared.deltas import StreamDelta
from shared.ir import Protocol, Request

# One streamed payload (parsed JSON) and the deltas read so far → the deltas it carries.
SseReader = Callable[[dict[str, Any], list[StreamDelta]], list[StreamDelta]]


def _no_ping(_: Any) -> Callable[[], list[Frame]]:
    return lambda: []


def _first_body(_request: Request, accumulators: list[Any]) -> dict[str, Any]:
    body: dict[str, Any] = accumulators[0].body()
    return body


@dataclass(frozen=True, slots=True, kw_only=True)
class Codec:
    """A protocol's encoders: `stream_encoder(request)` (deltas → SSE frames), `accumulator(request)` (deltas
    → the whole JSON body, `.feed`, `.body()`, `.error`), how several choices' bodies combine, its keep-alive
    frame, its encoder of a stream of several choices (where it has them) and its stream reader (None: no
    `met replay --against` for it)."""

    protocol: Protocol
    stream_encoder: Callable[[Request], Any]
    accumulator: Callable[[Request], Any]
    combine: Callable[[Request, list[Any]], dict[str, Any]] = _first_body
    ping: Callable[[Any], Callable[[], list[Frame]]] = _no_ping
    choices_encoder: Callable[[Request, list[Request]], FanInEncoder] | None = None
    sse_reader: SseReader | None = None


_CODECS: dict[Protocol, Codec] = {}


def register_codec(codec: Codec) -> Codec:
    _CODECS[codec.protocol] = codec
    return codec


def codec(protocol: Protocol) -> Codec:
    """The codec of a registered protocol (KeyError naming it otherwise)."""
    try:
        return _CODECS[protocol]
    except KeyError:
        raise KeyError(f"protocol {protocol!r} has no codec registered (is its module in --protocol-module?)") from None


CHAT = register_codec(
    Codec(
        protocol=Protocol.OPENAI_CHAT,
        stream_encoder=chat_enc.ChatStreamEncoder,
        accumulator=chat_enc.ChatCompletionAccumulator,
        combine=chat_enc.chat_completion_body,
        choices_encoder=chat_enc.choices_encoder,
        sse_reader=sse_readers.chat,
    )
)
MESSAGES = register_codec(
    Codec(
        protocol=Protocol.ANTHROPIC_MESSAGES,
        stream_encoder=messages_enc.MessagesStreamEncoder,
        accumulator=messages_enc.MessageAccumulator,
        ping=lambda encoder: lambda: [encoder.ping()],
        sse_reader=sse_readers.anthropic,
    )
)
RESPONSES = register_codec(
    Codec(
        protocol=Protocol.OPENAI_RESPONSES,
        stream_encoder=response_enc.ResponsesStreamEncoder,
        accumulator=response_enc.ResponseAccumulator,
        sse_reader=sse_readers.responses,
    )
)
COMPLETIONS = register_codec(
    Codec(
        protocol=Protocol.OPENAI_COMPLETIONS,
        stream_encoder=completions_enc.CompletionStreamEncoder,
        accumulator=completions_enc.CompletionAccumulator,
        combine=completions_enc.completion_body,
        choices_encoder=completions_enc.choices_encoder,
        sse_reader=sse_readers.completions,
    )
)
