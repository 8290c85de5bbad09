"""Speculative decoding without a model: the n-gram proposer, and the engine checking drafts against a
scripted runner (tests/workers/fakes.py `VerifyingRunner`): the same deltas and finish as decoding one
token a step, in fewer steps where the guesses are right."""

from __future__ import annotations

from dataclasses import replace

from shared.deltas import Content, Finish, FinishReason
from shared.settings import Settings
from workers.engine import Emission, Engine
from workers.speculate import NgramIndex

from .fakes import INFO, ByteTokenizer, VerifyingRunner, make_request

FILE = "def area(r):\n    return 3.14 * r * r\n\ndef volume(r, h):\n    return area(r) * h\n"


def ids(text: str) -> list[int]:
    return ByteTokenizer().encode(text)


def test_the_longest_suffix_ngram_proposes_what_followed_its_latest_earlier_occurrence() -> None:
    index = NgramIndex(1, 3, [5, 6, 7, 8, 9, 6, 7, 1, 2, 9, 6, 7])
    assert index.propose(3) == [1, 2, 9]  # "9 6 7" (n = 3) occurred at 4..7: what followed it
    index.extend([4])
    assert index.propose(3) == []  # "4" never occurred before
    index.extend([1])
    assert index.propose(2) == [2, 9]  # only "1" (n = 1) matches
    short = NgramIndex(2, 2, [1, 2, 3, 1, 2])
    assert short.propose(5) == [3, 1, 2]  # runs up to the end, not past it
    assert NgramIndex(2, 4, [1, 2]).propose(4) == []  # the suffix itself is no earlier occurrence


def test_an_index_extended_token_by_token_proposes_as_one_built_at_once() -> None:
    tokens = ids(FILE * 2)
    grown = NgramIndex(2, 4, tokens[:10])
    for t in tokens[10:]:
        grown.extend([t])
        whole = NgramIndex(2, 4, tokens[: len(grown.tokens)])
        assert grown.propose(6) == whole.propose(6)


def engine(runner: VerifyingRunner, **settings: object) -> Engine:
    return Engine(runner, ByteTokenizer(), INFO, settings=Settings(**{"max_running": 8, "max_tokens_per_step": 64, **settings}))  # type: ignore[arg-type]


def run(eng: Engine, *requests: object) -> list[Emission]:
    for r in requests:
        eng.add(r)  # type: ignore[arg-type]
    out: list[Emission] = []
    for _ in range(2000):
        if not eng.has_work():
            return out
        out.extend(eng.step())
    raise AssertionError("engine did not finish")


def deltas(out: list[Emission], rid: str) -> list[tuple[str, tuple[int, ...], object]]:
    return [(getattr(e.delta, "text", ""), e.delta.token_ids, getattr(e.delta, "reason", None)) for e in out if e.request_id == rid]  # type: ignore[attr-defined]


def both(script: str, prompt: str, **sampling: object) -> tuple[list[Emission], VerifyingRunner, Engine, list[Emission], VerifyingRunner]:
    request = replace(make_request("r", **sampling), prompt_token_ids=tuple(ids(prompt)))  # type: ignore[arg-type]
    on_runner, off_runner = VerifyingRunner(lambda s: script), VerifyingRunner(lambda s: script)
    on = engine(on_runner)
    on_out = run(on, request)
    off_out = run(engine(off_runner, speculative="off"), request)
    return on_out, on_runner, on, off_out, off_runner


def test_copying_text_from_the_prompt_takes_fewer_steps_with_the_same_deltas() -> None:
    on_out, on_runner, on, off_out, off_runner = both(FILE.replace("3.14", "3.1416"), FILE)
    assert deltas(on_out, "r") == deltas(off_out, "r")  # every delta, its token ids and the finish
    assert "".join(t for t, _, _ in deltas(on_out, "r")) == FILE.replace("3.14", "3.1416")
    assert any(p.verify for p in on_runner.plans) and not any(p.verify for p in off_runner.plans)
    assert len(on_runner.plans) * 3 < len(off_runner.plans), (len(on_runner.plans), len(off_runner.plans))
    f = on.figures()
    assert 0 < f["spec_accepted"] < f["spec_proposed"]  # the changed number cost guesses
    assert f["decode_tokens"] == len(FILE) + 2  # every token after the first once (82 with EOS), kept draft rows included


def test_a_stop_string_max_tokens_or_eos_inside_a_draft_ends_it_where_one_token_a_step_would() -> None:
    for sampling in ({"stop": ("volume",)}, {"max_tokens": 23}, {"stop": ("h\n",)}, {}):
        on_out, on_runner, _, off_out, _ = both(FILE[:40], FILE, **sampling)
        assert deltas(on_out, "r") == deltas(off_out, "r"), sampling
        assert any(p.verify for p in on_runner.plans), sampling
        finish = on_out[-1].delta
        assert isinstance(finish, Finish)
        tokens = [t for e in on_out for t in e.delta.token_ids]  # type: ignore[attr-defined]
        assert finish.usage.completion_tokens == len(tokens)


def test_wrong_guesses_cost_rows_never_tokens() -> None:
    script = "".join(reversed(FILE))  # a prompt full of n-grams that mostly propose the wrong continuation
    on_out, _, on, off_out, _ = both(script, FILE + script[:30])
    assert deltas(on_out, "r") == deltas(off_out, "r")
    f = on.figures()
    assert f["spec_proposed"] > f["spec_accepted"]


def test_a_request_that_opts_out_or_a_wide_batch_checks_no_draft() -> None:
    _, opted_runner, _, _, _ = both(FILE, FILE, speculative=False)
    assert not any(p.verify for p in opted_runner.plans)
    runner = VerifyingRunner(lambda s: FILE)
    eng = engine(runner, spec_max_batch=2)
    short = replace(make_request("short", max_tokens=10), prompt_token_ids=tuple(ids(FILE)))
    requests = [replace(make_request(f"r{i}"), prompt_token_ids=tuple(ids(FILE))) for i in range(2)]
    out = run(eng, short, *requests)
    for p in runner.plans:
        assert not p.verify or len(p.decode) + len(p.verify) <= 2, p
        assert all(len(d.tokens) <= 16 // (len(p.decode) + len(p.verify)) for d in p.verify), p  # a share of --spec-tokens each
    assert not any(p.verify for p in runner.plans[:5])  # three decoding: too many
    assert any(p.verify for p in runner.plans)  # once the short one finished, two were few enough
    for r in requests:
        assert "".join(e.delta.text for e in out if e.request_id == r.id and isinstance(e.delta, Content)) == FILE
        assert [e.delta.reason for e in out if e.request_id == r.id and isinstance(e.delta, Finish)] == [FinishReason.STOP]
