"""The scheduler and engine with a scripted runner: continuous batching without a model."""

from __future__ import annotations

from shared.deltas import Content, Finish, FinishReason
from shared.settings import Settings
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
    runner = ScriptedRunner(lambda seq: "y" * 100, num_slots=1)
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
    sched = Scheduler(num_slots=1, max_running=1, max_tokens_per_step=64)
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
    assert not eng.has_work() and eng.scheduler.num_free_slots == runner.num_slots


def test_a_higher_priority_arrival_preempts_and_the_victim_resumes_without_gaps_or_repeats() -> None:
    runner = ScriptedRunner(lambda seq: f"the full answer of {seq.key}", num_slots=1)
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
    runner = ScriptedRunner(lambda seq: "abcdef", num_slots=1)
    eng = engine(runner, max_running=1)
    eng.add(make_request("first"))
    eng.step()
    eng.add(make_request("second"))
    out = run_until_idle(eng)
    assert [e.request_id for e in out if e.terminal] == ["first", "second"]
    assert not any(p.prefill and p.prefill[0].seq.key == "first" and p.prefill[0].start == 0 for p in runner.plans[1:])
