"""Claims, leases and fenced writes: the Redis side of at-least-once work with exactly-once output.

- A request is claimed through the consumer group (XREADGROUP for new work, XAUTOCLAIM for work whose
  holder stopped renewing for `lease_s`). Every claim bumps the request's `attempt` in its meta hash
  (HINCRBY): that number is the fencing token.
- The holder renews its lease by resetting the entries' idle time (XCLAIM … JUSTID, which does not
  count as a delivery). A worker that dies stops renewing; its entries go idle and are reclaimed.
- Every delta write goes through one Lua script that first checks the stored attempt: writes from a
  stale attempt (a paused worker that woke up) are rejected atomically, so it can neither interleave
  with nor finish over the new owner. The script writes with NOMKSTREAM (ingest created the stream),
  so an expired request is never recreated; on the terminal event it records the outcome and sets the
  dump TTL on every key of the request (all in one `{req:<id>}` hash slot, so it is cluster-safe).
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

# KEYS: meta, deltas, request, cancel. ARGV: attempt, ttl, outcome ("" unless terminal), now, batch_max,
# written (how many deltas of this attempt the caller knows were written), then one encoded delta per
# remaining argument. Returns 1 when written, 0 when the attempt is stale. The meta field `emitted` counts
# this attempt's deltas: a resend after a lost reply skips the ones already written (never a duplicate).
FENCED_WRITE = f"""
if redis.call('HGET', KEYS[1], '{Meta.ATTEMPT}') ~= ARGV[1] then return 0 end
local have = tonumber(redis.call('HGET', KEYS[1], '{Meta.EMITTED}') or '0')
local base = tonumber(ARGV[6])
for i = 7, #ARGV do
  if base + i - 7 >= have then redis.call('XADD', KEYS[2], 'NOMKSTREAM', '*', '{DELTA_FIELD}', ARGV[i]) end
end
if base + #ARGV - 6 > have then redis.call('HSET', KEYS[1], '{Meta.EMITTED}', base + #ARGV - 6) end
if ARGV[3] == '' then
  if #ARGV >= 7 then redis.call('HSETNX', KEYS[1], '{Meta.FIRST_TOKEN_AT}', ARGV[4]) end
  return 1
