"""`met top` driven with Textual's pilot: against hand-written keys (fast), against a live two-worker
server under load (e2e), and as the screen of `met serve` on a pseudo-terminal (e2e)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis as sync_redis
from redis.asyncio import Redis
from textual.pilot import Pilot
from textual.widgets import Static

from bus import cancels
from cli.embedded_redis import free_port
from cli.top import RequestScreen, TopApp
from cli.top_snapshot import Snapshot, ThroughputHistory
from shared import keys
from shared.codec import ID_FIELD, encode_delta
from shared.deltas import Content
from shared.settings import Settings

from ..conftest import ROOT, LiveServer, start_server, stop_server
from .test_top_snapshot import add_worker, own_db, submit

SIZE = (170, 50)


async def wait_for(pilot: Pilot[None], app: TopApp, check: Callable[[Snapshot], bool], timeout: float = 60.0) -> Snapshot:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if app.snapshot is not None and check(app.snapshot):
            return app.snapshot
        await pilot.pause(0.2)
    raise AssertionError(f"the dashboard never showed it; last snapshot: {app.snapshot}")


async def select(pilot: Pilot[None], app: TopApp, request_id: str) -> None:
    """Move the cursor with the arrow keys until `request_id` is the selected row."""
    for _ in range(40):
        current = app.selected_request_id()
        if current == request_id:
            return
        ids = [r.id for r in app.snapshot.active] if app.snapshot else []
        if request_id not in ids or current not in ids:
            await pilot.pause(0.2)
            continue
        await pilot.press("down" if ids.index(request_id) > ids.index(current) else "up")
    raise AssertionError(f"could not select {request_id}")


def text_of(app: TopApp, selector: str) -> str:
    return str(app.screen.query_one(selector, Static).content)


# ---- against hand-written keys ------------------------------------------------------------------


@pytest.fixture
async def handmade(redis_server: str) -> AsyncIterator[tuple[str, Redis]]:
    url = own_db(redis_server)
    client = Redis.from_url(url)
    await client.flushdb()
    yield url, client
    await client.flushdb()
    await client.aclose()


async def test_the_dashboard_marks_a_dead_worker_opens_a_request_cancels_it_pauses_and_quits(handmade: tuple[str, Redis]) -> None:
    url, redis = handmade
    now = time.time()
    await add_worker(redis, "w-live", heartbeat=now, running=1, decode_tps=12.5)
    await add_worker(redis, "w-dead", heartbeat=now - 60)
    await submit(redis, "req-1", status="running", received_at=now - 4, worker="w-live", first_token_at=now - 1)
    await redis.xadd(keys.delta_stream("req-1"), {"d": encode_delta(Content(text="Bonjour", token_ids=(5,)))})
    app = TopApp(url, settings=Settings.from_env({}))

    # One CI run hung here past pytest-timeout's 300 s with no trace of where; a bounded body fails
    # with the traceback of the await it was stuck in.
    async with asyncio.timeout(200), app.run_test(size=SIZE) as pilot:
        snap = await wait_for(pilot, app, lambda s: len(s.workers) == 2 and len(s.active) == 1)
        assert {w.id: w.dead for w in snap.workers} == {"w-live": False, "w-dead": True}
        workers = app.query_one("#workers")
        assert str(workers.get_cell("w-dead", "state")) == "DEAD"  # type: ignore[attr-defined]
        assert "12.5" in text_of(app, "#spark-label")

        await pilot.press("enter")
        await pilot.pause(0.5)
        screen = app.screen
        assert isinstance(screen, RequestScreen) and screen.request_id == "req-1"
        assert text_of(app, "#text") == "Bonjour"
        await pilot.press("c")
        await pilot.pause(0.3)
        assert await redis.get(keys.cancel_flag("req-1")) == keys.OPERATOR_CANCEL  # the client is told (shared/deltas.py)
        await pilot.press("escape")
        assert not isinstance(app.screen, RequestScreen)

        await pilot.press("p")
        assert "PAUSED" in text_of(app, "#header")
        taken = app.snapshot.taken_at if app.snapshot else 0
        await pilot.pause(1.5)
        assert app.snapshot is not None and app.snapshot.taken_at == taken
        await pilot.press("p")
        await wait_for(pilot, app, lambda s: s.taken_at > taken)

        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0


async def test_the_tables_fit_140_columns_also_after_a_request_view(handmade: tuple[str, Redis]) -> None:
    url, redis = handmade
    now = time.time()
    worker = "a-rather-long-container-hostname-1234567-beef"  # <host>-<pid>-<hex>, as workers name themselves
    await add_worker(redis, worker, heartbeat=now, running=30, waiting=12, decode_tps=1234.5, prefill_tps=98765.4, kv_used_tokens=98304, kv_total_tokens=131072)
    await redis.hset(keys.worker_info(worker), mapping={"model": "SmolLM2-135M-Instruct-with-a-long-suffix", "device": "cuda:0"})
    for i in range(3):
        rid = f"0123456789abcdef01234{i:03d}"
        await submit(redis, rid, status="running", received_at=now - 4, worker=worker, first_token_at=now - 1, client="2001:db8:85a3::8a2e:370:7334")
        await redis.xadd(keys.delta_stream(rid), {"d": encode_delta(Content(text="A long streamed text. " * 40, token_ids=(5,) * 400))})
    app = TopApp(url, settings=Settings.from_env({}))

    def widths() -> list[int]:
        return [app.query_one(table).virtual_size.width for table in ("#workers", "#requests")]

    async with app.run_test(size=(140, 40)) as pilot:
        await wait_for(pilot, app, lambda s: len(s.active) == 3 and len(s.workers) == 1)
        await pilot.pause(0.3)
        assert max(widths()) <= 140, widths()
        await pilot.press("enter")
        await pilot.pause(1.5)
        assert isinstance(app.screen, RequestScreen)
        await pilot.press("escape")
        taken = app.snapshot.taken_at if app.snapshot else 0
        await wait_for(pilot, app, lambda s: s.taken_at > taken)
        await pilot.pause(0.3)
        assert not isinstance(app.screen, RequestScreen)
        assert max(widths()) <= 140, widths()
        assert "since met top started" in text_of(app, "#spark-label")  # its peak covers only what it saw
        await pilot.press("q")


def test_the_sparkline_says_last_5_min_only_once_it_has_seen_them() -> None:
    history = ThroughputHistory()
    history.add(1000.0, 5.0)
    assert history.span_label(1000.0 + 61) == "since met top started, 1m01s ago"
    history.add(1000.0 + 300, 7.0)
    assert history.span_label(1000.0 + 300) == "last 5 min"


async def test_the_redis_password_is_never_shown_even_when_redis_is_unreachable() -> None:
    with_password = f"redis://:hunter2-secret@127.0.0.1:{free_port()}/0"  # nothing listens there
    app = TopApp(with_password, settings=Settings.from_env({}))

    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(1.5)
        header = text_of(app, "#header")
        assert "Redis unreachable" in header
        assert "[redacted]" in header
        assert "hunter2" not in header
        await pilot.press("q")


# ---- against a live server with two workers under load ------------------------------------------


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("top"), "--workers", "2")
    yield server
    stop_server(server)


def stream_chat(base_url: str, i: int) -> str:
    """One long streaming request; returns the finish reason it ended with (or what went wrong)."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": f"Tell me a long story, number {i}."}],
        "max_tokens": 1500,
        "temperature": 0.8,
        "seed": i,
        "stream": True,
        "ignore_eos": True,
    }
    reason = "no finish"
    with (
        httpx.Client(timeout=httpx.Timeout(300, connect=10)) as client,
        client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as resp,
    ):
        for line in resp.iter_lines():
            if '"finish_reason":"' in line.replace(" ", ""):
                reason = line.split('"finish_reason":')[1].split('"')[1]
    return reason


