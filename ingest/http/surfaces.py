"""The generation routes' per-protocol rows, and the registry every protocol joins: everything that
differs between protocols on a generation (the path, the parser, the encoders, keep-alive, how n choices
combine, the protocol's own state).

A protocol is its parser (`ingest/parsers/<protocol>.py`), its encoder (`encoders/<protocol>.py`) and its row:
`register(Surface(spec=ProtocolSpec(...), codec=Codec(...), parse=...))`. The built-in four are below; a
protocol module named by `--protocol-module` registers its own as it is imported (`load_protocol_modules`,
before the app is built), and is then served, dumped, replayed and re-encoded like them
(tests/e2e/toy_protocol.py is one).
Must not: do I/O itself (a row's `session` is the protocol's own store, called by the app).
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any
from typing import Protocol as Protocol_

from redis.asyncio import Redis

from encoders import registry
from encoders.fan_in import FanInEncoder
from encoders.frames import Frame
from encoders.registry import Codec, register_codec
from ingest.http import responses_store
from ingest.http.responses_store import Saver
from ingest.parsers import anthropic_messages, openai_chat, openai_completions, openai_responses
from models.prompt import PromptRenderer
from shared import protocols
from shared.deltas import Error, StreamDelta
from shared.ir import Protocol, Request
from shared.protocols import ProtocolSpec, register_spec
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Surface:
    """A protocol's row: its pure spec (shared.protocols: route, names, error shape, context wording, finish
    column), its codec (encoders.registry: the encoders and its stream reader) and the HTTP side kept here:
    the parser, the protocol's own state around a generation (`session`: e.g. Responses' stored
    conversations), whether it answers in the background, and how one body becomes several requests.
    Adding a protocol is a parser, an encoder and `register(Surface(...))` (e.g. from a `--protocol-module`)."""

    spec: ProtocolSpec
    codec: Codec
    parse: Callable[..., Request]
    session: Session = _no_session
    background: Callable[[Any], bool] = lambda _body: False  # answered at once, generated detached from the client
    expand: Callable[[Any, Request, PromptRenderer], list[Request]] = lambda _body, request, _renderer: [request]  # e.g. one request per prompt

    @property
    def protocol(self) -> Protocol:
        return self.spec.protocol

    @property
    def path(self) -> str:
        return self.spec.path

    @property
    def stream_encoder(self) -> Callable[[Request], Any]:
        return self.codec.stream_encoder

    @property
    def accumulator(self) -> Callable[[Request], Accumulator]:
        return self.codec.accumulator

    @property
    def ping(self) -> Callable[[Any], Callable[[], list[Frame]]]:
        return self.codec.ping

    @property
    def combine(self) -> Callable[[Request, list[Any]], dict[str, Any]]:
        return self.codec.combine

    @property
    def choices_encoder(self) -> Callable[[Request, list[Request]], FanInEncoder] | None:  # a stream of several choices, where the protocol has them
        return self.codec.choices_encoder


_REGISTERED: dict[Protocol, Surface] = {}


def register(surface: Surface) -> Surface:
    """Add a protocol: its spec and codec to the pure registries (so dumps, replay and re-encoding know it)
    and its row to the routes every API node built after this serves."""
    if surface.codec.protocol is not surface.spec.protocol:
        raise ValueError(f"a row's codec ({surface.codec.protocol!r}) and spec ({surface.spec.protocol!r}) name different protocols")
    register_spec(surface.spec)
    register_codec(surface.codec)
    _REGISTERED[surface.protocol] = surface
    return surface


def surfaces() -> tuple[Surface, ...]:
    """Every registered protocol's row: the built-in four, then those protocol modules added."""
    return tuple(_REGISTERED.values())


def load_protocol_modules(names: Iterable[str]) -> None:
    """Import each `--protocol-module` (a dotted module path): importing it registers its protocol."""
    for name in names:
        importlib.import_module(name)


CHAT = register(Surface(spec=protocols.CHAT, codec=registry.CHAT, parse=openai_chat.parse))
MESSAGES = register(Surface(spec=protocols.MESSAGES, codec=registry.MESSAGES, parse=anthropic_messages.parse))
RESPONSES = register(
    Surface(
        spec=protocols.RESPONSES,
        codec=registry.RESPONSES,
        parse=openai_responses.parse,
        session=responses_store.begin,
        background=lambda body: isinstance(body, dict) and openai_responses.background_flag(body),
    )
)
COMPLETIONS = register(
    Surface(
        spec=protocols.COMPLETIONS,
        codec=registry.COMPLETIONS,
        parse=openai_completions.parse,
        expand=lambda body, request, renderer: openai_completions.per_prompt(body, request, renderer.decode),
    )
)
SURFACES = (CHAT, MESSAGES, RESPONSES, COMPLETIONS)  # the built-in rows
