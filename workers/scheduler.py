"""The torch-free scheduler: decides, each step, which sequences decode and which prompt chunks prefill.

Policy (continuous batching):
- Every running sequence whose prompt is in the KV cache decodes one token per step; a finished or
  cancelled one leaves at once and frees its blocks, so no request waits for another's last token.
  Except: a step that prefills a prompt leaves out the decodes of strictly lower priority (batch
  lines, `--batch-priority`), so an interactive first token never waits behind their forward.
- The rest of the per-step token budget (`max_tokens_per_step`) goes to prompt chunks: first for
  running sequences still prefilling (in admission order), then to waiting requests admitted while
  blocks are free and fewer than `max_running` run, ordered by (priority, arrival) — lower priority runs sooner, as in vLLM.
- KV memory is blocks (`workers.blocks.BlockPool`): a sequence takes blocks as it grows and gives
  them back when it finishes, so concurrency is bounded by the blocks actually used (and
  `max_running`), not by `max_model_len`. On admission a sequence reuses the cached blocks of its
  longest cached prefix (`computed` starts after them; the last prompt token is always recomputed
  so the step has its logits) and prefills only the rest. With `salt_outputs` (the runner computes
  prompt tokens otherwise than generated ones: `TorchRunner.wide_mode`) a block holding generated
  tokens is keyed apart from the same token ids as prompt, so a prompt never reads keys/values computed
  another way than its own prefill would compute them.
- Speculative decoding (`workers.speculate`, `--speculative ngram`): in a step with few decoding sequences
  (at most `spec.max_batch`), each may carry tokens its proposer guesses as a `Draft`: its last token and
  the guesses are computed as rows of this step at their positions, every row sampled, so the engine
  keeps the guesses the model agrees with plus the token after them (`advance_draft`), all in one step.
  Draft rows come out of what the token budget leaves after the prefill chunks, and take blocks only
  where the pool has them free (never a preemption). Positions past what was kept hold keys/values of
  rejected guesses: they sit past `computed`, in no registered block, and the next steps overwrite them
  before anything reads them (a row reads only positions below its own), so rolling back is moving
  `computed` alone.
- Running work gives way in two cases: a decoding sequence needs a block and the pool is exhausted,
  or a waiting request of strictly higher priority (lower value) finds no room. Either way the
  lowest-priority, latest running sequence is preempted — its blocks given back (they stay cached,
  so its readmission often finds them again), its prompt and output so far become the `context` it
  re-prefills (recompute, as vLLM does), and generation continues exactly where it stopped, with no
  token emitted twice.
Must not: import torch or touch Redis. Tests drive it with a fake runner.

Size (~410 lines): the one policy above, whose parts (decode, prefill budget, admission, drafts,
preemption) read and change the same running set in one step; split, each would need the others' state.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.block_keys import chain_hash, salted_root
from shared.ir import Request, prefix_salt
from workers.blocks import BlockPool

INTERACTIVE_PRIORITY = 0  # a request's priority unless it says (shared.ir.Request); batch lines run at --batch-priority (10)

_arrivals = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generation in flight. `computed` counts tokens whose keys/values are in the cache."""

    request: Request
    prompt: list[int]
    attempt: int = 1
    context: list[int] = field(default_factory=list)  # tokens to prefill: the prompt, plus output after a preemption
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # block table: block ids of positions 0, 16, 32, …
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks, by position
    registered: int = 0  # leading blocks whose keys are in the pool
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    arrival: int = field(default_factory=lambda: next(_arrivals))
    state: Any = None  # text state owned by the engine (detokenizer, stop matcher)
    grammar: Any = None  # the engine's llguidance matcher, advanced with every output token; None = free
    spec: Any = None  # the engine's proposer index over prompt + output (workers.speculate.NgramIndex), built on the first draft
    batch_max: int = 0  # largest decode batch this sequence took part in
    preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.context:
            self.context = list(self.prompt)

    @property
    def key(self) -> str:
        return self.request.id

    @property
    def prefilled(self) -> bool:
        return self.computed >= len(self.context)

    def span(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        return self.prompt[start:end] + self.output[max(0, start - n) : end - n]

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def order(self) -> tuple[int, int]:
        return (self.request.priority, self.arrival)


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    seq: Sequence
    start: int
    end: int

    @property
    def completes_prompt(self) -> bool:
        return self.end >= len(self.seq.context)


@dataclass(frozen=True, slots=True)
class Sampled:
    """One sampled token for one sequence; with logprobs asked, the chosen token's logprob and the top ones."""

    seq: Sequence
    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Draft:
    """A decoding sequence checked against guessed tokens in one step: rows for its last token and each
    guess, at positions `seq.computed` on, every row sampled (the engine keeps what the model agrees with)."""

    seq: Sequence
    tokens: tuple[int, ...]

    @property
    def rows(self) -> int:
        return len(self.tokens) + 1


@dataclass(frozen=True, slots=True)
class StepPlan:
    decode: tuple[Sequence, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()
    verify: tuple[Draft, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill and not self.verify

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + self.prefill_tokens + sum(d.rows for d in self.verify)

    @property
    def prefill_tokens(self) -> int:
        return sum(c.end - c.start for c in self.prefill)


Proposer = Callable[[Sequence, int], list[int]]  # (sequence, most tokens) → its guesses (workers.engine.Engine._propose)


@dataclass(frozen=True, slots=True)
class Speculation:
    """Speculative decoding's scheduling: who guesses, in steps of at most `max_batch` decoding sequences,
    `tokens` guesses a step shared among them."""

    propose: Proposer
    max_batch: int
    tokens: int


class Scheduler:
    def __init__(
        self,
        *,
        pool: BlockPool,
        max_running: int,
        max_tokens_per_step: int,
        salt_outputs: bool = False,
        speculation: Speculation | None = None,
        max_adapters: int | None = None,
    ) -> None:
        self.pool = pool
        self.max_adapters = max_adapters  # distinct LoRA adapters among running sequences (`--max-loras`); None: no limit
        self.speculation = speculation
        self.salt_outputs = salt_outputs
        self.max_running = max_running
        self.max_tokens_per_step = max(max_tokens_per_step, self.max_running)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.running_peak = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def room(self) -> bool:
        """Whether one more sequence could start now."""
        return len(self.running) < self.max_running and self.pool.num_free > 0

    def claim_room(self) -> int:
        """Requests a worker may claim now: room under `max_running` while the pool has a free block (the
        blocks in use, not `max_model_len`, bound how many run). Past it, one more per held sequence of
        lower priority than an interactive request (a batch line), up to a quarter of `max_running`: a
        request claimed then either outranks it (and preempts it) or waits as it would have in the stream.
        So a worker full of batch lines still takes an interactive request at once; it never holds more
        than a quarter over its width in waiting."""
        held = len(self.running) + len(self.waiting)
        if held < self.max_running and self.pool.num_free:
            return self.max_running - held  # the common case: no need to look at what is held (this runs every step)
        yielding = sum(1 for s in (*self.running, *self.waiting) if s.request.priority > INTERACTIVE_PRIORITY)
        if not self.pool.num_free and not yielding:
            return 0
        return max(0, self.max_running + min(yielding, max(1, self.max_running // 4)) - held)

    def schedule(self) -> StepPlan:
        self.waiting.sort(key=lambda s: s.order)
        self._preempt_for_priority()
        while True:
            budget = self.max_tokens_per_step
            decode = self._grow_decoders()
            budget -= len(decode)
            chunks: list[PrefillChunk] = []
            for seq in list(self.running):
                if budget <= 0:
                    break
                if not seq.prefilled:
                    budget -= self._chunk(seq, budget, chunks)
            while budget > 0 and self.waiting and len(self.running) < self.max_running and (nxt := self._next_waiting()) is not None and self._admit(nxt):
                budget -= self._chunk(self.running[-1], budget, chunks)
            if decode or chunks or not self.running:
                self.running_peak = max(self.running_peak, len(self.running))
                decode = _yielding(decode, chunks)
                drafts = self._drafts(decode, budget)
                if drafts:
                    drafted = {id(d.seq) for d in drafts}
                    decode = [s for s in decode if id(s) not in drafted]
                return StepPlan(decode=tuple(decode), prefill=tuple(chunks), verify=tuple(drafts))
            # Every running sequence is mid-prefill and the pool is full: the worst one gives way.
            self._preempt(max(self.running, key=lambda s: s.order))

    def _drafts(self, decode: list[Sequence], budget: int) -> list[Draft]:
        """The decoding sequences that check guesses this step: only in a step of at most `speculation.max_batch`
        of them, each at most its share of `speculation.tokens` (one sequence 16, four 4 each: a wrong guess costs a
        row, and rows cost more as the batch grows: bench/step_profile.py --draft), each guess a row out of
        what the budget leaves, its blocks only from free ones."""
        spec = self.speculation
        if spec is None or not decode or len(decode) > spec.max_batch:
            return []
        share = max(1, spec.tokens // len(decode))
        drafts = []
        for seq in decode:
            if budget <= 0:
                break
            room = min(budget, share)
            tokens = spec.propose(seq, room)[:room]
            while tokens and not self._reserve(seq, seq.computed + 1 + len(tokens)):
                tokens = tokens[: max(0, len(seq.blocks) * self.pool.block_size - seq.computed - 1)]  # what the blocks it got hold
            if tokens:
                drafts.append(Draft(seq, tuple(tokens)))
                budget -= len(tokens)
        return drafts

    def _grow_decoders(self) -> list[Sequence]:
        """The sequences that decode this step, each with a block for its next position; when the pool
        is exhausted, the lowest-priority latest running sequence is preempted (perhaps the one asking)."""
        pending = sorted((s for s in self.running if s.prefilled), key=lambda s: s.order)
        decode: list[Sequence] = []
        while pending:
            seq = pending.pop(0)
            while not self._reserve(seq, seq.computed + 1):
                victim = max(self.running, key=lambda s: s.order)
                self._preempt(victim)
                if victim is seq:
                    break
                if victim in pending:
                    pending.remove(victim)
            else:
                decode.append(seq)
        return decode

    def _reserve(self, seq: Sequence, tokens: int) -> bool:
        """Grow the block table to cover `tokens` positions; False when the pool ran out first."""
        while len(seq.blocks) < self.pool.blocks_for(tokens):
            block = self.pool.allocate()
            if block is None:
                return False
            seq.blocks.append(block)
        return True

    def _next_waiting(self) -> Sequence | None:
        """The first waiting sequence whose adapter may run beside the running ones: its own is already
        running, or fewer than `max_adapters` are (vLLM's `max_loras`); the base model always may."""
        if self.max_adapters is None:
            return self.waiting[0]
        live = {s.request.adapter for s in self.running if s.request.adapter}
        return next((s for s in self.waiting if not s.request.adapter or s.request.adapter in live or len(live) < self.max_adapters), None)

    def _admit(self, seq: Sequence) -> bool:
        """Move a waiting sequence to running, reusing its longest cached prefix; False (and it keeps
        waiting) when not even one block is free for what it must compute."""
        usable = (len(seq.context) - 1) // self.pool.block_size  # the last prompt token is always computed
        cached = self.pool.lookup(self._keys(seq, usable))
        self.pool.hold(cached)
        if self.pool.num_free == 0:
            self.pool.release(cached)
            return False
        self.waiting.remove(seq)
        hit = len(cached) * self.pool.block_size
        self.pool.count_query(queried=len(seq.context), hit=hit)
        if seq.cached_tokens is None:
            seq.cached_tokens = min(hit, len(seq.prompt))
        seq.blocks, seq.registered, seq.computed = cached, len(cached), hit
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return True

    def _keys(self, seq: Sequence, full_blocks: int) -> list[bytes]:
        """Prefix-cache keys of the sequence's first `full_blocks` blocks (computed once, kept)."""
        size = self.pool.block_size
        while len(seq.block_keys) < full_blocks:
            i = len(seq.block_keys)
            parent = seq.block_keys[-1] if seq.block_keys else salted_root(prefix_salt(seq.request))
            prompt_in_block = len(seq.prompt) - i * size  # < size: the block holds generated tokens
            salt = b"output after %d" % max(0, prompt_in_block) if self.salt_outputs and prompt_in_block < size else b""
            seq.block_keys.append(chain_hash(parent, seq.span(i * size, (i + 1) * size), salt))
        return seq.block_keys[:full_blocks]

    def advance(self, plan: StepPlan) -> None:
        """Record what a step computed, and key every block that became full for the prefix cache. A
        draft's sequence moves on by what the engine kept of it (`advance_draft`), not here."""
        width = len(plan.decode) + len(plan.verify)
        for seq in plan.decode:
            seq.computed += 1
            seq.batch_max = max(seq.batch_max, width)
        for draft in plan.verify:
            draft.seq.batch_max = max(draft.seq.batch_max, width)
        for chunk in plan.prefill:
            chunk.seq.computed = chunk.end
        for seq in (*plan.decode, *(c.seq for c in plan.prefill)):
            self._register(seq)

    def advance_draft(self, seq: Sequence, kept: int) -> None:
        """A draft's sequence took `kept` tokens this step (its last token's and the kept guesses' keys/values
        are valid; the rest of its rows' are rolled back by staying past `computed`)."""
        if seq.status is SeqStatus.RUNNING:
            seq.computed += kept
            self._register(seq)

    def _register(self, seq: Sequence) -> None:
        if not self.pool.prefix_cache:
            return
        full = seq.computed // self.pool.block_size
        if full > seq.registered:
            keys = self._keys(seq, full)
            for i in range(seq.registered, full):
                self.pool.register(seq.blocks[i], keys[i])
            seq.registered = full

    def _preempt_for_priority(self) -> None:
        """Make room for each waiting request that outranks the worst running one (recompute later)."""
        for seq in list(self.waiting):
            if self.room():
                break
            victim = max(self.running, key=lambda s: s.order, default=None)
            if victim is None or victim.request.priority <= seq.request.priority:
                break
            self._preempt(victim)

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        self.pool.release(victim.blocks)
        victim.blocks, victim.registered, victim.computed, victim.status = [], 0, 0, SeqStatus.WAITING
        victim.context = victim.prompt + victim.output
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.append(victim)
        self.waiting.sort(key=lambda s: s.order)

    def _chunk(self, seq: Sequence, budget: int, chunks: list[PrefillChunk]) -> int:
        end = min(len(seq.context), seq.computed + budget)
        if not self._reserve(seq, end):
            end = min(end, len(seq.blocks) * self.pool.block_size)
        if end <= seq.computed:
            return 0
        chunks.append(PrefillChunk(seq, seq.computed, end))
        return end - seq.computed

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is; its blocks are free (and stay cached) for the next step."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.pool.release(seq.blocks)
            seq.blocks = []
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED


def _yielding(decode: list[Sequence], chunks: list[PrefillChunk]) -> list[Sequence]:
    """A step that prefills a prompt leaves out the decodes of strictly lower priority (a larger value):
    batch lines pause for that step, so an interactive request's first token is not held back behind
    their decode forward. Their next positions' blocks stay reserved; they decode in the next step."""
    if not chunks:
        return decode
    best = min(c.seq.request.priority for c in chunks)
    return [s for s in decode if s.request.priority <= best]
