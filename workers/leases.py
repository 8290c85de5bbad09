"""Claims, leases and fenced writes: the Redis side of at-least-once work with exactly-once output.

- A request is claimed through the consumer group (XREADGROUP for new work, XAUTOCLAIM for work whose
  holder stopped renewing for `lease_s`). Every claim bumps the request's `attempt` in its meta hash
  (HINCRBY): that number is the fencing token.
- The holder renews its lease by resetting the entries' idle time (XCLAIM … JUSTID, which does not
  count as a delivery). A worker that dies stops renewing; its entries go idle and are reclaimed.
- Every delta write goes through one Lua script that first checks the stored attempt: writes from a
  stale attempt (a paused worker that woke up) are rejected atomically, so it can neither interleave
  with nor finish over the new owner. One call takes many requests' writes (a worker's whole step on a
  single server; on a cluster one call per hash slot, the per-request keys being sharded into few). The script writes with NOMKSTREAM (ingest created the stream),
  so an expired request is never recreated; on the terminal event it records the outcome and sets the
  dump TTL on every key of the request (all in one `{req:<shard>}` hash slot, so it is cluster-safe).
- XACK, the queue counter and the finished feed live in other slots, so they follow the script in
  the same pipeline only when it accepted the write.
Must not: decide scheduling or touch torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared import keys
from shared.codec import DELTA_FIELD, FINISHED, RUNNING, Meta

# Several requests' writes in one call (one step's, all of a hash slot's on a cluster). KEYS: four per
# request (meta, deltas, request, cancel). ARGV: ttl, now, then per request, in KEYS order: attempt,
# outcome ("" unless terminal), batch_max, written (how many deltas of this attempt the caller knows were
# written), n, then its n encoded deltas. Returns one number per request: 1 written, 0 its attempt is
# stale. The meta field `emitted` counts the attempt's deltas: a resend after a lost reply skips the ones
# already written (never a duplicate); `first_token_at` is set by the attempt's first write with deltas.
FENCED_WRITE = f"""
local ttl, now = ARGV[1], ARGV[2]
local out = {{}}
local a = 3
for r = 1, #KEYS, 4 do
  local meta, stream = KEYS[r], KEYS[r + 1]
  local attempt, outcome, batch_max, base, n = ARGV[a], ARGV[a + 1], ARGV[a + 2], tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local first = a + 5
  a = first + n
  local held = redis.call('HMGET', meta, '{Meta.ATTEMPT}', '{Meta.EMITTED}')
  if held[1] ~= attempt then
    out[#out + 1] = 0
  else
    local have = tonumber(held[2] or '0')
    for i = 0, n - 1 do
      if base + i >= have then redis.call('XADD', stream, 'NOMKSTREAM', '*', '{DELTA_FIELD}', ARGV[first + i]) end
    end
    if base + n > have then redis.call('HSET', meta, '{Meta.EMITTED}', base + n) end
    if have == 0 and n > 0 and outcome == '' then redis.call('HSETNX', meta, '{Meta.FIRST_TOKEN_AT}', now) end
    if outcome ~= '' then
      redis.call('HSET', meta, '{Meta.STATUS}', '{FINISHED}', '{Meta.OUTCOME}', outcome, '{Meta.FINISHED_AT}', now, '{Meta.BATCH_MAX}', batch_max)
      for k = r, r + 3 do redis.call('EXPIRE', KEYS[k], ttl) end
    end
    out[#out + 1] = 1
  end
end
return out
"""


@dataclass(frozen=True, slots=True)
class Write:
    """One request's part of a fenced write: its deltas (encoded) under its attempt."""

    request_id: str
    attempt: int
    deltas: tuple[bytes, ...]
    written: int = 0  # deltas of this attempt already confirmed written
    outcome: str = ""  # set when the last delta is terminal: the meta's outcome
    batch_max: int = 0


def fenced_args(writes: list[Write], *, ttl: int, now: float) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of one FENCED_WRITE call for these writes (all of one hash slot on a cluster)."""
    script_keys: list[str] = []
    args: list[Any] = [ttl, now]
    for w in writes:
        rid = w.request_id
        script_keys += (keys.request_meta(rid), keys.delta_stream(rid), keys.request_ir(rid), keys.cancel_flag(rid))
        args += (w.attempt, w.outcome, w.batch_max, w.written, len(w.deltas), *w.deltas)
    return script_keys, args


@dataclass(frozen=True, slots=True)
class Claimed:
    entry_id: str
    fields: dict[bytes, bytes] | None  # None: the entry was trimmed away meanwhile
    deliveries: int
    stream: str = keys.REQUEST_STREAM  # the shared request stream, or a worker's routed one (shared.keys.routed_stream)


async def ensure_group(redis: Redis, stream: str = keys.REQUEST_STREAM) -> None:
    try:
        await redis.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def claim_new(
    redis: Redis, consumer: str, *, count: int, block_ms: int | None, own: str | None = None, stream: str = keys.REQUEST_STREAM
) -> list[Claimed]:
    """New entries for `consumer`: of the shared request stream and, with `own`, of that stream too (the
    worker's routed stream: one call, one slot, so an idle worker blocks on both). COUNT holds per stream:
    up to twice `count` may come back (the scheduler queues what is over its room: a routed request was
    meant for this worker)."""
    streams: dict[Any, Any] = {own: ">", stream: ">"} if own else {stream: ">"}
    reply: Any = await redis.xreadgroup(keys.WORKER_GROUP, consumer, streams, count=count, block=block_ms)
    return [Claimed(_text(eid), fields, 1, _text(stream)) for stream, entries in _stream_replies(reply) for eid, fields in entries]


def _stream_replies(reply: Any) -> list[tuple[Any, Any]]:
    """XREADGROUP's reply as (stream, entries) pairs: RESP2 gives a list of pairs, RESP3 a map."""
    if not reply:
        return []
    return list(reply.items()) if isinstance(reply, dict) else [(r[0], r[1]) for r in reply]


async def reclaim_idle(redis: Redis, consumer: str, *, count: int, lease_s: float, stream: str = keys.REQUEST_STREAM) -> list[Claimed]:
    """Take over up to `count` entries idle longer than the lease, from the start of the pending list
    (one page: `reclaim_page` goes on from where a page stopped)."""
    claimed, _cursor = await reclaim_page(redis, consumer, count=count, lease_s=lease_s, start=START, stream=stream)
    return claimed


START = "0-0"  # XAUTOCLAIM's cursor at the start of the pending list; a page returning it has seen the end


async def reclaim_page(
    redis: Redis, consumer: str, *, count: int, lease_s: float, start: str, stream: str = keys.REQUEST_STREAM
) -> tuple[list[Claimed], str]:
    """One XAUTOCLAIM page from cursor `start`: the entries taken over (idle longer than the lease) and
    the cursor to go on from (START once the pending list's end was reached). Redis scans at most ten
    times `count` entries a page, so a long pending list of live work takes several pages to cross, and
    a caller that always began at START would never reach an idle entry past the first page. Parses
    both reply shapes: Redis 6.2 answers [cursor, entries], 7.x answers [cursor, entries, deleted ids]."""
    # Read the reply raw: redis-py's parser assumes 7.x and fails on 6.2's [id, nil] for deleted entries.
    redis.set_response_callback("XAUTOCLAIM", _raw)
    reply: Any = await redis.execute_command(
        "XAUTOCLAIM", stream, keys.WORKER_GROUP, consumer, int(lease_s * 1000), start, "COUNT", count
    )
    cursor = _text(reply[0]) if reply else START
    entries = reply[1] if reply else []
    claimed = [(_text(e[0]), _fields(e[1])) for e in entries if e]
    if not claimed:
        return [], cursor
    deliveries = await _delivery_counts(redis, [eid for eid, _ in claimed], stream)
    return [Claimed(eid, fields, deliveries.get(eid, 1), stream) for eid, fields in claimed], cursor


async def forget_dead_workers(redis: Redis, *, heartbeat_ttl: float, lease_s: float) -> list[str]:
    """Drop the workers whose heartbeat lapsed from the alive set (what `met top` lists) and from the
    consumer group, once nothing is pending under their name (their requests were reclaimed), or once
    their heartbeat is long expired (ten leases: a pending entry that old is reclaimed by then anyway).
    Returns the ids dropped."""
    now = time.time()
    stale: Any = await redis.zrangebyscore(keys.WORKERS_ALIVE, "-inf", now - heartbeat_ttl, withscores=True)
    if not stale:
        return []
    try:
        consumers: Any = await redis.xinfo_consumers(keys.REQUEST_STREAM, keys.WORKER_GROUP)
    except ResponseError:  # no stream or group yet
        consumers = []
    pending = {_text(c["name"]): int(c["pending"]) for c in consumers}
    gone = [_text(w) for w, beat in stale if not pending.get(_text(w)) or now - float(beat) > heartbeat_ttl + 10 * lease_s]
    if gone:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.zrem(keys.WORKERS_ALIVE, *gone)
            for worker in gone:
                if not pending.get(worker):  # a consumer with pending entries keeps them until reclaimed
                    pipe.xgroup_delconsumer(keys.REQUEST_STREAM, keys.WORKER_GROUP, worker)
            await pipe.execute(raise_on_error=False)
    return gone


async def _delivery_counts(redis: Redis, entry_ids: list[str], stream: str = keys.REQUEST_STREAM) -> dict[str, int]:
    counts: dict[str, int] = {}
    async with redis.pipeline(transaction=False) as pipe:
        for eid in entry_ids:
            pipe.xpending_range(stream, keys.WORKER_GROUP, min=eid, max=eid, count=1)
        for rows in await pipe.execute():
            for row in rows:
                counts[_text(row["message_id"])] = int(row["times_delivered"])
    return counts


async def renew(redis: Redis, consumer: str, entry_ids: list[str], *, stream: str = keys.REQUEST_STREAM) -> None:
    """Reset the idle time of the entries we hold (not a delivery), so nobody reclaims live work."""
    if entry_ids:
        await redis.xclaim(stream, keys.WORKER_GROUP, consumer, 0, list[Any](entry_ids), justid=True)


async def renew_all(redis: Redis, consumer: str, held: list[tuple[str, str]]) -> None:
    """`renew` (stream, entry id) pairs held on several streams: one call per stream."""
    for stream, entry_ids in by_stream(held).items():
        await renew(redis, consumer, entry_ids, stream=stream)


def by_stream(held: list[tuple[str, str]]) -> dict[str, list[str]]:
    """(stream, entry id) pairs grouped by stream, the shared one first."""
    grouped: dict[str, list[str]] = {}
    for stream, eid in sorted(held, key=lambda h: h[0] != keys.REQUEST_STREAM):
        grouped.setdefault(stream, []).append(eid)
    return grouped


async def release(redis: Redis, consumer: str, entry_ids: list[str], *, lease_s: float, stream: str = keys.REQUEST_STREAM) -> None:
    """Hand entries back at once (a drain's hand-back): mark them idle past the lease so the next
    XAUTOCLAIM takes them, with their delivery count one lower, so that XAUTOCLAIM's increment leaves it
    where it was: a hand-back is not a failed delivery, and a long request carried through rolling
    restarts is never dead-lettered for them (`--max-deliveries` counts the deliveries that died)."""
    if not entry_ids:
        return
    idle_ms = int(lease_s * 1000) * 10
    counts = await _delivery_counts(redis, entry_ids, stream)
    async with redis.pipeline(transaction=False) as pipe:
        for eid in entry_ids:
            retries = max(0, counts.get(eid, 1) - 1)
            pipe.xclaim(stream, keys.WORKER_GROUP, consumer, 0, [eid], idle=idle_ms, retrycount=retries, justid=True)
        await pipe.execute()


# Bump a request's attempt (the fencing token) and record the claim. KEYS: meta. ARGV: worker, now,
# deliveries. Returns the new attempt.
_BEGIN_ATTEMPT = f"""
local attempt = redis.call('HINCRBY', KEYS[1], '{Meta.ATTEMPT}', 1)
redis.call('HSET', KEYS[1], '{Meta.STATUS}', '{RUNNING}', '{Meta.WORKER}', ARGV[1], '{Meta.CLAIMED_AT}', ARGV[2], '{Meta.DELIVERIES}', ARGV[3], '{Meta.EMITTED}', 0)
return attempt
"""


async def begin_attempts(redis: Redis, claims: list[tuple[str, int]], *, worker: str) -> list[int]:
    """Begin an attempt for each (request id, deliveries): one script each (atomic), all in one round trip.
    Returns the attempt numbers, in order."""
    if not claims:
        return []
    now = time.time()
    async with redis.pipeline(transaction=False) as pipe:
        for rid, deliveries in claims:
            pipe.eval(_BEGIN_ATTEMPT, 1, keys.request_meta(rid), worker, now, deliveries)
        return [int(a) for a in await pipe.execute()]


async def begin_attempt(redis: Redis, request_id: str, *, worker: str, deliveries: int) -> int:
    """Bump and return the request's attempt number (the fencing token) and record the claim."""
    [attempt] = await begin_attempts(redis, [(request_id, deliveries)], worker=worker)
    return attempt


async def sweep_inflight(redis: Redis, *, grace_s: float) -> list[str]:
    """Heal the in-flight sets (keys.INFLIGHT and the batch pool's): remove the ids whose request finished
    (its terminal event was written but the ZREM after it was lost) or never reached Redis (admitted more
    than `grace_s` ago, no meta hash: a submit or release that failed halfway). O(in flight): one ZRANGE,
    one pipelined HGET each. Returns the ids removed."""
    gone: list[str] = []
    for in_flight in keys.IN_FLIGHT_SETS:
        gone += await _sweep(redis, in_flight, grace_s)
    return gone


async def _sweep(redis: Redis, in_flight: str, grace_s: float) -> list[str]:
    members: Any = await redis.zrange(in_flight, 0, -1, withscores=True)
    if not members:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for rid, _admitted in members:
            pipe.hget(keys.request_meta(_text(rid)), Meta.STATUS)
        statuses = await pipe.execute()
    cutoff = time.time() - grace_s
    gone = [_text(rid) for (rid, admitted), status in zip(members, statuses, strict=True) if status == FINISHED.encode() or (status is None and admitted < cutoff)]
    if gone:
        await redis.zrem(in_flight, *gone)
    return gone


async def trim_acknowledged(redis: Redis, stream: str = keys.REQUEST_STREAM) -> None:
    """Trim a request stream below the oldest entry still pending or not yet delivered (never MAXLEN)."""
    groups: Any = await redis.xinfo_groups(stream)
    group = next((g for g in groups if _text(g["name"]) == keys.WORKER_GROUP), None)
    if group is None:
        return
    floor = _text(group["last-delivered-id"])
    summary: Any = await redis.xpending(stream, keys.WORKER_GROUP)
    if summary and summary.get("pending") and summary.get("min"):
        floor = min(floor, _text(summary["min"]), key=_id_key)
    if floor != "0-0":
        await redis.xtrim(stream, minid=floor, approximate=False)


async def undelivered(redis: Redis, stream: str, *, cap: int = 64) -> int:
    """Entries of a request stream its group has not delivered yet (up to `cap`; 0 with no stream or group)."""
    try:
        groups: Any = await redis.xinfo_groups(stream)
    except ResponseError:
        return 0
    group = next((g for g in groups if _text(g["name"]) == keys.WORKER_GROUP), None)
    if group is None:
        return 0
    newer: Any = await redis.xrange(stream, min=f"({_text(group['last-delivered-id'])}", count=cap)
    return len(newer)


async def work_left(redis: Redis, stream: str) -> int:
    """Entries of a request stream still pending in the group or not yet delivered (0: it holds no work;
    a stream or group that does not exist holds none)."""
    try:
        groups: Any = await redis.xinfo_groups(stream)
    except ResponseError:  # no such stream
        return 0
    group = next((g for g in groups if _text(g["name"]) == keys.WORKER_GROUP), None)
    if group is None:
        return int(await redis.xlen(stream))
    newer: Any = await redis.xrange(stream, min=f"({_text(group['last-delivered-id'])}", count=1)
    return int(group.get("pending") or 0) + len(newer)


def _raw(response: Any, **_options: Any) -> Any:
    return response


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _fields(raw: Any) -> dict[bytes, bytes] | None:
    if raw is None:
        return None
    if isinstance(raw, dict):
        return raw
    return {raw[i]: raw[i + 1] for i in range(0, len(raw), 2)}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
