"""The Responses API's WebSocket mode: a WebSocket opened on `/v1/responses` (OpenAI's `wss://.../v1/responses`,
the openai SDK's `client.responses.connect()`) carries many responses, one after another.

The client sends JSON text frames `{"type": "response.create", ...the POST /v1/responses body...}`; each is
answered with the very events the SSE stream of the same body carries (ingest.http.app `Api.submit` queues
it exactly as `Api.generate` does: parse → session → prepare → charge → publish; encoders.openai_responses
encodes it; encoders.wire `sse_events` paces it), each event one text frame, without SSE framing.
`stream` is implicit (a `stream` field is ignored, as the SDK documents); `background: true` and
`generate: false` (warm-up without output) are refused with an `error` event naming the field; bad input
gets an `error` event in OpenAI's shape (`{"type": "error", "status", "error": {"type", "code", "message",
"param"}}`) and the socket stays open. `response.steer` is answered `response.steer.failed`
(`steering_not_supported`): this server has no steering. Any other event type is an `error` naming `type`.

One response runs at a time per socket: `response.create` events that arrive meanwhile wait their turn
(first in, first out, as OpenAI runs one lane; a `stream_id` is echoed on every event of its response, but
lanes are not run in parallel), at most `MAX_WAITING` of them; past that the event is refused at once.
Every response this socket ran is remembered (its conversation, the last `MAX_REMEMBERED`), so
`previous_response_id` continues one on the same socket even with `store: false`; other ids are looked up
in the store as over HTTP (ingest.http.responses_store). Closing the socket is leaving an SSE stream: the
running response is cancelled after `--resume-grace-s` (ingest.http.resume), and is counted as abandoned.

Auth is checked before the handshake completes (the same `Authenticator` as `guarded`); a refused socket
gets the HTTP answer in OpenAI's error shape (ASGI's `websocket.http.response` extension, which uvicorn has).
Framing, pings and close handshakes are the `websockets` library's (under uvicorn); none is written here.
Must not: parse Responses bodies or encode events (the parser and encoder do), or keep state beyond the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson
from blacksheep.server.websocket import WebSocket, WebSocketError
from redis.asyncio import Redis

from encoders.frames import Frame
from encoders.openai_responses import response_id
from encoders.wire import ClientLink, Presence, sse_events
from ingest.http import resume
from ingest.http.auth import CALLER
from ingest.http.limits import parse_json, too_large
from ingest.http.responses_store import Saver, assistant_turn, begin
from ingest.http.resume_routes import recording
from ingest.http.surfaces import RESPONSES
from ingest.parsers.errors import error_body, status_for
from ingest.parsers.openai_responses import previous_response_id
from shared.deltas import Error, StreamDelta
from shared.errors import ApiError, invalid
from shared.ir import Message, Protocol, Request, custom_tools
from shared.settings import Settings

if TYPE_CHECKING:
    from ingest.http.app import Api

log = logging.getLogger("met.api")

MAX_WAITING = 16  # response.create events queued behind the running one; past it one is refused
MAX_REMEMBERED = 16  # responses a socket keeps for `previous_response_id` (least recently used dropped)
NOT_BODY = ("type", "stream_id", "stream", "generate")  # a response.create's WebSocket-only fields: not part of the POST body
CLOSED = None  # what the reader queues when the socket closed


def responses_socket(api: Api) -> Callable[[WebSocket], Awaitable[None]]:
    """The `/v1/responses` WebSocket route: authenticate, accept, serve until the client closes."""

    async def run(ws: WebSocket) -> None:
        try:
            caller = api.auth.authenticate(ws.get_first_header(b"authorization"), ws.get_first_header(b"x-api-key"))
        except ApiError as err:
            api.metrics.http_error(err.status)
            await refuse(ws, err)
            return
        scope: Any = ws.scope
        scope[CALLER] = caller  # ingest.http.auth.caller_of reads it, as for an HTTP request
        await ws.accept()
        await ResponsesSocket(api, ws).serve()

    return run


async def refuse(ws: WebSocket, err: ApiError) -> None:
    """Refuse the handshake with `err` as OpenAI's HTTP error body, where the server lets the app answer it
    (ASGI `websocket.http.response`; blacksheep has no call for it, so its ASGI `send` is used); else close (403)."""
    scope: Any = ws.scope
    if "websocket.http.response" not in (scope.get("extensions") or {}):
        await ws.close()
        return
    headers = [(b"content-type", b"application/json")]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    send = ws._send  # the ASGI send blacksheep wraps
    await send({"type": "websocket.http.response.start", "status": status_for(Protocol.OPENAI_RESPONSES, err), "headers": headers})
    await send({"type": "websocket.http.response.body", "body": orjson.dumps(error_body(Protocol.OPENAI_RESPONSES, err))})


def error_event(err: ApiError, stream_id: str | None = None) -> dict[str, Any]:
    """`err` as the Responses WebSocket `error` event (the openai SDK's `ResponseWsError`)."""
    event = {"type": "error", "status": status_for(Protocol.OPENAI_RESPONSES, err), **error_body(Protocol.OPENAI_RESPONSES, err)}
    return event if stream_id is None else {**event, "stream_id": stream_id}


def steer_refused(event: dict[str, Any]) -> dict[str, Any]:
    """The answer to a `response.steer`: `response.steer.failed`, the input handed back uncommitted."""
    return {
        "type": "response.steer.failed",
        "sequence_number": 0,
        "error": {"type": "invalid_request_error", "code": "steering_not_supported", "message": "This server does not support steering responses."},
        "steer": {"input": event.get("input"), "previous_response_id": event.get("previous_response_id")},
    }


def create_body(event: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The POST /v1/responses body a `response.create` event carries (always streamed), and its `stream_id`;
    refused (naming the field) where the WebSocket mode has no meaning for it."""
    stream_id = event.get("stream_id")
    if stream_id is not None and not isinstance(stream_id, str):
        raise invalid("'stream_id' must be a string.", "stream_id", "invalid_type")
    if event.get("background"):
        raise invalid("Background responses are not supported over WebSocket; use POST /v1/responses.", "background", "unsupported_parameter")
    if event.get("generate") is False:
        raise invalid("'generate: false' (warm-up without output) is not supported by this server.", "generate", "unsupported_parameter")
    body = {k: v for k, v in event.items() if k not in NOT_BODY}
    return {**body, "stream": True}, stream_id


class Remembered:
    """The conversations of the responses one socket ran (by response id), so that `previous_response_id`
    continues a `store: false` one; bounded, least recently used dropped first."""

    def __init__(self, size: int = MAX_REMEMBERED) -> None:
        self.size = size
        self._conversations: OrderedDict[str, tuple[Message, ...]] = OrderedDict()

    def get(self, rid: str | None) -> tuple[Message, ...] | None:
        if rid is None or rid not in self._conversations:
            return None
        self._conversations.move_to_end(rid)
        return self._conversations[rid]

    def put(self, rid: str, conversation: tuple[Message, ...]) -> None:
        self._conversations[rid] = conversation
        self._conversations.move_to_end(rid)
        while len(self._conversations) > self.size:
            self._conversations.popitem(last=False)

    async def session(self, redis: Redis, settings: Settings, body: Any, parsed: Request, caller: str) -> tuple[Request, Saver | None]:
        """The Responses session (ingest.http.responses_store.begin) with this socket's own responses first:
        a `previous_response_id` this socket ran is continued from memory; the saver also remembers this one."""
        held = self.get(previous_response_id(body))
        if held is None:
            request, store = await begin(redis, settings, body, parsed, caller)
        else:
            request, store = await begin(redis, settings, {k: v for k, v in body.items() if k != "previous_response_id"}, parsed, caller)
            request = replace(request, messages=(*held, *request.messages))
        instructions = parsed.messages[0] if body.get("instructions") is not None else None  # not carried over (as begin)

        async def save(final: Request, deltas: list[StreamDelta]) -> None:
            if store is not None:
                await store(final, deltas)
            if deltas and not isinstance(deltas[-1], Error):
                kept = tuple(m for m in final.messages if m is not instructions)
                self.put(response_id(final), (*kept, assistant_turn(deltas, custom_tools(final))))

        return request, save


class ResponsesSocket:
    """One accepted socket: a reader task queues the client's events (and notices the close), the serving
    loop answers them in order (`step_once`), one response at a time."""

    def __init__(self, api: Api, ws: WebSocket) -> None:
        self.api = api
        self.ws = ws
        self.presence = Presence()  # left when the socket closes: the running response stops (encoders.wire)
        self.remembered = Remembered()
        self.surface = replace(RESPONSES, session=self.remembered.session)
        self.inbox: asyncio.Queue[tuple[dict[str, Any], int] | ApiError | None] = asyncio.Queue()
        self._sending = asyncio.Lock()

    async def serve(self) -> None:
        reader = asyncio.create_task(self.read())
        try:
            while (item := await self.inbox.get()) is not CLOSED and not self.presence.gone:  # nothing more once it closed
                await self.step_once(item)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def read(self) -> None:
        """Queue each client event (or the error it is) until the socket closes; past `MAX_WAITING` waiting
        events, refuse one at once."""
        try:
            while True:
                item = self.decode(await self.ws.receive())
                if self.inbox.qsize() >= MAX_WAITING:
                    await self.send_error(ApiError(f"Too many events waiting on this socket (at most {MAX_WAITING}).", status=429, kind="rate_limit", code="too_many_pending_events"))
                    continue
                self.inbox.put_nowait(item)
        except (WebSocketError, OSError):  # closed (blacksheep's WebSocketDisconnectError), or the connection failed
            pass
        finally:
            self.presence.leave()
            self.inbox.put_nowait(CLOSED)

    def decode(self, message: Any) -> tuple[dict[str, Any], int] | ApiError:
        """A frame's JSON object and its size, within the body limits (size, nesting), or the error it is."""
        raw = message.get("bytes") or (message.get("text") or "").encode()
        try:
            if len(raw) > self.api.settings.max_body_bytes:
                raise too_large(self.api.settings.max_body_bytes)
            event = parse_json(raw, self.api.settings.max_json_depth)
            if not isinstance(event, dict):
                raise invalid("Each event must be a JSON object with a 'type'.", "type", "invalid_type")
        except ApiError as err:
            return err
        return event, len(raw)

    async def step_once(self, item: tuple[dict[str, Any], int] | ApiError) -> None:
        """Answer one client event."""
        if isinstance(item, ApiError):
            await self.send_error(item)
            return
        event, size = item
        kind = event.get("type")
        if kind == "response.create":
            await self.create(event, size)
        elif kind == "response.steer":
            await self.send(steer_refused(event))
        else:
            await self.send_error(invalid(f"Unknown event type {kind!r}: send 'response.create'.", "type", "unknown_event_type"))

    async def create(self, event: dict[str, Any], size: int) -> None:
        """Queue one response (Api.submit, as POST /v1/responses) and send its events; a refusal is an `error` event."""
        stream_id = event.get("stream_id") if isinstance(event.get("stream_id"), str) else None
        try:
            body, stream_id = create_body(event)
            queued = await self.api.submit(self.ws, self.surface, body, size=size)
        except ApiError as err:
            await self.send_error(err, stream_id)
            return
        except Exception:
            log.exception("unhandled error on a Responses WebSocket")
            await self.send_error(ApiError("The server had an error while processing your request.", status=500, kind="internal"), stream_id)
            return
        await self.relay(queued.request, queued.store, stream_id)

    async def relay(self, request: Request, store: Saver | None, stream_id: str | None) -> None:
        """The response's events, each one text frame, until its terminal one or the client's leaving (which,
        after the resume grace, cancels it: the same `on_abandon` as an SSE stream's)."""
        api = self.api
        deltas = api.deltas(request, self.ws, self.presence)
        if store is not None:
            deltas = recording(deltas, partial(store, request))
        abandon = resume.graceful_cancel(api.redis, request.id, api.settings.resume_grace_s)
        encoder = self.surface.stream_encoder(request)
        events: Any = sse_events(deltas, encoder, ping=_no_ping, ping_interval=api.settings.ping_interval, client=ClientLink(self.presence, abandon))
        api.open_streams += 1  # a draining node waits for it, as for an SSE stream
        try:
            async for batch in events:
                for sent in batch:
                    if sent.frame.data and not await self.send_text(_with_stream_id(sent.frame.data, stream_id)):  # (keep-alives have no data)
                        return
        finally:
            api.open_streams -= 1
            await events.aclose()  # at once: its `finally` flags the cancel of a response the client left

    async def send_error(self, err: ApiError, stream_id: str | None = None) -> None:
        self.api.metrics.http_error(status_for(Protocol.OPENAI_RESPONSES, err))
        log.info("WebSocket /v1/responses answered an error event %d (%s): %.200s", err.status, err.code or err.kind, err)
        await self.send(error_event(err, stream_id))

    async def send(self, event: dict[str, Any]) -> bool:
        return await self.send_text(orjson.dumps(event).decode())

    async def send_text(self, text: str) -> bool:
        """Send one frame; False (and the client counts as gone) when the socket is closed."""
        try:
            async with self._sending:
                await self.ws.send_text(text)
        except (WebSocketError, OSError, RuntimeError):  # closed meanwhile (blacksheep's state, uvicorn's ClientDisconnected)
            self.presence.leave()
            return False
        return True


def _no_ping() -> list[Frame]:
    return []  # keep-alives are the WebSocket's own pings (the websockets library's, under uvicorn)


def _with_stream_id(data: str, stream_id: str | None) -> str:
    """An encoder event with the `stream_id` of the response.create that asked for it, as OpenAI echoes it."""
    return data if stream_id is None else orjson.dumps({**orjson.loads(data), "stream_id": stream_id}).decode()
