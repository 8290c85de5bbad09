"""`met serve`: one command that runs everything — embedded Redis (unless --redis-url), N worker
processes, and the API — prints the URL once ready, restarts a worker that dies, and shuts all of
them down cleanly on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from dataclasses import fields, replace

import uvicorn
from redis.asyncio import Redis

from cli.embedded_redis import EmbeddedRedis
from shared import keys
from shared.settings import Settings

log = logging.getLogger("met.serve")


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that hands these settings to a child process (Settings.from_env reads it)."""
    env = dict(os.environ)
    for f in fields(settings):
        value = getattr(settings, f.name)
        if value is not None:
            env[f"MET_{f.name.upper()}"] = str(value)
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def spawn_worker(settings: Settings) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "cli.main", "worker"], env=settings_env(settings))


async def run_api(settings: Settings) -> None:
    """Serve the API until uvicorn's own Ctrl-C / SIGTERM handling stops it."""
    from ingest.app import build_app
    from models.files import local_folder
    from models.prompt import PromptRenderer

    name, folder = await asyncio.to_thread(local_folder, settings.model, settings.data_dir)
    renderer = await asyncio.to_thread(PromptRenderer.load, folder, name=name, max_model_len=settings.max_model_len)
    app = build_app(settings, renderer)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    await uvicorn.Server(config).serve()


async def _announce_when_ready(settings: Settings, workers: int) -> None:
    redis = Redis.from_url(settings.redis_url or "")
    try:
        while True:
            import time

            alive = await redis.zrangebyscore(keys.WORKERS_ALIVE, time.time() - settings.heartbeat_ttl, "+inf")
            if len(alive) >= workers:
                print(f"Metrale ready: http://{settings.host}:{settings.port}/v1  ({workers} worker(s), redis {settings.redis_url})", flush=True)
                return
            await asyncio.sleep(0.2)
    finally:
        await redis.aclose()


async def _supervise(settings: Settings, procs: list[subprocess.Popen[bytes]]) -> None:
    while True:
        await asyncio.sleep(1.0)
        for i, proc in enumerate(procs):
            if proc.poll() is not None:
                log.warning("worker pid %d exited with %s; starting a new one", proc.pid, proc.returncode)
                procs[i] = spawn_worker(settings)


def serve(settings: Settings) -> None:
    from models.files import local_folder

    os.makedirs(settings.data_dir, exist_ok=True)
    local_folder(settings.model, settings.data_dir)  # convert a GGUF once, before workers race for it
    embedded = None
    if not settings.redis_url:
        embedded = EmbeddedRedis(settings.data_dir)
        settings = replace(settings, redis_url=embedded.start())
    procs = [spawn_worker(settings) for _ in range(settings.workers)]

    async def main() -> None:
        background = [asyncio.ensure_future(_announce_when_ready(settings, settings.workers)), asyncio.ensure_future(_supervise(settings, procs))]
        try:
            await run_api(settings)
        finally:
            for task in background:
                task.cancel()

    try:
        asyncio.run(main())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if embedded:
            embedded.stop()
        print("Metrale stopped.", flush=True)