@pytest.fixture
def load(two_workers: LiveServer) -> Iterator[list[Future[str]]]:
    """Four concurrent streams (two per worker), cancelled at the end so that teardown stays short."""
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream_chat, two_workers.base_url, i) for i in range(4)]
        try:
            yield futures
        finally:
            client = two_workers.redis()
            for rid in client.zrange(keys.REQUEST_INDEX, 0, -1):  # as bus.cancels.cancel does: the flag, then the workers' feed
                client.set(keys.cancel_flag(rid.decode()), keys.CLIENT_CANCEL, ex=600)
                client.xadd(keys.CANCELS, {ID_FIELD: rid, cancels.BY_FIELD: keys.CLIENT_CANCEL})
            for future in futures:
                future.result(timeout=120)
            client.close()


@pytest.mark.e2e
async def test_the_dashboard_follows_two_workers_under_load_and_cancels_a_request(two_workers: LiveServer, load: list[Future[str]]) -> None:
    app = TopApp(two_workers.redis_url, settings=Settings.from_env({}))
    check = sync_redis.Redis.from_url(two_workers.redis_url)

    async with app.run_test(size=SIZE) as pilot:
        snap = await wait_for(
            pilot,
            app,
            lambda s: sum(not w.dead for w in s.workers) == 2 and any(r.status == "running" and r.tokens > 0 for r in s.active),
            timeout=120,
        )
        assert snap.queue.inflight > 0 or snap.running > 0
        assert {w.model for w in snap.workers} == {"SmolLM2-135M-Instruct"}
        target = next(r.id for r in snap.active if r.status == "running" and r.tokens > 0)

        await select(pilot, app, target)
        await pilot.press("enter")
        screen = app.screen
        assert isinstance(screen, RequestScreen) and screen.request_id == target
        for _ in range(50):
            if screen.detail and screen.detail.text:
                break
            await pilot.pause(0.2)
        assert screen.detail is not None and screen.detail.text
        assert text_of(app, "#text").startswith(screen.detail.text[:20])
        assert "user: Tell me a long story" in text_of(app, "#prompt")

        await pilot.press("c")
        await pilot.pause(0.3)
        assert check.exists(keys.cancel_flag(target))
        end = time.monotonic() + 60
        while check.hget(keys.request_meta(target), "outcome") != b"cancelled" and time.monotonic() < end:
            await pilot.pause(0.2)
        assert check.hget(keys.request_meta(target), "outcome") == b"cancelled"

        await pilot.press("escape")
        await wait_for(pilot, app, lambda s: target not in {r.id for r in s.active})
        await pilot.press("q")
        await pilot.pause()
    check.close()
    assert app.return_code == 0


