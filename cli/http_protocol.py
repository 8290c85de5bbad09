"""uvicorn's httptools protocol with a deadline for each request's headers (slowloris on the header phase).

httptools (llhttp, in C) rather than h11 (pure Python): at thousands of streams the HTTP framing of every
chunk is a visible share of an API node's CPU (bench/RESULTS.md, session 16).

Hand-written because uvicorn has no header deadline: its keep-alive timer is cancelled by any byte
received, so a client sending one header byte every few seconds holds a connection (and its slot under
`--max-connections`) forever. Here a timer is armed when a connection opens and again when a response
ends (keep-alive), and cancelled as soon as the parser has a whole request line and headers; if it
fires first the connection is closed (no HTTP answer is possible before a request exists). The body
has its own limit, in the app (ingest.http.limits.read_body, `--body-timeout`: 408).
Must not: change anything else of uvicorn's protocol.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeaderDeadlineHttpTools(HttpToolsProtocol):
    header_timeout = 30.0  # set per server by `with_header_timeout`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        if self.header_timeout > 0:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def on_headers_complete(self) -> None:
        self._disarm()  # a whole request's headers arrived
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing() and not self.pipeline:  # (a pipelined request's headers are in already)
            self._arm()  # the next request on this keep-alive connection gets its own deadline
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(seconds: float) -> Any:
    """The protocol class for uvicorn's `http=` with this header deadline (0: none)."""
    return type("HeaderDeadlineHttpTools", (HeaderDeadlineHttpTools,), {"header_timeout": seconds})
