"""Every Responses-API answer the suite receives, checked against the Open Responses specification.

The specification's OpenAPI document is vendored as data (tests/fixtures/openresponses/: its source,
commit and version in SOURCE.md). `install()` (tests/conftest.py, for the whole session) wraps httpx's
sync and async transports, so every 2xx answer on a `/v1/responses` path that any test gets through
httpx, the openai SDK included, is validated as it arrives: a JSON body by its `object` (a `response`
against `ResponseResource`, a `response.compaction` against `CompactResource`), and every event of an
SSE stream against the event schema its `type` names (the `response` snapshot inside
`response.created` / `.in_progress` / `.completed` / ... included). A violation raises in the client,
naming the path, the event and the schema's complaint, so the test that made the request fails.
Event types the specification does not define (custom tool calls, ...) are checked only for a
`response` snapshot they carry; OpenAI's extensions the specification lacks (custom and namespace tools,
custom tool calls) are left out of what is checked (`_spec_view`). `checked` counts what was validated (tests/e2e/test_responses_schema.py
proves the hook is live).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import httpx
from jsonschema import Draft202012Validator

SPEC_PATH = Path(__file__).parent / "fixtures" / "openresponses" / "openapi.json"
OBJECTS = {"response": "ResponseResource", "response.compaction": "CompactResource"}
checked: Counter[str] = Counter()  # schema name → objects validated against it this session


@cache
def _spec() -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(SPEC_PATH.read_text())
    # The one override: the document types the echoed `text.format.schema` of a json_schema format as
    # `{"type": "null"}` (its generator's rendering of an untyped field); OpenAI's API echoes the schema
    # object the request gave, and so does this server. Every other field is checked as published.
    spec["components"]["schemas"]["JsonSchemaResponseFormat"]["properties"]["schema"] = {"type": ["object", "null"]}
    # And the SSE `error` event in OpenAI's shape (its SDK's ResponseErrorEvent: code, message, param at the top):
    # the document's `error` payload key would make the openai SDK raise on the event (it raises on any event
    # whose data has an `error` key) instead of handing the client the `response.failed` that follows.
    spec["components"]["schemas"]["ErrorStreamingEvent"] = {
        "type": "object",
        "required": ["type", "sequence_number", "code", "message", "param"],
        "properties": {
            "type": {"enum": ["error"]},
            "sequence_number": {"type": "integer"},
            "code": {"type": ["string", "null"]},
            "message": {"type": "string"},
            "param": {"type": ["string", "null"]},
        },
    }
    return spec


@cache
def validator(name: str) -> Draft202012Validator:
    """A validator for one of the specification's component schemas."""
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": _spec()["components"]})


@cache
def event_schemas() -> dict[str, str]:
    """Event `type` → the name of the schema that defines it."""
    out: dict[str, str] = {}
    for name, schema in _spec()["components"]["schemas"].items():
        kind = schema.get("properties", {}).get("type", {})
        if name.endswith("StreamingEvent") and kind.get("enum"):
            out[kind["enum"][0]] = name
    return out


def check(name: str, value: Any, where: str) -> None:
    """Raise AssertionError listing every way `value` breaks schema `name`."""
    errors = sorted(validator(name).iter_errors(value), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:300]}" for e in errors[:8]]
        raise AssertionError(f"{where}: not a valid {name} (Open Responses {_spec()['info']['version']}):\n  " + "\n  ".join(lines))
    checked[name] += 1


# OpenAI's own extensions the specification does not define (it knows function tools only): custom tools
# and their calls, and namespace tools. A response is checked without them (`_spec_view`), and an event
# about one of their items is not checked; everything else in such a response still is.
EXTENSION_TOOLS = frozenset({"custom", "namespace"})
EXTENSION_ITEMS = frozenset({"custom_tool_call"})


def _spec_view(response: dict[str, Any]) -> dict[str, Any]:
    view = dict(response)
    view["tools"] = [t for t in response.get("tools") or [] if not (isinstance(t, dict) and t.get("type") in EXTENSION_TOOLS)]
    view["output"] = [i for i in response.get("output") or [] if not (isinstance(i, dict) and i.get("type") in EXTENSION_ITEMS)]
    choice = response.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "custom":
        view["tool_choice"] = "required"  # a call to that tool was forced: the spec's nearest value
    return view