# ---- `met serve` on a terminal --------------------------------------------------------------------


class Terminal:
    """A pseudo-terminal whose output is drained in the background (so the child never blocks)."""

    def __init__(self, rows: int = 40, cols: int = 150) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.output = bytearray()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                return
            if not chunk:
                return
            self.output.extend(chunk)

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)


@pytest.mark.e2e
def test_serve_on_a_terminal_shows_the_dashboard_and_q_stops_everything(tmp_path: Path) -> None:
    port = free_port()
    term = Terminal()
    env = {**os.environ, "TERM": "xterm-256color", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "cli.main", "serve", "--port", str(port), "--data-dir", str(tmp_path), "--workers", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=term.slave, stdout=term.slave, stderr=term.slave, start_new_session=True)
    os.close(term.slave)
    try:
        end = time.monotonic() + 240
        log = tmp_path / "serve.log"  # logs go to the file, not over the screen
        while b"met top" not in term.output or not _ready(port) or "Metrale ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < end, bytes(term.output[-3000:]).decode(errors="replace")
            time.sleep(0.5)
        assert b"Metrale ready" not in term.output
        workers = _worker_pids(tmp_path)
        assert workers

        term.type(b"q")
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(term.master)
    tail = bytes(term.output[-2000:]).decode(errors="replace")
    assert proc.returncode == 0, tail
    assert "Dashboard closed" in tail and "Metrale stopped." in tail
    assert not (tmp_path / "redis.url").exists()  # the embedded Redis stopped
    assert not any(_alive(pid) for pid in workers)


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _worker_pids(data_dir: Path) -> list[int]:
    client = sync_redis.Redis.from_url((data_dir / "redis.url").read_text().strip())
    try:
        ids = [m.decode() for m in client.zrange(keys.WORKERS_ALIVE, 0, -1)]
        return [int(client.hget(keys.worker_info(i), "pid") or 0) for i in ids]
    finally:
        client.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
