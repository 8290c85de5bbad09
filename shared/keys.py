"""Every Redis key and stream name, built in one place.

Per-request keys share the hash tag of their request's shard, `{req:<shard>}` (`request_shard`: 64
shards), so all of a request's keys land in one cluster slot (its Lua scripts stay single-slot) and so
do the delta streams of every request of a shard: an API node reads many streams in one XREAD, which a
cluster allows only within one slot (bus.tails). Each per-request key carries a TTL only after its
terminal event (set by the worker that wrote it). Each name below says who writes it and who reads it.
"""

from __future__ import annotations

import zlib

PREFIX = "met"

# The request stream. Writer: ingest.http.publish (XADD, never MAXLEN). Readers: workers.claims through
# the consumer group WORKER_GROUP (XREADGROUP / XACK after the terminal event).
REQUEST_STREAM = f"{PREFIX}:requests"
WORKER_GROUP = f"{PREFIX}:workers"

# Prefix-aware routing (ingest.http.routing, workers.routed). A request the API node routes goes onto the
# chosen worker's own stream, `routed_stream(worker)`, read through a group of the same name WORKER_GROUP: it is
# pending there like any other, so the same leases, fencing and reclaim hold. Each routed stream shares the
# request stream's hash slot (its hash tag is REQUEST_STREAM), so one XREADGROUP reads both on a cluster too.
# Writer: ingest.http.publish (XADD, never MAXLEN). Readers: that worker (XREADGROUP with the shared stream),
# every other worker once it is gone (workers.routed.adopt: XAUTOCLAIM of what it held, XREADGROUP of what it
# never read).
ROUTED_STREAM_PREFIX = f"{PREFIX}:requests:{{{REQUEST_STREAM}}}:to:"
# The workers that may have a routed stream (score: their last heartbeat). A worker joins with its first
# heartbeat and stays until its stream is empty after it left, so a stream whose worker died or drained is
# always found and emptied. Writers: workers.claims heartbeat (ZADD), workers.routed.adopt (ZREM once empty).
# Readers: workers.routed.adopt, `met top`.
ROUTED_WORKERS = f"{PREFIX}:routed:workers"


def routed_stream(worker_id: str) -> str:
    """One worker's own request stream (see ROUTED_STREAM_PREFIX)."""
    return f"{ROUTED_STREAM_PREFIX}{worker_id}"


def kv_index(worker_id: str) -> str:
    """Set of the block keys (each its first 8 bytes: shared.block_keys.index_key)
    the worker's prefix cache holds: bounded by its KV blocks, expiring with its heartbeat. Writer: that
    worker (workers.routed.KVIndexPublisher: SADD / SREM as blocks are keyed and evicted, a full snapshot
    after a restart or a Redis outage). Readers: API nodes routing (ingest.http.routing, SMISMEMBER)."""
    return f"{PREFIX}:kvindex:{{{worker_id}}}"


# Accepted-but-unfinished requests, cluster-wide (the queue depth admission checks): a sorted set of request
# ids, score = admission time (unix). A set of ids, not a counter, so that it heals itself: taking an id out
# twice is harmless, and what a lost write leaks is found and removed (workers.leases.sweep_inflight: ids
# whose request finished, or never reached Redis; ids older than the longest a request lives go on admission).
# Writers: ingest.http.publish (ZADD on admission, under a Lua check against the limit; ZREM of parts never queued),
# workers.outbox (ZREM with each terminal event), workers.leases.sweep_inflight. Readers: ingest admission
# (ZCARD), the TUI, /metrics.
INFLIGHT = f"{PREFIX}:inflight:ids"
# Batch lines queued or running: the batch pool, a set of its own (the same shape, writers and healing as
# INFLIGHT), so batch work never takes a place interactive admission counts. Writer: ingest.http.publish
# (submit_batch_line). Readers: the batch dispatcher (--batch-max-queue), the TUI, /metrics.
INFLIGHT_BATCH = f"{PREFIX}:inflight:batch"
IN_FLIGHT_SETS = (INFLIGHT, INFLIGHT_BATCH)

# Every accepted request, by time received (score: unix time). Writer: ingest.http.publish. Pruner: workers.claims
# (entries older than the dump TTL). Readers: `met dump list`, the TUI.
REQUEST_INDEX = f"{PREFIX}:requests:index"

# One entry per request that reached its terminal event (fields: id, outcome). Writer: workers.outbox
# (approximately capped: a notification feed, not accepted work). Readers: `--dump-dir` writers, the TUI.
FINISHED = f"{PREFIX}:finished"

# Cancel notices (fields: id, by): one entry per cancel, after the request's cancel flag is set. Writers:
# bus.cancels (API nodes on a client disconnect, `met top` for an operator). Readers: every worker, once a
# step, from its last entry read. Approximately capped: the flags are the record, this only tells.
CANCELS = f"{PREFIX}:cancels"

