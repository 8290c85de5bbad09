"""`GET /metrics`: Prometheus text, names under `met_` in vLLM's style.

Owns: one `CollectorRegistry` per app (never the global default registry), holding
- what this API node observes from the delta streams it tails (streaming and not): requests by
  protocol and finish reason, prompt / generation tokens, time to first token, inter-token latency,
  end-to-end latency, queue time (`claimed_at - received_at` from the request's meta hash), and HTTP
  errors by status; and, beside them, each finished request's access-log line (ingest/http/request_log.py). Several API nodes each expose their own; Prometheus sums them.
- cluster figures read from Redis at scrape time (`ClusterCollector`): requests running / waiting
  KV-cache usage (blocks in use / pool) and prefix-cache queries / hits (prompt tokens looked up /
  found cached; counters of each live worker's life, so a worker that leaves takes its share with it:
  Prometheus' `rate()` treats that as a counter reset) summed over live workers' heartbeat hashes,
  constrained decoding (seconds spent on grammar masks, steps and rows masked, grammars compiled,
  matchers served from the compiled-grammar cache; counters of each worker's life as above),
  live worker count, accepted-but-unfinished requests, dead letters, and each gateway worker's upstream
  health (`met_upstream_healthy{worker, upstream}`). The async read happens in `render()`, just before the
  synchronous collect, so a scrape always shows Redis as it is now.
Must not: change what a client receives (observing is pass-through), or hold request payloads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from redis.asyncio import Redis
from redis.exceptions import RedisError

from ingest.http.request_log import RequestTiming, log_finished
from shared import keys
from shared.codec import Meta
from shared.deltas import Batch, Error, Finish, StreamDelta, is_terminal
from shared.ir import Request

log = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
# vLLM's buckets (seconds).
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
QUEUE_TIME_EVERY_S = 1.0  # finished requests' queue times are read together this often
_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True, slots=True)
class ClusterFigures:
    redis_up: bool = False
    workers: int = 0
    running: int = 0
    waiting: int = 0
    kv_used_tokens: int = 0
    kv_total_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    mask_ms_total: int = 0
    masked_steps: int = 0
    masked_rows: int = 0
    grammar_compiles: int = 0
    grammar_cache_hits: int = 0
    off_schema_calls: int = 0
    spec_drafts: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    inflight: int = 0
    dead_letters: int = 0
    gateways: tuple[tuple[str, str, bool], ...] = ()  # (worker, upstream, healthy) of each live gateway worker
    per_worker: tuple[tuple[str, dict[str, int]], ...] = ()  # (worker, its _PER_WORKER figures) of each live worker


_GATEWAY_FIELDS = ["upstream", "upstream_healthy"]
_PER_WORKER = ["routed_queue", "index_size"]  # read per worker beside _WORKER_FIELDS (routing: ingest.http.routing)
_WORKER_FIELDS = [
    "running",
    "waiting",
    "kv_used_tokens",
    "kv_total_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "mask_ms_total",
    "masked_steps",
    "masked_rows",
    "grammar_compiles",
    "grammar_cache_hits",
    "off_schema_calls",
    "spec_drafts",
    "spec_proposed",
    "spec_accepted",
]


async def read_cluster(redis: Redis, *, heartbeat_ttl: float) -> ClusterFigures:
    """Sum the live workers' heartbeat hashes and read the queue figures, in two round trips."""
    try:
        alive: list[bytes] = await redis.zrangebyscore(keys.WORKERS_ALIVE, time.time() - heartbeat_ttl, "+inf")  # type: ignore[assignment]
        async with redis.pipeline(transaction=False) as pipe:
            for worker in alive:
                pipe.hmget(keys.worker_info(_text(worker)), [*_WORKER_FIELDS, *_GATEWAY_FIELDS, *_PER_WORKER])
            pipe.zcard(keys.INFLIGHT)
            pipe.zcard(keys.INFLIGHT_BATCH)
            pipe.xlen(keys.DEAD_LETTER)
            *hashes, interactive, batch_lines, dead = await pipe.execute()
            inflight = interactive + batch_lines  # every request not finished, batch lines included
    except RedisError as exc:
        log.warning("metrics: redis unavailable (%s)", type(exc).__name__)
        return ClusterFigures()
    sums = [0] * len(_WORKER_FIELDS)
    live = 0
    gateways = []
    per_worker = []
    n = len(_WORKER_FIELDS)
    for worker, row in zip(alive, hashes, strict=True):
        values, (upstream, healthy), own = row[:n], row[n : n + 2], row[n + 2 :]
        if all(v is None for v in row):
            continue  # the hash expired between the two reads
        live += 1
        for i, v in enumerate(values):
            sums[i] += _int(v)
        if upstream is not None:
            gateways.append((_text(worker), _text(upstream), healthy == b"1"))
        mine = dict(zip(_WORKER_FIELDS, (_int(v) for v in values), strict=True)) | dict(zip(_PER_WORKER, (_int(v) for v in own), strict=True))
        per_worker.append((_text(worker), mine))
    figures = dict(zip(_WORKER_FIELDS, sums, strict=True))
    return ClusterFigures(
        redis_up=True,
        workers=live,
        inflight=max(0, _int(inflight)),
        dead_letters=int(dead or 0),
        gateways=tuple(gateways),
        per_worker=tuple(per_worker),
        **figures,
    )


