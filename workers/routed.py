"""A worker's side of prefix-aware routing (ingest.http.routing): what it tells API nodes, and how the work
routed to a worker that is gone is taken over.

- `KVIndex`: the worker's routing index in Redis (shared.keys.kv_index): the keys of the blocks its prefix
  cache holds, first INDEX_BYTES of each. A model worker feeds it the block pool's journal (keys gained and
  evicted, workers.blocks.BlockPool.journal) after each step; a gateway worker, which cannot see its upstream's
  cache, the keys of the prompts it served (`PromptKeys`, a bounded LRU: its upstream holds those prefixes
  most likely). Changes go out at most every FLUSH_EVERY_S in one pipeline (SADD, SREM, EXPIRE), a full
  snapshot first and again after a Redis outage (a Redis that came back may have lost the set). The set's
  TTL follows the heartbeat: a worker that dies stops being routed to once it expires.
- `adopt_routed`: part of every worker's reclaim pass. Each routed stream (shared.keys.ROUTED_WORKERS) whose
  worker is gone (no heartbeat for the TTL, or it drained) has what it held reclaimed (XAUTOCLAIM past the
  lease, as on the shared stream) and what it never read claimed (XREADGROUP); a stream gone for twice the
  TTL and empty is deleted. No entry is lost to that: an API node routes only to a worker whose heartbeat is
  within the TTL (by its clock: nodes' clocks must agree within a TTL), and its XADD is NOMKSTREAM, falling
  back to the shared stream, so nothing lands in a deleted stream. A drained worker marks itself gone as it
  leaves. A live worker's stream is left to it: its pending entries are renewed like any other.
Must not: decide routing (the API node does) or touch torch.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared import keys
from shared.block_keys import index_key, prompt_keys
from workers import leases

log = logging.getLogger("workers.routed")
FLUSH_EVERY_S = 0.1  # the index's staleness, at most (one round trip per flush; none while nothing changes)


class KVIndex:
    """The routing index of one worker (see the module docstring)."""

    def __init__(self, worker_id: str, *, ttl_s: float) -> None:
        self.key = keys.kv_index(worker_id)
        self.info_key = keys.worker_info(worker_id)
        self.load: tuple[int, int] | None = None  # (running, waiting) as last written
        self.ttl_s = max(1, int(ttl_s) + 1)
        self.pending: dict[bytes, bool] = {}  # index key -> present, not yet written
        self.snapshot: list[bytes] | None = None  # a full replacement, not yet written
        self.size = 0  # members written (approximately: SADD/SREM of keys already in/out are counted too)
        self._due = 0.0

    def note(self, journal: dict[bytes, bool]) -> None:
        for key, present in journal.items():
            self.pending[index_key(key)] = present

    def replace_all(self, cached: Iterable[bytes]) -> None:
        self.snapshot = [index_key(k) for k in cached]
        self.pending.clear()

    async def flush(self, redis: Redis, *, force: bool = False, load: tuple[int, int] | None = None) -> None:
        """Write what changed (at most every FLUSH_EVERY_S unless `force`), and the worker's `load` (running,
        waiting) with the time it was read, `load_at`, when it changed: fresher than the heartbeat's, which a
        router would otherwise read as a finished request still running. On a Redis error the changes stay
        pending and the error propagates; the caller asks for a snapshot once Redis is back."""
        now = time.monotonic()
        if not force and now < self._due:
            return
        new_load = load is not None and load != self.load
        if self.snapshot is None and not self.pending and not new_load:
            return
        self._due = now + FLUSH_EVERY_S
        snapshot, pending = self.snapshot, self.pending
        async with redis.pipeline(transaction=False) as pipe:
            if snapshot is not None:
                pipe.delete(self.key)
                for i in range(0, len(snapshot), 1000):
                    pipe.sadd(self.key, *snapshot[i : i + 1000])
            added = [k for k, present in pending.items() if present]
            gone = [k for k, present in pending.items() if not present]
            for i in range(0, len(added), 1000):
                pipe.sadd(self.key, *added[i : i + 1000])
            for i in range(0, len(gone), 1000):
                pipe.srem(self.key, *gone[i : i + 1000])
            if new_load and load is not None:
                pipe.hset(self.info_key, mapping={"running": load[0], "waiting": load[1], "load_at": time.time()})
            pipe.expire(self.key, self.ttl_s)
            pipe.scard(self.key)
            replies = await pipe.execute()
        self.size = int(replies[-1])
        self.snapshot, self.pending = None, {}
        if new_load:
            self.load = load

    async def keep_alive(self, redis: Redis) -> None:
        """With the heartbeat: the index lives as long as the worker does."""
        await redis.expire(self.key, self.ttl_s)


class PromptKeys:
    """A gateway worker's stand-in for a cache it cannot see: the block keys of the prompts it served, the most
    recent `capacity` of them (its upstream most likely still holds those prefixes), as a journal for `KVIndex`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self.journal: dict[bytes, bool] = {}

    def served(self, token_ids: list[int] | tuple[int, ...], cache_salt: str = "") -> None:
        for key in prompt_keys(token_ids, cache_salt=cache_salt):
            if key in self._lru:
                self._lru.move_to_end(key)
                continue
            self._lru[key] = None
            self.journal[key] = True
        while len(self._lru) > self.capacity:
            old, _ = self._lru.popitem(last=False)
            self.journal[old] = False

    def take_journal(self) -> dict[bytes, bool]:
        taken, self.journal = self.journal, {}
        return taken


async def adopt_routed(redis: Redis, worker_id: str, *, count: int, heartbeat_ttl: float, lease_s: float) -> list[leases.Claimed]:
    """What this worker takes over of other workers' routed streams, up to `count` (see the module docstring)."""
    if count <= 0:
        return []
    workers: Any = await redis.zrange(keys.ROUTED_WORKERS, 0, -1, withscores=True)
    now = time.time()
    taken: list[leases.Claimed] = []
    for raw, beat in workers:
        other = raw.decode() if isinstance(raw, bytes) else str(raw)
        if other == worker_id or len(taken) >= count:
            continue
        stream = keys.routed_stream(other)
        gone = float(beat) < now - heartbeat_ttl
        try:
            taken += await leases.reclaim_idle(redis, worker_id, count=count - len(taken), lease_s=lease_s, stream=stream)
            if gone and len(taken) < count:
                taken += await leases.claim_new(redis, worker_id, count=count - len(taken), block_ms=None, own=None, stream=stream)
        except ResponseError as exc:  # no stream or no group: nothing was ever routed there
            if "NOGROUP" not in str(exc) and "no such key" not in str(exc).lower():
                raise
        if float(beat) < now - 2 * heartbeat_ttl and await leases.work_left(redis, stream) == 0:
            async with redis.pipeline(transaction=False) as pipe:
                pipe.zrem(keys.ROUTED_WORKERS, other)
                pipe.delete(stream, keys.kv_index(other))
                await pipe.execute()
            log.info("routed stream of %s (gone) is empty: removed", other)
    for claimed in taken:
        log.warning("took over request entry %s routed to a worker that is gone (delivery %d)", claimed.entry_id, claimed.deliveries)
    return taken
