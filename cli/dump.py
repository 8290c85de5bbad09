"""`met dump list | show | export`: look at recorded requests in Redis and export them as JSONL.

Owns: the `dump` typer sub-app, finding the Redis to read (`--redis-url`, else REDIS_URL / MET_REDIS_URL,
else the `redis.url` file the local `met serve` writes into its data dir) and the plain-text tables.
Must not: write to Redis (reads go through ingest.dumps.dump_reader), or define the record format (shared.dumps).
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer

from bus.connect import connect
from cli import top_snapshot
from ingest.dumps.dump_reader import Listed, ids_with_prefix, list_requests, load_record
from shared.dumps import DumpRecord, display_status, generated_text, generated_token_ids, record_to_dict, record_to_line, terminal_label
from shared.redact import redact_url
from shared.settings import Settings

STATUSES = ("queued", "running", "finished", "error", "cancelled", "expired")
AMBIGUOUS_SHOWN = 10  # candidates `met dump show` lists for an ambiguous id prefix

ATTACH_HELP = (
    "Without --redis-url it reads REDIS_URL / MET_REDIS_URL, else attaches to the local `met serve`'s embedded "
    "Redis through the `redis.url` file that `met serve` writes in its data dir (--data-dir, MET_DATA_DIR, "
    "default ~/.cache/metrale)."
)

app = typer.Typer(
    help="Recorded requests: list them, show one, export them as JSONL for `met replay`. " + ATTACH_HELP,
    no_args_is_help=True,
    add_completion=False,
)

RedisUrlOption = Annotated[
    str | None, typer.Option("--redis-url", help="Redis to read (default: the local `met serve`'s embedded Redis).", show_default=False)
]
DataDirOption = Annotated[str | None, typer.Option("--data-dir", help="Data dir of the local `met serve` whose Redis to attach to.")]


# ---- finding Redis ---------------------------------------------------------------------------------


def resolve_redis_url(redis_url: str | None, data_dir: str | None = None) -> str:
    """--redis-url, else the environment's Redis URL, else `<data_dir>/redis.url` of a running `met serve`."""
    settings = Settings.from_env(os.environ).with_overrides(data_dir=data_dir)
    url = top_snapshot.resolve_redis_url(redis_url, settings)
    if url:
        return url
    url_file = Path(settings.data_dir) / "redis.url"
    raise typer.BadParameter(
        f"no Redis to read: pass --redis-url, set REDIS_URL, or start `met serve` (it writes {url_file}).", param_hint="--redis-url"
    )


# ---- formatting ------------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in (headers, *rows)]
    return "\n".join(lines)


def utc(ts: float | None) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def since_start(meta: dict[str, Any], name: str) -> str:
    """Time from `received_at` to the timing `name`, in ms below 10 s."""
    start, end = meta.get("received_at"), meta.get(name)
    if not isinstance(start, float) or not isinstance(end, float):
        return "-"
    span = end - start
    return f"{span * 1000:.0f} ms" if span < 10 else f"{span:.1f} s"


def parse_since(value: str, *, now: float | None = None) -> float:
    """A duration back from now (`90s`, `15m`, `2h`, `1d`, `1h30m`) or an ISO time (UTC unless it says)."""
    now = time.time() if now is None else now
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?", value.strip())
    if parts and any(parts.groups()):
        days, hours, minutes, seconds = (float(g or 0) for g in parts.groups())
        return now - (((days * 24 + hours) * 60 + minutes) * 60 + seconds)
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise typer.BadParameter(f"{value!r} is neither a duration (15m, 2h, 1d) nor an ISO time", param_hint="--since") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def list_rows(rows: Sequence[Listed]) -> str:
    headers = ("ID", "RECEIVED (UTC)", "STATUS", "OUTCOME", "PROTOCOL", "WORKER", "ATTEMPT", "TTFT", "TOTAL")
    body = [
        (
            row.id,
            utc(row.received),
            row.status,
            str(row.meta.get("outcome", "-")),
            str(row.meta.get("protocol", "-")),
            str(row.meta.get("worker", "-")),
            str(row.meta.get("attempt", "-")),
            since_start(row.meta, "first_token_at"),
            since_start(row.meta, "finished_at"),
        )
        for row in rows
    ]
    return table(headers, body)


def show_text(record: DumpRecord) -> str:
    """The request's timings, placement and result as a two-column block, then what the model said."""
    meta, request, sampling = record.meta, record.request, record.request.sampling
    settings = {k: getattr(sampling, k) for k in ("temperature", "top_p", "top_k", "seed", "max_tokens") if getattr(sampling, k) is not None}
    rows = [
        ("id", record.id),
        ("status", display_status(meta)),
        ("outcome", record.outcome or "-"),
        ("protocol", f"{request.protocol.value}  (POST {request.endpoint or '?'}, {'streaming' if request.stream else 'not streaming'})"),
        ("model", request.model),
        ("worker", str(meta.get("worker", "-"))),
        ("attempt", str(meta.get("attempt", "-"))),
        ("received", f"{utc(meta.get('received_at'))} UTC"),
        ("claimed", f"+{since_start(meta, 'claimed_at')}"),
        ("first token", f"+{since_start(meta, 'first_token_at')}"),
        ("finished", f"+{since_start(meta, 'finished_at')}"),
        ("batch peak", str(meta.get("batch_max", "-"))),
        ("prompt", f"{len(request.prompt_token_ids)} tokens"),
        ("generated", f"{len(generated_token_ids(record.deltas))} tokens, finish {terminal_label(record.deltas)}"),
        ("sampling", " ".join(f"{k}={v}" for k, v in settings.items()) or "defaults"),
        ("deltas", f"{len(record.deltas)} events"),
    ]
    text = generated_text(record.deltas)
    return table(("FIELD", "VALUE"), rows) + "\n\noutput:\n" + "\n".join(f"  {line}" for line in (text or "(none)").splitlines())


