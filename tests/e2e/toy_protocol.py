"""A toy protocol, added from this module alone: a parser, an encoder and one registry row (issue 33's
test of the protocol registry; tests/e2e/test_toy_protocol.py serves it with `--protocol-module`).

`POST /v1/toy` takes `{"model", "say", "max_tokens", "stream"}` and generates a greedy answer to `say`
as a user turn. Whole: `{"object": "toy.reply", "text", "finish", "tokens"}`. Streamed: one
`data: {"text": ...}` event per piece of text, then `data: {"finish": ..., "tokens": n}`. Errors take
OpenAI's shape, and a context error names `say`.
"""

from __future__ import annotations

from typing import Any

from encoders.frames import Frame, json_frame
from encoders.registry import Codec
from ingest.http.surfaces import Surface, register
from shared.deltas import Content, Error, Finish, StreamDelta
from shared.errors import invalid
from shared.ir import Message, Protocol, Request, Role, SamplingParams, TextPart
from shared.protocols import ProtocolSpec

TOY = Protocol.define("toy")


def parse(body: Any, *, request_id: str, created: float) -> Request:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", None, "invalid_body")
    say = body.get("say")
    if not isinstance(say, str) or not say:
        raise invalid("'say' must be a non-empty string.", "say")
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise invalid("'max_tokens' must be a positive integer.", "max_tokens")
    return Request(
        id=request_id,
        protocol=TOY,
        model=str(body.get("model") or ""),
        messages=(Message(role=Role.USER, content=(TextPart(text=say),)),),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        stream=body.get("stream") is True,
        created=created,
    )


class ToyStream:
    """Deltas → the toy's events."""

    def __init__(self, request: Request) -> None:
        self.request = request

    def feed(self, delta: StreamDelta) -> list[Frame]:
        if isinstance(delta, Content) and delta.text:
            return [json_frame({"text": delta.text})]
        if isinstance(delta, Finish):
            return [json_frame({"finish": delta.reason.value, "tokens": delta.usage.completion_tokens})]
        if isinstance(delta, Error):
            return [json_frame({"error": delta.message})]
        return []

    def finish(self) -> list[Frame]:
        return []


class ToyReply:
    """Deltas → the toy's whole reply."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.text: list[str] = []
        self.done: Finish | None = None
        self.error: Error | None = None

    def feed(self, delta: StreamDelta) -> None:
        if isinstance(delta, Content):
            self.text.append(delta.text)
        elif isinstance(delta, Finish):
            self.done = delta
        elif isinstance(delta, Error):
            self.error = delta

    def body(self) -> dict[str, Any]:
        tokens = self.done.usage.completion_tokens if self.done else 0
        return {"object": "toy.reply", "id": self.request.id, "text": "".join(self.text), "finish": self.done.reason.value if self.done else None, "tokens": tokens}


register(
    Surface(
        spec=ProtocolSpec(protocol=TOY, path="/v1/toy", name="toy", prompt_param="say"),
        codec=Codec(protocol=TOY, stream_encoder=ToyStream, accumulator=ToyReply),
        parse=parse,
    )
)