def check_body(path: str, body: Any) -> None:
    if isinstance(body, dict) and body.get("object") in OBJECTS and "deleted" not in body:  # a DELETE's answer is `{id, object, deleted}`
        check(OBJECTS[body["object"]], _spec_view(body) if body["object"] == "response" else body, f"{path} body")


def check_event(path: str, event: Any) -> None:
    if not isinstance(event, dict):
        return
    name = event_schemas().get(event.get("type", ""))
    where = f"{path} event {event.get('type')!r} #{event.get('sequence_number')}"
    item = event.get("item")
    if isinstance(item, dict) and item.get("type") in EXTENSION_ITEMS:
        return
    if isinstance(event.get("response"), dict):
        event = {**event, "response": _spec_view(event["response"])}
    if name is not None:
        check(name, event, where)
    elif isinstance(event.get("response"), dict):
        check("ResponseResource", event["response"], where)


def check_ws_event(event: Any) -> None:
    """A server event of the Responses WebSocket mode: an `error` is the WebSocket error envelope, any other
    event what the SSE stream would carry."""
    if isinstance(event, dict) and event.get("type") == "error":
        check("WebSocketErrorEvent", event, "/v1/responses WebSocket event 'error'")
    elif isinstance(event, dict) and not event.get("type", "").startswith("response.steer"):  # steering: not in the specification
        check_event("/v1/responses WebSocket", {k: v for k, v in event.items() if k != "stream_id"})


class _Events:
    """SSE bytes → each event's JSON `data`, fed as they arrive."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            line = line.rstrip(b"\r")
            if not line:
                self._dispatch()
            elif line.startswith(b"data:"):
                self._data.append(line[5:].lstrip(b" "))

    def close(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        data, self._data = b"\n".join(self._data), []
        if data and data != b"[DONE]":
            check_event(self.path, json.loads(data))


def _watched(request: Any, response: Any) -> _Events | None:
    path = request.url.path
    if not path.startswith("/v1/responses") or not 200 <= response.status_code < 300:
        return None
    return _Events(path)


class _SyncStream:
    """A sync body: SSE events validated as they pass, a JSON body once whole (the module's byte-stream
    base is mixed in by `_streams`, as httpx and httpx2 each check for their own)."""

    def __init__(self, inner: Any, events: _Events, sse: bool) -> None:
        self._inner, self._events, self._sse = inner, events, sse
        self._parts: list[bytes] = []

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._see(chunk)
            yield chunk
        self._end()

    def close(self) -> None:
        self._inner.close()

    def _see(self, chunk: bytes) -> None:
        if self._sse:
            self._events.feed(chunk)
        else:
            self._parts.append(chunk)

    def _end(self) -> None:
        if self._sse:
            self._events.close()
        else:
            _check_json(self._events.path, b"".join(self._parts))


class _AsyncStream(_SyncStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._see(chunk)
            yield chunk
        self._end()

    async def aclose(self) -> None:
        await self._inner.aclose()


def _is_sse(response: Any) -> bool:
    return str(response.headers.get("content-type", "")).startswith("text/event-stream")


def _check_json(path: str, raw: bytes) -> None:
    try:
        body = json.loads(raw)
    except ValueError:
        return
    check_body(path, body)


def install() -> None:
    """Wrap the transports of httpx and of httpx2 (the openai SDK's client) (idempotent)."""
    modules: list[Any] = [httpx]
    try:
        import httpx2

        modules.append(httpx2)
    except ImportError:
        pass
    for module in modules:
        _wrap(module)


def _wrap(module: Any) -> None:
    if getattr(module.HTTPTransport.handle_request, "_openresponses", False):
        return
    sync_stream = type("SyncStream", (_SyncStream, module.SyncByteStream), {})
    async_stream = type("AsyncStream", (_AsyncStream, module.AsyncByteStream), {})
    sync_handle = module.HTTPTransport.handle_request
    async_handle = module.AsyncHTTPTransport.handle_async_request

    def handle_request(self: Any, request: Any) -> Any:
        response = sync_handle(self, request)
        events = _watched(request, response)
        if events is not None:
            response.stream = sync_stream(response.stream, events, _is_sse(response))
        return response

    async def handle_async_request(self: Any, request: Any) -> Any:
        response = await async_handle(self, request)
        events = _watched(request, response)
        if events is not None:
            response.stream = async_stream(response.stream, events, _is_sse(response))
        return response

    handle_request._openresponses = True  # type: ignore[attr-defined]
    module.HTTPTransport.handle_request = handle_request
    module.AsyncHTTPTransport.handle_async_request = handle_async_request
