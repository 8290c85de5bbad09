"""Every Redis key and stream name, built in one place.

Per-request keys share the hash tag `{req:<id>}` so they land in one cluster slot; each carries a
TTL only after its terminal event (set by the worker that wrote it). Each name below says who
writes it and who reads it.
"""

from __future__ import annotations

PREFIX = "met"

# The request stream. Writer: ingest.publish (XADD, never MAXLEN). Readers: workers.loop through
# the consumer group WORKER_GROUP (XREADGROUP / XACK after the terminal event).
REQUEST_STREAM = f"{PREFIX}:requests"
WORKER_GROUP = f"{PREFIX}:workers"

# Accepted-but-unfinished requests, cluster-wide (the queue depth admission checks). Writers: ingest.publish
# (INCRBY on admission, under a Lua check against the limit), workers.loop (DECR with each terminal event).
# Readers: ingest admission, the TUI, /metrics.
INFLIGHT = f"{PREFIX}:inflight"

# Every accepted request, by time received (score: unix time). Writer: ingest.publish. Pruner: workers.loop
# (entries older than the dump TTL). Readers: `met dump list`, the TUI.
REQUEST_INDEX = f"{PREFIX}:requests:index"

# One entry per request that reached its terminal event (fields: id, outcome). Writer: workers.loop
# (approximately capped: a notification feed, not accepted work). Readers: `--dump-dir` writers, the TUI.
FINISHED = f"{PREFIX}:finished"

# Requests that killed their worker too often (fields: id, deliveries, reason). Writer: workers.loop.
# Readers: the TUI, `met dump`, operators. Never trimmed.
DEAD_LETTER = f"{PREFIX}:deadletter"

# Live workers. Writer: workers.loop heartbeat (ZADD score = unix time). Readers: ingest /ready,
# the TUI, /metrics. Entries older than the heartbeat TTL are dead.
WORKERS_ALIVE = f"{PREFIX}:workers:alive"


def worker_info(worker_id: str) -> str:
    """Hash of one worker's figures (model, pid, started, active, batch peak...).

    Writer: workers.loop heartbeat (HSET + EXPIRE). Readers: ingest /ready, the TUI, tests.
    """
    return f"{PREFIX}:worker:{worker_id}"


def rate_limit_bucket(caller: str, kind: str) -> str:
    """Hash of one caller's token bucket (fields: tokens, ts), `kind` "requests" or "tokens"; both of a
    caller's buckets share the hash tag `{<caller>}` so one Lua script updates them (cluster-safe).
    `caller` is a digest of the API key (ingest.auth.caller_id), never the key. Expires after two refill
    periods idle. Writer and reader: ingest.limits (one Lua script, shared by every API node)."""
    return f"{PREFIX}:ratelimit:{{{caller}}}:{kind}"


def stored_response(response_id: str) -> str:
    """A finished Responses-API response kept for `previous_response_id` and GET/DELETE
    /v1/responses/{id} (JSON: body + conversation), with a TTL. Writer and reader: ingest.responses_store."""
    return f"{PREFIX}:response:{response_id}"


def _tag(request_id: str) -> str:
    return "{req:" + request_id + "}"


def delta_stream(request_id: str) -> str:
    """The request's ordered StreamDelta events. Writer: the worker holding the request.
    Readers: encoders.wire (tails it for the client), dumps and replay."""
    return f"{_tag(request_id)}:deltas"


def request_meta(request_id: str) -> str:
    """Hash: status, worker, attempt, timings, batch peak. Writers: ingest.publish (received),
    workers.loop (claimed, first token, finished). Readers: dumps, the TUI, tests."""
    return f"{_tag(request_id)}:meta"


def request_ir(request_id: str) -> str:
    """The encoded request IR (as on the request stream), kept for dumps and replay after the stream is
    trimmed. Writer: ingest.publish. Readers: dumps, replay, workers.loop on reclaim."""
    return f"{_tag(request_id)}:request"


def request_keys(request_id: str) -> tuple[str, ...]:
    """Every per-request key (one hash slot); each gets the dump TTL after the terminal event."""
    return (delta_stream(request_id), request_meta(request_id), request_ir(request_id), cancel_flag(request_id))


def cancel_flag(request_id: str) -> str:
    """Present once the request is cancelled; its value says by whom (CLIENT_CANCEL, OPERATOR_CANCEL).
    Writers: ingest.app on a client disconnect, `met top` (cli/top_snapshot.py). Reader: workers.loop."""
    return f"{_tag(request_id)}:cancel"


CLIENT_CANCEL = b"1"  # the cancel flag's value when the client went away: nobody is told
OPERATOR_CANCEL = b"operator"  # ... when an operator cancelled it: the client gets an error