# Requests that killed their worker too often (fields: id, deliveries, reason). Writer: workers.claims.
# Readers: the TUI, `met dump`, operators. Never trimmed.
DEAD_LETTER = f"{PREFIX}:deadletter"

# Live workers. Writer: workers.claims heartbeat (ZADD score = unix time). Readers: ingest /ready,
# the TUI, /metrics. Entries older than the heartbeat TTL are dead.
WORKERS_ALIVE = f"{PREFIX}:workers:alive"

# The deployment's reasoning-seal key (32 raw bytes, shared.seal). Writer: the first API node or worker
# to start (SET NX, never overwritten). Readers: every API node (opens sealed reasoning clients send
# back) and every worker (seals each reasoning span). Never expires.
SEAL_KEY = f"{PREFIX}:seal-key"

# The LoRA adapters served, by model name → JSON {"path", "rank", "modules", "created"}. Writers: API nodes
# (ingest.http.loras: `--lora` at start, POST /v1/load_lora_adapter and /v1/unload_lora_adapter). Readers:
# every API node (each second, to resolve request model names and list /v1/models). Never expires.
LORAS = f"{PREFIX}:loras"


def worker_info(worker_id: str) -> str:
    """Hash of one worker's figures (model, pid, started, active, batch peak...).

    Writer: workers.claims heartbeat (HSET + EXPIRE). Readers: ingest /ready, the TUI, tests.
    """
    return f"{PREFIX}:worker:{worker_id}"


def rate_limit_bucket(caller: str, kind: str) -> str:
    """Hash of one caller's token bucket (fields: tokens, ts), `kind` "requests" or "tokens"; both of a
    caller's buckets share the hash tag `{<caller>}` so one Lua script updates them (cluster-safe).
    `caller` is a digest of the API key (ingest.http.auth.caller_id), never the key. Expires after two refill
    periods idle. Writer and reader: ingest.http.limits (one Lua script, shared by every API node)."""
    return f"{PREFIX}:ratelimit:{{{caller}}}:{kind}"


def stored_response(response_id: str) -> str:
    """A finished Responses-API response kept for `previous_response_id` and GET/DELETE
    /v1/responses/{id} (JSON: body + conversation), with a TTL. Writer and reader: ingest.http.responses_store."""
    return f"{PREFIX}:response:{response_id}"


REQUEST_SHARDS = 64  # hash slots the per-request keys spread over on a cluster (each shard: one slot)


def request_shard(request_id: str) -> int:
    """The request's shard: which of REQUEST_SHARDS hash tags its keys carry."""
    return zlib.crc32(request_id.encode()) % REQUEST_SHARDS


def _tag(request_id: str) -> str:
    return f"{{req:{request_shard(request_id):02x}}}:{request_id}"


def hash_tag(key: str) -> str:
    """The part of `key` a Redis Cluster hashes: between its first `{` and the next `}` (the whole key
    when there is none, or it is empty)."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def tail_doorbell(node: str, reader: str) -> str:
    """A one-entry stream that wakes one of an API node's delta-stream readers (bus.tails) when the set of
    streams it reads changes: named in each of its XREAD calls. `reader` is the reader's index on a single
    server, or the hash tag it reads on a cluster (the doorbell must share the slot of the streams).
    Writer and reader: that node's bus.tails. Expires a day after its last ring."""
    return f"{PREFIX}:tails:{{{reader}}}:{node}"


def delta_stream(request_id: str) -> str:
    """The request's ordered StreamDelta events. Writer: the worker holding the request.
    Readers: encoders.wire (tails it for the client), dumps and replay."""
    return f"{_tag(request_id)}:deltas"


def request_meta(request_id: str) -> str:
    """Hash: status, worker, attempt, timings, batch peak. Writers: ingest.http.publish (received),
    workers.claims (claimed, first token, finished). Readers: dumps, the TUI, tests."""
    return f"{_tag(request_id)}:meta"


def request_ir(request_id: str) -> str:
    """The encoded request IR (as on the request stream), kept for dumps and replay after the stream is
    trimmed. Writer: ingest.http.publish. Readers: dumps, replay, workers.claims on reclaim."""
    return f"{_tag(request_id)}:request"


def request_keys(request_id: str) -> tuple[str, ...]:
    """Every per-request key (one hash slot); each gets the dump TTL after the terminal event."""
    return (delta_stream(request_id), request_meta(request_id), request_ir(request_id), cancel_flag(request_id))


