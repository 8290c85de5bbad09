"""The scheduler and engine with a scripted runner: continuous batching without a model."""

from __future__ import annotations

from dataclasses import replace

from shared.deltas import Content, Finish, FinishReason
from shared.settings import Settings
from workers.blocks import BlockPool
from workers.engine import Emission, Engine
from workers.scheduler import Scheduler, Sequence

from .fakes import INFO, ByteTokenizer, ScriptedRunner, make_request


def engine(runner: ScriptedRunner, **settings: object) -> Engine:
    return Engine(runner, ByteTokenizer(), INFO, settings=Settings(**{"max_running": 4, "max_tokens_per_step": 64, **settings}))  # type: ignore[arg-type]


def run_until_idle(eng: Engine, limit: int = 1000) -> list[Emission]:
    out: list[Emission] = []
    for _ in range(limit):
        if not eng.has_work():
            return out
        out.extend(eng.step())
    raise AssertionError("engine did not finish")


def text_of(emissions: list[Emission], rid: str) -> str:
    return "".join(e.delta.text for e in emissions if e.request_id == rid and isinstance(e.delta, Content))


def test_each_request_gets_its_own_text_and_one_finish() -> None:
    runner = ScriptedRunner(lambda seq: f"reply to {seq.key}")
    eng = engine(runner)
    for rid in ("a", "b", "c"):
        eng.add(make_request(rid))
    out = run_until_idle(eng)
    for rid in ("a", "b", "c"):
        assert text_of(out, rid) == f"reply to {rid}"
        finishes = [e.delta for e in out if e.request_id == rid and isinstance(e.delta, Finish)]
        assert len(finishes) == 1 and finishes[0].reason is FinishReason.STOP
    assert max(len(p.decode) for p in runner.plans) == 3


def test_a_request_joining_mid_batch_starts_before_the_running_ones_finish() -> None:
    runner = ScriptedRunner(lambda seq: "x" * 40)
    eng = engine(runner)
    eng.add(make_request("early"))
    for _ in range(5):
        eng.step()
    eng.add(make_request("late"))
    out: list[Emission] = []
    first_late = None
    while eng.has_work():
        step = eng.step()
        out.extend(step)
        if first_late is None and any(e.request_id == "late" for e in step):
            first_late = len(runner.plans)
    early_done = next(i for i, p in enumerate(runner.plans) if not any(s.key == "early" for s in p.decode) and i > 5)
    assert first_late is not None and first_late < early_done
    assert any({s.key for s in p.decode} == {"early", "late"} for p in runner.plans)


def test_a_cancelled_request_frees_its_slot_within_one_step() -> None:
    runner = ScriptedRunner(lambda seq: "y" * 100)
    eng = engine(runner, max_running=1)
    eng.add(make_request("long"))
    eng.add(make_request("next"))
    for _ in range(3):
        eng.step()
    assert [s.key for s in eng.scheduler.running] == ["long"]
    [cancelled] = eng.cancel("long")
    assert isinstance(cancelled.delta, Finish) and cancelled.delta.reason is FinishReason.CANCELLED
    assert runner.released == ["long"]
    eng.step()
    assert [s.key for s in eng.scheduler.running] == ["next"]


def test_long_prompts_are_prefilled_in_chunks_within_the_step_budget_while_others_decode() -> None:
    runner = ScriptedRunner(lambda seq: "z" * 30)
    eng = engine(runner, max_tokens_per_step=16)
    eng.add(make_request("short", prompt_len=4))
    eng.step()
    eng.add(make_request("long", prompt_len=100))
    while eng.has_work():
        eng.step()
    assert all(p.num_tokens <= 16 for p in runner.plans)
    mixed = [p for p in runner.plans if p.decode and p.prefill and p.prefill[0].seq.key == "long"]
    assert len(mixed) >= 5  # the long prompt arrived in pieces while "short" kept decoding


def test_lower_priority_value_is_admitted_first() -> None:
    sched = Scheduler(pool=BlockPool(8), max_running=1, max_tokens_per_step=64)
    low = Sequence(request=make_request("later", priority=5), prompt=[1, 2])
    high = Sequence(request=make_request("sooner", priority=-1), prompt=[1, 2])
    sched.add(low)
    sched.add(high)
    plan = sched.schedule()
    assert [c.seq.key for c in plan.prefill] == ["sooner"]


