"""`--dump-dir`: the writer follows met:finished from when it first starts, resumes from its committed position,
and appends each record once to rotating JSONL files (fsynced at rotation and before each commit)."""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from ingest.dumps.dump_writer import DumpWriter, DumpWriterTask, Position, RotatingJsonl
from ingest.http.publish import submit
from shared import keys
from shared.codec import encode_delta
from shared.dumps import read_records
from shared.ir import Protocol

from ..encoders.recorded import SCENARIOS, request

DAY = 86400.0
NOON = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC


async def finish_by_hand(redis: Redis, *, body: str = '{"model":"m"}') -> str:
    """Do what ingest and a worker do for one request: record it, write its deltas and meta, announce it finished."""
    req = request(Protocol.OPENAI_CHAT, id=f"dw-{secrets.token_hex(6)}", raw_body=body)
    await submit(redis, req)
    for delta in SCENARIOS["plain_text"]:
        await redis.xadd(keys.delta_stream(req.id), {"d": encode_delta(delta)})
    await redis.hset(keys.request_meta(req.id), mapping={"status": "finished", "outcome": "stop", "worker": "w9", "attempt": 1})
    await redis.xadd(keys.FINISHED, {"id": req.id, "outcome": "stop"})
    return req.id


def records_in(directory: Path) -> list[str]:
    return [r.id for path in sorted(directory.glob("metrale-dumps-*.jsonl")) for r in read_records(path.read_bytes().splitlines())]


def test_files_rotate_at_the_size_limit_and_on_a_new_utc_date(tmp_path: Path) -> None:
    files = RotatingJsonl(tmp_path, max_bytes=25)
    files.append([b'{"n": 1, "pad": "xxxx"}\n'], now=NOON)  # 24 bytes
    files.append([b'{"n": 2}\n', b'{"n": 3}\n'], now=NOON)  # the first would pass 25: a new file
    files.append([b'{"n": 4}\n'], now=NOON + DAY)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["metrale-dumps-2023-11-14-0001.jsonl", "metrale-dumps-2023-11-14-0002.jsonl", "metrale-dumps-2023-11-15-0001.jsonl"]
    assert (tmp_path / names[1]).read_bytes() == b'{"n": 2}\n{"n": 3}\n'


def test_a_restarted_writer_continues_todays_newest_file(tmp_path: Path) -> None:
    (tmp_path / "metrale-dumps-2023-11-14-0003.jsonl").write_bytes(b"{}\n")
    RotatingJsonl(tmp_path).append([b'{"n": 1}\n'], now=NOON)
    assert (tmp_path / "metrale-dumps-2023-11-14-0003.jsonl").read_bytes() == b'{}\n{"n": 1}\n'


async def test_the_writer_appends_requests_finished_after_it_started_and_nothing_before(redis_server: str, tmp_path: Path) -> None:
    redis = Redis.from_url(redis_server)
    try:
        before = await finish_by_hand(redis)
        writer = DumpWriter(redis, RotatingJsonl(tmp_path))
        await writer.start_position()
        first, second = await finish_by_hand(redis), await finish_by_hand(redis)
        await redis.xadd(keys.FINISHED, {"id": "gone-long-ago", "outcome": "stop"})  # keys expired: skipped
        read = 0
        while read < 3:
            read += await writer.step_once(block_ms=100)
    finally:
        await redis.aclose()
    assert records_in(tmp_path) == [first, second] and before not in records_in(tmp_path)
    (path,) = tmp_path.glob("metrale-dumps-*.jsonl")
    line = orjson.loads(path.read_bytes().splitlines()[0])
    assert line["meta"]["worker"] == "w9" and line["outcome"] == "stop" and len(line["deltas"]) == 3


