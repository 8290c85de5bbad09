"""Per-key storage quota: what one API key's requests keep in Redis, bounded (`--max-stored-mb-per-key`).

A key's requests keep request records (the encoded IR of each, with its meta and deltas, for
`--dump-ttl`: dumps, replay, resume) and stored Responses (`store: true`, kept `MET_RESPONSE_TTL`,
30 days). Each is an entry of the key's ledger (`keys.stored_index`: member → when it expires;
`keys.stored_sizes`: member → bytes, and `#total`), written as it is stored: for a request by the
admission script itself (ingest.http.publish, `LEDGER_LUA`), so the hot path pays no round trip of its own.
Entries past their expiry leave the ledger on the next write.

When a key's total passes its cap, what of it expires first is dropped early (`make_room`): request
records of finished requests only (a request in flight keeps its IR: a reclaim reads it), then stored
responses (they expire a month out, records a day). Dropped means the record's keys are deleted, as its
TTL would have: a dump or replay of it then says it is gone, a stored response is rebuilt from its
deltas while they last. `met_stored_evicted_total{kind}` counts them. What is counted: the encoded IR
(the request as the client sent it: up to the body cap, 32 MiB) and a stored response's JSON; deltas
are bounded by `max_tokens` and not counted. Bounded this way, one key's requests hold at most its cap
plus what it has in flight (which admission and rate limits bound).

Hand-written: no library keeps a byte budget over Redis keys that live in other slots.
Must not: evict a request that has not finished, or fail a request because eviction failed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared import keys
from shared.codec import FINISHED, Meta

log = logging.getLogger(__name__)

TOTAL = "#total"  # the field of keys.stored_sizes holding the sum (members start with r: or s:)
RECORD, RESPONSE = "r:", "s:"
_PRUNE_AT_ONCE = 256  # expired entries one write takes out (the rest go with later writes)

# A Lua function: prune entries of ledger `idx` / `sizes` that expired by `now`, add `entries` (a flat
# list: member, bytes, expiry), keep both keys `keep` seconds, return the total. Embedded in the
# admission script (ingest.http.publish) and in `_RECORD` below.
LEDGER_LUA = f"""
local function ledger(idx, sizes, now, keep, entries)
  local old = redis.call('ZRANGEBYSCORE', idx, '-inf', now, 'LIMIT', 0, {_PRUNE_AT_ONCE})
  for _, m in ipairs(old) do
    local b = redis.call('HGET', sizes, m)
    if b then
      redis.call('HINCRBY', sizes, '{TOTAL}', -tonumber(b))
      redis.call('HDEL', sizes, m)
    end
    redis.call('ZREM', idx, m)
  end
  for i = 1, #entries, 3 do
    local m, b = entries[i], tonumber(entries[i + 1])
    local prev = redis.call('HGET', sizes, m)
    if prev then redis.call('HINCRBY', sizes, '{TOTAL}', -tonumber(prev)) end
    redis.call('ZADD', idx, entries[i + 2], m)
    redis.call('HSET', sizes, m, b)
    redis.call('HINCRBY', sizes, '{TOTAL}', b)
  end
  redis.call('EXPIRE', idx, keep)
  redis.call('EXPIRE', sizes, keep)
  return tonumber(redis.call('HGET', sizes, '{TOTAL}') or '0')
end
"""

# KEYS: index, sizes. ARGV: now, keep, then member, bytes, expiry triples. Returns the total.
_RECORD = LEDGER_LUA + """
local entries = {}
for i = 3, #ARGV do entries[#entries + 1] = ARGV[i] end
return ledger(KEYS[1], KEYS[2], ARGV[1], ARGV[2], entries)
"""

# KEYS: index, sizes. ARGV: members to take out. Returns the total.
_DROP = f"""
for _, m in ipairs(ARGV) do
  local b = redis.call('HGET', KEYS[2], m)
  if b then
    redis.call('HINCRBY', KEYS[2], '{TOTAL}', -tonumber(b))
    redis.call('HDEL', KEYS[2], m)
  end
  redis.call('ZREM', KEYS[1], m)
