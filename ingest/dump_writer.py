"""`--dump-dir`: append every finished request to rotating JSONL files, from the API process.

Owns: a background asyncio task that follows the `met:finished` feed (XREAD, starting from `$`: the
requests that finish after it starts), loads each finished request's dump record (ingest.dump_reader)
and appends it as one JSON line to `DIR/metrale-dumps-<UTC date>-<n>.jsonl`, starting a new file when
the next line would pass the size limit (64 MiB) or the UTC date changes. Lines are redacted by
`shared.dumps.record_to_line`. Started and stopped by `cli.serve.run_api`, never by the HTTP app.

With several API nodes each node with `--dump-dir` writes every request it sees on the feed (all of
them, not just its own), so enable it on one node only. A request whose keys expired before it was read
is skipped with a warning; a Redis outage is retried, never fatal to the API.
Must not: write to Redis, or block the event loop on file I/O (writes go through a thread).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from bus.connect import connect
from ingest.dump_reader import load_record
from shared import keys
from shared.codec import CodecError
from shared.dumps import record_to_line

log = logging.getLogger("met.dumps")

MAX_FILE_BYTES = 64 * 2**20
_NAME = re.compile(r"^metrale-dumps-(\d{4}-\d{2}-\d{2})-(\d+)\.jsonl$")


def utc_date(now: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(now))


class RotatingJsonl:
    """Appends lines to `metrale-dumps-<date>-<n>.jsonl`, moving to n+1 at the size limit and to n=1 on a
    new UTC date. On start it continues today's newest file. Each line is written whole, then flushed."""

    def __init__(self, directory: str | Path, *, max_bytes: int = MAX_FILE_BYTES) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._date = ""
        self._index = 0

    def path(self) -> Path:
        return self.directory / f"metrale-dumps-{self._date}-{self._index:04d}.jsonl"

    def append(self, lines: list[bytes], *, now: float | None = None) -> list[Path]:
        """Write `lines` (each ends with a newline); returns the files written to."""
        self.directory.mkdir(parents=True, exist_ok=True)
        written: list[Path] = []
        for line in lines:
            path = self._target(len(line), time.time() if now is None else now)
            with open(path, "ab") as out:
                out.write(line)
            if path not in written:
                written.append(path)
        return written

    def _target(self, size: int, now: float) -> Path:
        date = utc_date(now)
        if date != self._date:
            self._date, self._index = date, self._latest_index(date)
        path = self.path()
        used = path.stat().st_size if path.exists() else 0
        if used and used + size > self.max_bytes:
            self._index += 1
            path = self.path()
        return path

    def _latest_index(self, date: str) -> int:
        indices = [int(m.group(2)) for name in os.listdir(self.directory) if (m := _NAME.match(name)) and m.group(1) == date]
        return max(indices, default=1)


class DumpWriter:
    """Follows `met:finished` and appends each finished request's record. `step_once()` is one read."""

    def __init__(self, redis: Redis, files: RotatingJsonl) -> None:
        self.redis = redis
        self.files = files
        self.last_id = "$"
        self.written = 0

    async def start_position(self) -> None:
        """Pin `$` to a concrete id, so nothing that finishes between steps is missed."""
        info: Any = await self.redis.xinfo_stream(keys.FINISHED) if await self.redis.exists(keys.FINISHED) else None
        self.last_id = _text(info["last-generated-id"]) if info else "0-0"

    async def step_once(self, *, block_ms: int | None = 1000) -> int:
        """Read the next finished entries (waiting up to `block_ms`; None: do not wait) and append their
        records. Returns how many entries were read (records skipped as unreadable included)."""
        reply: Any = await self.redis.xread({keys.FINISHED: self.last_id}, count=100, block=block_ms)
        entries = [entry for _stream, stream_entries in reply or [] for entry in stream_entries]
        lines = [line for _entry_id, fields in entries if (line := await self._line(_text(fields.get(b"id", b"")))) is not None]
        if lines:
            await asyncio.to_thread(self.files.append, lines)
            self.written += len(lines)
        if entries:
            self.last_id = _text(entries[-1][0])  # only once written: a failed step is read again
        return len(entries)

    async def _line(self, request_id: str) -> bytes | None:
        try:
            record = await load_record(self.redis, request_id)
            return record_to_line(record) if record is not None else _gone(request_id)
        except (CodecError, ValueError, KeyError, TypeError) as exc:  # one bad record must not stall the feed
            log.warning("dump of request %s skipped: unreadable (%s)", request_id, exc)
            return None

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                await self.step_once()
            except RedisError as exc:
                log.warning("dump writer: redis unavailable (%s); retrying", type(exc).__name__)
                await asyncio.sleep(1.0)
            except OSError as exc:
                log.error("dump writer: cannot write to %s (%s); retrying", self.files.directory, exc)
                await asyncio.sleep(5.0)
            except Exception:
                log.exception("dump writer: unexpected failure; retrying")
                await asyncio.sleep(5.0)


class DumpWriterTask:
    """The writer as a background task of the API process: `await start()`, later `await stop()`.

    `stop()` lets the current step end (at most one blocking read), then reads on without blocking until
    the feed is drained, so requests that finished during shutdown (workers drain before the API exits)
    still reach the files."""

    def __init__(self, redis_url: str, directory: str | Path, *, max_bytes: int = MAX_FILE_BYTES) -> None:
        self.redis = connect(redis_url)
        self.writer = DumpWriter(self.redis, RotatingJsonl(directory, max_bytes=max_bytes))
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.writer.start_position()
        self._task = asyncio.create_task(self.writer.run(self._stopping), name="met-dump-writer")
        log.info("writing finished requests to %s", self.writer.files.directory)

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout)
            except TimeoutError:
                log.warning("dump writer: still busy after %.0f s; stopping it", timeout)
        try:
            while await self.writer.step_once(block_ms=None):
                pass
        except (RedisError, OSError) as exc:
            log.warning("dump writer: final read failed (%s)", type(exc).__name__)
        finally:
            await self.redis.aclose()


def _gone(request_id: str) -> bytes | None:
    log.warning("dump of request %s skipped: its keys are gone", request_id)
    return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
