"""`GET /ready`: whether this deployment can serve, read from the workers' heartbeat hashes.

Ready: Redis answers and at least one live, non-draining worker can generate; a gateway worker
(workers/gateway.py) counts only while its upstream answers its health probe, so a failing upstream
marks its workers unready. Gateway workers are listed with their health, and with their upstream's URL
and last error only for a caller who may see them (`detail`: no API key configured, or a valid one sent):
/ready is public, and an upstream's address is the deployment's internals. 503 while this API node drains.
Must not: write to Redis.
"""

from __future__ import annotations

import time
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared import keys

_FIELDS = ["draining", "upstream", "upstream_healthy", "upstream_error"]


async def readiness(redis: Redis, *, heartbeat_ttl: float, draining: bool, detail: bool = True) -> tuple[dict[str, Any], int]:
    """(body, HTTP status) of /ready."""
    try:
        await redis.ping()
        alive: Any = await redis.zrangebyscore(keys.WORKERS_ALIVE, time.time() - heartbeat_ttl, "+inf")
        async with redis.pipeline(transaction=False) as pipe:
            for worker in alive:
                pipe.hmget(keys.worker_info(worker.decode()), _FIELDS)
            rows = await pipe.execute()
    except RedisError:
        return {"status": "unavailable", "redis": False, "workers": 0}, 503
    serving = sum(1 for flag, upstream, healthy, _ in rows if flag not in (b"1", None) and (upstream is None or healthy == b"1"))
    body: dict[str, Any] = {"redis": True, "workers": serving}
    gateways = [
        {"worker": w.decode(), "healthy": healthy == b"1"} | ({"upstream": up.decode(), "error": (err or b"").decode()} if detail else {})
        for w, (_, up, healthy, err) in zip(alive, rows, strict=True)
        if up is not None
    ]
    if gateways:
        body["gateways"] = gateways
    if draining:
        return {"status": "draining", **body}, 503
    if serving:
        return {"status": "ready", **body}, 200
    return {"status": "upstream_unhealthy" if gateways else "no_workers", **body}, 503