end
return tonumber(redis.call('HGET', KEYS[2], '{TOTAL}') or '0')
"""


@dataclass(frozen=True)
class Quota:
    """One deployment's storage rules: the cap per key (bytes; 0: none) and how long each kind is kept."""

    cap: int
    record_s: float  # a request record: its longest life (request timeout + margin) and then the dump TTL
    response_s: float  # a stored response
    keep_s: int  # how long a ledger outlives its last write: the longest any entry lives

    @classmethod
    def from_settings(cls, settings: Any, *, margin_s: float) -> Quota:
        record_s = settings.request_timeout + margin_s + settings.dump_ttl
        return cls(
            cap=int(settings.max_stored_mb_per_key * 2**20),
            record_s=record_s,
            response_s=settings.response_ttl,
            keep_s=int(max(record_s, settings.response_ttl)) + 60,
        )


async def record(redis: Redis, owner: str, entries: list[tuple[str, int, float]], *, keep_s: int) -> int:
    """Add `entries` (member, bytes, expiry) to `owner`'s ledger, pruning what expired; the new total."""
    args: list[Any] = [time.time(), keep_s]
    for member, size, expiry in entries:
        args += (member, size, expiry)
    return int(await redis.eval(_RECORD, 2, keys.stored_index(owner), keys.stored_sizes(owner), *args))


async def total(redis: Redis, owner: str) -> int:
    raw: Any = await redis.hget(keys.stored_sizes(owner), TOTAL)
    return int(raw or 0)


async def make_room(redis: Redis, owner: str, cap: int, *, stored: int | None = None, batch: int = 64) -> dict[str, int]:
    """Drop what of `owner`'s ledger expires first until its total is within `cap`: finished requests'
    records and stored responses (never a request in flight). How many of each kind were dropped."""
    stored = await total(redis, owner) if stored is None else stored
    dropped = {"record": 0, "response": 0}
    skip = 0  # oldest entries that must stay (requests in flight)
    while stored > cap:
        raw: Any = await redis.zrange(keys.stored_index(owner), skip, skip + batch - 1)
        members = [m.decode() for m in raw]
        if not members:
            break
        async with redis.pipeline(transaction=False) as pipe:
            pipe.hmget(keys.stored_sizes(owner), members)
            for m in members:
                if m.startswith(RECORD):
                    pipe.hget(keys.request_meta(m[len(RECORD) :]), Meta.STATUS)
            sizes, *statuses = await pipe.execute()
        status_of = dict(zip([m for m in members if m.startswith(RECORD)], statuses, strict=True))
        victims: list[str] = []
        excess = stored - cap
        for member, size in zip(members, sizes, strict=True):
            if excess <= 0:
                break
            status = status_of.get(member)
            if member.startswith(RECORD) and status is not None and bytes(status).decode() != FINISHED:
                skip += 1  # in flight: stays, and is counted
                continue
            victims.append(member)
            excess -= int(size or 0)
        if not victims:
            if len(members) < batch:
                break
            continue
        for kind, count in (await _delete(redis, [(m, status_of.get(m)) for m in victims])).items():
            dropped[kind] += count
        stored = int(await redis.eval(_DROP, 2, keys.stored_index(owner), keys.stored_sizes(owner), *victims))
    return dropped


async def _delete(redis: Redis, victims: list[tuple[str, Any]]) -> dict[str, int]:
    """Delete what each ledger member stands for; how many of each kind still existed."""
    dropped = {"record": 0, "response": 0}
    async with redis.pipeline(transaction=False) as pipe:
        for member, status in victims:
            if member.startswith(RECORD):
                if status is None:
                    continue  # the record expired already: only its ledger entry is left
                request_id = member[len(RECORD) :]
                pipe.unlink(*keys.request_keys(request_id))
                pipe.zrem(keys.REQUEST_INDEX, request_id)
                dropped["record"] += 1
            else:
                pipe.unlink(keys.stored_response(member[len(RESPONSE) :]))
                dropped["response"] += 1
        if any(dropped.values()):
            await pipe.execute()
    return dropped


async def enforce(redis: Redis, owner: str, cap: int, stored: int, *, evicted: Any = None) -> None:
    """`make_room` when `stored` passes `cap`, logging rather than raising: the request that brought the
    key past its cap is served either way. `evicted`: a Counter labelled by kind (/metrics)."""
    if not cap or stored <= cap:
        return
    try:
        dropped = await make_room(redis, owner, cap, stored=stored)
    except RedisError as exc:
        log.warning("storage quota: could not drop stored records: %s", type(exc).__name__)
        return
    for kind, count in dropped.items():
        if count and evicted is not None:
            evicted.labels(kind).inc(count)
    if any(dropped.values()):
        log.info("storage quota: dropped %s of a key past its cap (--max-stored-mb-per-key)", dropped)