# ---- commands --------------------------------------------------------------------------------------


async def _load(url: str, ids: Sequence[str]) -> list[DumpRecord | None]:
    redis = connect(url)
    try:
        return [await load_record(redis, rid) for rid in ids]
    finally:
        await redis.aclose()


async def load_by_prefix(url: str, id_or_prefix: str) -> tuple[DumpRecord | None, list[str]]:
    """The record whose id is `id_or_prefix`, else the one recorded id it starts; with the candidates
    when the prefix starts several (then no record)."""
    redis = connect(url)
    try:
        record = await load_record(redis, id_or_prefix)
        if record is not None:
            return record, [id_or_prefix]
        candidates = await ids_with_prefix(redis, id_or_prefix, limit=AMBIGUOUS_SHOWN + 1) if id_or_prefix else []
        if len(candidates) == 1:
            return await load_record(redis, candidates[0]), candidates
        return None, candidates
    finally:
        await redis.aclose()


async def _list(url: str, *, since: float, limit: int, statuses: Sequence[str]) -> list[Listed]:
    redis = connect(url)
    try:
        return await list_requests(redis, since=since, limit=limit, statuses=statuses)
    finally:
        await redis.aclose()


@app.command("list")
def list_command(
    since: Annotated[str, typer.Option(help="Only requests received since: a duration back from now (90s, 15m, 2h, 1d) or an ISO time.")] = "1d",
    status: Annotated[list[str] | None, typer.Option(help=f"Only these statuses (repeatable): {', '.join(STATUSES)}.")] = None,
    limit: Annotated[int, typer.Option(help="Show at most this many (newest first).")] = 50,
    redis_url: RedisUrlOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """List recorded requests, newest first: status, outcome, protocol, worker, attempt, time to first token, total time."""
    wanted = [s.lower() for s in status or []]
    unknown = sorted(set(wanted) - set(STATUSES))
    if unknown:
        raise typer.BadParameter(f"unknown status {', '.join(unknown)}; use {', '.join(STATUSES)}", param_hint="--status")
    url = resolve_redis_url(redis_url, data_dir)
    rows = asyncio.run(_list(url, since=parse_since(since), limit=limit, statuses=wanted))
    if not rows:
        typer.echo(f"No requests recorded in {redact_url(url)} match.")
        return
    typer.echo(list_rows(rows))


@app.command()
def show(
    request_id: Annotated[str, typer.Argument(help="The request id or a unique prefix of it (the X-Request-Id header; chatcmpl-/msg_/resp_ ids without the prefix).")],
    json: Annotated[bool, typer.Option("--json", help="Print the whole dump record as JSON instead.")] = False,
    redis_url: RedisUrlOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Show one request (its id or a unique prefix of it): status, outcome, worker, attempt, timings from receipt, tokens and the generated text."""
    url = resolve_redis_url(redis_url, data_dir)
    record, candidates = asyncio.run(load_by_prefix(url, request_id))
    if len(candidates) > 1:
        shown = "\n".join(f"  {c}" for c in candidates[:AMBIGUOUS_SHOWN])
        more = "\n  ... and more" if len(candidates) > AMBIGUOUS_SHOWN else ""
        typer.echo(f"{request_id} is ambiguous; it starts these recorded requests:\n{shown}{more}", err=True)
        raise typer.Exit(2)
    if record is None:
        typer.echo(f"No request {request_id} in {redact_url(url)} (never seen, or older than the dump TTL).", err=True)
        raise typer.Exit(1)
    typer.echo(orjson.dumps(record_to_dict(record), option=orjson.OPT_INDENT_2).decode() if json else show_text(record))


@app.command()
def export(
    request_ids: Annotated[list[str], typer.Argument(help="Request ids to export.")],
    output: Annotated[str, typer.Option("--output", "-o", help="JSONL file to write ('-' for stdout).")],
    redis_url: RedisUrlOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Write the requests' dump records (request IR, deltas, meta; secrets redacted) as JSONL, one object a line, for `met replay`.

    Exits 1 if any id was not found (the others are still written)."""
    url = resolve_redis_url(redis_url, data_dir)
    records = asyncio.run(_load(url, request_ids))
    missing = [rid for rid, record in zip(request_ids, records, strict=True) if record is None]
    data = b"".join(record_to_line(r) for r in records if r is not None)
    if output == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        Path(output).write_bytes(data)
        typer.echo(f"Wrote {len(records) - len(missing)} record(s) to {output}.", err=True)
    if missing:
        typer.echo(f"Not found (never seen, or older than the dump TTL): {', '.join(missing)}", err=True)
        raise typer.Exit(1)