async def test_the_task_writes_what_finished_just_before_it_stopped_and_redacts_it(redis_server: str, tmp_path: Path) -> None:
    task = DumpWriterTask(redis_server, tmp_path / "dumps")
    await task.start()
    redis = Redis.from_url(redis_server)
    try:
        rid = await finish_by_hand(redis, body='{"model":"m","api_key":"sk-dump-secret"}')
    finally:
        await redis.aclose()
    await asyncio.sleep(0.05)  # the follower may or may not have read it yet: stop() must catch up, and write it once
    await task.stop()
    assert records_in(tmp_path / "dumps") == [rid]
    assert b"sk-dump-secret" not in b"".join(p.read_bytes() for p in (tmp_path / "dumps").iterdir())


async def drain(writer: DumpWriter) -> None:
    while await writer.step_once(block_ms=None):
        pass


async def test_a_restarted_writer_writes_what_finished_while_it_was_down_each_once(redis_server: str, tmp_path: Path) -> None:
    redis = Redis.from_url(redis_server)
    try:
        first = DumpWriter(redis, RotatingJsonl(tmp_path))
        await first.start_position()
        written = [await finish_by_hand(redis)]
        await drain(first)
        del first  # stopped
        written += [await finish_by_hand(redis), await finish_by_hand(redis)]  # finished while no writer ran
        again = DumpWriter(redis, RotatingJsonl(tmp_path))
        await again.start_position()
        await drain(again)
        written.append(await finish_by_hand(redis))
        await drain(again)
    finally:
        await redis.aclose()
    assert records_in(tmp_path) == written


async def test_a_batch_that_failed_halfway_or_crashed_before_its_commit_is_written_once(redis_server: str, tmp_path: Path, monkeypatch: Any) -> None:
    redis = Redis.from_url(redis_server)
    real_append, real_save = RotatingJsonl.append, Position.save
    failures = {"append": 1, "save": 1}

    def append_then_fail(self: RotatingJsonl, lines: list[bytes], **kw: Any) -> list[Path]:
        if failures["append"]:
            failures["append"] -= 1
            real_append(self, lines[:1], **kw)
            raise OSError(28, "No space left on device")  # the disk filled after one line
        return real_append(self, lines, **kw)

    def crash_before_commit(self: Position, directory: Path) -> None:
        if failures["save"] and self.size:
            failures["save"] -= 1
            raise SystemExit("killed before the position was committed")
        real_save(self, directory)

    try:
        writer = DumpWriter(redis, RotatingJsonl(tmp_path))
        await writer.start_position()
        monkeypatch.setattr(RotatingJsonl, "append", append_then_fail)
        batch = [await finish_by_hand(redis), await finish_by_hand(redis)]
        with pytest.raises(OSError):
            await writer.step_once(block_ms=None)
        await drain(writer)  # the retry
        assert records_in(tmp_path) == batch
        monkeypatch.setattr(Position, "save", crash_before_commit)
        batch.append(await finish_by_hand(redis))
        with pytest.raises(SystemExit):
            await writer.step_once(block_ms=None)  # its line is in the file, its position is not
        restarted = DumpWriter(redis, RotatingJsonl(tmp_path))
        await restarted.start_position()
        await drain(restarted)
    finally:
        await redis.aclose()
    assert records_in(tmp_path) == batch


def test_a_file_left_at_rotation_is_fsynced_before_the_next_one_is_written(tmp_path: Path, monkeypatch: Any) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    files = RotatingJsonl(tmp_path, max_bytes=20)
    files.append([b'{"n": 1, "pad": "x"}\n', b'{"n": 2}\n'], now=NOON)
    assert synced == ["metrale-dumps-2023-11-14-0001.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrale-dumps-2023-11-14-0001.jsonl", "metrale-dumps-2023-11-14-0002.jsonl"]


def test_dump_files_and_their_folder_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    folder = tmp_path / "dumps"
    [written] = RotatingJsonl(folder).append([b'{"n": 1}\n'], now=NOON)
    assert written.stat().st_mode & 0o077 == 0 and folder.stat().st_mode & 0o077 == 0
