"""Token sampling over a batch of logits, each row with its own `SamplingParams` (torch).

Owns: turning one step's last-position logits [B, vocab] into one token per row, plus the logprobs
a row asked for. Must not: know sequences, the scheduler or the tokenizer's text (the engine turns
ids into strings and sequence breakers into ids, with `breaker_ids`).

Processing order, every stage skipped for rows that do not use it:

1. logit_bias          added to the raw logits.
2. min_tokens          EOS ids (unless ignore_eos) and stop_token_ids set to -inf while
                       len(output) < min_tokens.
3. repetition_penalty  HF / vLLM: over prompt+output tokens, positive logits divided by it and
                       negative ones multiplied.
4. presence/frequency  OpenAI: over output tokens only, logit -= presence*(count>0) + frequency*count.
5. DRY                 llama.cpp / text-generation-webui: a candidate that would extend a repeat of
                       the context's suffix seen earlier, of match length >= allowed_length, loses
                       multiplier * base^(match_length - allowed_length); matches stop at breakers.
   grammar             rows with an llguidance matcher (structured output, forced tool calls):
                       tokens the grammar does not allow next set to -inf. The masks of all such
                       rows are filled in one `fill_next_token_bitmask_par` call (threads, GIL
                       released) into a [C, vocab/32] int32 bitmask, unpacked on the logits' device;
                       rows without a matcher do no mask work at all. EOS is in a mask only where
                       the grammar accepts.
6. greedy rows         (temperature 0 or top_k 1) take the argmax here: one-hot from now on.
7. temperature, 8. top-n-sigma (keep logits >= max - n*std of the row's finite logits),
9. top-k, 10. top-p (the smallest set whose mass reaches p), 11. min-p (prob >= min_p * max prob),
12. the draw: rows with a generator draw alone with it (`torch.multinomial(generator=...)`), so a
    seed gives the same tokens whatever else shares the batch; the rest draw together.

Every scalar parameter is a [rows] tensor applied to the whole batch (or to the rows that use it);
penalties use count tensors built by scatter from padded id tensors, only when some row needs them.
Only DRY's sequence matching and the seeded draws loop over rows.

Fast path: a batch whose rows are all greedy and use none of stages 1-5 (the common serving case)
skips the processing entirely: its tokens are the raw logits' argmax, with no copy of the logits.

Logprobs are those of the RAW model logits (log-softmax before any stage above), as OpenAI and
vLLM report them by default: the chosen token's, and the `top_logprobs` best (id, logprob) pairs.

Size (~420 lines): the twelve steps above, applied in that order to one batch; split, the order would
have no single place to be read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from shared.ir import SamplingParams

_DRY_MAX_MATCH = 50  # longest match DRY measures: bounds base**length and the worst-case scan
_NEG_INF = float("-inf")
TOP_P_CANDIDATES = 1024  # top-p's first look (`_top_k_top_p`): topk of 1,024 of SmolLM2's 49,152 takes a fraction of a full sort


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplerRow:
    """One row of the batch: its resolved params and the context the penalties look at."""

    params: SamplingParams
    generator: torch.Generator | None = None  # seeded per request; None draws from the global RNG
    prompt: Seq[int] = ()
    output: Seq[int] = ()
    eos_ids: tuple[int, ...] = ()  # the model's EOS ids, banned while min_tokens is not reached
    dry_breakers: frozenset[int] = frozenset()  # token ids a DRY match cannot cross
    grammar: Any = None  # an llguidance LLMatcher at this row's position, or None (unconstrained)


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLogprobData:
    """The chosen token's raw logprob and the best alternatives, best first (ids only; no text)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SampleResult:
    tokens: list[int]
    logprobs: list[TokenLogprobData | None]  # None for rows that did not ask for logprobs
    mask_s: float = 0.0  # seconds spent filling and applying grammar masks (0 when no row has one)


