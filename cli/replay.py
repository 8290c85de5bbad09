"""`met replay`: run recorded requests again and say whether the output is the same; or re-encode them.

Owns: the replay command. `--redis-url` (or the local `met serve`'s Redis) publishes each recorded IR
unchanged (same prompt token ids, same sampling and seed) under a fresh id through the ordinary
admission (`ingest.http.publish.admit`, waiting while the queue is at its limit) and `submit`, then tails its
deltas (`encoders.wire.tail`): exact. `--against URL` re-sends the recorded body over HTTP (cli.replay_http),
which re-renders the prompt on the server. Either way `shared.dumps.compare` decides: same generated
token ids, text and finish reason. Requests run one after another, so batch-mates never differ.
`--encode-only` needs no model: it writes the recorded deltas as a protocol's SSE bytes.
FILE is a JSONL of dump records; where no such file exists it is taken as a request id (or a unique
prefix of one) and its record is read from Redis, as `met dump show` finds it.
Must not: edit the records, or count a request that could not be replayed as a match.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import typer
from redis.asyncio import Redis

from bus.connect import connect
from bus.tails import Tails
from cli.dump import AMBIGUOUS_SHOWN, load_by_prefix, resolve_redis_url
from cli.replay_http import ReplayHttpError, post_and_read
from encoders.reencode import encode_sse
from encoders.wire import tail
from ingest.http.publish import admit, submit
from shared.codec import DELTA_FIELD, CodecError
from shared.deltas import StreamDelta
from shared.dumps import Comparison, DumpRecord, compare, read_records
from shared.ir import Protocol
from shared.protocols import specs
from shared.redact import redact_url
from shared.settings import Settings


def protocol_named(name: str) -> Protocol | None:
    """A registered protocol by its `met replay --as` name (shared.protocols) or its own value."""
    return next((s.protocol for s in specs() if name in (s.name, s.protocol.value)), None)


@dataclass(frozen=True, slots=True)
class ReplayTarget:
    """Where to replay: a Redis URL (exact) or an HTTP base URL, and the limits that apply."""

    redis_url: str | None = None
    against: str | None = None
    api_key: str | None = None
    max_queue: int = 256
    timeout: float = 630.0


@dataclass(frozen=True, slots=True)
class Outcome:
    record: DumpRecord
    comparison: Comparison | None
    new_id: str = ""
    problem: str = ""  # why the request could not be replayed


def load_file(path: str) -> list[DumpRecord]:
    try:
        with open(path, "rb") as lines:
            return read_records(lines)
    except (OSError, ValueError, KeyError, CodecError) as exc:
        raise typer.BadParameter(f"cannot read dump records from {path}: {exc}", param_hint="FILE") from None


def load_records(source: str, *, redis_url: str | None, data_dir: str | None) -> list[DumpRecord]:
    """The records of `source`: a file of dump records, else the recorded request with that id (or the
    one id it uniquely starts) in Redis; a clear error naming both ways when neither finds one."""
    if os.path.exists(source) or source == "-" or os.sep in source or source.endswith((".jsonl", ".json")):
        return load_file(source)
    url = resolve_redis_url(redis_url, data_dir)
    record, candidates = asyncio.run(load_by_prefix(url, source))
    if len(candidates) > 1:
        shown = ", ".join(candidates[:AMBIGUOUS_SHOWN])
        raise typer.BadParameter(f"{source} is neither a file nor one recorded request: it starts several ({shown}...).", param_hint="FILE")
    if record is None:
        raise typer.BadParameter(
            f"{source} is neither a file nor a recorded request in the Redis at {redact_url(url)} (never seen, or older than the dump TTL). "
            "`met dump list` shows the recorded ids; `met dump export ID -o FILE.jsonl` saves one to replay later.",
            param_hint="FILE",
        )
    return [record]


# ---- replaying -------------------------------------------------------------------------------------


async def replay_through_redis(redis: Redis, record: DumpRecord, target: ReplayTarget) -> tuple[str, list[StreamDelta]]:
    """Publish the recorded IR under a fresh id (received now, so its deadline starts now) and collect its deltas."""
    request = replace(record.request, id=secrets.token_hex(12), created=time.time())
    end = time.monotonic() + target.timeout
    while not await admit(redis, [request.id], target.max_queue, request_timeout=target.timeout):
        if time.monotonic() > end:
            raise TimeoutError(f"the queue stayed at its limit ({target.max_queue}) for {target.timeout:.0f} s")
        await asyncio.sleep(0.5)
    await submit(redis, request)
    tails = Tails(redis, node=f"replay-{request.id[:8]}", field=DELTA_FIELD)
    try:
        deltas = [d async for batch in tail(tails, request.id, deadline=time.time() + target.timeout) if batch is not None for d in batch]
    finally:
        await tails.close()
    return request.id, deltas


async def replay_all(records: Sequence[DumpRecord], target: ReplayTarget) -> list[Outcome]:
    redis = connect(target.redis_url) if target.redis_url else None
    outcomes: list[Outcome] = []
    try:
        for record in records:
            outcomes.append(await _replay_one(redis, record, target))
            _print_outcome(outcomes[-1])
    finally:
        if redis is not None:
            await redis.aclose()
    return outcomes


async def _replay_one(redis: Redis | None, record: DumpRecord, target: ReplayTarget) -> Outcome:
    try:
        if redis is not None:
            new_request_id, deltas = await replay_through_redis(redis, record, target)
            return Outcome(record, compare(record.deltas, deltas), new_request_id)
        assert target.against is not None
        deltas = await asyncio.to_thread(post_and_read, record, against=target.against, api_key=target.api_key, timeout=target.timeout)
        return Outcome(record, compare(record.deltas, deltas, protocol=record.request.protocol))
    except (ReplayHttpError, OSError, TimeoutError, ValueError, KeyError) as exc:
        return Outcome(record, None, problem=f"{type(exc).__name__}: {exc}")


# ---- reporting -------------------------------------------------------------------------------------


def divergence_cause(record: DumpRecord) -> str:
    """Why a diverged request may have diverged, by what it asked for: a greedy or seeded request must give
    the same tokens (docs/cpu.md, "Exact on every CPU"), so there the cause is the machine or the flags; an
    unseeded sampled one is expected to differ; one that set no temperature got the server's default."""
    sampling = record.request.sampling
    if sampling.greedy or sampling.seed is not None:
        how = "greedy" if sampling.greedy else f"seeded ({sampling.seed})"
        return (
            f"this request is {how}, so the same tokens are expected: a divergence comes from the kernels, not from sampling — "
            "another CPU kind or ONEDNN_MAX_CPU_ISA, --no-row-invariant, batch-mates on an AVX2 CPU without --batch-invariant, "
            "CUDA, or another model, dtype or --quantization (the worker's kernels: `met top`, the log's `kernels:` line)"
        )
    if sampling.temperature is None:
        return "this request set no temperature and no seed: the server's default decided (sampled unless --default-temperature 0), so a different output may be expected"
    return "this request was sampled without a seed, so a different output is expected"


