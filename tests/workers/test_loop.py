"""`WorkerLoop.step_once` against a real Redis with a scripted runner: requests flow through claim → step →
fenced write → ack; one failing request (engine.add or a step) fails alone; the in-flight set heals from
every leak path; and a kill -9 + restart of redis-server mid-generation is ridden out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from cli.embedded_redis import EmbeddedRedis
from ingest.http.publish import admit, submit, submit_all
from shared import keys
from shared.codec import decode_delta
from shared.deltas import Content, Error, Finish, StreamDelta, is_terminal
from shared.ir import Request
from shared.settings import Settings
from workers import leases
from workers.engine import Emission, Engine
from workers.faults import FAULT_INJECTION_FILE
from workers.loop import WorkerLoop
from workers.main import redis_client
from workers.scheduler import Sampled, StepPlan

from .fakes import INFO, ByteTokenizer, ScriptedRunner, make_request

pytestmark = pytest.mark.redis  # every test here runs against a real redis-server

TIMEOUT = 600.0


def reply(rid: str) -> str:
    return f"the answer for {rid}, word by word"


def run(redis_url: str, body: Callable[[Redis], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        redis = redis_client(redis_url)
        try:
            await redis.delete(keys.REQUEST_STREAM, keys.INFLIGHT)
            await leases.ensure_group(redis)
            return await body(redis)
        finally:
            await redis.aclose()

    return asyncio.run(main())


def make_loop(redis: Redis, runner: ScriptedRunner | None = None, **settings: Any) -> WorkerLoop:
    config = Settings(**settings)
    engine = Engine(runner or ScriptedRunner(lambda seq: reply(seq.key)), ByteTokenizer(), INFO, settings=config)
    return WorkerLoop(redis, engine, settings=config, worker_id=f"w-{time.monotonic_ns()}", info={"model": "fake"})


async def queue(redis: Redis, *requests: Request) -> None:
    assert await admit(redis, [r.id for r in requests], 100, request_timeout=TIMEOUT)
    await submit_all(redis, list(requests))


async def recorded(redis: Redis, rid: str) -> list[StreamDelta]:
    return [decode_delta(f[b"d"]) for _, f in await redis.xrange(keys.delta_stream(rid)) if b"d" in f]


async def until_done(loop: WorkerLoop, redis: Redis, rids: list[str], steps: int = 2000) -> None:
    for _ in range(steps):
        await loop.step_once()
        ended = [any(is_terminal(d) for d in await recorded(redis, rid)) for rid in rids]
        if all(ended) and not loop.held:
            return
    raise AssertionError("the requests did not finish")


def text(deltas: list[StreamDelta]) -> str:
    return "".join(d.text for d in deltas if isinstance(d, Content))


async def settled(redis: Redis) -> tuple[int, int]:
    """(entries pending in the group, ids in the in-flight set)."""
    pending: Any = await redis.xpending(keys.REQUEST_STREAM, keys.WORKER_GROUP)
    return int(pending["pending"]), int(await redis.zcard(keys.INFLIGHT))


def test_step_once_claims_generates_writes_through_the_fence_and_acks(redis_server: str) -> None:
    async def body(redis: Redis) -> None:
        rids = [f"flow-{i}-{time.monotonic_ns()}" for i in range(3)]
        await queue(redis, *(make_request(rid) for rid in rids))
        loop = make_loop(redis)
        finished_before = await redis.xlen(keys.FINISHED)
        await until_done(loop, redis, rids)
        for rid in rids:
            deltas = await recorded(redis, rid)
            assert text(deltas) == reply(rid)
            assert [type(d) for d in deltas if is_terminal(d)] == [Finish] and is_terminal(deltas[-1])
            assert (await redis.hget(keys.request_meta(rid), "status")) == b"finished"
        assert await settled(redis) == (0, 0)
        assert await redis.xlen(keys.FINISHED) == finished_before + 3
        steps = loop.engine.stats.steps
        loop.engine.scheduler = loop.engine.stats = None  # type: ignore[assignment]  # the heartbeat must not read the engine's tables
        await loop.heartbeat()
        beat = await redis.hgetall(keys.worker_info(loop.worker_id))
        assert int(beat[b"steps"]) == steps > 0 and int(beat[b"decode_tokens"]) > 0  # the figures the step handed over

    run(redis_server, body)


def test_an_outbox_holding_only_emissions_of_requests_no_longer_held_is_dropped_without_a_write(redis_server: str) -> None:
    """A request that ended here (a client that left, a stale attempt) can leave emissions in the outbox
    after it is no longer held. Before: the write had nothing to send, got no results back, and the
    worker died on `zip(groups, results, strict=True)` (seen on CI: a gateway worker after a client left)."""

    async def body(redis: Redis) -> None:
        rid = f"gone-{time.monotonic_ns()}"
        loop = make_loop(redis)
        loop.outbox.append(Emission(rid, Content(text="late", attempt=1)))
        assert rid not in loop.held
        await loop.publish([])
        assert not loop.outbox and not await redis.exists(keys.delta_stream(rid))

    run(redis_server, body)


def faulty(tmp_path: Path) -> dict[str, Any]:
    (tmp_path / FAULT_INJECTION_FILE).touch()
    return {"data_dir": str(tmp_path), "fail_on": "BAD"}


def test_the_fenced_write_skips_the_script_check_once_loaded_and_reloads_after_a_script_flush(redis_server: str) -> None:
    async def body(redis: Redis) -> None:
        rids = [f"flush-{i}-{time.monotonic_ns()}" for i in range(2)]
        loop = make_loop(redis)
        await queue(redis, make_request(rids[0]))
        await until_done(loop, redis, rids[:1])
        assert loop._fenced_loaded  # later pipelines run EVALSHA without redis-py's SCRIPT EXISTS round trip
        await redis.script_flush()  # what a restarted Redis has: no scripts
        await queue(redis, make_request(rids[1]))
        for _ in range(2000):
            await loop.step_once()  # the NOSCRIPT must be handled inside, not raised
            if not loop.held and any(is_terminal(d) for d in await recorded(redis, rids[1])):
                break
        deltas = await recorded(redis, rids[1])
        assert text(deltas) == reply(rids[1]) and [type(d) for d in deltas if is_terminal(d)] == [Finish]
        assert loop._fenced_loaded and loop.redis_outages >= 1  # the NOSCRIPT was taken for an outage, then the script reloaded

    run(redis_server, body)


def test_a_request_that_fails_every_step_fails_alone_and_its_batch_mates_finish(redis_server: str, tmp_path: Path) -> None:
    async def body(redis: Redis) -> None:
        rids = [f"mate-{i}-{time.monotonic_ns()}" for i in range(5)]
        poison = rids[2]
        requests = [replace(make_request(rid), raw_body='{"note":"BAD:step"}' if rid == poison else "{}") for rid in rids]
        await queue(redis, *requests)
        loop = make_loop(redis, **faulty(tmp_path))
        await until_done(loop, redis, rids)
        for rid in rids:
            deltas = await recorded(redis, rid)
            if rid == poison:
                assert len(deltas) == 1 and isinstance(deltas[0], Error)
            else:
                assert text(deltas) == reply(rid) and isinstance(deltas[-1], Finish)
        assert (await redis.hget(keys.request_meta(poison), "deliveries")) == b"1"  # delivered once, never redelivered
        assert not [f for _, f in await redis.xrange(keys.DEAD_LETTER) if f.get(b"id", b"").decode() == poison]
        assert await settled(redis) == (0, 0)

    run(redis_server, body)


def test_a_request_engine_add_refuses_fails_alone(redis_server: str, tmp_path: Path) -> None:
    async def body(redis: Redis) -> None:
        rids = [f"add-{i}-{time.monotonic_ns()}" for i in range(3)]
        requests = [replace(make_request(rid), raw_body='{"note":"BAD:add"}' if i == 1 else "{}") for i, rid in enumerate(rids)]
        await queue(redis, *requests)
        loop = make_loop(redis, **faulty(tmp_path))
        await until_done(loop, redis, rids)
        outcomes = [await recorded(redis, rid) for rid in rids]
        assert text(outcomes[0]) == reply(rids[0]) and text(outcomes[2]) == reply(rids[2])
        assert len(outcomes[1]) == 1 and isinstance(outcomes[1][0], Error)
        assert await settled(redis) == (0, 0)

    run(redis_server, body)


def test_the_in_flight_set_heals_from_each_leak_path_and_admission_recovers(redis_server: str) -> None:
    async def body(redis: Redis) -> None:
        stamp = time.monotonic_ns()
        runs, never_queued, lost_zrem, lost_entry = (f"{name}-{stamp}" for name in ("runs", "never-queued", "lost-zrem", "lost-entry"))
        # A partial submit whose release failed too: two admitted, only the first reached the queue.
        assert await admit(redis, [runs, never_queued], 2, request_timeout=TIMEOUT)
        await submit(redis, make_request(runs))
        assert not await admit(redis, ["one-more"], 2, request_timeout=TIMEOUT)  # full
        loop = make_loop(redis)
        await until_done(loop, redis, [runs])
        # A terminal event written whose ZREM was lost (the worker died between the two).
        await redis.zadd(keys.INFLIGHT, {lost_zrem: time.time()})
        await redis.hset(keys.request_meta(lost_zrem), mapping={"status": "finished"})
        assert await redis.zcard(keys.INFLIGHT) == 2
        assert sorted(await leases.sweep_inflight(redis, grace_s=0.0)) == sorted([never_queued, lost_zrem])
        assert await redis.zcard(keys.INFLIGHT) == 0
        # An entry that is gone for good (its request stays "queued"): its id ages out at admission.
        await redis.zadd(keys.INFLIGHT, {lost_entry: time.time() - TIMEOUT - 1000})
        await redis.hset(keys.request_meta(lost_entry), mapping={"status": "queued"})
        assert await leases.sweep_inflight(redis, grace_s=0.0) == []  # it looks alive to the sweep ...
        assert await admit(redis, ["fresh-1", "fresh-2"], 2, request_timeout=TIMEOUT)  # ... but not to admission
        assert sorted(m.decode() for m in await redis.zrange(keys.INFLIGHT, 0, -1)) == ["fresh-1", "fresh-2"]
        await redis.zrem(keys.INFLIGHT, "fresh-1", "fresh-2")
        # A garbled entry for an admitted id: one Error, and its place is given back.
        garbled = f"garbled-{stamp}"
        assert await admit(redis, [garbled], 2, request_timeout=TIMEOUT)
        await redis.xadd(keys.delta_stream(garbled), {"created": b"1"}, id="0-1")
        await redis.xadd(keys.REQUEST_STREAM, {"v": 1, "id": garbled, "req": b"{not json"})
        await until_done(loop, redis, [garbled])
        assert await settled(redis) == (0, 0)

    run(redis_server, body)


def test_the_loop_sweeps_the_in_flight_set_on_its_own(redis_server: str, monkeypatch: Any) -> None:
    monkeypatch.setattr("workers.claims.SWEEP_GRACE_S", 0.0)

    async def body(redis: Redis) -> None:
        assert await admit(redis, [f"leaked-{time.monotonic_ns()}"], 1, request_timeout=TIMEOUT)
        assert not await admit(redis, ["next"], 1, request_timeout=TIMEOUT)
        await make_loop(redis).step_once()
        assert await redis.zcard(keys.INFLIGHT) == 0 and await admit(redis, ["next"], 1, request_timeout=TIMEOUT)
        await redis.zrem(keys.INFLIGHT, "next")

    run(redis_server, body)


def test_an_entry_this_worker_still_runs_is_not_started_twice_when_its_own_reclaim_takes_it(redis_server: str) -> None:
    async def body(redis: Redis) -> None:
        rid = f"own-{time.monotonic_ns()}"
        await queue(redis, make_request(rid))
        loop = make_loop(redis, lease_s=0.0)  # every entry is "idle past its lease" at once, as after a long outage
        await loop.claim(block_ms=None)
        await loop.reclaim()
        assert loop.engine.active_ids() == [rid] and (await redis.hget(keys.request_meta(rid), "attempt")) == b"1"
        await until_done(loop, redis, [rid])
        assert text(await recorded(redis, rid)) == reply(rid)

    run(redis_server, body)


class SlowRunner(ScriptedRunner):
    """A step takes a while, as a real forward does, so a Redis restart lands mid-generation."""

    def execute(self, plan: StepPlan) -> list[Sampled]:
        time.sleep(0.01)
        return super().execute(plan)


def test_a_kill_9_and_restart_of_redis_mid_generation_is_ridden_out_with_every_delta_written_once(tmp_path: Path) -> None:
    server = EmbeddedRedis(str(tmp_path), appendfsync="always")
    url = server.start()
    long_reply = "x" * 40 + "y" * 40 + "z" * 40 + "!" * 40

    async def scenario() -> None:
        redis = redis_client(url)
        rids = [f"outage-{i}" for i in range(3)]
        await leases.ensure_group(redis)
        await queue(redis, *(make_request(rid) for rid in rids))
        loop = make_loop(redis, SlowRunner(lambda _seq: long_reply), lease_s=3.0)
        stop = asyncio.Event()
        worker = asyncio.create_task(loop.run(stop))
        while await redis.xlen(keys.delta_stream(rids[0])) < 20:
            await asyncio.sleep(0.01)
        assert server.proc is not None
        server.proc.kill()  # kill -9: AOF (fsync always) keeps every acknowledged write
        server.proc.wait()
        await asyncio.sleep(1.5)  # the worker steps on meanwhile, its deltas waiting
        await asyncio.to_thread(server.start)
        for _ in range(3000):
            if not loop.held and not loop.engine.has_work():
                break
            assert not worker.done(), worker
            await asyncio.sleep(0.01)
        for rid in rids:
            deltas = await recorded(redis, rid)
            assert text(deltas) == long_reply  # no gap, no repeat
            assert sum(is_terminal(d) for d in deltas) == 1 and isinstance(deltas[-1], Finish)
            assert {getattr(d, "attempt", 0) for d in deltas} == {1}  # the same attempt carried on
        assert loop.redis_outages == 1 and not worker.done()
        assert await settled(redis) == (0, 0)
        stop.set()
        await asyncio.wait_for(worker, 30)
        await redis.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_model_worker_loads_steps_and_scores_prompts_on_its_one_torch_thread(redis_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real default model through `load_engine` and the loop: every torch call of the process (the
    load, each step, a request's prompt scoring, which `start` runs between steps) is made on one
    thread, not the loop's, so one OpenMP pool exists (WorkerLoop's docstring: two made every op slower)."""
    import threading

    from workers import runner as runner_module
    from workers.main import load_engine

    threads: dict[str, set[int]] = {"load": set(), "step": set(), "score": set()}
    real_load = runner_module.load

    def load(*args: Any, **kwargs: Any) -> Any:
        threads["load"].add(threading.get_ident())
        return real_load(*args, **kwargs)

    monkeypatch.setattr(runner_module, "load", load)

    async def body(redis: Redis) -> None:
        settings = replace(Settings.from_env({}), redis_url=redis_server, kv_budget_mb=64)
        engine, info, stepper = await load_engine(settings)
        try:
            model_forward = engine.runner.forward

            def forward(plan: Any) -> Any:
                threads["step"].add(threading.get_ident())
                return model_forward(plan)

            engine.runner.forward = forward  # type: ignore[method-assign]
            score_prompt = engine.score_prompt
            assert score_prompt is not None

            def score(*args: Any, **kwargs: Any) -> Any:
                threads["score"].add(threading.get_ident())
                return score_prompt(*args, **kwargs)

            engine.score_prompt = score
            loop = WorkerLoop(redis, engine, settings=settings, worker_id=f"w-{time.monotonic_ns()}", info=info, stepper=stepper)
            rids = [f"torch-{k}-{time.monotonic_ns()}" for k in range(2)]
            await queue(redis, make_request(rids[0], prompt_len=12, max_tokens=4, prompt_logprobs=2), make_request(rids[1], prompt_len=30, max_tokens=4))
            await until_done(loop, redis, rids)
            scored = [d for d in await recorded(redis, rids[0]) if isinstance(d, Content) and d.prompt_logprobs]
            assert len(scored) == 1 and len(scored[0].prompt_logprobs or ()) == 12
        finally:
            stepper.shutdown(wait=True)
        assert all(threads.values()), threads
        assert len(set().union(*threads.values())) == 1, threads
        assert threading.get_ident() not in threads["load"]

    run(redis_server, body)