def breaker_ids(tokenizer: Any, strings: Iterable[str]) -> frozenset[int]:
    """Every token id of each DRY sequence breaker, tokenized alone without special tokens."""
    return frozenset(t for s in strings for t in tokenizer.encode(s, add_special_tokens=False))


def sample(logits: torch.Tensor, rows: list[SamplerRow]) -> SampleResult:
    # logits: [B, vocab] float32 raw model logits, left unchanged
    if not rows:
        return SampleResult(tokens=[], logprobs=[])
    if all(r.params.greedy and _plain(r) for r in rows):
        token_list = logits.argmax(dim=-1).tolist()
        return SampleResult(tokens=token_list, logprobs=_logprobs(logits, rows, token_list))
    timer = _Timer()
    processed = process_logits(logits, rows, timer=timer)  # [B, vocab]; greedy rows are one-hot
    tokens = processed.argmax(dim=-1)  # [B]; final for greedy rows, overwritten below for the others
    drawn = [i for i, r in enumerate(rows) if not r.params.greedy]
    if drawn:
        index = torch.tensor(drawn, device=logits.device)
        probs = processed[index].softmax(dim=-1)  # [S, vocab]
        tokens[index] = _draw(probs, [rows[i].generator for i in drawn])
    token_list = tokens.tolist()
    return SampleResult(tokens=token_list, logprobs=_logprobs(logits, rows, token_list), mask_s=timer.seconds)


def _plain(row: SamplerRow) -> bool:
    """Whether stages 1-5 and the grammar leave this row's logits as they are."""
    p = row.params
    return (
        not p.logit_bias
        and not (len(row.output) < p.min_tokens and ((row.eos_ids and not p.ignore_eos) or p.stop_token_ids))
        and p.repetition_penalty in (None, 1.0)
        and not p.presence_penalty
        and not p.frequency_penalty
        and p.dry_multiplier <= 0
        and row.grammar is None
    )


class _Timer:
    seconds = 0.0


def process_logits(logits: torch.Tensor, rows: list[SamplerRow], *, timer: _Timer | None = None) -> torch.Tensor:
    """[B, vocab] raw logits → [B, vocab] logits to sample from: -inf outside each row's candidates."""
    out = logits.clone()
    _add_logit_bias(out, rows)
    _ban_stops_before_min_tokens(out, rows)
    _apply_repetition_penalty(out, rows)
    _apply_presence_frequency(out, rows)
    _apply_dry(out, rows)
    if any(r.grammar is not None for r in rows):
        started = time.perf_counter()
        _apply_grammar(out, rows)
        if timer is not None:
            timer.seconds = time.perf_counter() - started
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        index = torch.tensor(greedy, device=out.device)
        penalised = out[index]  # [G, vocab]
        out[index] = torch.full_like(penalised, _NEG_INF).scatter_(1, penalised.argmax(dim=-1, keepdim=True), 0.0)
    drawn = [i for i, r in enumerate(rows) if not r.params.greedy]
    if drawn:
        index = torch.tensor(drawn, device=out.device)
        out[index] = _filter(out[index], [rows[i].params for i in drawn])
    return out


# -- stages 1-5: bias, min_tokens, penalties (all rows, greedy included) ---------------------------


def _put(logits: torch.Tensor, entries: list[tuple[int, int, float]], *, accumulate: bool) -> None:
    # entries: (row, token, value); tokens outside the model's vocab are dropped
    vocab = logits.shape[-1]
    kept = [e for e in entries if 0 <= e[1] < vocab]
    if not kept:
        return
    row_ids, token_ids, values = zip(*kept, strict=True)
    device = logits.device
    index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
    logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=accumulate)


def _add_logit_bias(logits: torch.Tensor, rows: list[SamplerRow]) -> None:
    entries = [(i, token, bias) for i, r in enumerate(rows) for token, bias in r.params.logit_bias]
    _put(logits, entries, accumulate=True)


