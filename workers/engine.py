"""The engine: scheduler + runner + per-sequence text state, one `step()` at a time (torch-free).

Owns: turning sampled token ids into `StreamDelta`s (incremental detokenization, stop strings held
back and never emitted, EOS / stop-token / max-token / deadline finishes, usage), and the figures
the worker reports (batch sizes, token counts); a request's prompt logprobs, from the injected
`score_prompt` (workers/prompt_logprobs.py), as its first delta. Must not: touch Redis (workers.claims and workers.outbox do) or torch
(the injected runner does).

Constrained requests (`models.grammar.grammar_for`) get an llguidance matcher on their `Sequence`:
the runner's sampler masks their logits with it, and the engine advances it with every accepted
token — also with the tokens an earlier attempt emitted, on resume; a preempted sequence keeps its
matcher, so recompute needs nothing more. A grammar that does not compile, or a token it refuses
(a dead end), ends that request alone with one `Error` delta; once the grammar is complete the
request finishes at once (STOP), without spending a step on the EOS the mask would force.

Speculative decoding (`--speculative ngram`, workers.speculate): the scheduler asks `_propose` for a
decoding sequence's guesses (prompt lookup over its own tokens; a constrained one's cut where its matcher
would refuse one), the runner samples every row of the draft, and `_verify` appends the row tokens in
order through the same `_append` as any token while each confirms the guess after it. So stop strings,
tool parsers, grammars, reasoning budgets, logprobs and usage see exactly the token sequence decoding one
at a time gives (greedy or seeded: each row samples as that position would; unseeded: the standard
rejection rule for a one-token-certain draft, so the distribution is unchanged).

Size (~600 lines): the one owner of a sequence's life (admit, prefill, decode, finish, cancel, resume);
the scheduler, runner, sampler and text pipeline it drives each live in a module of their own.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

import jsonschema

from models.grammar import Grammars, grammar_for, special_markers
from models.prompt import ModelInfo
from models.reasoning import budget_for, think_format
from models.tool_formats import ToolFormat, for_request, select
from models.tools import calls_enabled
from shared.codec import adapter_counts, adapters_field
from shared.deltas import (
    Content,
    Error,
    ErrorKind,
    Finish,
    FinishReason,
    Reasoning,
    StreamDelta,
    TokenLogprob,
    ToolCallArgs,
    ToolCallStart,
    Usage,
    is_terminal,
)
from shared.ir import Request, ToolKind, resolve
from shared.seal import Sealer
from shared.settings import Settings
from workers.blocks import BlockPool
from workers.detok import IncrementalDetokenizer, StopMatcher
from workers.reasoning import Channel, ReasoningSpan
from workers.scheduler import Draft, Sampled, Scheduler, Sequence, Speculation, StepPlan
from workers.speculate import NgramIndex
from workers.tool_parsers import ToolParser
from workers.tools import CallCap, RepeatGuard, make_parser

log = logging.getLogger(__name__)
FAILED_STEP = "The worker failed while generating this response."
FAILED_ADD = "The worker could not start this request."

# (prompt ids, top k) → for positions 1..L-1: (logprob, top (id, logprob) pairs); workers/prompt_logprobs.py
PromptScorer = Callable[[list[int], int], list[tuple[float, tuple[tuple[int, float], ...]]]]


class Runner(Protocol):
    num_blocks: int  # KV blocks of `block_size` positions in the pool
    block_size: int
    max_len: int

    def execute(self, plan: StepPlan) -> list[Sampled]:
        """Run one step's forwards and return the token sampled for each sequence that needs one."""
        ...

    def release(self, seq: Sequence) -> None: ...


@dataclass(frozen=True, slots=True)
class Emission:
    """A delta for one request; on the terminal one, `batch_max` is the largest decode batch it ran in."""

    request_id: str
    delta: StreamDelta
    batch_max: int = 0

    @property
    def terminal(self) -> bool:
        return is_terminal(self.delta)


