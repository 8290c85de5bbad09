"""Prefix-aware routing: which worker's own stream a request goes to, or the shared one (`--routing`).

Every worker's prefix cache is its own, so with N workers a returning conversation would find its prefix
cached about 1/N of the time if whichever worker asks first took it. An API node routes instead: it computes
the request's prompt block keys (shared.block_keys: the keys the worker's cache uses), asks each live
worker's routing index (shared.keys.kv_index, SMISMEMBER, one pipelined round trip) how long a prefix it
holds, and weighs that against the worker's queue, in tokens of prefill (Dynamo's KV router and SGLang's
cache-aware policy are the models):

    cost(w) = (prompt tokens - tokens w holds cached) + --routing-queue-cost × queue(w)

`queue(w)`: the requests w runs and holds waiting (written as they change, with the routing index: a
heartbeat's would show a request that just ended still running), those routed to it not read yet (its
heartbeat), plus the ones this node routed to it since it wrote them. The cheapest worker gets the request,
on its own stream (shared.keys.routed_stream), except:
- no worker holds `--routing-min-overlap` tokens of it (a first turn): the shared stream, whose consumer
  group hands it to whichever worker asks first (a free one);
- the cheapest worker's queue is at its width (`max_running`): the shared stream, so a hot prefix never
  piles its sessions onto one worker past what it runs at once;
- fewer than two live routable workers, or `--routing shared`: the shared stream (nothing to choose).
So a prefix every session shares (one system prompt) spreads: once its worker's queue costs more than
prefilling it elsewhere, the next request goes elsewhere and that worker caches it too.

Durability is the shared stream's: a routed request is pending in a consumer group, fenced, reclaimed and
resumed by another worker if its worker dies (workers.routed.adopt_routed). The worker table is read at most
every REFRESH_S; a failure to read it (or the index) routes to the shared stream, never refuses the request.
Must not: block admission on routing (any Redis error here means "shared"), or route to a draining worker.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared import keys
from shared.block_keys import BLOCK_SIZE, index_key, prompt_keys
from shared.ir import Request, prefix_salt
from shared.settings import Settings

log = logging.getLogger(__name__)
REFRESH_S = 0.25  # how stale the worker table may be (one pipelined read per refresh)
MAX_KEYS = 4096  # prompt blocks looked up at most (64k tokens at 16 a block)
_FIELDS = ["routable", "draining", "block_size", "max_running", "running", "waiting", "routed_queue", "load_at"]
DECISIONS = ("routed", "no_overlap", "busy", "single", "off", "error")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A live, routable worker as its heartbeat last described it."""

    worker: str
    block_size: int
    max_running: int
    queue: int  # running + waiting + routed-not-read, at `load_at`
    load_at: float  # when the worker wrote them (its heartbeat, or a step that changed them: workers.routed.KVIndex)


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: `stream`, and the worker it was routed to (None: the shared stream)."""

    stream: str
    worker: str | None
    decision: str
    cached_tokens: int = 0  # what the chosen worker holds of the prompt (by its index)


SHARED = Route(keys.REQUEST_STREAM, None, "off")


class Router:
    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.redis = redis
        self.enabled = settings.routing == "prefix"
        self.min_overlap = settings.routing_min_overlap
        self.queue_cost = settings.routing_queue_cost
        self.ttl = settings.heartbeat_ttl
        self._candidates: list[Candidate] = []
        self._read_at = 0.0
        self._mine: dict[str, list[float]] = defaultdict(list)  # worker -> when this node routed to it (recent)
        self.decisions: Counter[str] = Counter()  # /metrics: met_routing_decisions_total
        self.routed_to: Counter[str] = Counter()  # per worker

    def block_keys(self, request: Request) -> list[bytes] | None:
        """The prompt's block keys at the usual block size, as the routing index holds them (None with routing off):
        hashed where the caller tokenized (~0.1 ms per 1k tokens), off the event loop."""
        if not self.enabled:
            return None
        return [index_key(k) for k in prompt_keys(request.prompt_token_ids, cache_salt=prefix_salt(request), block_size=BLOCK_SIZE, limit=MAX_KEYS)]

    async def route(self, request: Request, block_keys: list[bytes] | None = None) -> Route:
        """Where `request` (and the other parts of its body) goes; `block_keys`: its `block_keys` when known."""
        route = await self._route(request, block_keys) if self.enabled else SHARED
        self.decisions[route.decision] += 1
        if route.worker is not None:
            self.routed_to[route.worker] += 1
            self._mine[route.worker].append(time.time())
        return route

    async def _route(self, request: Request, block_keys: list[bytes] | None) -> Route:
        try:
            candidates = await self.candidates()
            if len(candidates) < 2:
                return Route(keys.REQUEST_STREAM, None, "single")
            overlaps = await self.overlaps(request, candidates, block_keys)
        except RedisError as exc:
            log.warning("routing: redis error (%s); the request goes to the shared stream", type(exc).__name__)
            return Route(keys.REQUEST_STREAM, None, "error")
        if max(overlaps) < self.min_overlap:
            return Route(keys.REQUEST_STREAM, None, "no_overlap")
        prompt = len(request.prompt_token_ids)
        queues = [self.queue_of(c) for c in candidates]
        costs = [(prompt - cached) + self.queue_cost * queue for cached, queue in zip(overlaps, queues, strict=True)]
        best = min(range(len(candidates)), key=lambda i: (costs[i], -overlaps[i], queues[i]))
        chosen = candidates[best]
        if queues[best] >= chosen.max_running:
            return Route(keys.REQUEST_STREAM, None, "busy")
        return Route(keys.routed_stream(chosen.worker), chosen.worker, "routed", overlaps[best])

    def queue_of(self, candidate: Candidate) -> int:
        """Its queue when it last wrote it, plus what this node routed to it since."""
        mine = self._mine.get(candidate.worker)
        if not mine:
            return candidate.queue
        while mine and mine[0] <= candidate.load_at:
            mine.pop(0)
        return candidate.queue + len(mine)

    async def candidates(self) -> list[Candidate]:
        """Live, routable, not draining workers (read at most every REFRESH_S)."""
        now = time.monotonic()
        if now - self._read_at < REFRESH_S:
            return self._candidates
        self._read_at = now
        alive: Any = await self.redis.zrangebyscore(keys.WORKERS_ALIVE, time.time() - self.ttl, "+inf")
        workers = [w.decode() if isinstance(w, bytes) else str(w) for w in alive]
        rows: list[Any] = []
        if workers:
            async with self.redis.pipeline(transaction=False) as pipe:
                for worker in workers:
                    pipe.hmget(keys.worker_info(worker), _FIELDS)
                rows = await pipe.execute()
        found = []
        for worker, row in zip(workers, rows, strict=True):
            routable, draining, block_size, max_running, running, waiting, routed_queue, load_at = (_num(v) for v in row)
            if routable != 1 or draining or block_size <= 0:
                continue
            queue = int(running + waiting + routed_queue)
            found.append(Candidate(worker, int(block_size), max(1, int(max_running)), queue, load_at))
        live = {c.worker for c in found}
        for gone in [w for w in self._mine if w not in live]:
            del self._mine[gone]
        self._candidates = found
        return found

    async def overlaps(self, request: Request, candidates: list[Candidate], block_keys: list[bytes] | None = None) -> list[int]:
        """Prompt tokens each candidate holds cached, by its routing index: the longest run of the prompt's
        block keys from the first, in one pipelined round trip."""
        by_size: dict[int, list[bytes]] = {} if block_keys is None else {BLOCK_SIZE: block_keys}
        for c in candidates:
            if c.block_size not in by_size:
                keys_ = prompt_keys(request.prompt_token_ids, cache_salt=prefix_salt(request), block_size=c.block_size, limit=MAX_KEYS)
                by_size[c.block_size] = [index_key(k) for k in keys_]
        if not any(by_size.values()):
            return [0] * len(candidates)
        async with self.redis.pipeline(transaction=False) as pipe:
            for c in candidates:
                block_keys = by_size[c.block_size]
                if block_keys:
                    pipe.smismember(keys.kv_index(c.worker), block_keys)
            replies = iter(await pipe.execute())
        out = []
        for c in candidates:
            if not by_size[c.block_size]:
                out.append(0)
                continue
            held = 0
            for present in next(replies):
                if not present:
                    break
                held += 1
            out.append(held * c.block_size)
        return out


def _num(value: Any) -> float:
    try:
        return float(value) if value is not None else 0.0
    except (TypeError, ValueError):
        return 0.0