def test_max_tokens_and_stop_strings_finish_with_the_right_reason() -> None:
    runner = ScriptedRunner(lambda seq: "hello world, goodbye")
    eng = engine(runner)
    eng.add(make_request("cut", max_tokens=5))
    eng.add(make_request("stop", stop=("d, g",)))
    out = run_until_idle(eng)
    finish = {e.request_id: e.delta for e in out if isinstance(e.delta, Finish)}
    assert finish["cut"].reason is FinishReason.LENGTH and finish["cut"].usage.completion_tokens == 5  # type: ignore[union-attr]
    assert text_of(out, "cut") == "hello"
    assert finish["stop"].reason is FinishReason.STOP_SEQUENCE and finish["stop"].matched_stop == "d, g"  # type: ignore[union-attr]
    assert text_of(out, "stop") == "hello worl"


def test_every_generated_token_is_accounted_for_in_some_delta() -> None:
    runner = ScriptedRunner(lambda seq: "abc d")
    eng = engine(runner)
    eng.add(make_request("r", stop=(" d",)))
    out = run_until_idle(eng)
    ids = [t for e in out for t in e.delta.token_ids]  # type: ignore[union-attr]
    finish = out[-1].delta
    assert isinstance(finish, Finish) and len(ids) == finish.usage.completion_tokens == 5


def test_a_failing_step_ends_every_request_in_flight_with_one_error() -> None:
    runner = ScriptedRunner(lambda seq: "abc")
    eng = engine(runner)
    eng.add(make_request("a"))
    eng.add(make_request("b"))
    eng.step()
    out = eng.fail_all("boom")
    assert sorted(e.request_id for e in out) == ["a", "b"] and all(e.terminal for e in out)
    assert not eng.has_work() and eng.scheduler.pool.num_free == runner.num_blocks


def test_a_higher_priority_arrival_preempts_and_the_victim_resumes_without_gaps_or_repeats() -> None:
    runner = ScriptedRunner(lambda seq: f"the full answer of {seq.key}")
    eng = engine(runner, max_running=1)
    eng.add(make_request("low", priority=5))
    out = [e for _ in range(8) for e in eng.step()]
    assert text_of(out, "low")  # it was streaming when the urgent request came
    eng.add(make_request("urgent", priority=-5))
    out += run_until_idle(eng)
    assert text_of(out, "urgent") == "the full answer of urgent"
    assert text_of(out, "low") == "the full answer of low"
    order = [e.request_id for e in out if e.terminal]
    assert order == ["urgent", "low"]
    resumed = [p for p in runner.plans if p.prefill and p.prefill[0].seq.key == "low" and p.prefill[0].start == 0]
    assert len(resumed) == 2 and len(resumed[1].prefill[0].seq.context) > 4  # re-prefilled prompt + output


def test_equal_priority_never_preempts() -> None:
    runner = ScriptedRunner(lambda seq: "abcdef")
    eng = engine(runner, max_running=1)
    eng.add(make_request("first"))
    eng.step()
    eng.add(make_request("second"))
    out = run_until_idle(eng)
    assert [e.request_id for e in out if e.terminal] == ["first", "second"]
    assert not any(p.prefill and p.prefill[0].seq.key == "first" and p.prefill[0].start == 0 for p in runner.plans[1:])


# Paged KV: blocks taken as sequences grow, prefix caching, exhaustion.


def distinct(rid: str, prompt: list[int], **sampling: object) -> object:
    return replace(make_request(rid, **sampling), prompt_token_ids=tuple(prompt))


def finishes(out: list[Emission]) -> dict[str, Finish]:
    return {e.request_id: e.delta for e in out if isinstance(e.delta, Finish)}


def first_chunk_start(runner: ScriptedRunner, rid: str) -> int:
    return next(c.start for p in runner.plans for c in p.prefill if c.seq.key == rid)


