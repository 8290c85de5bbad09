"""The generation routes' per-protocol rows: everything that differs between protocols on a generation
(the path, the parser, the encoders, keep-alive, how n choices combine, the protocol's own state).

A protocol is its parser (`ingest/<protocol>.py`), its encoder (`encoders/<protocol>.py`) and its row here.
Must not: do I/O itself (a row's `session` is the protocol's own store, called by the app).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from typing import Protocol as Protocol_

from redis.asyncio import Redis

from encoders import anthropic_messages as messages_enc
from encoders import openai_chat as chat_enc
from encoders import openai_completions as completions_enc
from encoders import openai_responses as response_enc
from encoders.fan_in import FanInEncoder
from encoders.frames import Frame
from ingest import anthropic_messages, openai_chat, openai_completions, openai_responses, responses_store
from ingest.responses_store import Saver
from models.prompt import PromptRenderer
from shared.deltas import Error, StreamDelta
from shared.ir import Protocol, Request
from shared.settings import Settings


class Accumulator(Protocol_):
    @property
    def error(self) -> Error | None: ...

    def feed(self, delta: StreamDelta) -> None: ...
    def body(self) -> dict[str, Any]: ...


# (redis, settings, body, parsed request, caller id) → (the request to queue, its saver or None)
Session = Callable[[Redis, Settings, Any, Request, str], Awaitable[tuple[Request, Saver | None]]]


async def _no_session(_redis: Redis, _settings: Settings, _body: Any, request: Request, _caller: str) -> tuple[Request, Saver | None]:
    return request, None


def _no_ping(_: Any) -> Callable[[], list[Frame]]:
    return lambda: []


@dataclass(frozen=True, slots=True, kw_only=True)
class Surface:
    """Everything that differs between protocols on the generation routes: the path, the parser, the
    encoders, keep-alive, how n choices combine, and the protocol's own state around a generation
    (`session`: e.g. Responses' stored conversations). A protocol is its parser, its encoder and its row here."""

    protocol: Protocol
    path: str
    parse: Callable[..., Request]
    stream_encoder: Callable[[Request], Any]
    accumulator: Callable[[Request], Accumulator]
    ping: Callable[[Any], Callable[[], list[Frame]]] = _no_ping
    combine: Callable[[Request, list[Any]], dict[str, Any]] = lambda _request, accs: accs[0].body()
    session: Session = _no_session
    background: Callable[[Any], bool] = lambda _body: False  # answered at once, generated detached from the client
    expand: Callable[[Any, Request, PromptRenderer], list[Request]] = lambda _body, request, _renderer: [request]  # e.g. one request per prompt
    choices_encoder: Callable[[Request, list[Request]], FanInEncoder] | None = None  # a stream of several choices, where the protocol has them


CHAT = Surface(
    protocol=Protocol.OPENAI_CHAT,
    path="/v1/chat/completions",
    parse=openai_chat.parse,
    stream_encoder=chat_enc.ChatStreamEncoder,
    accumulator=chat_enc.ChatCompletionAccumulator,
    combine=chat_enc.chat_completion_body,
    choices_encoder=chat_enc.choices_encoder,
)
MESSAGES = Surface(
    protocol=Protocol.ANTHROPIC_MESSAGES,
    path="/v1/messages",
    parse=anthropic_messages.parse,
    stream_encoder=messages_enc.MessagesStreamEncoder,
    accumulator=messages_enc.MessageAccumulator,
    ping=lambda encoder: lambda: [encoder.ping()],
)
RESPONSES = Surface(
    protocol=Protocol.OPENAI_RESPONSES,
    path="/v1/responses",
    parse=openai_responses.parse,
    stream_encoder=response_enc.ResponsesStreamEncoder,
    accumulator=response_enc.ResponseAccumulator,
    session=responses_store.begin,
    background=lambda body: isinstance(body, dict) and openai_responses.background_flag(body),
)
COMPLETIONS = Surface(
    protocol=Protocol.OPENAI_COMPLETIONS,
    path=openai_completions.ENDPOINT,
    parse=openai_completions.parse,
    stream_encoder=completions_enc.CompletionStreamEncoder,
    accumulator=completions_enc.CompletionAccumulator,
    combine=completions_enc.completion_body,
    choices_encoder=completions_enc.choices_encoder,
    expand=lambda body, request, renderer: openai_completions.per_prompt(body, request, renderer.decode),
)
SURFACES = (CHAT, MESSAGES, RESPONSES, COMPLETIONS)
