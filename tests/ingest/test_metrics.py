"""ingest.http.metrics without a server: the per-token histogram's exposition against prometheus_client's own."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from ingest.http.metrics import _ITL, LoopHistogram


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