def _ban_stops_before_min_tokens(logits: torch.Tensor, rows: list[SamplerRow]) -> None:
    entries: list[tuple[int, int, float]] = []
    for i, r in enumerate(rows):
        if len(r.output) < r.params.min_tokens:
            eos = () if r.params.ignore_eos else r.eos_ids
            entries.extend((i, token, _NEG_INF) for token in (*eos, *r.params.stop_token_ids))
    _put(logits, entries, accumulate=False)


def _token_counts(sequences: list[Seq[int]], vocab: int, device: torch.device) -> torch.Tensor:
    # → [R, vocab] float32 occurrences of each token id per sequence
    width = max(1, *(len(s) for s in sequences))
    ids = torch.full((len(sequences), width), vocab, dtype=torch.long)  # [R, L], padded with `vocab`
    for j, s in enumerate(sequences):
        if s:
            ids[j, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    ids = ids.clamp_(0, vocab).to(device)  # ids the logits do not have fall into the padding column
    counts = torch.zeros((len(sequences), vocab + 1), device=device)  # [R, vocab + 1]
    counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplerRow]) -> None:
    used = [i for i, r in enumerate(rows) if r.params.repetition_penalty not in (None, 1.0)]
    if not used:
        return
    device = logits.device
    index = torch.tensor(used, device=device)
    seen = _token_counts([[*rows[i].prompt, *rows[i].output] for i in used], logits.shape[-1], device) > 0  # [R, vocab]
    penalty = torch.tensor([rows[i].params.repetition_penalty for i in used], device=device)[:, None]  # [R, 1]
    sub = logits[index]  # [R, vocab]
    penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
    logits[index] = torch.where(seen, penalised, sub)


def _apply_presence_frequency(logits: torch.Tensor, rows: list[SamplerRow]) -> None:
    used = [i for i, r in enumerate(rows) if r.params.presence_penalty or r.params.frequency_penalty]
    if not used:
        return
    device = logits.device
    index = torch.tensor(used, device=device)
    counts = _token_counts([rows[i].output for i in used], logits.shape[-1], device)  # [R, vocab]
    presence = torch.tensor([rows[i].params.presence_penalty for i in used], device=device)[:, None]  # [R, 1]
    frequency = torch.tensor([rows[i].params.frequency_penalty for i in used], device=device)[:, None]
    logits[index] -= presence * (counts > 0) + frequency * counts


def dry_penalties(row: SamplerRow) -> dict[int, float]:
    """token id → DRY penalty for one row (empty when DRY is off or nothing repeats long enough)."""
    p = row.params
    context = [*row.prompt, *row.output]
    if p.dry_multiplier <= 0 or len(context) < 2 or context[-1] in row.dry_breakers:
        return {}
    n, breakers = len(context), row.dry_breakers
    longest: dict[int, int] = {}  # candidate next token → longest suffix match it would extend
    for i in (k for k in range(n - 1) if context[k] == context[-1]):
        candidate = context[i + 1]
        if candidate in breakers:
            continue
        length = 1
        while length < _DRY_MAX_MATCH and i - length >= 0:
            previous = context[n - 1 - length]
            if context[i - length] != previous or previous in breakers:
                break
            length += 1
        longest[candidate] = max(length, longest.get(candidate, 0))
    allowed = p.dry_allowed_length
    return {t: p.dry_multiplier * p.dry_base ** (m - allowed) for t, m in longest.items() if m >= allowed}


def _apply_dry(logits: torch.Tensor, rows: list[SamplerRow]) -> None:
    entries = [(i, t, -pen) for i, r in enumerate(rows) if r.params.dry_multiplier > 0 for t, pen in dry_penalties(r).items()]
    _put(logits, entries, accumulate=True)


# -- grammar masks (llguidance) -------------------------------------------------------------------

_executor: Any = None


def _grammar_executor() -> Any:
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    return _executor


