"""The Responses WebSocket mode's handler without a server: the handshake is authenticated like every HTTP
route (a missing or wrong key is refused with OpenAI's 401 body, nothing accepted), a `response.create` becomes
the POST body it carries, and a socket remembers a bounded number of its responses. The protocol itself, over a
real socket with the openai SDK, is tests/e2e/test_responses_ws.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from blacksheep.server.websocket import WebSocket

from ingest.http.auth import CALLER, Authenticator, caller_id
from ingest.http.responses_ws import Remembered, create_body, error_event, responses_socket
from shared.errors import ApiError, invalid
from shared.ir import Message, Role, TextPart
from shared.settings import Settings


class FakeAsgi:
    """One WebSocket handshake as the ASGI server hands it over: connect, then (once accepted) the client's close."""

    def __init__(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.scope: dict[str, Any] = {
            "type": "websocket",
            "path": "/v1/responses",
            "raw_path": b"/v1/responses",
            "query_string": b"",
            "headers": headers,
            "extensions": {"websocket.http.response": {}},
        }
        self.sent: list[dict[str, Any]] = []
        self.incoming: list[dict[str, Any]] = [{"type": "websocket.connect"}, {"type": "websocket.disconnect", "code": 1000}]

    async def receive(self) -> dict[str, Any]:
        return self.incoming.pop(0)

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


def fake_api() -> Any:
    errors: list[int] = []
    return SimpleNamespace(auth=Authenticator(["k1"]), settings=Settings(), metrics=SimpleNamespace(http_error=errors.append), errors=errors)


@pytest.mark.parametrize(("headers", "code"), [([], "missing_api_key"), ([(b"authorization", b"Bearer k2")], "invalid_api_key")])
async def test_a_socket_without_a_right_key_is_refused_with_openais_401_and_never_accepted(headers: list[tuple[bytes, bytes]], code: str) -> None:
    asgi, api = FakeAsgi(headers), fake_api()
    await responses_socket(api)(WebSocket(asgi.scope, asgi.receive, asgi.send))
    start, body = asgi.sent
    assert start["type"] == "websocket.http.response.start" and start["status"] == 401
    assert (b"www-authenticate", b"Bearer") in start["headers"]
    error = orjson.loads(body["body"])["error"]
    assert error["code"] == code and error["type"] == "authentication_error"
    assert api.errors == [401]


@pytest.mark.parametrize("header", [(b"authorization", b"Bearer k1"), (b"x-api-key", b"k1")])
async def test_a_socket_with_a_key_is_accepted_as_its_caller(header: tuple[bytes, bytes]) -> None:
    asgi = FakeAsgi([header])
    await responses_socket(fake_api())(WebSocket(asgi.scope, asgi.receive, asgi.send))
    assert [m["type"] for m in asgi.sent] == ["websocket.accept"]
    assert asgi.scope[CALLER] == caller_id("k1")


def test_a_response_create_is_its_post_body_always_streamed() -> None:
    event = {"type": "response.create", "model": "m", "input": "hi", "stream": False, "stream_id": "a", "generate": True}
    assert create_body(event) == ({"model": "m", "input": "hi", "stream": True}, "a")


@pytest.mark.parametrize(
    ("event", "param"),
    [({"background": True}, "background"), ({"generate": False}, "generate"), ({"stream_id": 3}, "stream_id")],
)
def test_what_a_socket_cannot_do_is_refused_naming_the_field(event: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        create_body({"type": "response.create", "model": "m", "input": "hi", **event})
    assert caught.value.param == param and caught.value.status == 400


def test_an_error_event_is_openais_error_shape_with_its_status_and_lane() -> None:
    event = error_event(invalid("Bad.", "max_output_tokens", "invalid_type"), "lane")
    assert event == {
        "type": "error",
        "status": 400,
        "error": {"message": "Bad.", "type": "invalid_request_error", "param": "max_output_tokens", "code": "invalid_type"},
        "stream_id": "lane",
    }


def test_a_socket_remembers_its_latest_responses_only() -> None:
    remembered = Remembered(size=2)
    turn = (Message(role=Role.USER, content=(TextPart(text="hi"),)),)
    for rid in ("a", "b", "c"):
        remembered.put(rid, turn)
    assert remembered.get("a") is None and remembered.get("b") == turn
    remembered.put("d", turn)  # "b" was used last: "c" goes
    assert remembered.get("c") is None and remembered.get("b") == turn and remembered.get(None) is None
