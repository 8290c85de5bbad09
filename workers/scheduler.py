"""The torch-free scheduler: decides, each step, which sequences decode and which prompt chunks prefill.

Policy (continuous batching):
- Every running sequence whose prompt is in the KV cache decodes one token per step; a finished or
  cancelled one leaves at once and frees its slot, so no request waits for another's last token.
- The rest of the per-step token budget (`max_tokens_per_step`) goes to prompt chunks: first for
  running sequences still prefilling (in admission order), then to waiting requests admitted into
  free slots, ordered by (priority, arrival) — lower priority runs sooner, as in vLLM.
- A sequence holds one KV slot (see `workers.runner.SlotKVCache`) from admission to finish; when no
  slot is free, new work waits in the queue. Slots are preallocated for `max_model_len` tokens, so a
  running sequence never runs out of KV space mid-flight; the one case where running work must give
  way is a waiting request of strictly higher priority (lower value): the lowest-priority, latest
  running sequence is preempted — its slot freed, its prompt and output so far become the `context`
  it re-prefills on readmission (recompute, as vLLM does), and generation continues exactly where it
  stopped, with no token emitted twice.
Must not: import torch or touch Redis. Tests drive it with a fake runner.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from shared.ir import Request

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
    slot: int | None = None
    computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    arrival: int = field(default_factory=lambda: next(_arrivals))
    state: Any = None  # text state owned by the engine (detokenizer, stop matcher)
    grammar: Any = None  # the engine's llguidance matcher, advanced with every output token; None = free
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
class StepPlan:
    decode: tuple[Sequence, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.end - c.start for c in self.prefill)


class Scheduler:
    def __init__(self, *, num_slots: int, max_running: int, max_tokens_per_step: int) -> None:
        self.max_running = min(max_running, num_slots)
        self.max_tokens_per_step = max(max_tokens_per_step, self.max_running)
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        self.waiting.sort(key=lambda s: s.order)
        self._preempt_for_priority()
        budget = self.max_tokens_per_step
        decode = tuple(s for s in self.running if s.prefilled)
        budget -= len(decode)
        chunks: list[PrefillChunk] = []
        for seq in self.running:
            if budget <= 0:
                break
            if not seq.prefilled:
                budget -= self._chunk(seq, budget, chunks)
        while budget > 0 and self.waiting and self._free_slots and len(self.running) < self.max_running:
            seq = self.waiting.pop(0)
            seq.slot = self._free_slots.pop()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            budget -= self._chunk(seq, budget, chunks)
        return StepPlan(decode=decode, prefill=tuple(chunks))

    def _preempt_for_priority(self) -> None:
        """Free a slot for each waiting request that outranks the worst running one (recompute later)."""
        preempted: list[Sequence] = []
        for seq in list(self.waiting):
            if self._free_slots and len(self.running) < self.max_running:
                break
            victim = max(self.running, key=lambda s: s.order, default=None)
            if victim is None or victim.request.priority <= seq.request.priority:
                break
            self.running.remove(victim)
            assert victim.slot is not None
            self._free_slots.append(victim.slot)
            self._free_slots.sort(reverse=True)
            victim.slot, victim.computed, victim.status = None, 0, SeqStatus.WAITING
            victim.context = victim.prompt + victim.output
            victim.preemptions += 1
            self.preemptions += 1
            preempted.append(victim)
        self.waiting.extend(preempted)
        self.waiting.sort(key=lambda s: s.order)

    @staticmethod
    def _chunk(seq: Sequence, budget: int, chunks: list[PrefillChunk]) -> int:
        end = min(len(seq.context), seq.computed + budget)
        chunks.append(PrefillChunk(seq, seq.computed, end))
        return end - seq.computed

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is; its slot is free for the next step."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            assert seq.slot is not None
            self._free_slots.append(seq.slot)
            self._free_slots.sort(reverse=True)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
