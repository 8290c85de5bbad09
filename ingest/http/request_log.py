"""The access log: one line per finished request at the API node, logged as `met.requests`.

Owns: what the line holds: request id, protocol, model, status (the finish reason, `error:<kind>`, or
`abandoned` for a client that left before the end), prompt / output tokens, time to first token,
total time and the client's address. Fed by `ingest.http.metrics.Metrics.observe`, which already sees
every request's deltas and timing. Must not: log a body, a message, a header or a key.

The fields also travel as `record.fields`, so `--log-format json` (cli/logs.py) writes them as JSON
keys instead of the human line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shared.deltas import Error, Finish, StreamDelta
from shared.ir import Request

log = logging.getLogger("met.requests")


@dataclass(slots=True)
class RequestTiming:
    """What the observer gathers while a request's deltas pass: times are unix seconds."""

    client: str = ""
    first_at: float | None = None
    output_tokens: int = 0


def status_of(delta: StreamDelta | None) -> str:
    if isinstance(delta, Finish):
        return delta.reason.value
    if isinstance(delta, Error):
        return f"error:{delta.kind.value}"
    return "abandoned"


def log_finished(request: Request, terminal: StreamDelta | None, timing: RequestTiming, *, now: float) -> None:
    """Write the request's one line. `terminal` is None when the client left before it arrived."""
    output = terminal.usage.completion_tokens if isinstance(terminal, Finish) else timing.output_tokens
    fields = {
        "request_id": request.id,
        "protocol": request.protocol.value,
        "model": request.model,
        "status": status_of(terminal),
        "prompt_tokens": len(request.prompt_token_ids),
        "output_tokens": output,
        "ttft_s": round(timing.first_at - request.created, 4) if timing.first_at is not None else None,
        "total_s": round(now - request.created, 4),
        "client": timing.client or "-",
        "stream": request.stream,
    }
    ttft = f"{fields['ttft_s']:.3f}s" if fields["ttft_s"] is not None else "-"
    log.info(
        "%s %s model=%s status=%s prompt_tokens=%d output_tokens=%d ttft=%s total=%.3fs client=%s",
        request.id,
        request.protocol.value,
        request.model,
        fields["status"],
        fields["prompt_tokens"],
        output,
        ttft,
        fields["total_s"],
        fields["client"],
        extra={"fields": fields},
    )