def test_concurrency_is_bounded_by_blocks_in_use_not_by_a_slot_count() -> None:
    roomy = ScriptedRunner(lambda seq: "a" * 20, num_blocks=64)
    eng = engine(roomy, max_running=32)
    for i in range(12):
        eng.add(distinct(f"r{i}", [100 + i] * 4))
    run_until_idle(eng)
    assert max(len(p.decode) for p in roomy.plans) == 12
    tight = ScriptedRunner(lambda seq: "a" * 20, num_blocks=4)
    eng = engine(tight, max_running=32)
    for i in range(12):
        eng.add(distinct(f"r{i}", [100 + i] * 4))
    out = run_until_idle(eng)
    assert max(len(p.decode) for p in tight.plans) == 4  # one block each at first
    assert eng.scheduler.preemptions >= 2  # past 16 tokens each needs a second block: the latest give way
    assert all(text_of(out, f"r{i}") == "a" * 20 for i in range(12))


def test_an_exhausted_pool_preempts_the_latest_sequence_and_every_text_arrives_without_gaps_or_repeats() -> None:
    runner = ScriptedRunner(lambda seq: f"{seq.key}: " + "0123456789" * 4, num_blocks=6)
    eng = engine(runner, max_running=4)
    for rid in ("a", "b", "c"):
        eng.add(distinct(rid, [ord(rid)] * 20))  # 20 + 43 tokens each: 4 blocks; three need 12 of 6
    out = run_until_idle(eng)
    assert eng.scheduler.preemptions >= 1
    for rid in ("a", "b", "c"):
        assert text_of(out, rid) == f"{rid}: " + "0123456789" * 4
        ids = [t for e in out if e.request_id == rid for t in e.delta.token_ids]  # type: ignore[union-attr]
        assert ids == [*ByteTokenizer().encode(f"{rid}: " + "0123456789" * 4), 0]
    assert finishes(out).keys() == {"a", "b", "c"} and eng.scheduler.pool.num_used == 0
    restarts = [c.seq.key for p in runner.plans for c in p.prefill if c.start == 0]
    assert restarts.count("a") == 1 and restarts.count("c") >= 2  # the latest gave way, the earliest never
    assert next(e.request_id for e in out if e.terminal) == "a"


def test_a_repeated_prefix_is_prefilled_only_after_its_cached_blocks_and_reported_as_cached() -> None:
    runner = ScriptedRunner(lambda seq: "ok")
    eng = engine(runner)
    shared = list(range(50, 82))  # two full blocks
    eng.add(distinct("first", [*shared, 7, 8, 9]))
    out = run_until_idle(eng)
    eng.add(distinct("suffix", [*shared, 1, 2, 3, 4]))
    eng.add(distinct("exact", [*shared]))  # 32 tokens: the last one is recomputed, so one block is reused
    eng.add(distinct("other", [*range(200, 240)]))
    out += run_until_idle(eng)
    usage = {rid: f.usage.cached_tokens for rid, f in finishes(out).items()}
    assert usage == {"first": 0, "suffix": 32, "exact": 16, "other": 0}
    assert first_chunk_start(runner, "suffix") == 32 and first_chunk_start(runner, "exact") == 16
    assert text_of(out, "suffix") == text_of(out, "exact") == "ok"
    assert eng.scheduler.pool.hits == 48 and eng.scheduler.pool.queries == 35 + 36 + 32 + 40


def test_no_prefix_cache_prefills_every_prompt_in_full() -> None:
    runner = ScriptedRunner(lambda seq: "ok")
    eng = engine(runner, prefix_cache=False)
    for rid in ("one", "two"):
        eng.add(distinct(rid, list(range(50, 90))))
        out = run_until_idle(eng)
        assert finishes(out)[rid].usage.cached_tokens == 0
    assert first_chunk_start(runner, "two") == 0 and eng.scheduler.pool.hits == 0


def test_cached_blocks_are_evicted_least_recently_used_tail_first() -> None:
    runner = ScriptedRunner(lambda seq: "xy", num_blocks=4)
    eng = engine(runner)
    a_prompt = list(range(1, 34))  # 33 tokens: two full blocks cached, the third partial
    eng.add(distinct("a", a_prompt))
    run_until_idle(eng)
    eng.add(distinct("b", list(range(100, 140))))  # needs three blocks: two free, one evicted
    run_until_idle(eng)
    eng.add(distinct("a-again", a_prompt))
    out = run_until_idle(eng)
    assert finishes(out)["a-again"].usage.cached_tokens == 16  # a's tail block went, its head stayed
    assert first_chunk_start(runner, "a-again") == 16


