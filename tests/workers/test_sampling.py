"""The sampler on small synthetic logits: each stage's effect on the processed logits, then the draws."""

from __future__ import annotations

import math

import pytest
import torch

from shared.ir import SamplingParams
from workers.sampling import SamplerRow, breaker_ids, dry_penalties, process_logits, sample

EOS = 7
NEG_INF = float("-inf")


def params(**fields: object) -> SamplingParams:
    """Resolved params (no None left but seed/max_tokens), overridden by `fields`."""
    base: dict[str, object] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    return SamplingParams(**(base | fields))  # type: ignore[arg-type]


def row(seed: int | None = None, *, prompt: tuple[int, ...] = (), output: tuple[int, ...] = (), **fields: object) -> SamplerRow:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplerRow(params=params(**fields), generator=generator, prompt=prompt, output=output, eos_ids=(EOS,))


def probs_from(logits: list[float]) -> torch.Tensor:
    return torch.tensor([logits], dtype=torch.float32)


def kept(processed: torch.Tensor) -> list[int]:
    return processed[0].isfinite().nonzero().flatten().tolist()


def random_logits(batch: int, vocab: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn((batch, vocab), generator=torch.Generator().manual_seed(seed)) * 3


# -- greedy ----------------------------------------------------------------------------------------


def test_temperature_zero_takes_the_argmax_of_every_row() -> None:
    logits = random_logits(6)
    result = sample(logits, [row(temperature=0.0) for _ in range(6)])
    assert result.tokens == logits.argmax(dim=-1).tolist()
    assert result.logprobs == [None] * 6


def test_top_k_one_equals_greedy_even_at_a_high_temperature() -> None:
    logits = random_logits(6, seed=1)
    top_k_one = sample(logits, [row(i, temperature=1.5, top_k=1) for i in range(6)])
    greedy = sample(logits, [row(temperature=0.0) for _ in range(6)])
    assert top_k_one.tokens == greedy.tokens


def test_greedy_rows_get_penalties_before_the_argmax() -> None:
    logits = probs_from([5.0, 4.0, 0.0, 0.0])
    assert sample(logits, [row(temperature=0.0, output=(0,), presence_penalty=2.0)]).tokens == [1]


def test_process_logits_leaves_the_raw_logits_alone() -> None:
    logits = random_logits(2)
    before = logits.clone()
    process_logits(logits, [row(temperature=0.0, logit_bias=((0, 5.0),)), row(top_k=3, repetition_penalty=1.3, output=(1, 2))])
    assert torch.equal(logits, before)


def test_an_empty_batch_samples_nothing() -> None:
    result = sample(torch.zeros((0, 8)), [])
    assert result.tokens == [] and result.logprobs == []


# -- logit_bias and min_tokens ---------------------------------------------------------------------


def test_a_logit_bias_of_plus_100_forces_its_token() -> None:
    logits = random_logits(1, seed=2)
    forced = int(logits.argmin())
    tokens = [sample(logits, [row(seed, logit_bias=((forced, 100.0),))]).tokens[0] for seed in range(20)]
    assert tokens == [forced] * 20


def test_a_logit_bias_of_minus_100_bans_the_argmax() -> None:
    logits = probs_from([10.0, 0.0, 0.0, 0.0])
    processed = process_logits(logits, [row(logit_bias=((0, -100.0),))])
    assert processed[0, 0] == pytest.approx(-90.0)
    assert sample(logits, [row(temperature=0.0, logit_bias=((0, -100.0),))]).tokens != [0]


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros((1, 10))
    logits[0, EOS] = logits[0, 3] = 50.0
    early = row(output=(1, 2), min_tokens=3, stop_token_ids=(3,))
    assert process_logits(logits, [early])[0, [EOS, 3]].tolist() == [NEG_INF, NEG_INF]
    assert sample(logits, [row(temperature=0.0, output=(1, 2), min_tokens=3, stop_token_ids=(3,))]).tokens[0] not in (EOS, 3)
    reached = row(temperature=0.0, output=(1, 2, 4), min_tokens=3, stop_token_ids=(3,))
    assert sample(logits, [reached]).tokens[0] in (EOS, 3)


def test_min_tokens_leaves_eos_alone_when_eos_is_ignored() -> None:
    logits = torch.zeros((1, 10))
    processed = process_logits(logits, [row(output=(), min_tokens=3, ignore_eos=True)])
    assert processed[0, EOS] == 0.0


# -- penalties -------------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = probs_from([2.0, -2.0, 2.0, -2.0])
    processed = process_logits(logits, [row(prompt=(0,), output=(1,), repetition_penalty=2.0)])
    assert processed[0].tolist() == [1.0, -4.0, 2.0, -2.0]


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros((1, 5))
    processed = process_logits(logits, [row(prompt=(3, 3), output=(0, 0, 0, 1), presence_penalty=0.5, frequency_penalty=0.25)])
    assert processed[0].tolist() == pytest.approx([-1.25, -0.75, 0.0, 0.0, 0.0])


def test_penalties_lower_the_probability_of_seen_tokens_only_in_their_own_row() -> None:
    logits = torch.zeros((2, 4))
    processed = process_logits(logits, [row(output=(2,), frequency_penalty=1.0), row(output=(2,))])
    probs = processed.softmax(dim=-1)
    assert probs[0, 2] < probs[0, 0] == probs[0, 1] == probs[0, 3]
    assert probs[1].tolist() == [0.25] * 4


# -- DRY -------------------------------------------------------------------------------------------


def dry_row(context: tuple[int, ...], breakers: frozenset[int] = frozenset()) -> SamplerRow:
    p = params(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    return SamplerRow(params=p, prompt=context[:2], output=context[2:], dry_breakers=breakers)


def test_dry_penalises_the_token_that_would_continue_a_repeated_sequence() -> None:
    context = (5, 6, 7, 8, 9, 1, 5, 6, 7)  # "5 6 7" repeats; 8 followed it before
    assert dry_penalties(dry_row(context)) == {8: pytest.approx(0.8 * 1.75 ** (3 - 2))}
    processed = process_logits(torch.zeros((1, 10)), [dry_row(context)])
    assert processed[0, 8] == pytest.approx(-1.4)
    assert (processed[0, :8] == 0).all()


def test_dry_spares_a_repeat_shorter_than_the_allowed_length() -> None:
    assert dry_penalties(dry_row((5, 6, 7, 8, 9, 1, 2, 7))) == {}


def test_dry_matches_do_not_cross_a_breaker() -> None:
    context = (5, 6, 7, 8, 9, 1, 5, 6, 7)
    assert dry_penalties(dry_row(context, frozenset({6}))) == {}
    assert dry_penalties(dry_row(context, frozenset({8}))) == {}  # the continuation itself is a breaker
    assert dry_penalties(dry_row((*context, 4), frozenset({4}))) == {}  # the context ends on a breaker


def test_dry_is_off_at_multiplier_zero() -> None:
    off = SamplerRow(params=params(), prompt=(5, 6, 7, 8), output=(5, 6, 7))
    assert dry_penalties(off) == {}


def test_breaker_ids_takes_every_token_of_every_breaker_without_special_tokens() -> None:
    class Tokenizer:
        def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
            assert not add_special_tokens
            return [ord(c) for c in text]

    assert breaker_ids(Tokenizer(), ["\n", "ab"]) == frozenset({10, 97, 98})


# -- filters ---------------------------------------------------------------------------------------

DIST = [0.5, 0.3, 0.15, 0.05]
DIST_LOGITS = probs_from([math.log(p) for p in DIST])


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    assert kept(process_logits(DIST_LOGITS, [row(top_p=0.75)])) == [0, 1]
    assert kept(process_logits(DIST_LOGITS, [row(top_p=0.85)])) == [0, 1, 2]
    assert kept(process_logits(DIST_LOGITS, [row(top_p=0.4)])) == [0]
    assert kept(process_logits(DIST_LOGITS, [row(top_p=1.0)])) == [0, 1, 2, 3]


def test_top_p_over_a_real_sized_vocabulary_keeps_the_same_set_as_a_full_sort_whether_it_is_narrow_or_wide() -> None:
    """Top-p first looks among each row's 1,024 best tokens (workers.sampling.TOP_P_CANDIDATES); rows
    whose kept set reaches past them (flat ones, a top-k above 1,024) must still get the exact set,
    checked against a float64 sort of every row here."""
    vocab = 6000
    generator = torch.Generator().manual_seed(5)
    shapes = [(8.0, {}), (2.0, {}), (0.05, {}), (8.0, {"top_k": 50}), (0.05, {"top_k": 2000}), (0.05, {"top_k": 700}), (1.0, {"top_k": 5999})]
    rows, logits = [], []
    for scale, extra in shapes:
        for top_p in (0.3, 0.9, 0.99):
            rows.append(row(top_p=top_p, **extra))
            logits.append(torch.randn(vocab, generator=generator) * scale)
    processed = process_logits(torch.stack(logits), rows)
    sizes = []
    for j, (r, raw) in enumerate(zip(rows, logits, strict=True)):
        order = raw.double().argsort(descending=True)
        top_k = r.params.top_k or vocab
        probs = raw.double()[order[:top_k]].softmax(dim=-1)
        before = probs.cumsum(dim=0) - probs
        want = sorted(order[:top_k][before < (r.params.top_p or 1.0)].tolist())
        assert processed[j].isfinite().nonzero().flatten().tolist() == want, (j, r.params)
        assert torch.equal(processed[j][want], raw[want])  # kept logits untouched (temperature 1)
        sizes.append(len(want))
    assert min(sizes) == 1 and max(sizes) > 1024  # both ways were taken: narrow sets and wide ones


def test_top_k_keeps_the_k_best() -> None:
    assert kept(process_logits(DIST_LOGITS, [row(top_k=3)])) == [0, 1, 2]


def test_min_p_drops_tokens_below_min_p_times_the_top_probability() -> None:
    assert kept(process_logits(DIST_LOGITS, [row(min_p=0.2)])) == [0, 1, 2]  # 0.05 < 0.2 * 0.5
    assert kept(process_logits(DIST_LOGITS, [row(min_p=0.5)])) == [0, 1]  # 0.15 < 0.25


def test_top_n_sigma_keeps_tokens_within_n_std_of_the_top_over_finite_logits() -> None:
    values = [10.0, 9.0, 8.0, 6.0, 0.0, 0.0, 0.0, 0.0]
    logits = probs_from([*values, 0.0])
    banned = row(top_n_sigma=1.0, logit_bias=((8, NEG_INF),))
    std = torch.tensor(values).std(correction=0).item()  # ≈ 4.33: threshold 10 - std ≈ 5.67
    assert 10.0 - std < 6.0
    assert kept(process_logits(logits, [banned])) == [0, 1, 2, 3]
    assert kept(process_logits(logits, [row(top_n_sigma=0.5, logit_bias=((8, NEG_INF),))])) == [0, 1, 2]


def test_filters_apply_per_row_in_one_batch() -> None:
    logits = DIST_LOGITS.repeat(6, 1)
    rows = [row(top_k=2), row(top_k=3), row(top_p=0.85), row(top_k=2, top_p=0.99), row(min_p=0.5), row()]
    processed = process_logits(logits, rows)
    assert [processed[i].isfinite().sum().item() for i in range(6)] == [2, 3, 3, 2, 2, 4]


def test_temperature_scales_the_drawn_rows_logits() -> None:
    processed = process_logits(probs_from([2.0, 1.0]), [row(temperature=0.5)])
    assert processed[0].tolist() == [4.0, 2.0]


# -- draws -----------------------------------------------------------------------------------------


def mixed_batch_mates() -> list[SamplerRow]:
    return [
        row(temperature=0.0),
        row(11, temperature=0.7, top_k=5),
        row(None, top_p=0.9),
        row(12, min_p=0.1, repetition_penalty=1.2, prompt=(1, 2, 3), output=(4,)),
        row(13, top_n_sigma=1.0, presence_penalty=0.5, frequency_penalty=0.3, output=(2, 2)),
        row(None, temperature=1.3, logit_bias=((3, 2.0),)),
        row(14, dry_multiplier=0.8, prompt=(1, 2, 3, 1, 2), logprobs=True, top_logprobs=3),
    ]


def test_a_seed_gives_the_same_tokens_alone_and_inside_a_mixed_batch() -> None:
    steps = 40
    alone = row(1234, temperature=0.9, top_p=0.95)
    batched = row(1234, temperature=0.9, top_p=0.95)
    alone_tokens, batched_tokens = [], []
    for step in range(steps):
        logits = random_logits(8, seed=step)
        alone_tokens.append(sample(logits[3:4], [alone]).tokens[0])
        mates = mixed_batch_mates()
        batch = [*mates[:3], batched, *mates[3:]]
        batched_tokens.append(sample(logits, batch).tokens[3])
    assert alone_tokens == batched_tokens
    assert len(set(alone_tokens)) > 5  # the rows really drew


def test_different_seeds_draw_different_tokens() -> None:
    logits = torch.zeros((1, 50))
    first, second = row(1), row(2)
    a = [sample(logits, [first]).tokens[0] for _ in range(50)]
    b = [sample(logits, [second]).tokens[0] for _ in range(50)]
    assert a != b


def test_sampled_frequencies_match_the_filtered_distribution() -> None:
    draws = 2000
    logits = probs_from([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    generator = torch.Generator().manual_seed(7)
    rows = [SamplerRow(params=params(temperature=0.7, top_k=4), generator=generator) for _ in range(draws)]
    expected = torch.softmax(logits[0, :4] / 0.7, dim=-1)
    assert process_logits(logits, rows[:1]).softmax(dim=-1)[0, :4] == pytest.approx(expected.tolist())
    counts = torch.bincount(torch.tensor(sample(logits.expand(draws, -1), rows).tokens), minlength=6).float()
    assert counts[4:].sum() == 0
    chi_square = (((counts[:4] - draws * expected) ** 2) / (draws * expected)).sum().item()
    assert chi_square < 16.27  # 3 degrees of freedom, p = 0.001


def test_unseeded_rows_draw_inside_their_filtered_set() -> None:
    logits = DIST_LOGITS.repeat(64, 1)
    tokens = sample(logits, [row(None, top_k=2) for _ in range(64)]).tokens
    assert set(tokens) <= {0, 1}


# -- logprobs --------------------------------------------------------------------------------------


def test_logprobs_are_those_of_the_raw_logits_with_sorted_top_alternatives() -> None:
    logits = random_logits(3, seed=5)
    rows = [
        row(1, logprobs=True, top_logprobs=4, logit_bias=((0, 30.0),), repetition_penalty=1.5, output=(1, 2)),
        row(2),
        row(temperature=0.0, logprobs=True, top_logprobs=0),
    ]
    result = sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    first, second, third = result.logprobs
    assert second is None
    assert first is not None and third is not None
    assert first.token_id == result.tokens[0] == 0  # the bias chose the token, not the logprob
    assert first.logprob == pytest.approx(raw[0, 0].item())
    assert len(first.top) == 4
    assert [lp for _, lp in first.top] == sorted((lp for _, lp in first.top), reverse=True)
    best = raw[0].topk(4)
    assert [i for i, _ in first.top] == best.indices.tolist()
    assert [lp for _, lp in first.top] == pytest.approx(best.values.tolist())
    assert third.token_id == int(logits[2].argmax()) and third.top == ()
    assert third.logprob == pytest.approx(raw[2].max().item())


def test_a_batch_of_plain_greedy_rows_takes_the_argmax_without_processing_the_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    import workers.sampling

    logits = random_logits(3, seed=9)
    expected = logits.argmax(dim=-1).tolist()
    plain = [row(temperature=0.0), row(top_k=1), row(temperature=0.0, logprobs=True, top_logprobs=2)]
    monkeypatch.setattr(workers.sampling, "process_logits", lambda *a, **k: pytest.fail("processed a plain greedy batch"))
    result = sample(logits, plain)
    assert result.tokens == expected and result.logprobs[2] is not None and result.logprobs[0] is None
    with pytest.raises(pytest.fail.Exception):  # a penalty (or any sampled row) still goes through the stages
        sample(logits, [*plain, row(temperature=0.0, repetition_penalty=1.3, output=(1, 2))])
