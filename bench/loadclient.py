"""A lean streaming client for load: thousands of concurrent OpenAI chat streams from one process.

Owns: one HTTP/1.1 connection per stream on asyncio streams (no SDK: at thousands of streams the
`openai` SDK's per-chunk parsing would cost more CPU than the server under test, on the same cores),
reading the chunked SSE body, timing every content event, reading the final usage, and checking that
the stream ended properly (`[DONE]` after a finish reason). Also the `/ready` watcher that polls
while the load runs. Must not: reach anything but 127.0.0.1, or loop without a time bound.

Written by hand because no maintained client parses chunked SSE at this rate with this little CPU
(httpx + an SSE parser costs ~5x more per event here); it speaks only what `met api` answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import orjson


@dataclass(slots=True)
class StreamResult:
    """One stream as its client saw it; times in seconds from when the request was sent."""

    status: int = 0
    error: str = ""
    events: int = 0  # content events received
    completion_tokens: int = 0  # from the final usage chunk
    finish_reason: str = ""
    done: bool = False  # `data: [DONE]` arrived
    first_s: float = 0.0
    event_times: list[float] = field(default_factory=list)
    end_s: float = 0.0

    @property
    def complete(self) -> bool:
        return self.status == 200 and not self.error and self.done and bool(self.finish_reason)


def chat_body(*, model: str, prompt: str, max_tokens: int, stream_interval: int | None = None) -> bytes:
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    return orjson.dumps(body)


def _request(host: str, port: int, path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nAccept: text/event-stream\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


async def stream_once(host: str, port: int, body: bytes, *, path: str = "/v1/chat/completions", timeout_s: float = 600.0) -> StreamResult:
    """One streamed request on its own connection; never raises (a failure is the result's `error`)."""
    result = StreamResult()
    started = time.perf_counter()
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
            writer.write(_request(host, port, path, body))
            status_line = await reader.readline()
            result.status = int(status_line.split()[1])
            chunked = False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                    chunked = True
            if result.status != 200:
                result.error = (await reader.read(2000)).decode(errors="replace")[-300:]
                return result
            await _read_events(reader, result, started, chunked=chunked)
    except TimeoutError:
        result.error = "timed out"
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.end_s = time.perf_counter() - started
        if writer is not None:
            writer.close()
    return result


async def _read_events(reader: asyncio.StreamReader, result: StreamResult, started: float, *, chunked: bool) -> None:
    pending = b""
    while True:
        if chunked:
            size_line = await reader.readline()
            if not size_line:
                raise ValueError("connection closed before the last chunk")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                return _check_end(result)
            data = await reader.readexactly(size + 2)
            data = data[:-2]
        else:
            data = await reader.read(65536)
            if not data:
                return _check_end(result)
        now = time.perf_counter() - started
        pending += data
        *events, pending = pending.split(b"\n\n")
        for event in events:
            _on_event(event, result, now)


def _on_event(event: bytes, result: StreamResult, now: float) -> None:
    for line in event.split(b"\n"):
        if not line.startswith(b"data: "):
            continue
        payload = line[6:]
        if payload == b"[DONE]":
            result.done = True
            continue
        chunk = orjson.loads(payload)
        if "error" in chunk:
            result.error = str(chunk["error"])[:300]
            continue
        for choice in chunk.get("choices") or ():
            if (choice.get("delta") or {}).get("content"):
                if not result.events:
                    result.first_s = now
                result.events += 1
                result.event_times.append(now)
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        usage = chunk.get("usage")
        if usage:
            result.completion_tokens = int(usage.get("completion_tokens", 0))


def _check_end(result: StreamResult) -> None:
    if not result.done and not result.error:
        result.error = "the stream ended without [DONE]"


@dataclass(slots=True)
class ReadyWatch:
    """`/ready` polled every `period_s` while the load runs: every status seen, counted."""

    statuses: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def always_ready(self) -> bool:
        return not self.failures and set(self.statuses) == {200}


async def watch_ready(host: str, port: int, stop: asyncio.Event, watch: ReadyWatch, *, period_s: float = 0.5) -> None:
    while not stop.is_set():
        try:
            async with asyncio.timeout(10):
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(f"GET /ready HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
                status = int((await reader.readline()).split()[1])
                body = await reader.read()
                writer.close()
            watch.statuses[status] = watch.statuses.get(status, 0) + 1
            if status != 200:
                watch.failures.append(f"{status}: {body[-200:].decode(errors='replace')}")
        except (OSError, TimeoutError, ValueError, IndexError) as exc:
            watch.failures.append(f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=period_s)