def test_a_dead_workers_requests_are_reclaimed_past_a_long_list_of_live_ones_and_before_newer_work(redis_server: str) -> None:
    """40 live entries pending under a live worker come first in the pending list; the dead worker's 2 are
    past them, and one more request waits unclaimed. A worker with room for one takes the dead worker's
    first (page after page of XAUTOCLAIM: one page from the start scans only ten times its count), then
    the other, and only then the newer request."""

    async def body(redis: Redis) -> None:
        tag = time.monotonic_ns()
        live = [make_request(f"live-{tag}-{i}") for i in range(40)]
        dead = [make_request(f"dead-{tag}-{i}") for i in range(2)]
        newer = make_request(f"newer-{tag}")
        await queue(redis, *live)
        live_entries = [c.entry_id for c in await leases.claim_new(redis, "alive", count=40, block_ms=None)]
        await queue(redis, *dead)
        assert len(await leases.claim_new(redis, "died", count=2, block_ms=None)) == 2
        await queue(redis, newer)
        await asyncio.sleep(0.4)  # past the lease (0.3 s) ...

        async def live_worker() -> None:  # ... which the live worker keeps renewing, as a live one does
            while True:
                await leases.renew(redis, "alive", live_entries)
                await asyncio.sleep(0.05)

        renewing = asyncio.create_task(live_worker())
        await asyncio.sleep(0.01)
        loop = make_loop(redis, lease_s=0.3, max_running=1)
        loop.reclaim_due = True
        order = []
        try:
            for _ in range(3):
                await loop.claim(block_ms=None)
                order += loop.engine.active_ids()
                await until_done(loop, redis, loop.engine.active_ids())
        finally:
            renewing.cancel()
        assert order == [dead[0].id, dead[1].id, newer.id]

    run(redis_server, body)


def test_a_recorded_delta_that_does_not_decode_sets_its_request_aside_and_the_worker_goes_on(redis_server: str) -> None:
    async def body(redis: Redis) -> None:
        tag = time.monotonic_ns()
        broken, fine = make_request(f"broken-{tag}"), make_request(f"fine-{tag}")
        await queue(redis, broken, fine)
        await redis.xadd(keys.delta_stream(broken.id), {"d": b"{not json"})  # what an earlier attempt wrote, damaged
        dead_before = await redis.xlen(keys.DEAD_LETTER)
        loop = make_loop(redis)
        await loop.claim(block_ms=None)
        await until_done(loop, redis, [fine.id])
        assert text(await recorded(redis, fine.id)) == reply(fine.id)  # the other request ran
        assert await redis.xlen(keys.DEAD_LETTER) == dead_before + 1
        [(_id, entry)] = await redis.xrevrange(keys.DEAD_LETTER, count=1)
        assert entry[b"id"].decode() == broken.id
        last = decode_delta((await redis.xrevrange(keys.delta_stream(broken.id), count=1))[0][1][b"d"])
        assert isinstance(last, Error)  # its client gets one error, not a wait

    run(redis_server, body)
