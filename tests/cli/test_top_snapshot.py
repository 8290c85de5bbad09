"""The `met top` Snapshot builder against a real Redis with hand-written keys (no model, no terminal)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from cli.top import decode_cell, queue_line, routing_cell
from cli.top_snapshot import ThroughputHistory, cancel, resolve_redis_url, take_request_detail, take_snapshot
from shared import keys
from shared.codec import encode_delta, encode_request
from shared.deltas import Content, Finish, FinishReason, Usage
from shared.ir import Message, Protocol, Request, Role, TextPart
from shared.settings import Settings

TTL = 10.0


def own_db(redis_server: str) -> str:
    """A database of its own on the shared test server (other tests use db 0)."""
    return redis_server.rsplit("/", 1)[0] + "/9"


@pytest.fixture
async def redis(redis_server: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(own_db(redis_server))
    await client.flushdb()
    yield client
    await client.flushdb()
    await client.aclose()


async def add_worker(redis: Redis, worker_id: str, *, heartbeat: float | None, **figures: object) -> None:
    await redis.zadd(keys.WORKERS_ALIVE, {worker_id: heartbeat or time.time() - 30})
    if heartbeat is not None:
        await redis.hset(
            keys.worker_info(worker_id),
            mapping={"host": "box", "pid": 42, "model": "m", "device": "cpu", "heartbeat": heartbeat, **figures},
        )


async def test_a_worker_with_a_stale_heartbeat_or_no_hash_is_marked_dead_and_left_out_of_the_totals(redis: Redis) -> None:
    now = time.time()
    await add_worker(
        redis, "w-live", heartbeat=now, running=3, waiting=1, decode_tps=50.5, prefill_tps=200, kv_used_tokens=300, kv_total_tokens=1000
    )
    await add_worker(redis, "w-stale", heartbeat=now - 60, running=2, decode_tps=99)
    await add_worker(redis, "w-gone", heartbeat=None)

    snap = await take_snapshot(redis, heartbeat_ttl=TTL)

    by_id = {w.id: w for w in snap.workers}
    assert sorted(by_id) == ["w-gone", "w-live", "w-stale"]
    assert [by_id[w].dead for w in ("w-live", "w-stale", "w-gone")] == [False, True, True]
    live = by_id["w-live"]
    assert (live.host, live.pid, live.model, live.device, live.running, live.waiting) == ("box", "42", "m", "cpu", 3, 1)
    assert (live.kv_used_tokens, live.kv_total_tokens, live.prefill_tps, live.decode_tps) == (300, 1000, 200.0, 50.5)
    assert live.heartbeat_age is not None and live.heartbeat_age < 5
    assert by_id["w-gone"].heartbeat_age is not None and by_id["w-gone"].heartbeat_age > 20
    assert (snap.decode_tps, snap.prefill_tps, snap.running) == (50.5, 200.0, 3)


async def test_an_empty_deployment_reads_as_an_empty_snapshot(redis: Redis) -> None:
    snap = await take_snapshot(redis, heartbeat_ttl=TTL)

    assert (snap.workers, snap.active, snap.errors, snap.dead_letters, snap.dead_letter_total) == ((), (), (), (), 0)
    assert (snap.queue.inflight, snap.queue.pending, snap.queue.undelivered, snap.queue.oldest_wait) == (0, 0, 0, None)


async def submit(redis: Redis, rid: str, *, status: str, received_at: float, **meta: object) -> None:
    await redis.hset(
        keys.request_meta(rid), mapping={"status": status, "protocol": "openai_chat", "model": "m", "received_at": received_at, **meta}
    )
    await redis.zadd(keys.REQUEST_INDEX, {rid: received_at})
    await redis.xadd(keys.REQUEST_STREAM, {"id": rid})


async def test_the_queue_and_the_active_requests_come_from_the_group_the_index_and_the_delta_streams(redis: Redis) -> None:
    now = time.time()
    await add_worker(redis, "w-1", heartbeat=now, running=1)
    await redis.xgroup_create(keys.REQUEST_STREAM, keys.WORKER_GROUP, id="0", mkstream=True)
    await submit(redis, "done", status="finished", received_at=now - 9, outcome="stop")
    await submit(redis, "run", status="running", received_at=now - 5, worker="w-1", first_token_at=now - 2, client="10.0.0.7")
    await submit(redis, "wait", status="queued", received_at=now - 3)
    await redis.xreadgroup(keys.WORKER_GROUP, "w-1", {keys.REQUEST_STREAM: ">"}, count=2)
    await redis.xack(keys.REQUEST_STREAM, keys.WORKER_GROUP, (await redis.xrange(keys.REQUEST_STREAM, count=1))[0][0])
    await redis.zadd(keys.INFLIGHT, {"run": now, "wait": now})
    for delta in (Content(text="Hel", token_ids=(1, 2)), Content(text="lo", token_ids=(3,))):
        await redis.xadd(keys.delta_stream("run"), {"d": encode_delta(delta)})

    snap = await take_snapshot(redis, heartbeat_ttl=TTL)

    assert [(r.id, r.status) for r in snap.active] == [("wait", "queued"), ("run", "running")]
    run = snap.active[1]
    assert (run.tokens, run.worker, run.client, run.protocol, run.model) == (3, "w-1", "10.0.0.7", "openai_chat", "m")
    assert 1.0 < run.tokens_per_s < 2.0  # 3 tokens in the ~2 s since its first token
    assert 4.5 < run.age < 10
    q = snap.queue
    assert (q.inflight, q.pending, q.undelivered, q.consumers) == (2, 1, 1, 1)
    assert q.oldest_wait is not None and 2.5 < q.oldest_wait < 10
    assert snap.workers[0].claimed == 1


async def test_recent_errors_and_dead_letters_are_listed_newest_first(redis: Redis) -> None:
    for rid, outcome in (("a", "stop"), ("b", "error:api_error"), ("c", "cancelled"), ("d", "error:overloaded_error")):
        await redis.xadd(keys.FINISHED, {"id": rid, "outcome": outcome})
    await redis.xadd(keys.DEAD_LETTER, {"id": "poison", "entry": "1-0", "deliveries": 3, "at": time.time()})

    snap = await take_snapshot(redis, heartbeat_ttl=TTL)

    assert [(p.request_id, p.detail) for p in snap.errors] == [("d", "error:overloaded_error"), ("b", "error:api_error")]
    assert [(p.kind, p.request_id, p.detail) for p in snap.dead_letters] == [
        ("dead letter", "poison", "delivered 3 times without finishing")
    ]
    assert snap.dead_letter_total == 1


async def test_a_request_detail_has_its_prompt_head_its_text_so_far_and_its_timings(redis: Redis) -> None:
    now = time.time()
    request = Request(
        id="r1",
        protocol=Protocol.OPENAI_CHAT,
        model="m",
        messages=(
            Message(role=Role.SYSTEM, content=(TextPart(text="Be brief."),)),
            Message(role=Role.USER, content=(TextPart(text="Capital of France?"),)),
        ),
    )
    await redis.set(keys.request_ir("r1"), encode_request(request))
    await redis.hset(
        keys.request_meta("r1"),
        mapping={
            "status": "finished",
            "outcome": "stop",
            "received_at": now - 3,
            "claimed_at": now - 2.5,
            "first_token_at": now - 2,
            "finished_at": now - 1,
        },
    )
    for delta in (
        Content(text="Paris", token_ids=(7,)),
        Content(text=".", token_ids=(8,)),
        Finish(reason=FinishReason.STOP, usage=Usage(completion_tokens=2)),
    ):
        await redis.xadd(keys.delta_stream("r1"), {"d": encode_delta(delta)})

    detail = await take_request_detail(redis, "r1")

    assert detail.prompt_head == "system: Be brief.\nuser: Capital of France?"
    assert detail.text == "Paris.\n[stop]"
    assert detail.tokens == 2
    assert not detail.cancel_requested
    timings = dict(detail.timings)
    assert timings["queued for"] == pytest.approx(0.5, abs=0.01)
    assert timings["first token after"] == pytest.approx(1.0, abs=0.01)
    assert timings["total"] == pytest.approx(2.0, abs=0.01)


async def test_cancel_sets_the_flag_a_worker_checks_marked_as_the_operators(redis: Redis) -> None:
    await cancel(redis, "r2")

    assert await redis.get(keys.cancel_flag("r2")) == keys.OPERATOR_CANCEL  # not a client's quiet cancel
    assert 0 < await redis.ttl(keys.cancel_flag("r2")) <= 3600
    assert (await take_request_detail(redis, "r2")).cancel_requested


def test_the_redis_url_is_the_flag_then_the_environment_then_the_local_serve(tmp_path: Path) -> None:
    settings = Settings.from_env({"MET_DATA_DIR": str(tmp_path)})
    assert resolve_redis_url(None, settings) is None
    (tmp_path / "redis.url").write_text("redis://127.0.0.1:7777/0\n")
    assert resolve_redis_url(None, settings) == "redis://127.0.0.1:7777/0"
    with_env = Settings.from_env({"MET_DATA_DIR": str(tmp_path), "REDIS_URL": "redis://:pw@db:6379/0"})
    assert resolve_redis_url(None, with_env) == "redis://:pw@db:6379/0"
    assert resolve_redis_url("redis://other:6379/1", with_env) == "redis://other:6379/1"


def test_the_throughput_history_keeps_only_its_window() -> None:
    history = ThroughputHistory(window_s=10)
    for t in range(30):
        history.add(float(t), float(t))
    assert history.values() == [float(t) for t in range(19, 30)]


async def test_batches_in_progress_are_in_the_snapshot_with_their_progress_and_shown_by_top(redis: Redis) -> None:
    from cli.top import problems_text
    from ingest.batches import batch_jobs

    settings = Settings()
    lines = [{"custom_id": f"c{i}", "body": {}} for i in range(5)]
    doc = await batch_jobs.create(redis, settings, record={"protocol": "openai", "owner": "o", "endpoint": "/v1/chat/completions"}, lines=lines)
    await batch_jobs.record_result(redis, doc["id"], "c0", outcome="succeeded", result={})
    await batch_jobs.record_result(redis, doc["id"], "c1", outcome="errored", result={})
    await batch_jobs.record_result(redis, doc["id"], "c1", outcome="succeeded", result={})  # a second write counts nothing
    snap = await take_snapshot(redis, heartbeat_ttl=TTL)
    assert [(b.id, b.protocol, b.status, b.total, b.succeeded, b.failed) for b in snap.batches] == [(doc["id"], "openai", "validating", 5, 1, 1)]
    assert f"{doc['id']}  openai  validating  2/5 done" in problems_text(snap).plain
    await redis.srem(keys.BATCHES_ACTIVE, doc["id"])  # ended
    assert (await take_snapshot(redis, heartbeat_ttl=TTL)).batches == ()


async def test_each_worker_shows_where_its_claims_came_from_its_cache_hit_rate_and_its_routing_index(redis: Redis) -> None:
    now = time.time()
    figures = {"routed_claims": 7, "shared_claims": 3, "adopted_claims": 2, "prefix_cache_queries": 400, "prefix_cache_hits": 300}
    await add_worker(redis, "w-routed", heartbeat=now, index_size=128, routed_queue=1, **figures)
    await add_worker(redis, "w-cold", heartbeat=now)

    by_id = {w.id: w for w in (await take_snapshot(redis, heartbeat_ttl=TTL)).workers}

    routed, cold = by_id["w-routed"], by_id["w-cold"]
    assert (routed.routed_claims, routed.shared_claims, routed.adopted_claims, routed.index_size, routed.routed_queue) == (7, 3, 2, 128, 1)
    assert routed.cache_hit_rate == 0.75 and cold.cache_hit_rate is None
    assert routing_cell(routed) == "7/3 +2 (1) 75% i128"
    assert routing_cell(cold) == "0/0 - i0"


async def test_each_worker_shows_the_share_of_guessed_tokens_speculative_decoding_kept(redis: Redis) -> None:
    now = time.time()
    await add_worker(redis, "w-spec", heartbeat=now, decode_tps=41.25, spec_proposed=200, spec_accepted=124)
    await add_worker(redis, "w-plain", heartbeat=now, decode_tps=12.0)

    by_id = {w.id: w for w in (await take_snapshot(redis, heartbeat_ttl=TTL)).workers}

    assert (by_id["w-spec"].spec_proposed, by_id["w-spec"].spec_accepted) == (200, 124)
    assert decode_cell(by_id["w-spec"]) == "41.2 s62%"
    assert decode_cell(by_id["w-plain"]) == "12.0"


async def test_the_queue_panel_shows_the_requests_of_each_lora_adapter_summed_over_the_live_workers(redis: Redis) -> None:
    now = time.time()
    await add_worker(redis, "w-a", heartbeat=now, running=4, adapters="pirate=2/1,support-bot=1/0")
    await add_worker(redis, "w-b", heartbeat=now, running=2, adapters="pirate=1/0")
    await add_worker(redis, "w-old", heartbeat=now - 60, running=5, adapters="gone=5/0")  # dead: not counted
    await add_worker(redis, "w-base", heartbeat=now, running=1)

    snap = await take_snapshot(redis, heartbeat_ttl=TTL)

    assert {w.id: w.adapters for w in snap.workers}["w-a"] == (("pirate", 2, 1), ("support-bot", 1, 0))
    assert snap.adapters == (("pirate", 3, 1), ("support-bot", 1, 0))
    assert queue_line(snap).plain.splitlines()[1] == "adapters  pirate 3 running, 1 waiting · support-bot 1 running"
    await redis.hset(keys.worker_info("w-a"), "adapters", "")
    await redis.hset(keys.worker_info("w-b"), "adapters", "")
    assert len(queue_line(await take_snapshot(redis, heartbeat_ttl=TTL)).plain.splitlines()) == 1  # no adapters: no line
