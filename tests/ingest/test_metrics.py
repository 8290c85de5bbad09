"""ingest.http.metrics without a server: the per-token histogram's exposition against prometheus_client's own; the cluster
figures read from a real Redis."""

from __future__ import annotations

import random
import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from ingest.http.metrics import _ITL, LoopHistogram, Metrics
from shared import keys

from ..conftest import redis_db


def test_the_loop_histogram_exposes_what_prometheus_clients_histogram_would_for_the_same_observations() -> None:
    theirs_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    theirs = Histogram("met_itl_seconds", "Inter-token latency.", registry=theirs_registry, buckets=_ITL)
    ours = LoopHistogram("met_itl_seconds", "Inter-token latency.", _ITL, ours_registry)
    rng = random.Random(0)
    for _ in range(5000):
        value, count = rng.choice([0.0, 0.01, 0.3, 99.0, rng.expovariate(10)]), rng.choice([1, 1, 1, 3])
        ours.observe(value, count)
        for _ in range(count):
            theirs.observe(value)

    def lines(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return [line for line in text.splitlines() if line.startswith("met_itl_seconds_") and "_created" not in line]

    ours_lines, theirs_lines = lines(ours_registry), lines(theirs_registry)
    assert [line for line in ours_lines if "_sum" not in line] == [line for line in theirs_lines if "_sum" not in line]
    [ours_sum], [theirs_sum] = ([float(line.split()[-1]) for line in x if "_sum" in line] for x in (ours_lines, theirs_lines))
    assert abs(ours_sum - theirs_sum) < 1e-6 * max(1.0, theirs_sum)


async def test_the_cluster_collector_shows_each_workers_queue_cache_hit_rate_and_routing_index(redis_server: str) -> None:
    async with redis_db(redis_server, 13) as redis:
        now = time.time()
        for worker, figures in {
            "w-a": {"running": 2, "waiting": 1, "routed_queue": 1, "prefix_cache_queries": 1000, "prefix_cache_hits": 900, "index_size": 64,
                    "spec_drafts": 10, "spec_proposed": 60, "spec_accepted": 30},
            "w-b": {"running": 1, "waiting": 0, "routed_queue": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0, "index_size": 0,
                    "spec_drafts": 5, "spec_proposed": 20, "spec_accepted": 10},
        }.items():
            await redis.zadd(keys.WORKERS_ALIVE, {worker: now})
            await redis.hset(keys.worker_info(worker), mapping={"heartbeat": now, **figures})
        metrics = Metrics(redis, heartbeat_ttl=10)
        metrics.routing.labels("routed").inc(3)
        metrics.routing.labels("no_overlap").inc()
        text = (await metrics.render()).decode()
        await redis.flushdb()

    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and not line.startswith("#")}
    assert samples['met_worker_queue{worker="w-a"}'] == 4 and samples['met_worker_queue{worker="w-b"}'] == 1
    assert samples['met_worker_prefix_cache_hit_rate{worker="w-a"}'] == 0.9 and samples['met_worker_prefix_cache_hit_rate{worker="w-b"}'] == 0
    assert samples['met_routing_index_blocks{worker="w-a"}'] == 64
    assert samples["met_spec_decode_num_drafts_total"] == 15 and samples["met_spec_decode_num_draft_tokens_total"] == 80
    assert samples["met_spec_decode_num_accepted_tokens_total"] == 40 and samples["met_spec_decode_acceptance_rate"] == 0.5
    assert samples['met_routing_decisions_total{decision="routed"}'] == 3 and samples['met_routing_decisions_total{decision="no_overlap"}'] == 1
