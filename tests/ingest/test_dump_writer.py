"""`--dump-dir`: the writer follows met:finished from when it starts and appends records to rotating JSONL files."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import orjson
from redis.asyncio import Redis

from ingest.dump_writer import DumpWriter, DumpWriterTask, RotatingJsonl
from ingest.publish import submit
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
    (path,) = tmp_path.iterdir()
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
