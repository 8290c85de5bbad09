"""`met replay --against URL`: re-send a recorded request over HTTP and read the streamed answer back into deltas.

Owns: the request body sent (the recorded, redacted raw body with `stream: true` and
`return_token_ids: true`), the SSE reader (stdlib urllib, no extra dependency) and the three protocols'
frames → `StreamDelta`s through each protocol's reader (encoders/sse_readers.py, named by its codec row),
enough for `shared.dumps.compare`: text, generated token ids, finish reason.
The server re-renders the prompt from the body (and a `previous_response_id` reloads a stored
conversation), so this path checks the whole pipeline but is only as exact as that rendering;
`--redis-url` replays the recorded prompt token ids themselves.
Must not: touch Redis.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import orjson

from encoders.registry import codec
from shared.deltas import StreamDelta
from shared.dumps import DumpRecord
from shared.ir import Protocol

RETRY_STATUSES = (429, 503, 529)
MAX_RETRIES = 120



class ReplayHttpError(RuntimeError):
    """The server refused the replayed request (status and body in the message)."""


def replay_body(record: DumpRecord) -> dict[str, Any]:
    """The recorded body, streaming with token ids. A part of an `n` > 1 chat request becomes n=1 with the part's seed."""
    body: dict[str, Any] = orjson.loads(record.request.raw_body or "{}")
    body["stream"] = True
    body["return_token_ids"] = True
    if record.request.protocol is Protocol.OPENAI_CHAT:
        body.pop("stream_options", None)
        if isinstance(body.get("n"), int) and body["n"] > 1:
            body["n"] = 1
            body["seed"] = record.request.sampling.seed
    return body


def endpoint_url(base: str, endpoint: str) -> str:
    """`http://host:8000` or `http://host:8000/v1` + `/v1/chat/completions`."""
    base = base.rstrip("/")
    return (base.removesuffix("/v1") if endpoint.startswith("/v1/") else base) + endpoint


def post_and_read(record: DumpRecord, *, against: str, api_key: str | None, timeout: float) -> list[StreamDelta]:
    """POST the recorded body, wait out queue-full answers (Retry-After), and read the stream into deltas."""
    headers = {"content-type": "application/json", "accept": "text/event-stream"}
    if api_key:
        headers |= {"authorization": f"Bearer {api_key}", "x-api-key": api_key}
    data = orjson.dumps(replay_body(record))
    url = endpoint_url(against, record.request.endpoint)
    for _ in range(MAX_RETRIES):
        request = urllib.request.Request(url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return frames_to_deltas(record.request.protocol, read_sse(response))
        except urllib.error.HTTPError as err:
            if err.code not in RETRY_STATUSES:
                raise ReplayHttpError(f"{url} answered {err.code}: {err.read().decode(errors='replace')[:500]}") from None
            time.sleep(float(err.headers.get("retry-after") or 1))
    raise ReplayHttpError(f"{url} stayed at its queue limit")


def read_sse(lines: Any) -> Iterator[tuple[str | None, str]]:
    """(event, data) for each SSE event in a byte-line iterable; comments and pings are dropped."""
    event: str | None = None
    data: list[str] = []
    for raw in lines:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if data and event != "ping":
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data and event != "ping":
        yield event, "\n".join(data)


def frames_to_deltas(protocol: Protocol, frames: Iterator[tuple[str | None, str]]) -> list[StreamDelta]:
    """The deltas a protocol's streamed payloads carry, through its codec's `sse_reader` (encoders.registry)."""
    reader = codec(protocol).sse_reader
    if reader is None:
        raise ReplayHttpError(f"protocol {protocol.value!r} has no stream reader: replay it with --redis-url, or --encode-only")
    deltas: list[StreamDelta] = []
    for _event, data in frames:
        if data == "[DONE]":
            break
        deltas += reader(orjson.loads(data), deltas)
    return deltas
