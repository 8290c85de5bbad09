"""`--dump-dir`: append every finished request to rotating JSONL files, from the API process.

Owns: a background asyncio task that follows the `met:finished` feed (XREAD), loads each finished
request's dump record (ingest.dumps.dump_reader) and appends it as one JSON line to
`DIR/metrale-dumps-<UTC date>-<n>.jsonl`, starting a new file when the next line would pass the size limit
(64 MiB) or the UTC date changes. Lines are redacted by `shared.dumps.record_to_line`. Started and stopped
by `cli.serve.run_api`, never by the HTTP app.

Each record is written once, also across restarts and failed writes: after every batch the file is
fsynced and the position is committed to `DIR/.metrale-dumps-position.json` (the last feed id written,
the file, its size; written atomically). A writer that starts resumes from that id, so what finished
while it was down is written too; before writing it cuts away whatever a crashed or failed batch left
after the committed size (and any newer file), so a retried batch never duplicates a line. A file left
at rotation is fsynced before the next one starts. The first start of a dump dir begins with what
finishes from then on. Kept by hand (about 60 lines) because no library offers "rotating JSONL with a
committed position" and the position must name our own feed ids.

With several API nodes each node with `--dump-dir` writes every request it sees on the feed (all of
them, not just its own), so enable it on one node only. A request whose keys expired before it was read
is skipped with a warning; a Redis outage is retried, never fatal to the API. The feed keeps the last
~100k finishes: a writer down for longer than that misses the older ones (it says so).
Must not: write to Redis, or block the event loop on file I/O (writes go through a thread).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from bus.connect import connect
from ingest.dumps.dump_reader import load_record
from shared import keys
from shared.codec import CodecError, request_id_of
from shared.dumps import record_to_line

log = logging.getLogger("met.dumps")

MAX_FILE_BYTES = 64 * 2**20
POSITION_FILE = ".metrale-dumps-position.json"
RECENT_IDS = 10_000
_NAME = re.compile(r"^metrale-dumps-(\d{4}-\d{2}-\d{2})-(\d+)\.jsonl$")


def utc_date(now: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(now))


PRIVATE = 0o600  # dump files: the owner's only (os.open's mode, under the umask)


class RotatingJsonl:
    """Appends lines to `metrale-dumps-<date>-<n>.jsonl`, moving to n+1 at the size limit and to n=1 on a
    new UTC date (fsyncing the file it leaves). On start it continues today's newest file."""

    def __init__(self, directory: str | Path, *, max_bytes: int = MAX_FILE_BYTES) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._date = ""
        self._index = 0
        self._size = 0

    def path(self) -> Path:
        return self.directory / f"metrale-dumps-{self._date}-{self._index:04d}.jsonl"

    def append(self, lines: list[bytes], *, now: float | None = None) -> list[Path]:
        """Write `lines` (each ends with a newline); returns the files written to. Files are created
        readable by their owner only (prompts and outputs are users' data), in a folder likewise."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        written: list[Path] = []
        out: BinaryIO | None = None
        try:
            for line in lines:
                path = self._target(len(line), time.time() if now is None else now)
                if out is None or out.name != str(path):
                    if out is not None:  # rotation: the file left is on disk before the next one starts
                        _sync(out)
                        out.close()
                    out = os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE), "ab")  # kept open across lines, closed below
                out.write(line)
                self._size += len(line)
                if path not in written:
                    written.append(path)
        finally:
            if out is not None:
                out.close()
        return written

    def sync(self) -> None:
        """fsync the current file (before its position is committed)."""
        if self._date and self.path().exists():
            with open(self.path(), "ab") as out:
                _sync(out)

    def current(self) -> tuple[str, int]:
        """The file written last and its size ("" before any)."""
        return (self.path().name, self._size) if self._date else (self._newest(), 0)

    def restore(self, name: str, size: int) -> None:
        """Go back to a committed position: `name` cut to `size`; newer files (only uncommitted lines) removed."""
        self.directory.mkdir(parents=True, exist_ok=True)
        mark = _order(name)
        for other in os.listdir(self.directory):
            if _NAME.match(other) and _order(other) > mark:
                log.warning("dump writer: removing %s (written after the last committed position; rewritten now)", other)
                os.unlink(self.directory / other)
        match = _NAME.match(name)
        if match is None:
            self._date = ""
            return
        self._date, self._index = match.group(1), int(match.group(2))
        path = self.path()
        if path.exists() and path.stat().st_size > size:
            log.warning("dump writer: cutting %s back to %d bytes (lines of a batch never committed)", name, size)
            os.truncate(path, size)
        self._size = min(size, path.stat().st_size) if path.exists() else 0

    def _target(self, size: int, now: float) -> Path:
        date = utc_date(now)
        if date != self._date:
            self._date, self._index = date, self._latest_index(date)
            self._size = self._stat()
        if self._size and self._size + size > self.max_bytes:
            self._index += 1
            self._size = self._stat()
        return self.path()

    def _stat(self) -> int:
        return self.path().stat().st_size if self.path().exists() else 0

    def _latest_index(self, date: str) -> int:
        indices = [int(m.group(2)) for name in os.listdir(self.directory) if (m := _NAME.match(name)) and m.group(1) == date]
        return max(indices, default=1)

    def _newest(self) -> str:
        names = [name for name in os.listdir(self.directory) if _NAME.match(name)] if self.directory.exists() else []
        return max(names, key=_order, default="")


def _order(name: str) -> tuple[str, int]:
    match = _NAME.match(name)
    return (match.group(1), int(match.group(2))) if match else ("", 0)


def _sync(out: BinaryIO) -> None:
    out.flush()
    os.fsync(out.fileno())


@dataclass(frozen=True, slots=True)
class Position:
    """What is committed: every feed entry up to `feed_id` is in the files, which end at `file` / `size`."""

    feed_id: str
    file: str
    size: int

    @staticmethod
    def load(directory: Path) -> Position | None:
        try:
            doc = orjson.loads((directory / POSITION_FILE).read_bytes())
            return Position(feed_id=str(doc["feed_id"]), file=str(doc["file"]), size=int(doc["size"]))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            log.error("dump writer: %s is unreadable (%s); starting from new finishes", directory / POSITION_FILE, exc)
            return None

    def save(self, directory: Path) -> None:
        """Atomically: a temporary file, fsynced, renamed over the old one, the directory fsynced."""
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f"{POSITION_FILE}.tmp"
        with open(tmp, "wb") as out:
            out.write(orjson.dumps({"feed_id": self.feed_id, "file": self.file, "size": self.size}))
            _sync(out)
        os.replace(tmp, directory / POSITION_FILE)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class DumpWriter:
    """Follows `met:finished` and appends each finished request's record once. `step_once()` is one read."""

    def __init__(self, redis: Redis, files: RotatingJsonl) -> None:
        self.redis = redis
        self.files = files
        self.last_id = "$"
        self.written = 0
        self.position: Position | None = None
        self._recent: OrderedDict[str, None] = OrderedDict()  # request ids written lately (a feed entry sent twice)

    async def start_position(self) -> None:
        """Resume from the committed position (cutting away what a crash left after it); on the first start
        of this dump dir, pin `$` to a concrete id, so nothing that finishes between steps is missed."""
        info: Any = await self.redis.xinfo_stream(keys.FINISHED) if await self.redis.exists(keys.FINISHED) else None
        newest = _text(info["last-generated-id"]) if info else "0-0"
        committed = Position.load(self.files.directory)
        if committed is None:
            await asyncio.to_thread(self._commit, newest, first=True)
            self.last_id = newest
            return
        await asyncio.to_thread(self.files.restore, committed.file, committed.size)
        self.position, self.last_id = committed, committed.feed_id
        if _id_key(committed.feed_id) > _id_key(newest):
            log.warning("dump writer: the finished feed is older than our position %s (a new Redis?): reading it from the start", committed.feed_id)
            self.last_id = "0-0"
        elif info and info.get("first-entry") and _id_key(_text(info["first-entry"][0])) > _id_key(committed.feed_id) and committed.feed_id != "0-0":
            log.warning("dump writer: finishes after %s were trimmed from the feed before they were written", committed.feed_id)

    async def step_once(self, *, block_ms: int | None = 1000) -> int:
        """Read the next finished entries (waiting up to `block_ms`; None: do not wait) and append their
        records. Returns how many entries were read (records skipped as unreadable included)."""
        reply: Any = await self.redis.xread({keys.FINISHED: self.last_id}, count=100, block=block_ms)
        entries = [entry for _stream, stream_entries in reply or [] for entry in stream_entries]
        lines: list[tuple[str, bytes]] = []
        for _entry_id, fields in entries:
            rid = request_id_of(fields)
            if rid in self._recent or any(rid == seen for seen, _ in lines):
                continue  # announced twice (a worker's resend after a lost reply): written once
            line = await self._line(rid)
            if line is not None:
                lines.append((rid, line))
        if entries:
            await asyncio.to_thread(self._write, [line for _, line in lines], _text(entries[-1][0]))
            self.last_id = _text(entries[-1][0])  # only once written and committed: a failed step is read again
            self.written += len(lines)
            for rid, _ in lines:
                self._recent[rid] = None
            while len(self._recent) > RECENT_IDS:
                self._recent.popitem(last=False)
        return len(entries)

    def _write(self, lines: list[bytes], feed_id: str) -> None:
        """In a thread: back to the committed position (a failed try may have left part of this batch),
        append, fsync, commit."""
        if self.position is not None:
            self.files.restore(self.position.file, self.position.size)
        if lines:
            self.files.append(lines)
            self.files.sync()
        self._commit(feed_id)

    def _commit(self, feed_id: str, *, first: bool = False) -> None:
        name, size = self.files.current()
        if first and name:
            size = (self.files.directory / name).stat().st_size
        position = Position(feed_id=feed_id, file=name, size=size)
        position.save(self.files.directory)
        self.position = position

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
                if self.position is None:
                    await self.start_position()
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
        try:
            await self.writer.start_position()
        except RedisError as exc:  # Redis not up yet: the task resumes from the committed position once it is
            log.warning("dump writer: redis unavailable at start (%s); retrying in the background", type(exc).__name__)
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


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms or 0), int(seq or 0)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
