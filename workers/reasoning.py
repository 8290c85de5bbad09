"""One sequence's reasoning span: routes each output token to the span or the answer, and enforces the
budget (pure, torch-free; `models.reasoning` owns the formats and budgets).

A span is recognised on the marker token ids, never on text. States: `maybe` (before the first output
token: `<think>` opens a span, anything else is the answer), `reasoning`, `answer`. Forcing: when a span
reaches its budget, the close (`</think>` and a blank line) is queued and the engine writes those
tokens instead of the sampled ones; a constrained request on a `maybe` model gets `<think>` forced first,
so its grammar (which applies to the answer only) is attached once the span is closed. The markers and
forced tokens produce no text. The same routing replays an earlier attempt's tokens on resume, so the
span, its token count and the forced queue are where they were.
"""

from __future__ import annotations

import enum

from models.reasoning import ThinkFormat


class Channel(enum.Enum):
    REASONING = "reasoning"
    ANSWER = "answer"
    MARKER = "marker"  # a marker or forced close token: no text


class ReasoningSpan:
    def __init__(self, fmt: ThinkFormat, *, prompt: tuple[int, ...], budget: int | None, force_open: bool = False) -> None:
        self.fmt = fmt
        self.budget = budget
        self.tokens = 0  # reasoning tokens so far (markers not counted)
        self.forced: list[int] = []
        self.closed_span = False  # a span ran and closed: the answer's leading blank lines are dropped
        self.state = "reasoning" if fmt.always_open or fmt.opens_in_prompt(prompt) else "maybe"
        if self.state == "maybe" and force_open:
            self.forced = [fmt.start_id]
        self._check_budget()

    @property
    def in_answer(self) -> bool:
        """No span is running or forced to run: an answer grammar applies (in `maybe` too, so a
        constrained request whose span is off starts constrained)."""
        return self.state != "reasoning" and not self.forced

    def take_forced(self) -> int | None:
        return self.forced[0] if self.forced else None

    def route(self, token: int) -> Channel:
        if self.forced and token == self.forced[0]:
            self.forced.pop(0)
            forced = True
        else:
            forced = False
        if self.state == "maybe":
            if token == self.fmt.start_id:
                self.state = "reasoning"
                self._check_budget()
                return Channel.MARKER
            self.state = "answer"
            return Channel.ANSWER
        if self.state == "reasoning":
            if token == self.fmt.end_id:
                self.state, self.closed_span = "answer", True
                return Channel.MARKER
            self.tokens += 1
            self._check_budget()
            return Channel.REASONING
        return Channel.MARKER if forced else Channel.ANSWER

    def _check_budget(self) -> None:
        if self.state == "reasoning" and self.budget is not None and self.tokens >= self.budget and not self.forced:
            self.forced = list(self.fmt.close_ids)
