"""`met serve --dump-dir`: every finished request lands, redacted, in the rotating JSONL files."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ingest.dumps.dump_writer import POSITION_FILE
from shared.dumps import DumpRecord, read_records

from ..conftest import LiveServer, start_server, stop_server
from .conftest import body, send

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def dumping_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Path]]:
    dumps = tmp_path_factory.mktemp("dump-dir")
    server = start_server(tmp_path_factory.mktemp("serve-dumps"), "--workers", "1", "--kv-budget-mb", "256", "--dump-dir", str(dumps))
    yield server, dumps
    stop_server(server)


def records_in(directory: Path) -> list[DumpRecord]:
    return [r for path in sorted(directory.glob("metrale-dumps-*.jsonl")) for r in read_records(path.read_bytes().splitlines())]


def test_finished_requests_are_appended_to_the_dump_dir_without_secrets(dumping_server: tuple[LiveServer, Path]) -> None:
    server, dumps = dumping_server
    streamed, _ = send(server, "anthropic_messages", body("anthropic_messages", "Hi", stream=True, seed=None))
    secret = {**body("openai_chat", "Hello", stream=False, seed=3), "api_key": "sk-dump-dir-secret"}
    answered, _ = send(server, "openai_chat", secret, {"Authorization": "Bearer sk-dump-dir-header"})
    end = time.monotonic() + 30
    while len(records_in(dumps)) < 2 and time.monotonic() < end:
        time.sleep(0.1)
    records = records_in(dumps)
    assert [r.id for r in records] == [streamed, answered]
    assert all(r.outcome in ("stop", "length") and r.meta["status"] == "finished" and r.deltas for r in records)
    (path,) = dumps.glob("*.jsonl")  # beside it only the writer's committed position (ingest.dumps.dump_writer.POSITION_FILE)
    # The position is saved as <name>.tmp then renamed over: wait out a save in flight before listing.
    end = time.monotonic() + 10
    while any(p.name.endswith(".tmp") for p in dumps.iterdir()) and time.monotonic() < end:
        time.sleep(0.05)
    assert sorted(p.name for p in dumps.iterdir()) == sorted([path.name, POSITION_FILE])
    assert path.name.startswith("metrale-dumps-") and path.name.endswith("-0001.jsonl")
    raw = path.read_bytes()
    assert b"sk-dump-dir-secret" not in raw and b"sk-dump-dir-header" not in raw


def test_a_met_api_killed_and_restarted_writes_what_finished_while_it_was_down_each_once(redis_server: str, tmp_path: Path) -> None:
    """A real `met api --dump-dir` process, kill -9, requests finishing meanwhile (recorded by hand, as a
    worker does), a restart: every record is in the files exactly once."""
    import asyncio
    import os
    import signal
    import subprocess
    import sys

    import httpx
    from redis.asyncio import Redis

    from cli.embedded_redis import free_port

    from ..conftest import ROOT
    from ..ingest.test_dump_writer import finish_by_hand

    dumps = tmp_path / "dumps"

    def start() -> subprocess.Popen[bytes]:
        port = free_port()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "MET_DATA_DIR": str(tmp_path)}
        cmd = [sys.executable, "-m", "cli.main", "api", "--redis-url", redis_server, "--port", str(port), "--dump-dir", str(dumps)]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 180
        while time.monotonic() < end and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return proc
            except httpx.HTTPError:
                time.sleep(0.2)
        proc.kill()
        pytest.fail("met api did not start")

    def finish(n: int) -> list[str]:
        async def run() -> list[str]:
            redis = Redis.from_url(redis_server)
            try:
                return [await finish_by_hand(redis) for _ in range(n)]
            finally:
                await redis.aclose()

        return asyncio.run(run())

    def written(expected: int) -> list[str]:
        end = time.monotonic() + 60
        while len(records_in(dumps)) < expected and time.monotonic() < end:
            time.sleep(0.1)
        time.sleep(0.5)  # and nothing more arrives
        return [r.id for r in records_in(dumps)]

    api = start()
    try:
        ids = finish(1)
        assert written(1) == ids
        api.send_signal(signal.SIGKILL)
        api.wait(10)
        ids += finish(3)  # finished while no writer ran
        api = start()
        assert written(4) == ids
        ids += finish(1)
        assert written(5) == ids
    finally:
        api.terminate()
        api.wait(30)
