"""What `met top` shows, read from Redis: a `Snapshot` of workers, queue, active requests and problems.

Owns: the read-only queries behind the dashboard (`take_snapshot`, `take_request_detail`), the one
write it allows (`cancel`, through ingest.http.publish like a disconnecting client), the throughput
history, and finding the Redis URL of a local `met serve`. Every figure comes from the keys in
shared/keys.py, so the dashboard works against any deployment (embedded, compose, many machines).

Reads are batched: a fixed three pipelined round trips per snapshot, whatever the number of
workers and requests (globals; then the hashes the globals name; then the delta streams of the
requests still active). Ages are measured against Redis's own clock (TIME).

Must not: import Textual (the widgets live in cli/top.py, and this module is tested without a
terminal), or write anything but a cancel flag.

Size (~430 lines): every figure `met top` shows, read and derived in one place from three round trips.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from cli.top_batches import BatchView, take_batches
from ingest.http.publish import cancel as set_cancel_flag
from shared import keys
from shared.codec import ID_FIELD, AdapterCounts, CodecError, Meta, adapter_counts, adapters_of, decode_request, delta_of
from shared.deltas import Content, Error, Finish
from shared.ir import TextPart
from shared.settings import Settings

INDEX_WINDOW = 100  # newest requests looked at for the active list
MAX_ACTIVE = 50  # active requests whose delta streams are read each refresh
FINISHED_WINDOW = 200  # newest finished entries searched for errors
SHOWN_PROBLEMS = 8
ACTIVE_STATUSES = ("queued", "running")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerView:
    id: str
    host: str
    pid: str
    model: str
    device: str
    running: int
    waiting: int
    claimed: int  # entries this consumer holds pending in the group
    kv_used_tokens: int
    kv_total_tokens: int
    prefill_tps: float
    decode_tps: float
    heartbeat_age: float | None  # seconds since its last heartbeat (from the alive zset when the hash is gone)
    dead: bool  # hash gone, or heartbeat older than the TTL, while still in the alive set
    draining: bool  # stopping: claims nothing new, finishing what it holds
    upstream: str = ""  # a gateway worker's upstream (workers/gateway.py); "" for a model worker
    upstream_healthy: bool = True  # a gateway worker: its upstream answered the last health probe
    # prefix routing (ingest.http.routing): requests claimed off its own routed stream, the shared one, and other
    # (gone) workers' routed streams; its prefix cache's hit rate; its routing index's size; routed to it, unread
    routed_claims: int = 0
    shared_claims: int = 0
    adopted_claims: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    index_size: int = 0
    routed_queue: int = 0
    spec_proposed: int = 0  # speculative decoding (workers.speculate): guessed tokens checked, and kept
    spec_accepted: int = 0
    adapters: AdapterCounts = ()  # LoRA adapters in its engine: (name, running, waiting), most running first

    @property
    def cache_hit_rate(self) -> float | None:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueView:
    inflight: int  # accepted and unfinished, cluster-wide (met:inflight:ids and the batch pool, met:inflight:batch)
    pending: int  # delivered to a worker, not yet acknowledged
    undelivered: int  # on the stream, not yet read by any worker
    undelivered_estimated: bool  # Redis < 7 has no `lag`: inflight - pending instead
    consumers: int
    oldest_wait: float | None  # seconds the oldest not-yet-started request has waited


@dataclass(frozen=True, slots=True, kw_only=True)
class ActiveRequest:
    id: str
    status: str
    protocol: str
    model: str
    worker: str
    client: str
    age: float
    tokens: int  # generated token ids so far (from its delta stream)
    tokens_per_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    """A recent error (met:finished) or dead letter (met:deadletter)."""

    kind: str  # "error" or "dead letter"
    request_id: str
    detail: str
    age: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    taken_at: float  # Redis TIME, unix seconds
    workers: tuple[WorkerView, ...]
    queue: QueueView
    active: tuple[ActiveRequest, ...]
    errors: tuple[Problem, ...]
    dead_letters: tuple[Problem, ...]
    dead_letter_total: int
    batches: tuple[BatchView, ...] = ()  # batch jobs not yet ended (cli/top_batches.py)

    @property
    def decode_tps(self) -> float:
        return sum(w.decode_tps for w in self.workers if not w.dead)

    @property
    def prefill_tps(self) -> float:
        return sum(w.prefill_tps for w in self.workers if not w.dead)

    @property
    def running(self) -> int:
        return sum(w.running for w in self.workers if not w.dead)

    @property
    def adapters(self) -> AdapterCounts:
        """The LoRA adapters in the live workers' engines, summed over workers: (name, running, waiting),
        most running first."""
        counts: dict[str, tuple[int, int]] = {}
        for w in self.workers:
            for name, running, waiting in () if w.dead else w.adapters:
                r, q = counts.get(name, (0, 0))
                counts[name] = (r + running, q + waiting)
        return adapter_counts(counts)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestDetail:
    id: str
    meta: dict[str, str]
    prompt_head: str
    text: str
    tokens: int
    cancel_requested: bool
    timings: tuple[tuple[str, float | None], ...]  # (label, seconds)


@dataclass(slots=True)
class ThroughputHistory:
    """Summed decode tok/s per refresh over the last `window_s` seconds (the sparkline's data). It holds
    only what this `met top` saw (Redis keeps no throughput history), so until it has run for the whole
    window its span is "since start", and `span_label` says so."""

    window_s: float = 300.0
    points: deque[tuple[float, float]] = field(default_factory=deque)
    started: float | None = None

    def add(self, at: float, value: float) -> None:
        if self.started is None:
            self.started = at
        self.points.append((at, value))
        while self.points and self.points[0][0] < at - self.window_s:
            self.points.popleft()

    def values(self) -> list[float]:
        return [v for _, v in self.points]

    def span_label(self, now: float) -> str:
        """What the sparkline and its peak cover: the whole window, or only since this top started."""
        seen = now - self.started if self.started is not None else 0.0
        if seen >= self.window_s:
            return f"last {int(self.window_s // 60)} min"
        return f"since met top started, {int(seen // 60)}m{int(seen % 60):02d}s ago"


def local_redis_url(settings: Settings) -> str | None:
    """The URL a local `met serve` wrote for its embedded Redis, if one is running."""
    path = Path(settings.data_dir) / "redis.url"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def resolve_redis_url(flag: str | None, settings: Settings) -> str | None:
    """--redis-url, else REDIS_URL / MET_REDIS_URL, else the local `met serve`'s <data_dir>/redis.url."""
    return flag or settings.redis_url or local_redis_url(settings)


async def cancel(redis: Redis, request_id: str) -> None:
    """Flag the request cancelled by the operator; its worker ends it with an error the client sees."""
    await set_cancel_flag(redis, request_id, by_operator=True)


# ---- the snapshot -------------------------------------------------------------------------------


async def take_snapshot(redis: Redis, *, heartbeat_ttl: float) -> Snapshot:
    """Everything the dashboard shows, in three pipelined round trips."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.time()
        pipe.zrange(keys.WORKERS_ALIVE, 0, -1, withscores=True)
        pipe.zcard(keys.INFLIGHT)
        pipe.zcard(keys.INFLIGHT_BATCH)
        pipe.xinfo_groups(keys.REQUEST_STREAM)
        pipe.xpending(keys.REQUEST_STREAM, keys.WORKER_GROUP)
        pipe.zrevrange(keys.REQUEST_INDEX, 0, INDEX_WINDOW - 1)
        pipe.xrevrange(keys.FINISHED, count=FINISHED_WINDOW)
        pipe.xrevrange(keys.DEAD_LETTER, count=SHOWN_PROBLEMS)
        pipe.xlen(keys.DEAD_LETTER)
        clock, alive, interactive, batch_lines, groups, pending, recent, finished, dead, dead_total = _ok(await pipe.execute(raise_on_error=False))
    inflight = int(interactive or 0) + int(batch_lines or 0)  # every request not finished, batch lines (their own pool) included
    now = float(clock[0]) + float(clock[1]) / 1e6
    alive = sorted(alive or [], key=lambda pair: _s(pair[0]))
    recent_ids = [_s(r) for r in recent or []]
    group = _our_group(groups)
    last_delivered = _s(group.get("last-delivered-id")) if group else ""

    async with redis.pipeline(transaction=False) as pipe:
        for member, _score in alive:
            pipe.hgetall(keys.worker_info(_s(member)))
        for rid in recent_ids:
            pipe.hgetall(keys.request_meta(rid))
        if last_delivered:
            pipe.xrange(keys.REQUEST_STREAM, min=f"({last_delivered}", count=1)
        second = _ok(await pipe.execute(raise_on_error=False))
    worker_hashes, metas = second[: len(alive)], second[len(alive) : len(alive) + len(recent_ids)]
    first_undelivered = second[-1] if last_delivered else None

    readable = [(rid, _text_map(m)) for rid, m in zip(recent_ids, metas, strict=True)]
    active_metas = [(rid, m) for rid, m in readable if m.get(Meta.STATUS) in ACTIVE_STATUSES][:MAX_ACTIVE]
    async with redis.pipeline(transaction=False) as pipe:
        for rid, _meta in active_metas:
            pipe.xrange(keys.delta_stream(rid))
        streams = _ok(await pipe.execute(raise_on_error=False))

    consumer_pending = {_s(c["name"]): int(c["pending"]) for c in (pending or {}).get("consumers", [])}
    workers = tuple(
        _worker(_s(m), score, h, now=now, ttl=heartbeat_ttl, claimed=consumer_pending)
        for (m, score), h in zip(alive, worker_hashes, strict=True)
    )
    active = tuple(_active(rid, meta, entries or [], now) for (rid, meta), entries in zip(active_metas, streams, strict=True))
    queue = _queue(group, inflight, active, first_undelivered, now)
    return Snapshot(
        taken_at=now,
        workers=workers,
        queue=queue,
        active=active,
        errors=tuple(_errors(finished or [], now)),
        dead_letters=tuple(_dead_letters(dead or [], now)),
        dead_letter_total=int(dead_total or 0),
        batches=await take_batches(redis),
    )


def _worker(
    worker_id: str, score: float, raw: Mapping[Any, Any] | None, *, now: float, ttl: float, claimed: Mapping[str, int]
) -> WorkerView:
    h = _text_map(raw)
    beat = _float(h, "heartbeat", default=float(score))
    age = max(0.0, now - beat)
    return WorkerView(
        id=worker_id,
        host=h.get("host", "?"),
        pid=h.get("pid", "?"),
        model=h.get("model", "?"),
        device=h.get("device", "?"),
        running=_int(h, "running"),
        waiting=_int(h, "waiting"),
        claimed=claimed.get(worker_id, 0),
        kv_used_tokens=_int(h, "kv_used_tokens"),
        kv_total_tokens=_int(h, "kv_total_tokens"),
        prefill_tps=_float(h, "prefill_tps"),
        decode_tps=_float(h, "decode_tps"),
        heartbeat_age=age,
        dead=not h or age > ttl,
        draining=h.get("draining", "0") not in ("0", ""),
        upstream=h.get("upstream", ""),
        upstream_healthy=h.get("upstream_healthy", "1") == "1",
        routed_claims=_int(h, "routed_claims"),
        shared_claims=_int(h, "shared_claims"),
        adopted_claims=_int(h, "adopted_claims"),
        prefix_cache_queries=_int(h, "prefix_cache_queries"),
        prefix_cache_hits=_int(h, "prefix_cache_hits"),
        index_size=_int(h, "index_size"),
        routed_queue=_int(h, "routed_queue"),
        spec_proposed=_int(h, "spec_proposed"),
        spec_accepted=_int(h, "spec_accepted"),
        adapters=adapters_of(h.get("adapters", "")),
    )


def _queue(
    group: Mapping[str, Any] | None, inflight: Any, active: Iterable[ActiveRequest], first_undelivered: Any, now: float
) -> QueueView:
    depth = int(inflight or 0)
    pending = int(group.get("pending", 0)) if group else 0
    lag = group.get("lag") if group else None
    waits = [r.age for r in active if r.status == "queued"]
    if first_undelivered:
        entry_ms = int(_s(first_undelivered[0][0]).split("-")[0])
        waits.append(max(0.0, now - entry_ms / 1000))
    return QueueView(
        inflight=depth,
        pending=pending,
        undelivered=int(lag) if lag is not None else max(0, depth - pending),
        undelivered_estimated=lag is None,
        consumers=int(group.get("consumers", 0)) if group else 0,
        oldest_wait=max(waits) if waits else None,
    )


def _active(rid: str, meta: Mapping[str, str], entries: list[Any], now: float) -> ActiveRequest:
    tokens = sum(len(_token_ids(d)) for d in _deltas(entries))
    first = _float(meta, Meta.FIRST_TOKEN_AT, default=0.0)
    span = now - first if first else 0.0
    return ActiveRequest(
        id=rid,
        status=meta.get(Meta.STATUS, "?"),
        protocol=meta.get(Meta.PROTOCOL, "?"),
        model=meta.get(Meta.MODEL, "?"),
        worker=meta.get(Meta.WORKER, ""),
        client=meta.get("client", ""),
        age=max(0.0, now - _float(meta, Meta.RECEIVED_AT, default=now)),
        tokens=tokens,
        tokens_per_s=tokens / span if span > 0.5 else 0.0,
    )


def _errors(entries: list[Any], now: float) -> Iterable[Problem]:
    shown = 0
    for entry_id, raw in entries:
        fields = _text_map(raw)
        if not fields.get(Meta.OUTCOME, "").startswith("error"):
            continue
        yield Problem(kind="error", request_id=fields.get(ID_FIELD, "?"), detail=fields[Meta.OUTCOME], age=_entry_age(entry_id, now))
        shown += 1
        if shown == SHOWN_PROBLEMS:
            return


def _dead_letters(entries: list[Any], now: float) -> Iterable[Problem]:
    for entry_id, raw in entries:
        fields = _text_map(raw)
        detail = f"delivered {fields.get('deliveries', '?')} times without finishing"
        if fields.get("reason"):
            detail = f"{fields['reason']} ({detail})"
        yield Problem(kind="dead letter", request_id=fields.get("id", "?"), detail=detail, age=_entry_age(entry_id, now))


# ---- one request --------------------------------------------------------------------------------


async def take_request_detail(redis: Redis, request_id: str) -> RequestDetail:
    """Its prompt head, the text streamed so far and its timings, in one round trip."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.time()
        pipe.hgetall(keys.request_meta(request_id))
        pipe.get(keys.request_ir(request_id))
        pipe.xrange(keys.delta_stream(request_id))
        pipe.exists(keys.cancel_flag(request_id))
        clock, raw_meta, raw_ir, entries, flagged = _ok(await pipe.execute(raise_on_error=False))
    now = float(clock[0]) + float(clock[1]) / 1e6
    meta = _text_map(raw_meta)
    deltas = list(_deltas(entries or []))
    text = "".join(d.text for d in deltas if isinstance(d, Content))
    ends = [d for d in deltas if isinstance(d, Finish | Error)]
    if ends:
        end = ends[-1]
        text += f"\n[{end.reason.value}]" if isinstance(end, Finish) else f"\n[error: {end.message}]"
    return RequestDetail(
        id=request_id,
        meta=meta,
        prompt_head=_prompt_head(raw_ir),
        text=text,
        tokens=sum(len(_token_ids(d)) for d in deltas),
        cancel_requested=bool(flagged),
        timings=_timings(meta, now),
    )


def _prompt_head(raw_ir: Any, limit: int = 600) -> str:
    if raw_ir is None:
        return "(the request IR has expired)"
    try:
        request = decode_request(raw_ir)
    except (CodecError, ValueError, KeyError, TypeError):
        return "(unreadable request IR)"
    lines = [f"{m.role.value}: " + " ".join(p.text for p in m.content if isinstance(p, TextPart)) for m in request.messages]
    head = "\n".join(lines)
    return head if len(head) <= limit else head[:limit] + "…"


def _timings(meta: Mapping[str, str], now: float) -> tuple[tuple[str, float | None], ...]:
    received = _float(meta, Meta.RECEIVED_AT, default=0.0)

    def since(name: str) -> float | None:
        at = _float(meta, name, default=0.0)
        return at - received if at and received else None

    finished = _float(meta, Meta.FINISHED_AT, default=0.0)
    total = (finished or now) - received if received else None
    return (("queued for", since(Meta.CLAIMED_AT)), ("first token after", since(Meta.FIRST_TOKEN_AT)), ("total", total))


# ---- decoding helpers ---------------------------------------------------------------------------


def _ok(results: list[Any]) -> list[Any]:
    """A pipeline's replies with errors (a missing stream or group) read as 'nothing there'."""
    return [None if isinstance(r, Exception) else r for r in results]


def _s(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _text_map(raw: Mapping[Any, Any] | None) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in (raw or {}).items()}


def _int(h: Mapping[str, str], name: str) -> int:
    try:
        return int(float(h.get(name, 0)))
    except ValueError:
        return 0


def _float(h: Mapping[str, str], name: str, *, default: float = 0.0) -> float:
    try:
        return float(h[name])
    except (KeyError, ValueError):
        return default


def _our_group(groups: Any) -> dict[str, Any] | None:
    for group in groups or []:
        g = {_s(k): v for k, v in group.items()}
        if _s(g.get("name")) == keys.WORKER_GROUP:
            return g
    return None


def _deltas(entries: list[Any]) -> Iterable[Any]:
    for _entry_id, raw in entries:
        try:
            delta = delta_of(raw)
        except (CodecError, ValueError, KeyError, TypeError):
            continue
        if delta is not None:
            yield delta


def _token_ids(delta: Any) -> tuple[int, ...]:
    return tuple(getattr(delta, "token_ids", ()))


def _entry_age(entry_id: Any, now: float) -> float:
    return max(0.0, now - int(_s(entry_id).split("-")[0]) / 1000)