def _apply_grammar(logits: torch.Tensor, rows: list[SamplerRow]) -> None:
    # The executor is called directly, not through `llguidance.torch` (whose import runs torch.compile).
    used = [i for i, r in enumerate(rows) if r.grammar is not None]
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    bitmask = torch.zeros((len(used), words), dtype=torch.int32)  # [C, words] on the CPU, filled by llguidance
    _grammar_executor().unsafe_compute_mask_ptr([(rows[i].grammar, j) for j, i in enumerate(used)], bitmask.data_ptr(), words * 4, len(used))
    device = logits.device
    bits = torch.arange(32, dtype=torch.int32, device=device)  # [32]
    allowed = ((bitmask.to(device, non_blocking=True)[:, :, None] >> bits) & 1).bool()  # [C, words, 32]
    allowed = allowed.reshape(len(used), -1)[:, :vocab]  # [C, vocab]; ids past the grammar's vocab stay banned
    index = torch.tensor(used, device=device)
    logits[index] = logits[index].masked_fill(~allowed, _NEG_INF)


# -- stages 7-11: filters over the rows that draw --------------------------------------------------


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    # logits: [S, vocab] of the drawing rows → [S, vocab] with -inf outside each row's kept set
    temperature = [p.temperature if p.temperature is not None else 1.0 for p in params]
    if any(t != 1.0 for t in temperature):
        logits = logits / torch.tensor(temperature, device=logits.device)[:, None]
    _on_rows(logits, params, lambda p: (p.top_n_sigma or 0.0) > 0, _top_n_sigma)
    vocab = logits.shape[-1]
    _on_rows(logits, params, lambda p: 0 < (p.top_k or 0) < vocab and _top_p(p) >= 1.0, _top_k)
    _on_rows(logits, params, lambda p: _top_p(p) < 1.0, _top_k_top_p)
    _on_rows(logits, params, lambda p: (p.min_p or 0.0) > 0, _min_p)
    return logits


def _top_p(p: SamplingParams) -> float:
    return 1.0 if p.top_p is None else p.top_p


def _on_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    uses: Callable[[SamplingParams], bool],
    stage: Callable[[torch.Tensor, list[SamplingParams]], torch.Tensor],
) -> None:
    """Run `stage` on the rows whose params use it, in place; the other rows pay nothing."""
    used = [j for j, p in enumerate(params) if uses(p)]
    if used:
        index = torch.tensor(used, device=logits.device)
        logits[index] = stage(logits[index], [params[j] for j in used])