@dataclass
class _TextState:
    detok: IncrementalDetokenizer
    stops: StopMatcher
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    max_tokens: int = 0
    tools: ToolParser | None = None  # the tool-call parser, when the request may call tools
    span: ReasoningSpan | None = None  # the reasoning span, when the model reasons
    reasoning_detok: IncrementalDetokenizer | None = None
    reasoning_text: list[str] = field(default_factory=list)
    deferred_grammar: Any = None  # the answer's matcher, attached once the reasoning span closes
    sealed: bool = False  # the span's sealed delta was written
    calls: dict[int, list[str]] = field(default_factory=dict)  # tool calls parsed so far: index → [name, argument pieces...]
    answer_begun: bool = False  # after a span: the answer's leading blank lines are dropped until text comes
    opened: bool = False  # the first generated delta (with the prefix-cache count) was written


@dataclass
class EngineStats:
    steps: int = 0
    batch_peak: int = 0
    last_batch: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    last_step_s: float = 0.0
    off_schema_calls: int = 0  # generated tool calls whose arguments do not match their tool's whole schema
    spec_drafts: int = 0  # drafts checked (one per sequence per speculating step)
    spec_proposed: int = 0  # guessed tokens checked
    spec_accepted: int = 0  # guessed tokens the model agreed with (kept)


