"""`met serve`: one command that runs everything — embedded Redis (unless --redis-url), N worker
processes, and the API — prints the URL once ready, restarts a worker that dies, and shuts all of
them down cleanly on Ctrl-C / SIGTERM. Redis and the workers run in their own process groups, so a
terminal's Ctrl-C reaches only this supervisor, which drains in order: `/ready` answers 503, the
workers finish (or hand back) their requests, the API closes, Redis stops last. On a terminal (unless --no-tui) the `met top` dashboard is its
screen, run as a child process whose quitting is Ctrl-C (cli/top_serve.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import fields, replace
from types import FrameType

import uvicorn

from bus.connect import connect
from cli.embedded_redis import EmbeddedRedis, detached
from cli.http_protocol import with_header_timeout
from cli.top_serve import Dashboard
from shared import keys
from shared.event_loop import run_loop, settle_heap
from shared.redact import redact_url
from shared.settings import Settings

log = logging.getLogger("met.serve")


_API_ONLY = frozenset({"MET_API_KEYS", "MET_API_KEYS_FILE"})


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that hands these settings to a child process (Settings.from_env reads it).
    API keys stay in the API process: workers and the dashboard never need them."""
    env = {k: v for k, v in os.environ.items() if k not in _API_ONLY}
    for f in fields(settings):
        value = getattr(settings, f.name)
        if value is not None and f"MET_{f.name.upper()}" not in _API_ONLY:
            env[f"MET_{f.name.upper()}"] = str(value)
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def spawn_worker(settings: Settings) -> subprocess.Popen[bytes]:
    """A worker in its own session: only the supervisor's SIGTERM (a drain) stops it, never a terminal's
    Ctrl-C directly; and it drains if the supervisor dies (cli/embedded_redis.detached)."""
    return subprocess.Popen([sys.executable, "-m", "cli.main", "worker"], **detached(env=settings_env(worker_settings(settings))))


