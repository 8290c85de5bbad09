"""Ingest's Redis writes: put an admitted request on the request stream, flag a cancel."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError, WatchError

from bus import cancels
from bus.connect import is_cluster
from ingest.http import storage
from ingest.http.auth import ANONYMOUS
from shared import keys
from shared.codec import ID_FIELD, QUEUED, REQUEST_FIELD, STREAM_MARKER, VERSION, Meta, encode_request, request_entry
from shared.ir import Request

OWNER = Meta.OWNER  # the request meta field naming the caller id that made it (ingest.http.auth.owns)
BATCH_CLIENT = "batch"  # the client `met top` shows for a batch line


@dataclass(frozen=True, slots=True)
class Origin:
    """Who made a request: the caller id that owns it (ingest.http.auth) and the client `met top` shows."""

    owner: str = ANONYMOUS
    client: str = ""


async def submit(redis: Redis, request: Request, *, owner: str = ANONYMOUS, client: str = "", stream: str = keys.REQUEST_STREAM) -> None:
    """Record the request (IR, meta, index), create its empty delta stream (so that workers' NOMKSTREAM
    writes can never recreate an expired one), then XADD it (never MAXLEN: accepted work is never trimmed).

    On one Redis a non-transactional pipeline keeps that order. On a cluster these keys live in
    different slots and redis-py sends each node's share concurrently, so the request's own keys are
    written first (one slot, one script) and the global ones after (bus.connect).

    `stream`: the request stream it goes on, the shared one or a worker's routed one (ingest.http.routing);
    a routed stream that no longer exists (its worker left and it was emptied) is never recreated
    (NOMKSTREAM): the request goes on the shared stream instead."""
    if is_cluster(redis):
        encoded = encode_request(request)
        await _record(redis, request, encoded, owner, client)
        async with redis.pipeline(transaction=False) as pipe:
            pipe.zadd(keys.REQUEST_INDEX, {request.id: time.time()})
            await pipe.execute()
        await _xadd(redis, request, encoded, stream)
        return
    async with redis.pipeline(transaction=False) as pipe:
        encoded = _queue(pipe, request, owner, client, enqueue=stream == keys.REQUEST_STREAM)
        await pipe.execute()
    if stream != keys.REQUEST_STREAM:
        await _xadd(redis, request, encoded, stream)


async def _xadd(redis: Redis, request: Request, encoded: bytes, stream: str) -> None:
    """XADD the request to `stream`, or to the shared stream when `stream` is a routed one that is gone."""
    entry = request_entry(request, encoded)
    if stream != keys.REQUEST_STREAM and await redis.xadd(stream, entry, nomkstream=True) is not None:
        return
    await redis.xadd(keys.REQUEST_STREAM, entry)


async def submit_batch_line(
    redis: Redis, request: Request, *, owner: str = ANONYMOUS, client: str = BATCH_CLIENT, lease: tuple[str, str] | None = None
) -> bool:
    """`submit` for a batch line, all or nothing (MULTI/EXEC), with its place in the queue counted, and
    fenced: it queues nothing (False) when the line is queued already or, with `lease` (the batch's lease
    key, this node's id), when this node no longer holds the batch. The check and the write are one
    optimistic transaction (WATCH on the line's IR key and the lease): a node whose lease lapsed while it
    paused cannot queue a line the new leader queued meanwhile. Once the IR key exists the line is queued,
    so a dispatcher that restarts asks `is_queued` and never queues a line twice or loses one.

    A cluster has no MULTI across slots, so there it takes three steps after the same checks (not atomic
    with them): the request's keys without the IR (an idempotent script), then the count and the XADD,
    then the IR key. A dispatcher that dies between the last two, or loses its lease between the check
    and the write, queues that one line twice (it runs twice; its result is recorded once, by custom_id):
    at least once, never lost."""
    if is_cluster(redis):
        if await is_queued(redis, request.id) or (lease is not None and await redis.get(lease[0]) != lease[1].encode()):
            return False
        encoded = encode_request(request)
        await _record(redis, request, b"", owner, client)
        async with redis.pipeline(transaction=False) as pipe:
            pipe.zadd(keys.INFLIGHT_BATCH, {request.id: time.time()})
            _enqueue(pipe, request, encoded)
            await pipe.execute()
        await redis.set(keys.request_ir(request.id), encoded)
        return True
    ir = keys.request_ir(request.id)
    async with redis.pipeline(transaction=True) as pipe:
        try:
            await pipe.watch(ir, *([lease[0]] if lease else []))
            if await pipe.exists(ir) or (lease is not None and await pipe.get(lease[0]) != lease[1].encode()):
                await pipe.unwatch()
                return False
            pipe.multi()
            pipe.zadd(keys.INFLIGHT_BATCH, {request.id: time.time()})
            _queue(pipe, request, owner, client)
            await pipe.execute()
        except WatchError:  # the line was queued, or the lease changed hands, between the check and the write
            return False
    return True


async def is_queued(redis: Redis, request_id: str) -> bool:
    return bool(await redis.exists(keys.request_ir(request_id)))


async def owner_of(redis: Redis, request_id: str) -> str | None:
    """The caller id that made the request (None: unknown, expired, or queued before owners were recorded)."""
    raw: Any = await redis.hget(keys.request_meta(request_id), OWNER)
    return bytes(raw).decode() if raw is not None else None


def _queue(pipe: Pipeline, request: Request, owner: str, client: str = "", *, enqueue: bool = True) -> bytes:
    """Queue the request's writes on `pipe` (the XADD to the shared stream last, unless not `enqueue`); its record."""
    encoded = encode_request(request)
    now = time.time()
    deltas = keys.delta_stream(request.id)
    pipe.set(keys.request_ir(request.id), encoded)
    meta = {Meta.STATUS: QUEUED, Meta.PROTOCOL: request.protocol.value, Meta.MODEL: request.model, Meta.ENDPOINT: request.endpoint, Meta.RECEIVED_AT: now, OWNER: owner, Meta.CLIENT: client}
    pipe.hset(keys.request_meta(request.id), mapping=meta)  # type: ignore[arg-type]
    pipe.xadd(deltas, STREAM_MARKER, id="0-1")
    pipe.xtrim(deltas, maxlen=0, approximate=False)
    pipe.zadd(keys.REQUEST_INDEX, {request.id: now})
    if enqueue:
        pipe.xadd(keys.REQUEST_STREAM, request_entry(request, encoded))
    return encoded


# The request's own keys, one slot (cluster path): KEYS ir, meta, deltas; ARGV encoded IR ('' = not
# yet), protocol, model, endpoint, now, owner, client. Creates the empty delta stream once (an empty stream stays a key).
_MARKER_FIELD, _MARKER_VALUE = (str(v.decode() if isinstance(v, bytes) else v) for v in next(iter(STREAM_MARKER.items())))
_RECORD = f"""
if redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('XADD', KEYS[3], '0-1', '{_MARKER_FIELD}', '{_MARKER_VALUE}')
  redis.call('XTRIM', KEYS[3], 'MAXLEN', 0)
end
redis.call('HSET', KEYS[2], '{Meta.STATUS}', '{QUEUED}', '{Meta.PROTOCOL}', ARGV[2], '{Meta.MODEL}', ARGV[3], '{Meta.ENDPOINT}', ARGV[4], '{Meta.RECEIVED_AT}', ARGV[5], '{Meta.OWNER}', ARGV[6], '{Meta.CLIENT}', ARGV[7])
if ARGV[1] ~= '' then redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"""


async def _record(redis: Redis, request: Request, encoded: bytes, owner: str, client: str = "") -> None:
    ids = (keys.request_ir(request.id), keys.request_meta(request.id), keys.delta_stream(request.id))
    await redis.eval(_RECORD, 3, *ids, encoded, request.protocol.value, request.model, request.endpoint, time.time(), owner, client)


def _enqueue(pipe: Any, request: Request, encoded: bytes) -> None:
    """The global half of a submit (cluster path): the index and the shared request stream."""
    pipe.zadd(keys.REQUEST_INDEX, {request.id: time.time()})
    pipe.xadd(keys.REQUEST_STREAM, request_entry(request, encoded))


# Atomically: drop ids admitted before ARGV[2] (older than any request lives), then refuse (-1) when admitting
# the ids ARGV[4..] would pass the limit ARGV[1]; else add them with score ARGV[3] (now) and return the size.
_ADMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[2])
if redis.call('ZCARD', KEYS[1]) + #ARGV - 3 > tonumber(ARGV[1]) then return -1 end
for i = 4, #ARGV do redis.call('ZADD', KEYS[1], ARGV[3], ARGV[i]) end
return redis.call('ZCARD', KEYS[1])
"""
LIFETIME_MARGIN_S = 120.0  # past the request timeout: queue and clock slack before an id is surely stale


async def admit(redis: Redis, request_ids: list[str], limit: int, *, request_timeout: float) -> bool:
    """Reserve a place in the queue for each id; False when the queue is full."""
    now = time.time()
    result = await redis.eval(_ADMIT, 1, keys.INFLIGHT, limit, now - request_timeout - LIFETIME_MARGIN_S, now, *request_ids)
    return int(result) >= 0


# Admission and submission in one call (a single server: the keys of every part and the global ones may
# be named together). KEYS: inflight, index, request stream, the owner's storage ledger (index, sizes:
# ingest.http.storage), the stream the parts go on (the request stream, or a worker's routed stream: if that
# one is gone, NOMKSTREAM fails and they go on the request stream), then per part ir, meta, deltas. ARGV: limit, stale before, now, owner, client, ledger
# keep ('': no ledger), record lifetime, then per part id, encoded IR, protocol, model, endpoint. As `admit`,
# then for each part what `_queue` does, in its order, and its record into the ledger; -1 (nothing
# written) when the queue is full, else the owner's stored bytes (0 with no ledger).
_ADMIT_AND_SUBMIT = storage.LEDGER_LUA + f"""
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[2])
local parts = (#KEYS - 6) / 3
if redis.call('ZCARD', KEYS[1]) + parts > tonumber(ARGV[1]) then return -1 end
local now, owner, client = ARGV[3], ARGV[4], ARGV[5]
local entries = {{}}
for p = 0, parts - 1 do
  local ir, meta, deltas = KEYS[7 + p * 3], KEYS[8 + p * 3], KEYS[9 + p * 3]
  local a = 8 + p * 5
  local id, encoded = ARGV[a], ARGV[a + 1]
  redis.call('ZADD', KEYS[1], now, id)
  redis.call('SET', ir, encoded)
  redis.call('HSET', meta, '{Meta.STATUS}', '{QUEUED}', '{Meta.PROTOCOL}', ARGV[a + 2], '{Meta.MODEL}', ARGV[a + 3], '{Meta.ENDPOINT}', ARGV[a + 4], '{Meta.RECEIVED_AT}', now, '{Meta.OWNER}', owner, '{Meta.CLIENT}', client)
  if redis.call('EXISTS', deltas) == 0 then
    redis.call('XADD', deltas, '0-1', '{_MARKER_FIELD}', '{_MARKER_VALUE}')
    redis.call('XTRIM', deltas, 'MAXLEN', 0)
  end
  redis.call('ZADD', KEYS[2], now, id)
  local queued = false
  if KEYS[6] ~= KEYS[3] then
    queued = redis.call('XADD', KEYS[6], 'NOMKSTREAM', '*', 'v', '{VERSION}', '{ID_FIELD}', id, '{REQUEST_FIELD}', encoded)
  end
  if not queued then redis.call('XADD', KEYS[3], '*', 'v', '{VERSION}', '{ID_FIELD}', id, '{REQUEST_FIELD}', encoded) end
  entries[#entries + 1] = '{storage.RECORD}' .. id
  entries[#entries + 1] = string.len(encoded)
  entries[#entries + 1] = tonumber(now) + tonumber(ARGV[7])
end
if ARGV[6] == '' then return 0 end
return ledger(KEYS[4], KEYS[5], now, ARGV[6], entries)
"""


@dataclass(frozen=True, slots=True)
class Admission:
    """What admission checks a request against: the queue limit, how long a request may live (ids older are
    stale), and the per-key storage quota (ingest.http.storage; None or a zero cap: no ledger)."""

    limit: int
    request_timeout: float
    quota: storage.Quota | None = None


async def admit_and_submit(
    redis: Redis,
    parts: list[Request],
    admission: Admission,
    *,
    origin: Origin | None = None,
    encoded: list[bytes] | None = None,
    stream: str = keys.REQUEST_STREAM,
) -> int:
    """`admit` every part and `submit` each, or nothing when the queue is full (-1). One round trip and
    one atomic script on a single server (the API node's per-request Redis work: before, a script and a
    six-command pipeline); on a cluster, whose keys hash apart, `admit` then `submit_all`. `encoded`: the
    parts' records when the caller has them already. With a quota (its cap set) each part's record goes
    into the owner's storage ledger (ingest.http.storage) and the owner's stored bytes are returned (else 0):
    the caller makes room when they pass the cap. `stream`: where the parts go (`submit`)."""
    owner, client = (origin.owner, origin.client) if origin else (ANONYMOUS, "")
    records = encoded or [encode_request(p) for p in parts]
    limit, request_timeout, quota = admission.limit, admission.request_timeout, admission.quota
    ledger = quota is not None and quota.cap > 0
    if is_cluster(redis):
        if not await admit(redis, [p.id for p in parts], limit, request_timeout=request_timeout):
            return -1
        await submit_all(redis, parts, owner=owner, client=client, stream=stream)
        if not ledger:
            return 0
        assert quota is not None
        expiry = time.time() + quota.record_s
        entries = [(storage.RECORD + p.id, len(r), expiry) for p, r in zip(parts, records, strict=True)]
        try:  # the parts are queued: a ledger that misses one is only generous
            return await storage.record(redis, owner, entries, keep_s=quota.keep_s)
        except RedisError:
            return 0
    now = time.time()
    script_keys = [keys.INFLIGHT, keys.REQUEST_INDEX, keys.REQUEST_STREAM, keys.stored_index(owner), keys.stored_sizes(owner), stream]
    args: list[Any] = [limit, now - request_timeout - LIFETIME_MARGIN_S, now, owner, client]
    args += (quota.keep_s, quota.record_s) if ledger and quota is not None else ("", 0)
    for part, record in zip(parts, records, strict=True):
        script_keys += (keys.request_ir(part.id), keys.request_meta(part.id), keys.delta_stream(part.id))
        args += (part.id, record, part.protocol.value, part.model, part.endpoint)
    script = redis.register_script(_ADMIT_AND_SUBMIT)  # EVALSHA, loaded on the first NOSCRIPT
    return int(await script(keys=script_keys, args=args))


async def release(redis: Redis, request_ids: list[str]) -> None:
    if request_ids:
        await redis.zrem(keys.INFLIGHT, *request_ids)


async def submit_all(redis: Redis, parts: list[Request], *, owner: str = ANONYMOUS, client: str = "", stream: str = keys.REQUEST_STREAM) -> None:
    """`submit` each admitted part; on a Redis error give back the places of the parts not tried (best
    effort: what a failing Redis keeps, the sweep finds), and raise. The part that failed keeps its place:
    it may have been queued (a lost reply), and if not, the sweep removes it (its request never appears)."""
    for i, part in enumerate(parts):
        try:
            await submit(redis, part, owner=owner, client=client, stream=stream)
        except RedisError:
            with contextlib.suppress(RedisError):
                await release(redis, [p.id for p in parts[i + 1 :]])
            raise


async def cancel(redis: Redis, request_id: str, *, by_operator: bool = False) -> None:
    """Cancel the request: its flag and a notice on the workers' cancel feed (bus.cancels)."""
    await cancels.cancel(redis, request_id, by_operator=by_operator)