def attachments(request_id: str) -> str:
    """Counter of resumed connections to the request's stream (ingest.http.resume), with its own TTL. Writer:
    the API node a client reconnects to. Reader: the API node whose client left, when its resume grace
    ends: a count that moved means the client came back elsewhere, so the generation is not cancelled."""
    return f"{_tag(request_id)}:attach"


def choices(request_id: str) -> str:
    """The ids of the parts behind a stream of several choices (chat n > 1, completions with n > 1 or
    several prompts), in choice order, JSON. Writer: the API node that takes the request; reader: an
    API node a client resumes that stream on (ingest.http.resume). Expires with the parts' dumps."""
    return f"{_tag(request_id)}:choices"


def cancel_flag(request_id: str) -> str:
    """Present once the request is cancelled; its value says by whom (CLIENT_CANCEL, OPERATOR_CANCEL).
    Writer: bus.cancels (for ingest.http.app on a client disconnect, `met top`). Reader: workers.claims when it
    claims the request (later cancels reach it on CANCELS)."""
    return f"{_tag(request_id)}:cancel"


# ---- Files and batch jobs (ingest.batches.files, ingest.batches.batch_jobs, ingest.batches.batch_dispatch) -------------------
# Every key below is written and read by API nodes only; workers see batch lines as ordinary requests.


def file_meta(file_id: str) -> str:
    """Hash: the file object's fields (JSON under "doc") and its owner. Writer: ingest.batches.files (upload, and
    the dispatcher for batch output files). Readers: ingest.batches.files, ingest.batches.batch_jobs."""
    return f"{PREFIX}:file:{{{file_id}}}:meta"


def file_content(file_id: str) -> str:
    """The file's bytes (bounded by --max-file-mb). Writer and readers as for `file_meta`."""
    return f"{PREFIX}:file:{{{file_id}}}:content"


def files_of(owner: str) -> str:
    """Sorted set of an owner's file ids (score: created). Writer: ingest.batches.files. Reader: GET /v1/files."""
    return f"{PREFIX}:files:{owner}"


def stored_index(owner: str) -> str:
    """Sorted set of what an owner's requests keep stored (members `r:<request id>`, a request record;
    `s:<response id>`, a stored response), score: when it expires. Writers: ingest.http.publish (with each
    admission), ingest.http.responses_store, ingest.http.storage (prunes, evicts). Reader: ingest.http.storage."""
    return f"{PREFIX}:stored:{{{owner}}}:index"


def stored_sizes(owner: str) -> str:
    """Hash: each member of `stored_index(owner)` → its bytes, and `#total` → their sum (same slot).
    Writers and reader: as `stored_index`."""
    return f"{PREFIX}:stored:{{{owner}}}:sizes"


def batch_doc(batch_id: str) -> str:
    """JSON of one batch job (protocol, status, timestamps, owner, ids of its files). Writers: the create,
    cancel and delete routes and the dispatcher (ingest.batches.batch_dispatch). Readers: the batch routes, `met batch`,
    the TUI."""
    return f"{PREFIX}:batch:{{{batch_id}}}:doc"


def batch_lines(batch_id: str) -> str:
    """List of the batch's validated lines (JSON: custom_id, body), in input order. Writer: the create route.
    Reader: the dispatcher."""
    return f"{PREFIX}:batch:{{{batch_id}}}:lines"


def batch_results(batch_id: str) -> str:
    """Hash custom_id → result (JSON: outcome + the protocol's result line): one per line, whatever restarts
    (HSET by custom_id). Writer: the dispatcher. Readers: results routes, counts."""
    return f"{PREFIX}:batch:{{{batch_id}}}:results"


def batch_counts(batch_id: str) -> str:
    """Hash outcome → number of lines with that result (HINCRBY in the same Lua call as the result).
    Writer: the dispatcher. Readers: the batch routes, `met batch`, the TUI."""
    return f"{PREFIX}:batch:{{{batch_id}}}:counts"


def batch_lease(batch_id: str) -> str:
    """Which API node dispatches the batch now (SET NX PX, renewed; expiry hands it to another node).
    Writer and reader: ingest.batches.batch_dispatch."""
    return f"{PREFIX}:batch:{{{batch_id}}}:lease"


def batches_of(owner: str) -> str:
    """Sorted set of an owner's batch ids (score: created). Writer: the create route. Reader: the list routes."""
    return f"{PREFIX}:batches:{owner}"


# Batches not yet ended (set of ids). Writers: the create route (SADD), the dispatcher (SREM at the end).
# Readers: every API node's dispatcher (which one takes a batch is decided by `batch_lease`), the TUI.
BATCHES_ACTIVE = f"{PREFIX}:batches:active"
CLIENT_CANCEL = b"1"  # the cancel flag's value when the client went away: nobody is told
OPERATOR_CANCEL = b"operator"  # ... when an operator cancelled it: the client gets an error