def _top_n_sigma(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    # logits: [R, vocab]; keep logits >= max - n * std, std over the row's finite logits
    n_sigma = torch.tensor([p.top_n_sigma for p in params], device=logits.device)[:, None]  # [R, 1]
    finite = logits.isfinite()
    count = finite.sum(dim=-1, keepdim=True).clamp(min=1)  # [R, 1]
    values = torch.where(finite, logits, 0.0)
    mean = values.sum(dim=-1, keepdim=True) / count
    std = ((((values - mean) ** 2) * finite).sum(dim=-1, keepdim=True) / count).sqrt()
    top = logits.max(dim=-1, keepdim=True).values
    return logits.masked_fill(logits < top - n_sigma * std, _NEG_INF)


def _top_k(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    # logits: [R, vocab]; keep logits >= the row's k-th best (a partial top-k, cheaper than a sort)
    top_k = torch.tensor([p.top_k for p in params], device=logits.device)[:, None]  # [R, 1]
    best = logits.topk(max(p.top_k or 0 for p in params), dim=-1).values  # [R, max k], best first
    return logits.masked_fill(logits < best.gather(1, top_k - 1), _NEG_INF)


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    # logits: [R, vocab] of rows with top-p (and maybe top-k). The kept set is almost always a few
    # tokens, so it is looked for among each row's TOP_P_CANDIDATES best (one topk, no sort of the
    # vocabulary); the rows whose kept set reaches past them (a flat distribution) take the full sort.
    vocab = logits.shape[-1]
    k = min(vocab, TOP_P_CANDIDATES)
    top_k, top_p = _top_k_top_p_params(params, vocab, logits.device)
    if k == vocab:
        return _top_k_top_p_sorted(logits, top_k, top_p)
    values, order = logits.topk(k, dim=-1)  # [R, k], descending
    values = values.masked_fill(torch.arange(k, device=logits.device)[None, :] >= top_k[:, None], _NEG_INF)
    within = top_k <= k  # [R]: the top-k set is among the candidates, so it normalizes alone
    norm = torch.where(within, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))  # [R]
    probs = (values - norm[:, None]).exp()  # [R, k]: the candidates' probabilities after top-k
    mass = probs.cumsum(dim=-1)
    drop = mass - probs >= top_p[:, None]  # the mass of the better tokens already reaches p
    drop[:, 0] = False
    out = torch.full_like(logits, _NEG_INF).scatter_(-1, order, values.masked_fill(drop, _NEG_INF))
    wider = ~(within | (mass[:, -1] >= top_p))  # [R]: a token past the candidates is kept too
    if bool(wider.any()):
        rows = wider.nonzero().squeeze(1)
        out[rows] = _top_k_top_p_sorted(logits[rows], top_k[rows], top_p[rows])
    return out


def _top_k_top_p_params(params: list[SamplingParams], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # [R] top-k (vocab when unset) and [R] top-p (inf when unset)
    top_k = torch.tensor([p.top_k if p.top_k and 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([_top_p(p) if _top_p(p) < 1.0 else math.inf for p in params], device=device)
    return top_k, top_p


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # logits: [R, vocab]; one descending sort of the whole vocabulary serves both
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1, descending=True)  # [R, vocab]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    ordered = ordered.masked_fill(ranks >= top_k[:, None], _NEG_INF)
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the better tokens: keep while it is < p
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False
    ordered = ordered.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(-1, order, ordered)


def _min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    # prob >= min_p * max prob  ⇔  logit >= max logit + log(min_p)
    log_min_p = torch.tensor([math.log(p.min_p or 1.0) for p in params], device=logits.device)[:, None]
    top = logits.max(dim=-1, keepdim=True).values
    return logits.masked_fill(logits < top + log_min_p, _NEG_INF)


# -- stage 12 and logprobs -------------------------------------------------------------------------


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    # probs: [S, vocab] → [S] token ids; a seeded row draws alone so its batch-mates cannot shift it
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    shared = [j for j, g in enumerate(generators) if g is None]
    if shared:
        index = torch.tensor(shared, device=probs.device)
        out[index] = torch.multinomial(probs[index], 1).squeeze(1)
    for j, generator in enumerate(generators):
        if generator is not None:
            out[j] = torch.multinomial(probs[j], 1, generator=generator)[0]
    return out


def _logprobs(logits: torch.Tensor, rows: list[SamplerRow], tokens: list[int]) -> list[TokenLogprobData | None]:
    result: list[TokenLogprobData | None] = [None] * len(rows)
    asked = [i for i, r in enumerate(rows) if r.params.logprobs]
    if not asked:
        return result
    device = logits.device
    logprobs = logits[torch.tensor(asked, device=device)].log_softmax(dim=-1)  # [L, vocab]
    chosen = logprobs.gather(1, torch.tensor([[tokens[i]] for i in asked], device=device)).squeeze(1)  # [L]
    k = min(max(rows[i].params.top_logprobs for i in asked), logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(k, dim=-1)  # [L, k], best first
    chosen_l, values_l, ids_l = chosen.tolist(), top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(asked):
        n = rows[i].params.top_logprobs
        top = tuple(zip(ids_l[j][:n], values_l[j][:n], strict=True))
        result[i] = TokenLogprobData(token_id=tokens[i], logprob=chosen_l[j], top=top)
    return result