end
redis.call('HSET', KEYS[1], '{Meta.STATUS}', '{FINISHED}', '{Meta.OUTCOME}', ARGV[3], '{Meta.FINISHED_AT}', ARGV[4], '{Meta.BATCH_MAX}', ARGV[5])
for i = 1, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[2]) end
return 1
"""


@dataclass(frozen=True, slots=True)
class Claimed:
    entry_id: str
    fields: dict[bytes, bytes] | None  # None: the entry was trimmed away meanwhile
    deliveries: int


async def ensure_group(redis: Redis) -> None:
    try:
        await redis.xgroup_create(keys.REQUEST_STREAM, keys.WORKER_GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def claim_new(redis: Redis, consumer: str, *, count: int, block_ms: int | None) -> list[Claimed]:
    reply: Any = await redis.xreadgroup(keys.WORKER_GROUP, consumer, {keys.REQUEST_STREAM: ">"}, count=count, block=block_ms)
    return [Claimed(_text(eid), fields, 1) for _stream, entries in reply or [] for eid, fields in entries]


async def reclaim_idle(redis: Redis, consumer: str, *, count: int, lease_s: float) -> list[Claimed]:
    """Take over entries idle longer than the lease. Parses both reply shapes: Redis 6.2 answers
    [cursor, entries], 7.x answers [cursor, entries, deleted ids]."""
    # Read the reply raw: redis-py's parser assumes 7.x and fails on 6.2's [id, nil] for deleted entries.
    redis.set_response_callback("XAUTOCLAIM", _raw)
    reply: Any = await redis.execute_command(
        "XAUTOCLAIM", keys.REQUEST_STREAM, keys.WORKER_GROUP, consumer, int(lease_s * 1000), "0-0", "COUNT", count
    )
    entries = reply[1] if reply else []
    claimed = [(_text(e[0]), _fields(e[1])) for e in entries if e]
    if not claimed:
        return []
    deliveries = await _delivery_counts(redis, [eid for eid, _ in claimed])
    return [Claimed(eid, fields, deliveries.get(eid, 1)) for eid, fields in claimed]


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


async def _delivery_counts(redis: Redis, entry_ids: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    async with redis.pipeline(transaction=False) as pipe:
        for eid in entry_ids:
            pipe.xpending_range(keys.REQUEST_STREAM, keys.WORKER_GROUP, min=eid, max=eid, count=1)
        for rows in await pipe.execute():
            for row in rows:
                counts[_text(row["message_id"])] = int(row["times_delivered"])
    return counts


async def renew(redis: Redis, consumer: str, entry_ids: list[str]) -> None:
    """Reset the idle time of the entries we hold (not a delivery), so nobody reclaims live work."""
    if entry_ids:
        await redis.xclaim(keys.REQUEST_STREAM, keys.WORKER_GROUP, consumer, 0, list[Any](entry_ids), justid=True)


async def release(redis: Redis, consumer: str, entry_ids: list[str], *, lease_s: float) -> None:
    """Hand entries back at once: mark them idle past the lease so the next XAUTOCLAIM takes them."""
    if entry_ids:
        idle_ms = int(lease_s * 1000) * 10
        await redis.xclaim(keys.REQUEST_STREAM, keys.WORKER_GROUP, consumer, 0, list[Any](entry_ids), idle=idle_ms, justid=True)


async def begin_attempt(redis: Redis, request_id: str, *, worker: str, deliveries: int) -> int:
    """Bump and return the request's attempt number (the fencing token) and record the claim."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hincrby(keys.request_meta(request_id), Meta.ATTEMPT, 1)
        claim = {Meta.STATUS: RUNNING, Meta.WORKER: worker, Meta.CLAIMED_AT: time.time(), Meta.DELIVERIES: deliveries, Meta.EMITTED: 0}
        pipe.hset(keys.request_meta(request_id), mapping=claim)  # type: ignore[arg-type]
        attempt, _ = await pipe.execute()
    return int(attempt)


async def sweep_inflight(redis: Redis, *, grace_s: float) -> list[str]:
    """Heal the in-flight set (keys.INFLIGHT): remove the ids whose request finished (its terminal event
    was written but the ZREM after it was lost) or never reached Redis (admitted more than `grace_s` ago,
    no meta hash: a submit or release that failed halfway). O(in flight): one ZRANGE, one pipelined HGET
    each. Returns the ids removed."""
    members: Any = await redis.zrange(keys.INFLIGHT, 0, -1, withscores=True)
    if not members:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for rid, _admitted in members:
            pipe.hget(keys.request_meta(_text(rid)), Meta.STATUS)
        statuses = await pipe.execute()
    cutoff = time.time() - grace_s
    gone = [_text(rid) for (rid, admitted), status in zip(members, statuses, strict=True) if status == FINISHED.encode() or (status is None and admitted < cutoff)]
    if gone:
        await redis.zrem(keys.INFLIGHT, *gone)
    return gone


async def trim_acknowledged(redis: Redis) -> None:
    """Trim the request stream below the oldest entry still pending or not yet delivered (never MAXLEN)."""
    groups: Any = await redis.xinfo_groups(keys.REQUEST_STREAM)
    group = next((g for g in groups if _text(g["name"]) == keys.WORKER_GROUP), None)
    if group is None:
        return
    floor = _text(group["last-delivered-id"])
    summary: Any = await redis.xpending(keys.REQUEST_STREAM, keys.WORKER_GROUP)
    if summary and summary.get("pending") and summary.get("min"):
        floor = min(floor, _text(summary["min"]), key=_id_key)
    if floor != "0-0":
        await redis.xtrim(keys.REQUEST_STREAM, minid=floor, approximate=False)


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
