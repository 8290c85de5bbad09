"""`Frame`: one server-sent event as the encoders produce it (serialized data + optional event name)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class Frame:
    data: str
    event: str | None = None
    comment: str | None = None  # an SSE comment line (keep-alive where the protocol has no ping event)

    def to_sse(self, position: int | str | None = None) -> bytes:
        """The exact bytes on the wire, `id:` first when the frame has a stream position (encoders.wire),
        in blacksheep's order (used by tests and `met replay --encode-only`)."""
        head = f"id: {position}\n" if position is not None else ""
        head += f": {self.comment}\n" if self.comment else ""
        head += f"event: {self.event}\n" if self.event else ""
        body = f"data: {self.data}\n" if self.data else ""
        return f"{head}{body}\n".encode()


def json_frame(payload: dict[str, Any], event: str | None = None) -> Frame:
    return Frame(orjson.dumps(payload).decode(), event)
