"""`met serve --dump-dir`: every finished request lands, redacted, in the rotating JSONL files."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

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
    (path,) = dumps.iterdir()
    assert path.name.startswith("metrale-dumps-") and path.name.endswith("-0001.jsonl")
    raw = path.read_bytes()
    assert b"sk-dump-dir-secret" not in raw and b"sk-dump-dir-header" not in raw