class Engine:
    def __init__(self, runner: Runner, tokenizer: Any, info: ModelInfo, *, settings: Settings, clock: Callable[[], float] = time.time) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.info = info
        pool = BlockPool(runner.num_blocks, block_size=runner.block_size, prefix_cache=settings.prefix_cache)
        salt = getattr(runner, "wide_mode", "off") != "off"  # prompt tokens computed otherwise than generated ones
        speculates = settings.speculative == "ngram" and settings.spec_tokens > 0 and getattr(runner, "verifies", False)
        self.ngrams = (settings.spec_ngram_min, settings.spec_ngram_max)  # the proposer's n-gram lengths (workers.speculate)
        self.scheduler = Scheduler(
            pool=pool,
            max_running=settings.max_running,
            max_tokens_per_step=settings.max_tokens_per_step,
            salt_outputs=salt,
            speculation=Speculation(self._propose, settings.spec_max_batch, settings.spec_tokens) if speculates else None,
            max_adapters=settings.max_loras,
        )
        self.request_timeout = settings.request_timeout
        self.clock = clock
        self.stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}
        self.grammars: Grammars | None = None  # built on the first constrained request (tokenizer-bound)
        self.tool_format = select(getattr(tokenizer, "chat_template", None), settings.tool_parser)
        markers = self.tool_format.markers if self.tool_format is not None else ()
        self._special = special_markers(tokenizer, markers)  # the family's markers that are special tokens here
        self._keep = frozenset(self._special.values())  # ... which the tool parser must see as text
        self.think = think_format(tokenizer, settings.reasoning_parser)
        self.max_thinking_tokens = settings.max_thinking_tokens
        self.sealer: Sealer | None = None  # set by the worker from the deployment's key (shared.seal)
        self.score_prompt: PromptScorer | None = None  # set by the worker: workers.prompt_logprobs on its model

    def add(self, request: Request, *, attempt: int = 1, resume: tuple[int, ...] = ()) -> list[Emission]:
        """Queue a request. `resume` holds the tokens an earlier attempt already emitted: they are
        re-prefilled with the prompt (recompute) and generation continues after them, so the client
        sees no gap and no repeat. Returns the terminal emission when nothing is left to generate, and
        first, for a request that asks, its prompt logprobs (not again on a resume: they went out
        before the first token did)."""
        emissions = self._admit(request, attempt=attempt, resume=resume)
        top = request.sampling.prompt_logprobs
        if top is None or resume or (emissions and isinstance(emissions[0].delta, Error)):
            return emissions
        if self.score_prompt is None:
            self.discard(request.id)
            return [Emission(request.id, Error(message="This worker cannot compute prompt logprobs.", kind=ErrorKind.INVALID_REQUEST, attempt=attempt))]
        prompt = list(request.prompt_token_ids)
        scored = [(0.0, ()), *self.score_prompt(prompt, top)]  # the first token has nothing before it
        entries = tuple(self._logprob(token, lp, alternatives) for token, (lp, alternatives) in zip(prompt, scored, strict=True))
        return [Emission(request.id, Content(text="", attempt=attempt, prompt_logprobs=entries)), *emissions]

    def _admit(self, request: Request, *, attempt: int, resume: tuple[int, ...]) -> list[Emission]:
        request = _with_resolved_sampling(request, self.info)  # claimed requests come resolved (WorkerLoop.with_defaults): a no-op then
        pool_tokens = self.scheduler.pool.num_tokens
        if len(request.prompt_token_ids) >= pool_tokens:
            message = f"The prompt has {len(request.prompt_token_ids)} tokens; this worker's KV cache holds at most {pool_tokens} (raise --kv-budget-mb)."
            return [Emission(request.id, Error(message=message, kind=ErrorKind.INVALID_REQUEST, attempt=attempt))]
        budget = min(self.runner.max_len, pool_tokens) - len(request.prompt_token_ids)
        max_tokens = min(request.sampling.max_tokens or budget, budget)
        seq = Sequence(request=request, prompt=list(request.prompt_token_ids), attempt=attempt, output=list(resume))
        seq.context = seq.prompt + seq.output
        calls = calls_enabled(request) and self.tool_format is not None
        detok = IncrementalDetokenizer(self.tokenizer, self._keep if calls else frozenset())
        state = _TextState(detok, StopMatcher(request.sampling.stop), max_tokens=max_tokens)
        if calls and self.tool_format is not None:
            state.tools = _tool_parser(self.tool_format, request)
        grammar = grammar_for(request, self.tool_format, self._special)
        if self.think is not None and request.completion is None:  # a raw completion's text is all answer
            thinking_budget = budget_for(request.thinking, self.max_thinking_tokens)
            state.span = ReasoningSpan(self.think, prompt=request.prompt_token_ids, budget=thinking_budget, force_open=grammar is not None and thinking_budget != 0)
            state.reasoning_detok = IncrementalDetokenizer(self.tokenizer)
        answer: list[int] = []
        for token in resume:  # the text of these tokens was delivered by the earlier attempt
            channel = state.span.route(token) if state.span is not None else Channel.ANSWER
            if channel is Channel.REASONING:
                assert state.reasoning_detok is not None
                state.reasoning_text.append(state.reasoning_detok.push(token))
            elif channel is Channel.ANSWER:
                answer.append(token)
                replayed = state.detok.push(token)
                state.answer_begun = state.answer_begun or bool(replayed.strip())
                if state.tools is not None:
                    state.tools.push(replayed)  # so the parser is where it was (its deltas were delivered too)
        state.sealed = state.span is not None and state.span.closed_span
        seq.state = state
        refused = self._attach_grammar(seq, grammar, answer) or self._attach_adapter(seq)
        if refused is not None:
            return [Emission(request.id, refused)]
        self._seqs[request.id] = seq
        self.scheduler.add(seq)
        if resume and resume[-1] in self.info.eos_token_ids and not request.sampling.ignore_eos:
            return [self._finish(seq, FinishReason.STOP)]
        if seq.grammar is not None and seq.grammar.is_stopped():
            return [self._finish(seq, FinishReason.STOP)]
        if len(resume) >= max_tokens:
            return [self._finish(seq, FinishReason.LENGTH)]
        return []

    def _attach_grammar(self, seq: Sequence, grammar: str | None, answer: list[int]) -> Error | None:
        """Give a constrained sequence its matcher, replayed over the answer tokens an earlier attempt
        emitted; an Error if that fails. The grammar constrains the answer only: while a reasoning span
        runs it waits in the text state."""
        if grammar is None:
            return None
        if self.grammars is None:
            self.grammars = Grammars.for_model(self.tokenizer, self.info.eos_token_ids)
        matcher = self.grammars.matcher(grammar)
        if not matcher.is_error() and answer:
            matcher.consume_tokens(answer)
        if matcher.is_error():
            return Error(message=f"The output constraint cannot be applied: {_first_line(matcher.get_error())}", kind=ErrorKind.INVALID_REQUEST, attempt=seq.attempt)
        state: _TextState = seq.state
        if state.span is not None and not state.span.in_answer:
            state.deferred_grammar = matcher
        else:
            seq.grammar = matcher
        return None

    def _attach_adapter(self, seq: Sequence) -> Error | None:
        """Hold the LoRA adapter the request names on the runner (`TorchRunner.attach`); an Error if it cannot."""
        if not seq.request.adapter:
            return None
        attach = getattr(self.runner, "attach", None)
        why = attach(seq) if attach is not None else f"This worker serves no LoRA adapters (the request asks for '{seq.request.adapter}')."
        return Error(message=why, kind=ErrorKind.INVALID_REQUEST, attempt=seq.attempt) if why is not None else None

    def discard(self, request_id: str) -> None:
        """Forget a request without emitting anything (another worker owns it now)."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.runner.release(seq)
            self.scheduler.finish(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def active_ids(self) -> list[str]:
        return list(self._seqs)

    def figures(self) -> dict[str, float | int | str]:
        """The engine's figures for the heartbeat, read where no step runs (the step thread hands them
        over with its emissions): a heartbeat on its own timer never reads the engine's tables."""
        stats, sched, runner, grammars = self.stats, self.scheduler, self.runner, self.grammars
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "active": len(self._seqs),
            "batch_peak": stats.batch_peak,
            "last_batch": stats.last_batch,
            "steps": stats.steps,
            "prefill_tokens": stats.prefill_tokens,
            "decode_tokens": stats.decode_tokens,
            "step_ms": round(stats.last_step_s * 1000, 2),
            "mask_ms_total": round(getattr(runner, "mask_s", 0.0) * 1000, 3),  # grammar masks (constrained rows only)
            "masked_steps": getattr(runner, "masked_steps", 0),
            "masked_rows": getattr(runner, "masked_rows", 0),
            "grammar_compiles": grammars.compiles if grammars is not None else 0,
            "grammar_cache_hits": grammars.hits if grammars is not None else 0,
            "kv_used_tokens": sched.pool.num_used * sched.pool.block_size,
            "kv_total_tokens": sched.pool.num_tokens,
            "kv_blocks_used": sched.pool.num_used,
            "prefix_cache_queries": sched.pool.queries,
            "prefix_cache_hits": sched.pool.hits,
            "running_peak": sched.running_peak,
            "preemptions": sched.preemptions,
            "off_schema_calls": stats.off_schema_calls,
            "spec_drafts": stats.spec_drafts,
            "spec_proposed": stats.spec_proposed,
            "spec_accepted": stats.spec_accepted,
            "adapters": adapters_in(sched.running, sched.waiting),
        }

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> list[Emission]:
        seq = self._seqs.get(request_id)
        if seq is None:
            return []
        return [self._finish(seq, reason)]

    def fail_all(self, message: str) -> list[Emission]:
        """End every request in flight with an Error (the step itself failed; the worker lives on)."""
        out = []
        for seq in list(self._seqs.values()):
            self._finish(seq, FinishReason.CANCELLED)
            out.append(Emission(seq.key, Error(message=message, kind=ErrorKind.INTERNAL, attempt=seq.attempt), batch_max=seq.batch_max))
        return out

    def step(self) -> list[Emission]:
        emissions = self._expire()
        plan = self.scheduler.schedule()
        if plan.empty:
            return emissions
        started = time.perf_counter()
        try:
            done = [(plan, self.runner.execute(plan))]
        except Exception as exc:
            done, failed = self._isolate(plan, exc)
            emissions.extend(self._fail(seq, FAILED_STEP, kind=ErrorKind.INTERNAL) for seq in failed)
        for part, sampled in done:
            self.scheduler.advance(part)
            plain = len(sampled) - sum(d.rows for d in part.verify)  # drafts' rows come last, each draft's in order
            for s in sampled[:plain] if part.verify else sampled:
                if s.seq.key in self._seqs:
                    emissions.extend(self._append_alone(s))
            for draft in part.verify:
                emissions.extend(self._verify(draft, sampled[plain : plain + draft.rows]))
                plain += draft.rows
        self._record(plan, time.perf_counter() - started)
        return emissions

    def _propose(self, seq: Sequence, room: int) -> list[int]:
        """A decoding sequence's guesses for this step (the scheduler's `Proposer`): none for a request that
        opted out, whose answer's grammar waits on a reasoning span, or that is sampled under a grammar (its
        later rows are sampled unmasked: only greedy can confirm a guess there); at most what is left of its
        max_tokens and the context; for a constrained one, cut where its matcher would refuse a guess."""
        state: _TextState = seq.state
        params = seq.request.sampling
        if not params.speculative or state.deferred_grammar is not None or (seq.grammar is not None and not params.greedy):
            return []
        k = min(room, state.max_tokens - len(seq.output) - 1, self.runner.max_len - seq.length - 1)
        if k <= 0:
            return []
        index: NgramIndex | None = seq.spec
        if index is None:
            index = seq.spec = NgramIndex(*self.ngrams, seq.span(0, seq.length))
        elif len(index.tokens) < seq.length:
            index.extend(seq.span(len(index.tokens), seq.length))
        guesses = index.propose(k)
        if guesses and seq.grammar is not None:
            guesses = guesses[: seq.grammar.validate_tokens(guesses)]
        return guesses

    def _verify(self, draft: Draft, rows: list[Sampled]) -> list[Emission]:
        """A draft's sampled rows: row i's token is what the sequence samples after its guesses before row
        i, so it is appended while every earlier row confirmed the guess after it; the first row that
        does not ends it (its token is the one a plain step would have sampled there). A constrained
        sequence's later rows ran without its mask: their token counts only where it confirms a guess
        the matcher allowed. The sequence then moves on by the tokens appended (`advance_draft`)."""
        seq = draft.seq
        masked_alone = seq.grammar is not None  # rows past the first ran without the matcher
        out: list[Emission] = []
        kept = confirmed = 0
        for i, s in enumerate(rows):
            guess = draft.tokens[i] if i < len(draft.tokens) else None
            if seq.key not in self._seqs or (i and masked_alone and s.token != guess):
                break
            out.extend(self._append_alone(s))
            kept += 1
            if seq.output[-1] != guess:
                break
            confirmed += 1
        stats = self.stats
        stats.spec_drafts += 1
        stats.spec_proposed += len(draft.tokens)
        stats.spec_accepted += confirmed
        stats.decode_tokens += kept
        self.scheduler.advance_draft(seq, kept)
        return out

    def _isolate(self, plan: StepPlan, exc: Exception) -> tuple[list[tuple[StepPlan, list[Sampled]]], list[Sequence]]:
        """A step that raised: bisect its sequences, re-running each half, until every failing part is one
        sequence. Those fail alone; the rest get the tokens their re-run sampled. Re-running is safe: a
        step writes each KV position it computes (the same values again) and samples per position.
        Costs about 2·log2(batch) extra forwards per failing sequence, only on the step that failed."""
        log.warning("engine step failed (%s: %s); isolating the failing request(s) among %d", type(exc).__name__, exc, len(_members(plan)))
        done: list[tuple[StepPlan, list[Sampled]]] = []
        failed: list[Sequence] = []
        parts: list[tuple[StepPlan, bool]] = [(plan, True)]  # (part, known to fail)
        while parts:
            part, fails = parts.pop()
            members = _members(part)
            if not fails:
                try:
                    done.append((part, self.runner.execute(part)))
                    continue
                except Exception:
                    pass
            if len(members) == 1:
                log.error("request %s fails the step on its own; ending it with an error", members[0].key)
                failed.append(members[0])
                continue
            half = len(members) // 2
            parts.extend(((_subplan(part, members[:half]), False), (_subplan(part, members[half:]), False)))
        return done, failed

    def _record(self, plan: StepPlan, seconds: float) -> None:
        s = self.stats
        s.steps += 1
        s.last_batch = len(plan.decode) + len(plan.prefill) + len(plan.verify)
        s.batch_peak = max(s.batch_peak, s.last_batch)
        s.decode_tokens += len(plan.decode)  # a draft's: what it kept (`_verify`)
        s.prefill_tokens += plan.prefill_tokens
        s.last_step_s = seconds

    def _expire(self) -> list[Emission]:
        now = self.clock()
        late = [s for s in self._seqs.values() if s.request.created and now - s.request.created > self.request_timeout]
        return [self._finish(s, FinishReason.TIMEOUT) for s in late]

    def _append_alone(self, sampled: Sampled) -> list[Emission]:
        """`_append`, where a failure (a parser's bug on this one request's text) ends only this request."""
        try:
            return self._append(sampled)
        except Exception:
            log.exception("request %s: turning its token into deltas failed; ending it with an error", sampled.seq.key)
            return [self._fail(sampled.seq, FAILED_STEP, kind=ErrorKind.INTERNAL)] if sampled.seq.key in self._seqs else []

    def _append(self, sampled: Sampled) -> list[Emission]:
        seq, token = sampled.seq, sampled.token
        state: _TextState = seq.state
        span = state.span
        forced = span.take_forced() if span is not None else None
        token = forced if forced is not None else token  # a reasoning budget's forced close replaces the sample
        seq.output.append(token)
        if sampled.logprob is not None and forced is None:
            state.pending_logprobs.append(self._logprob(sampled.token, sampled.logprob, sampled.top))
        channel = span.route(token) if span is not None else Channel.ANSWER
        if channel is Channel.ANSWER and seq.grammar is not None and not seq.grammar.consume_token(token):
            return [self._fail(seq, f"The output reached a dead end of its constraint: {_first_line(seq.grammar.get_error())}")]
        params = seq.request.sampling
        out: list[Emission] = []
        may_stop = len(seq.output) > params.min_tokens
        if may_stop and ((token in self.info.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids):
            state.pending_ids.append(token)
            self._emit_final(seq, state.stops.flush(), out)
            out.append(self._finish(seq, FinishReason.STOP))
            return out
        state.pending_ids.append(token)
        if channel is Channel.ANSWER:
            text, matched = state.stops.push(state.detok.push(token))
            self._emit_text(seq, text, out)
        else:
            matched = None
            self._emit_reasoning(seq, token if channel is Channel.REASONING else None, out)
        if matched is not None:
            self._emit_final(seq, "", out)
            out.append(self._finish(seq, FinishReason.STOP_SEQUENCE, matched_stop=matched))
        elif (seq.grammar is not None and seq.grammar.is_stopped()) or getattr(state.tools, "ended", False):
            self._emit_final(seq, state.stops.flush(), out)
            out.append(self._finish(seq, FinishReason.STOP))
        elif len(seq.output) >= state.max_tokens or seq.length >= self.runner.max_len:
            self._emit_final(seq, state.stops.flush(), out, cut=True)
            # a repeat cut mid-way was dropped (workers.tools.RepeatGuard): what was delivered is whole calls
            out.append(self._finish(seq, FinishReason.STOP if getattr(state.tools, "ended", False) else FinishReason.LENGTH))
        return out

    def _logprob(self, token: int, logprob: float, alternatives: tuple[tuple[int, float], ...]) -> TokenLogprob:
        def text(token_id: int) -> str:
            return str(self.tokenizer.decode([token_id]))

        top = tuple((text(t), t, lp) for t, lp in alternatives)
        return TokenLogprob(token=text(token), token_id=token, logprob=logprob, top=top)

    def _emit_reasoning(self, seq: Sequence, token: int | None, out: list[Emission]) -> None:
        """A reasoning token's text → a Reasoning delta; a marker closing the span → the sealed delta,
        and the answer's grammar (if any) takes over."""
        state: _TextState = seq.state
        assert state.span is not None and state.reasoning_detok is not None
        if token is not None:
            text = state.reasoning_detok.push(token)
            if text:
                state.reasoning_text.append(text)
                self._push(seq, [Reasoning(text=text)], out)
        elif state.span.state == "answer":
            self._seal(seq, out)
        if state.deferred_grammar is not None and state.span.in_answer:
            seq.grammar, state.deferred_grammar = state.deferred_grammar, None

    def _seal(self, seq: Sequence, out: list[Emission]) -> None:
        """Once per span: its whole text sealed with the deployment's key (shared.seal), on an empty Reasoning delta."""
        state: _TextState = seq.state
        if state.sealed or state.span is None or self.sealer is None or not (state.span.tokens or state.span.closed_span):
            return
        state.sealed = True
        self._push(seq, [Reasoning(text="", sealed=self.sealer.seal("".join(state.reasoning_text)))], out)

    def _emit_text(self, seq: Sequence, text: str, out: list[Emission], *, final: bool = False, cut: bool = False) -> None:
        """Text → deltas (through the tool-call parser when calls are on); the pending token ids and
        logprobs ride on the first delta, so every generated token is in exactly one delta."""
        state: _TextState = seq.state
        if state.span is not None and state.span.closed_span and not state.answer_begun:
            text = text.lstrip()  # the blank line after `</think>`
            state.answer_begun = bool(text)
        if state.tools is not None:
            deltas = state.tools.push(text) + (state.tools.flush(cut) if final else [])
        else:
            deltas = [Content(text=text)] if text else []
        self._push(seq, deltas, out)

    def _push(self, seq: Sequence, deltas: list[StreamDelta], out: list[Emission]) -> None:
        state: _TextState = seq.state
        if deltas and not state.opened:
            state.opened = True  # the prefix-cache count rides on the first delta (a text-less Content before any other)
            cached = seq.cached_tokens or 0
            if type(deltas[0]) is Content:
                deltas = [replace(deltas[0], cached_tokens=cached), *deltas[1:]]
            else:
                out.append(Emission(seq.key, Content(text="", attempt=seq.attempt, cached_tokens=cached)))
        for delta in deltas:
            token_ids = tuple(state.pending_ids)
            if type(delta) is Content and not delta.prompt_logprobs and delta.cached_tokens is None:  # the common case, built directly (replace() costs ~4 µs)
                stamped: StreamDelta = Content(text=delta.text, token_ids=token_ids, attempt=seq.attempt, logprobs=tuple(state.pending_logprobs))
            elif isinstance(delta, Content):
                stamped = replace(delta, token_ids=token_ids, attempt=seq.attempt, logprobs=tuple(state.pending_logprobs))
            else:
                stamped = replace(cast(Any, delta), token_ids=token_ids, attempt=seq.attempt)
            out.append(Emission(seq.key, stamped))
            state.pending_ids, state.pending_logprobs = [], []
            if state.tools is not None and isinstance(delta, ToolCallStart | ToolCallArgs):
                _note_call(state.calls, delta)

    def _emit_final(self, seq: Sequence, text: str, out: list[Emission], *, cut: bool = False) -> None:
        self._seal(seq, out)  # a span the finish cut short is sealed as far as it got
        self._emit_text(seq, text, out, final=True, cut=cut)

    def _check_calls(self, seq: Sequence) -> None:
        """Each finished call's arguments against its tool's whole schema (the constraint may have left
        keywords out: models.grammar); one that does not match is logged and counted (`off_schema_calls`),
        and delivered as generated (the client checks its tools' inputs itself, as with any model)."""
        state: _TextState = seq.state
        specs = {t.name: t for t in seq.request.tools}
        for name, *pieces in state.calls.values():
            spec = specs.get(name)
            if spec is None or spec.kind is not ToolKind.FUNCTION:
                continue
            problem = off_schema(spec.parameters_json, "".join(pieces))
            if problem:
                self.stats.off_schema_calls += 1
                log.warning("request %s: the call to %s does not match its schema: %s", seq.key, name, problem)

    def _fail(self, seq: Sequence, message: str, *, kind: ErrorKind = ErrorKind.INVALID_REQUEST) -> Emission:
        """End one request with an Error (its constraint failed, or it alone fails the step); the batch goes on."""
        self._finish(seq, FinishReason.CANCELLED)
        return Emission(seq.key, Error(message=message, kind=kind, attempt=seq.attempt), batch_max=seq.batch_max)

    def _finish(self, seq: Sequence, reason: FinishReason, *, matched_stop: str | None = None) -> Emission:
        state: _TextState = seq.state
        if reason in (FinishReason.STOP, FinishReason.STOP_SEQUENCE) and state.tools is not None and state.tools.calls:
            reason, matched_stop = FinishReason.TOOL_CALLS, None
        usage = Usage(
            prompt_tokens=len(seq.request.prompt_token_ids),
            completion_tokens=len(seq.output),
            cached_tokens=seq.cached_tokens or 0,
            reasoning_tokens=state.span.tokens if state.span is not None else 0,
        )
        if state.calls:
            self._check_calls(seq)
        delta = Finish(reason=reason, usage=usage, matched_stop=matched_stop, token_ids=tuple(state.pending_ids), attempt=seq.attempt, at=time.time())
        self.runner.release(seq)
        self.scheduler.finish(seq)
        del self._seqs[seq.key]
        return Emission(seq.key, delta, batch_max=seq.batch_max)


def _tool_parser(fmt: ToolFormat, request: Request) -> ToolParser:
    parser: ToolParser = make_parser(for_request(fmt, request), f"call_{request.id}")
    if request.tool_choice == "required" and request.parallel_tool_calls:
        parser = RepeatGuard(parser)  # the grammar lets calls follow calls: a repeated call ends the turn
    if request.max_tool_calls is not None:
        parser = CallCap(parser, request.max_tool_calls)
    return parser


def _note_call(calls: dict[int, list[str]], delta: ToolCallStart | ToolCallArgs) -> None:
    if isinstance(delta, ToolCallStart):
        calls[delta.index] = [delta.name]
    elif delta.index in calls:
        calls[delta.index].append(delta.arguments)


@functools.lru_cache(maxsize=256)
def _validator(schema_text: str) -> Any:
    schema = json.loads(schema_text) or {"type": "object"}
    return jsonschema.validators.validator_for(schema)(schema)


def off_schema(schema_text: str, arguments: str) -> str:
    """Why `arguments` (JSON text) do not match the schema, or "" when they do (or it cannot be said)."""
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        return "its arguments are not JSON"
    try:
        error = next(iter(_validator(schema_text).iter_errors(args)), None)
    except Exception:  # a schema jsonschema cannot apply (an unresolvable $ref...): nothing can be said
        return ""
    if error is None:
        return ""
    return f"{error.message} at /{'/'.join(str(p) for p in error.absolute_path)}"


def _members(plan: StepPlan) -> list[Sequence]:
    return [*plan.decode, *(c.seq for c in plan.prefill), *(d.seq for d in plan.verify)]


def _subplan(plan: StepPlan, members: list[Sequence]) -> StepPlan:
    keep = set(map(id, members))
    return StepPlan(
        decode=tuple(s for s in plan.decode if id(s) in keep),
        prefill=tuple(c for c in plan.prefill if id(c.seq) in keep),
        verify=tuple(d for d in plan.verify if id(d.seq) in keep),
    )


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"


def _with_resolved_sampling(request: Request, info: ModelInfo) -> Request:
    from dataclasses import replace

    return replace(request, sampling=resolve(request.sampling, info.sampling_defaults))


def adapters_in(running: list[Sequence], waiting: list[Sequence]) -> str:
    """The LoRA adapters of the sequences in the engine, for the heartbeat (`met top`'s adapters line):
    `shared.codec.adapters_field` of each adapter's running and waiting sequences."""
    counts: dict[str, tuple[int, int]] = {}
    for at, seqs in enumerate((running, waiting)):
        for seq in seqs:
            if seq.request.adapter:
                r, w = counts.get(seq.request.adapter, (0, 0))
                counts[seq.request.adapter] = (r + 1 - at, w + at)
    return adapters_field(adapter_counts(counts))