def worker_settings(settings: Settings) -> Settings:
    """`--workers N` on one machine without `--threads`: each worker computes with its share of the cores
    (torch's default gives every worker every core, and their thread pools spin against each other: a token
    took ~0.4 s instead of ~0.03 s with 3 workers on 2 cores, bench/routing.py)."""
    if settings.threads or settings.workers < 2:
        return settings
    return replace(settings, threads=max(1, (os.cpu_count() or 1) // settings.workers))


class _Server(uvicorn.Server):
    """uvicorn's server, but on Ctrl-C / SIGTERM it first runs `before_exit` (stop the workers, which
    end their in-flight requests with a terminal event) while the API keeps streaming, then exits.
    A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, before_exit: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._before_exit = before_exit
        self._exiting = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._exiting or self._before_exit is None:
            super().handle_exit(sig, frame)
            return
        self._exiting = True
        before_exit = self._before_exit

        def drain() -> None:
            before_exit()
            super(_Server, self).handle_exit(sig, frame)

        threading.Thread(target=drain, daemon=True).start()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        # Handled: uvicorn would re-raise the signal after serving, and a re-raised SIGTERM kills the
        # process before `serve`'s cleanup runs (the embedded Redis and the dashboard would be orphaned).
        self._captured_signals.clear()


def open_to_the_network(settings: Settings) -> str:
    """The warning for an API that listens beyond this host with no API key (anyone who reaches the port
    can run requests, read stored responses and batches); "" when it listens on loopback or has keys."""
    from ingest.http.auth import load_keys

    if load_keys(settings) or settings.host in ("127.0.0.1", "localhost", "::1"):
        return ""
    return (
        f"the API listens on {settings.host}:{settings.port} with no API key: anyone who reaches this port can run requests "
        "and read every stored response, file and batch. Set --api-key / --api-keys-file (MET_API_KEYS), or listen on 127.0.0.1."
    )


async def run_api(settings: Settings, before_exit: Callable[[], None] | None = None) -> None:
    """Serve the API until Ctrl-C / SIGTERM."""
    from ingest.http.app import build_app
    from models.prompt import PromptRenderer
    from models.window import model_folder

    name, folder = await asyncio.to_thread(model_folder, settings)
    renderer = await asyncio.to_thread(PromptRenderer.load, folder, name=name, max_model_len=settings.max_model_len)
    app = build_app(settings, renderer)
    open_to_all = open_to_the_network(settings)
    if open_to_all:
        log.warning(open_to_all)
    settle_heap()  # the renderer and the app are loaded: out of the garbage collector's way (shared.event_loop)
    api = app.met_api  # type: ignore[attr-defined]
    stop_workers = before_exit

    def drain() -> None:
        """On SIGTERM / Ctrl-C: /ready answers 503 first; `met serve` then drains its workers (whose
        requests end with a terminal event); `met api` alone waits for its open streams and the
        non-streamed requests it is answering to end (each within the drain timeout)."""
        api.draining = True
        if stop_workers is not None:
            stop_workers()
            return
        end = time.monotonic() + settings.drain_timeout
        while (api.open_streams or api.open_requests) and time.monotonic() < end:
            time.sleep(0.1)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=5,
        http=with_header_timeout(settings.header_timeout),  # a deadline for request headers (cli/http_protocol.py)
        limit_concurrency=settings.max_connections or None,  # past it uvicorn answers 503 (open connections counted)
        ws_max_size=settings.max_body_bytes,  # a Responses WebSocket message may be as large as a POST body (ingest.http.responses_ws)
    )
    dumps = None
    if settings.dump_dir:  # --dump-dir: a background task follows met:finished (ingest/dumps/dump_writer.py)
        from ingest.dumps.dump_writer import DumpWriterTask

        dumps = DumpWriterTask(settings.redis_url or "", settings.dump_dir)
        await dumps.start()
    try:
        await _Server(config, drain).serve()
    finally:
        if dumps is not None:
            await dumps.stop()


async def _announce_when_ready(settings: Settings, workers: int) -> None:
    redis = connect(settings.redis_url or "")
    try:
        while True:
            alive = await redis.zrangebyscore(keys.WORKERS_ALIVE, time.time() - settings.heartbeat_ttl, "+inf")
            if len(alive) >= workers:
                print(f"Metrale ready: http://{settings.host}:{settings.port}/v1  ({workers} worker(s), redis {redact_url(settings.redis_url or '')})", flush=True)
                return
            await asyncio.sleep(0.2)
    finally:
        await redis.aclose()


async def _supervise(settings: Settings, procs: list[subprocess.Popen[bytes]], stopping: threading.Event) -> None:
    while True:
        await asyncio.sleep(1.0)
        for i, proc in enumerate(procs):
            if proc.poll() is not None and not stopping.is_set():
                log.warning("worker pid %d exited with %s; starting a new one", proc.pid, proc.returncode)
                procs[i] = spawn_worker(settings)


def stop_workers(procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()


def _refuse_a_taken_port(settings: Settings) -> None:
    """Before anything starts (a Redis, a worker, a file written): the API's address must be free, or this
    is a second server on a used port, which would fail to bind only after its workers announced it
    ready, and whose cleanup would take the running server's files with it."""
    with socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((settings.host, settings.port))
        except OSError as exc:
            print(f"met serve: {settings.host}:{settings.port} is in use ({exc.strerror}): is another server running there? Stop it or pass --port.", file=sys.stderr, flush=True)
            raise SystemExit(3) from None


def serve(settings: Settings, *, tui: bool = False) -> None:
    """Run everything until Ctrl-C / SIGTERM. With `tui` (a terminal, no --no-tui) the `met top`
    dashboard is the screen and logs go to <data_dir>/serve.log: see cli/top_serve.py; quitting it is
    Ctrl-C."""
    from models.window import model_folder

    _refuse_a_taken_port(settings)
    os.makedirs(settings.data_dir, exist_ok=True)
    model_folder(settings)  # convert a GGUF (and derive a long-context folder) once, before workers race for it
    embedded = None
    if not settings.redis_url:
        embedded = EmbeddedRedis(settings.data_dir)
        settings = replace(settings, redis_url=embedded.start())
    dashboard = Dashboard(settings, env=settings_env(settings)) if tui else None
    if dashboard:
        dashboard.start()  # before the workers, so that they log to the file too
    procs = [spawn_worker(settings) for _ in range(settings.workers)]

    stopping = threading.Event()

    def before_exit() -> None:
        stopping.set()
        stop_workers(procs, settings.drain_timeout + 15)

    async def main() -> None:
        background = [
            asyncio.ensure_future(_announce_when_ready(settings, settings.workers)),
            asyncio.ensure_future(_supervise(settings, procs, stopping)),
        ]
        try:
            await run_api(settings, before_exit)
        finally:
            for task in background:
                task.cancel()

    try:
        run_loop(main())
    finally:
        if dashboard:
            dashboard.stop()
        stopping.set()
        stop_workers(procs, settings.drain_timeout + 15)
        if embedded:
            embedded.stop()
        print("Metrale stopped.", flush=True)