class LoopHistogram(Collector):
    """A histogram observed from the event loop alone, per token: prometheus_client's `Histogram` takes a
    lock and walks its buckets in Python on every observation (~2 µs, a visible share of an API node's
    CPU per token at thousands of streams); this keeps plain counts (one bisect) and hands them to the
    library's exposition as a `HistogramMetricFamily` when scraped. Not thread-safe: one loop observes."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value`."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def collect(self) -> Iterable[Metric]:
        cumulative, buckets = 0, []
        for bound, count in zip([*self.bounds, float("inf")], self.counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.sum)


class ClusterCollector(Collector):
    """Gauges from the figures `render()` read from Redis just before collecting."""

    def __init__(self) -> None:
        self.figures = ClusterFigures()

    def collect(self) -> Iterable[Metric]:
        f = self.figures
        yield _gauge("met_redis_up", "1 when Redis answered this scrape.", 1 if f.redis_up else 0)
        yield _gauge("met_workers", "Live workers (heartbeat within the TTL).", f.workers)
        yield _gauge("met_num_requests_running", "Requests in workers' running batches, summed over live workers.", f.running)
        yield _gauge("met_num_requests_waiting", "Requests claimed by workers but waiting for a batch slot, summed over live workers.", f.waiting)
        usage = f.kv_used_tokens / f.kv_total_tokens if f.kv_total_tokens else 0.0
        yield _gauge("met_kv_cache_usage_perc", "KV-cache usage over live workers (1 = full): blocks in use / blocks in the pools.", usage)
        yield CounterMetricFamily("met_prefix_cache_queries", "Prompt tokens looked up in the prefix cache, summed over live workers.", value=f.prefix_cache_queries)
        yield CounterMetricFamily("met_prefix_cache_hits", "Prompt tokens found in the prefix cache, summed over live workers.", value=f.prefix_cache_hits)
        yield CounterMetricFamily("met_grammar_mask_seconds", "Seconds spent filling and applying grammar masks, summed over live workers.", value=f.mask_ms_total / 1000)
        yield CounterMetricFamily("met_grammar_masked_steps", "Decode steps that masked at least one constrained row, summed over live workers.", value=f.masked_steps)
        yield CounterMetricFamily("met_grammar_constrained_rows", "Constrained rows masked (one per sequence per step), summed over live workers.", value=f.masked_rows)
        yield CounterMetricFamily("met_grammar_compiles", "Grammars compiled (compiled-grammar cache misses), summed over live workers.", value=f.grammar_compiles)
        yield CounterMetricFamily("met_grammar_cache_hits", "Constrained requests served a compiled grammar from the cache, summed over live workers.", value=f.grammar_cache_hits)
        yield CounterMetricFamily(
            "met_tool_calls_off_schema",
            "Generated tool calls whose arguments do not match their tool's whole schema (keywords the constraint cannot enforce), summed over live workers.",
            value=f.off_schema_calls,
        )
        yield CounterMetricFamily("met_spec_decode_num_drafts", "Drafts checked by speculative decoding (one per sequence per step), summed over live workers.", value=f.spec_drafts)
        yield CounterMetricFamily("met_spec_decode_num_draft_tokens", "Guessed tokens speculative decoding checked, summed over live workers.", value=f.spec_proposed)
        yield CounterMetricFamily("met_spec_decode_num_accepted_tokens", "Guessed tokens the model agreed with (kept), summed over live workers.", value=f.spec_accepted)
        rate = f.spec_accepted / f.spec_proposed if f.spec_proposed else 0.0
        yield _gauge("met_spec_decode_acceptance_rate", "Share of checked guessed tokens that were kept, over live workers' lifetimes.", rate)
        yield _gauge("met_num_requests_inflight", "Accepted requests without a terminal event yet, cluster-wide (what admission limits).", f.inflight)
        yield _gauge("met_dead_letters", "Requests in the dead-letter stream (met:deadletter).", f.dead_letters)
        health = GaugeMetricFamily(
            "met_upstream_healthy", "Gateway workers (workers/gateway.py): 1 while the upstream answers the worker's health probe.", labels=["worker", "upstream"]
        )
        for worker, upstream, healthy in f.gateways:
            health.add_metric([worker, upstream], 1 if healthy else 0)
        yield health
        yield from _per_worker(f.per_worker)


def _per_worker(rows: tuple[tuple[str, dict[str, int]], ...]) -> Iterable[Metric]:
    """Each live worker's load, cache hit rate and routing index (what prefix routing weighs: ingest.http.routing)."""
    queue = GaugeMetricFamily("met_worker_queue", "Requests a worker runs, holds waiting, or has routed to it unread.", labels=["worker"])
    hits = GaugeMetricFamily("met_worker_prefix_cache_hit_rate", "Share of a worker's looked-up prompt tokens found in its prefix cache.", labels=["worker"])
    index = GaugeMetricFamily("met_routing_index_blocks", "Block keys in a worker's routing index (its prefix cache, as API nodes see it).", labels=["worker"])
    for worker, f in rows:
        queue.add_metric([worker], f["running"] + f["waiting"] + f["routed_queue"])
        hits.add_metric([worker], f["prefix_cache_hits"] / f["prefix_cache_queries"] if f["prefix_cache_queries"] else 0.0)
        index.add_metric([worker], f["index_size"])
    yield from (queue, hits, index)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class Metrics:
    """This app's registry: the API node's own observations plus the cluster collector."""

    def __init__(self, redis: Redis, *, heartbeat_ttl: float) -> None:
        self.redis = redis
        self.heartbeat_ttl = heartbeat_ttl
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("met_requests", "Finished requests by protocol and finish reason.", ["protocol", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("met_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("met_generation_tokens", "Generated tokens of finished requests.", registry=r)
        self.adapter_requests = Counter("met_lora_requests", "Finished requests on a LoRA adapter, by adapter (ingest.http.loras).", ["adapter"], registry=r)
        self.http_errors = Counter("met_http_errors", "HTTP error responses by status.", ["status"], registry=r)
        self.routing = Counter(
            "met_routing_decisions", "Where this node sent requests (ingest.http.routing): routed, or the shared queue and why.", ["decision"], registry=r
        )
        self.routed_cached_tokens = Counter("met_routing_cached_tokens", "Prompt tokens the chosen worker held cached, by its index, of routed requests.", registry=r)
        self.stored_evicted = Counter(
            "met_stored_evicted", "Stored request records and responses dropped early for a key past --max-stored-mb-per-key.", ["kind"], registry=r
        )
        self.queue_time = Histogram("met_request_queue_time_seconds", "Time from acceptance to a worker's claim.", registry=r, buckets=_LATENCY)
        self.ttft = Histogram("met_time_to_first_token_seconds", "Time from acceptance to the first output delta at the API.", registry=r, buckets=_TTFT)
        self.itl = LoopHistogram("met_inter_token_latency_seconds", "Time between output tokens, as the API receives them.", _ITL, r)
        self.e2e = Histogram("met_e2e_request_latency_seconds", "Time from acceptance to the terminal event at the API.", registry=r, buckets=_LATENCY)
        self.cluster = ClusterCollector()
        r.register(self.cluster)
        self._queue_ids: list[str] = []  # finished requests whose queue time is not read yet
        self._flusher: asyncio.Task[None] | None = None

    async def render(self) -> bytes:
        await self.flush_queue_times()
        self.cluster.figures = await read_cluster(self.redis, heartbeat_ttl=self.heartbeat_ttl)
        return generate_latest(self.registry)

    def http_error(self, status: int) -> None:
        self.http_errors.labels(str(status)).inc()

    def observe(self, request: Request, *, client: str = "") -> Observation:
        """The observer of one request's deltas (encoders.wire.tail feeds it each batch as it passes)."""
        return Observation(self, request, client)

    def _token(self, request: Request, delta: StreamDelta, now: float, last: float | None) -> float:
        if last is None:
            self.ttft.observe(max(0.0, now - request.created))
            return now
        count = max(1, len(getattr(delta, "token_ids", ())))
        self.itl.observe((now - last) / count, count)
        return now

    def _finish(self, request: Request, delta: StreamDelta, now: float) -> None:
        reason = delta.reason.value if isinstance(delta, Finish) else "error"
        self.requests.labels(request.protocol.value, reason).inc()
        if request.adapter:
            self.adapter_requests.labels(request.adapter).inc()
        self.e2e.observe(max(0.0, now - request.created))
        if isinstance(delta, Finish):
            self.prompt_tokens.inc(delta.usage.prompt_tokens)
            self.generation_tokens.inc(delta.usage.completion_tokens)
        if isinstance(delta, Error) and delta.attempt == 0:
            return  # synthesized by the API (deadline): no worker claimed it
        self._queue_ids.append(request.id)  # its queue time is read with others' (`flush_queue_times`)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(QUEUE_TIME_EVERY_S)
        await self.flush_queue_times()

    async def flush_queue_times(self) -> None:
        """Observe the queue time (`claimed_at - received_at`, from their meta hashes) of the requests
        finished since the last flush, in one round trip: every second while requests finish, and
        before each scrape (`render`). One read per request cost an API node a Redis command each."""
        ids, self._queue_ids = self._queue_ids, []
        if not ids:
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for rid in ids:
                    pipe.hmget(keys.request_meta(rid), [Meta.RECEIVED_AT, Meta.CLAIMED_AT])
                rows = await pipe.execute()
        except RedisError:
            return
        for received, claimed in rows:
            if received is not None and claimed is not None:
                self.queue_time.observe(max(0.0, float(claimed) - float(received)))


class Observation:
    """One request's deltas as /metrics and the access log see them: fed each batch as it passes
    (`batch`), closed when its stream ends (`close`: a stream left before its terminal event counts as
    'abandoned'). Either way the request's access-log line is written (ingest/http/request_log.py)."""

    def __init__(self, metrics: Metrics, request: Request, client: str) -> None:
        self.metrics = metrics
        self.request = request
        self.timing = RequestTiming(client=client)
        self.last: float | None = None
        self.terminal: StreamDelta | None = None

    def batch(self, batch: Batch) -> None:
        now = time.time()
        for delta in batch:
            if is_terminal(delta):
                self.terminal = delta
                log_finished(self.request, delta, self.timing, now=now)
                self.metrics._finish(self.request, delta, now)
            else:
                self.timing.output_tokens += len(getattr(delta, "token_ids", ()))
                self.last = self.metrics._token(self.request, delta, now, self.last)
                self.timing.first_at = self.timing.first_at or now

    def close(self) -> None:
        if self.terminal is None:
            self.metrics.requests.labels(self.request.protocol.value, "abandoned").inc()
            log_finished(self.request, None, self.timing, now=time.time())


def _int(value: bytes | str | None) -> int:
    try:
        return int(float(value)) if value is not None else 0
    except ValueError:
        return 0


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