def _print_outcome(outcome: Outcome) -> None:
    record, result = outcome.record, outcome.comparison
    head = f"{record.id}  {record.request.protocol.value:<18}"
    replayed = f"  (replayed as {outcome.new_id})" if outcome.new_id else ""
    if result is None:
        typer.echo(f"{head}  FAILED    {outcome.problem}")
        return
    if result.matches:
        typer.echo(f"{head}  match     {result.new_tokens} tokens, {result.new_finish}{replayed}")
        return
    typer.echo(f"{head}  DIVERGED  {result.recorded_tokens} tokens recorded, {result.new_tokens} now{replayed}")
    for line in result.diff.splitlines():
        typer.echo(f"    {line}")
    typer.echo(f"    note: {divergence_cause(record)}")


def summary(outcomes: Sequence[Outcome]) -> tuple[str, bool]:
    matched = sum(1 for o in outcomes if o.comparison is not None and o.comparison.matches)
    failed = sum(1 for o in outcomes if o.comparison is None)
    diverged = len(outcomes) - matched - failed
    text = f"{len(outcomes)} request(s): {matched} matched, {diverged} diverged" + (f", {failed} could not be replayed" if failed else "")
    return text, matched == len(outcomes)


# ---- the command (its typer signature lives in cli/main.py) --------------------------------------

HELP = """Replay recorded requests and report, per request, whether the new output matches the recorded one.

Each request runs again with the same IR: the same prompt token ids and sampling, seed included. A match means the same generated token ids, text and finish reason; otherwise the first divergent token and the text around it are shown. Exits 1 when anything diverged or could not be replayed.

Through Redis (--redis-url, else REDIS_URL, else the local `met serve`'s embedded Redis found through <data_dir>/redis.url) the recorded IR itself is queued again under a fresh id: exact. With --against URL the recorded body is POSTed to that server (streaming, with return_token_ids), which renders the prompt again: this checks the whole HTTP path, but only as exactly as the prompt renders the same.

`--encode-only [--protocol openai|anthropic|responses] [-o OUT]` runs nothing: it writes the recorded deltas as that protocol's SSE bytes. For the protocol a client spoke, they equal the bytes it received (without keep-alive pings): ids and timestamps come from the recorded request id and creation time.
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayOptions:
    """The flags of `met replay` that choose the target (see HELP)."""

    against: str | None = None
    redis_url: str | None = None
    data_dir: str | None = None
    api_key: str | None = None
    max_queue: int | None = None


def run(file: str, options: ReplayOptions) -> None:
    """Replay every record in `file` (or the recorded request of that id), print the report; typer.Exit(1) unless all matched."""
    if options.against and options.redis_url:
        raise typer.BadParameter("use either --against or --redis-url, not both", param_hint="--against")
    records = load_records(file, redis_url=options.redis_url, data_dir=options.data_dir)
    settings = Settings.from_env(os.environ).with_overrides(max_queue=options.max_queue)
    target = ReplayTarget(
        redis_url=None if options.against else resolve_redis_url(options.redis_url, options.data_dir),
        against=options.against,
        api_key=options.api_key,
        max_queue=settings.max_queue,
        timeout=settings.request_timeout + 30,
    )
    outcomes = asyncio.run(replay_all(records, target))
    text, all_matched = summary(outcomes)
    typer.echo(text)
    if not all_matched:
        raise typer.Exit(1)


def encode_only(file: str, *, protocol: str | None, output: str | None) -> None:
    """Write the records' deltas as SSE bytes of `protocol` (default: each record's own) to `output` or stdout."""
    chosen = protocol_named(protocol.lower()) if protocol else None
    if protocol and chosen is None:
        names = ", ".join(s.name for s in specs())
        raise typer.BadParameter(f"unknown protocol {protocol!r}; use one of {names}", param_hint="--protocol")
    data = b"".join(encode_sse(r.request, r.deltas, chosen or r.request.protocol) for r in load_file(file))
    if output:
        Path(output).write_bytes(data)
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
