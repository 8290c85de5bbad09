"""`/ready`'s body (ingest/http/readiness.py) against a real Redis: a gateway worker's upstream URL and error are
shown only to a caller who may see them; its health always."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis.asyncio import Redis

from ingest.http.readiness import readiness
from shared import keys


def test_a_gateway_workers_upstream_is_detail_for_callers_who_may_see_it(redis_server: str) -> None:
    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        redis = Redis.from_url(redis_server)
        worker = f"gw-{time.monotonic_ns()}"
        await redis.hset(keys.worker_info(worker), mapping={"draining": "0", "upstream": "http://10.0.0.5:8000/v1", "upstream_healthy": "1", "upstream_error": ""})
        await redis.zadd(keys.WORKERS_ALIVE, {worker: time.time()})
        try:
            public, status = await readiness(redis, heartbeat_ttl=10, draining=False, detail=False)
            assert status == 200
            private, _ = await readiness(redis, heartbeat_ttl=10, draining=False, detail=True)
            return public, private
        finally:
            await redis.zrem(keys.WORKERS_ALIVE, worker)
            await redis.delete(keys.worker_info(worker))
            await redis.aclose()

    public, private = asyncio.run(scenario())
    mine = [g for g in public["gateways"] if g["worker"].startswith("gw-")]
    assert mine and all(g["healthy"] and "upstream" not in g and "error" not in g for g in mine)
    assert any(g.get("upstream") == "http://10.0.0.5:8000/v1" for g in private["gateways"])
