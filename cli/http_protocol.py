"""uvicorn's h11 protocol with a deadline for each request's headers (slowloris on the header phase).

Hand-written because uvicorn has none: its keep-alive timer is cancelled by any byte received, so a
client sending one header byte every few seconds holds a connection (and its slot under
`--max-connections`) forever. Here a timer is armed when a connection opens and again when a response
ends (keep-alive), and cancelled as soon as h11 has parsed a whole request line and headers; if it
fires first the connection is closed (no HTTP answer is possible before a request exists). The body
has its own limit, in the app (ingest.limits.read_body, `--body-timeout`: 408).
Must not: change anything else of uvicorn's protocol.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderDeadlineH11(H11Protocol):
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
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a whole request's headers arrived
            self._disarm()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm()  # the next request on this keep-alive connection gets its own deadline
        super().on_response_complete()  # may start a pipelined request at once, which disarms it again

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(seconds: float) -> Any:
    """The protocol class for uvicorn's `http=` with this header deadline (0: none)."""
    return type("HeaderDeadlineH11", (HeaderDeadlineH11,), {"header_timeout": seconds})