def test_a_prompt_larger_than_the_whole_pool_ends_with_one_error_and_queues_nothing() -> None:
    from shared.deltas import Error, ErrorKind

    runner = ScriptedRunner(lambda seq: "never", num_blocks=2)
    eng = engine(runner)
    [end] = eng.add(distinct("huge", list(range(1, 41))))
    assert isinstance(end.delta, Error) and end.delta.kind is ErrorKind.INVALID_REQUEST
    assert "40 tokens" in end.delta.message and "32" in end.delta.message
    assert not eng.has_work() and not eng.active_ids()
    eng.add(distinct("fits", list(range(1, 21)), ignore_eos=True))  # 20 of 32 tokens: at most 12 more
    out = run_until_idle(eng)
    assert finishes(out)["fits"].reason is FinishReason.LENGTH and finishes(out)["fits"].usage.completion_tokens == 12


def test_a_step_that_prefills_a_higher_priority_prompt_pauses_lower_priority_decodes_only() -> None:
    runner = ScriptedRunner(lambda seq: "y" * 30)
    eng = engine(runner, max_running=8)
    out: list[Emission] = []
    for rid, priority in (("batch-1", 10), ("batch-2", 10), ("chat-0", 0)):
        out += eng.add(make_request(rid, priority=priority))
    for _ in range(4):
        out += eng.step()
    out += eng.add(make_request("chat-new", prompt_len=8, priority=0))
    out += eng.step()
    admitting = runner.plans[-1]
    assert [c.seq.key for c in admitting.prefill] == ["chat-new"]
    assert {s.key for s in admitting.decode} == {"chat-0"}  # batch lines sit this step out
    out += eng.step()
    assert {s.key for s in runner.plans[-1].decode} == {"batch-1", "batch-2", "chat-0", "chat-new"}
    out += run_until_idle(eng)
    assert all(text_of(out, rid) == "y" * 30 for rid in ("batch-1", "batch-2", "chat-0", "chat-new"))  # only delayed


def test_a_worker_full_of_batch_lines_still_claims_an_interactive_request_and_runs_it_first() -> None:
    runner = ScriptedRunner(lambda seq: "a long batch answer" if seq.key.startswith("batch") else "chat")
    eng = engine(runner, max_running=4)
    for i in range(4):
        eng.add(make_request(f"batch-{i}", priority=10))
    eng.step()
    assert eng.scheduler.claim_room() == 1  # full width, but of batch lines: room for one more (a quarter of 4)
    eng.add(make_request("chat", priority=0))
    assert eng.scheduler.claim_room() == 0  # never more than a quarter over its width
    out = run_until_idle(eng)
    assert next(e.request_id for e in out if e.terminal) == "chat"  # it preempted a batch line, ran first


def test_a_worker_full_of_interactive_requests_claims_nothing_more() -> None:
    eng = engine(ScriptedRunner(lambda seq: "abc"), max_running=4)
    for i in range(4):
        eng.add(make_request(f"chat-{i}"))
    assert eng.scheduler.claim_room() == 0


def test_blocks_are_shared_only_between_requests_of_the_same_cache_salt() -> None:
    eng = engine(ScriptedRunner(lambda seq: "ok"))
    shared = list(range(50, 82))  # two full blocks

    def salted(rid: str, salt: str) -> object:
        return replace(make_request(rid), prompt_token_ids=(*shared, 7, 8), cache_salt=salt)

    eng.add(salted("key-a", "key:a"))
    out = run_until_idle(eng)
    eng.add(salted("key-b", "key:b"))
    eng.add(salted("key-a-again", "key:a"))
    eng.add(distinct("unsalted", [*shared, 7, 8]))
    out += run_until_idle(eng)
    usage = {rid: f.usage.cached_tokens for rid, f in finishes(out).items()}
    assert usage == {"key-a": 0, "key-b": 0, "key-a-again": 32, "unsalted": 0}
