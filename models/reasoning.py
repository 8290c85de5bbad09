"""Reasoning on the model side: which models reason, their span markers, and the token budget.

Owns: `ThinkFormat` (the `<think>` / `</think>` marker token ids and how a span opens), chosen from the
tokenizer and `--reasoning-parser`; the effort → token budget table; and whether a chat template takes
`enable_thinking`. Used by the worker (to route tokens and enforce budgets) and by ingest (to render
`enable_thinking=False` when the client turned reasoning off). Must not: import torch or know any
protocol's field names (ingest maps `thinking`, `reasoning_effort`, `reasoning.effort` onto the IR).

Parsers (`--reasoning-parser`):
- `qwen3`: a span the model opens with `<think>` as its first output token, or one the prompt left
  open (templates that end the generation prompt with `<think>`); anything else is plain content.
- `deepseek_r1`: the output always starts inside a span (R1's templates open it, and older ones
  expect the model to have), up to `</think>`.
- `auto` (default): `qwen3` when the tokenizer has both markers as single tokens and the chat template
  mentions `<think>`; no parsing otherwise (SmolLM2 has neither).
- `none`: no parsing; the markers are text.
Markers must be single tokens: spans are recognised on the output's token ids (never on text, never in
the prompt's client content), so a marker never splits across deltas.

Budgets: an explicit `budget_tokens` wins; otherwise `effort` through `EFFORT_BUDGETS`; otherwise no
budget. Every budget is capped by `--max-thinking-tokens` (0: no cap). When a span reaches its
budget the worker forces `</think>` and the answer begins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.ir import Thinking

START, END = "<think>", "</think>"
PARSERS = ("auto", "qwen3", "deepseek_r1", "none")

# Reasoning effort (OpenAI `reasoning_effort` / `reasoning.effort`, Anthropic `output_config.effort`)
# → the most reasoning tokens a span may have.
EFFORT_BUDGETS: dict[str, int] = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": 8192,
    "xhigh": 16384,
    "max": 32768,
}


@dataclass(frozen=True, slots=True)
class ThinkFormat:
    start_id: int
    end_id: int
    close_ids: tuple[int, ...]  # forced at the budget: `</think>` then the blank line the model writes after it
    always_open: bool  # deepseek_r1: the output starts inside a span

    def opens_in_prompt(self, prompt: tuple[int, ...]) -> bool:
        """True when the prompt's last marker is an unclosed `<think>` (the template opened the span)."""
        for token in reversed(prompt):
            if token == self.end_id:
                return False
            if token == self.start_id:
                return True
        return False


def marker_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The single-token ids of `<think>` and `</think>`, or None when either is not one token."""
    ids = []
    for marker in (START, END):
        encoded = tokenizer.encode(marker, add_special_tokens=False)
        if len(encoded) != 1:
            return None
        ids.append(int(encoded[0]))
    return ids[0], ids[1]


def think_format(tokenizer: Any, parser: str) -> ThinkFormat | None:
    """The reasoning format for this tokenizer under `--reasoning-parser`; None: no reasoning parsing.
    Raises ValueError when a parser is asked for explicitly and the markers are not single tokens."""
    if parser == "none":
        return None
    if parser == "auto":
        if START not in (getattr(tokenizer, "chat_template", None) or ""):
            return None
        parser = "qwen3" if marker_ids(tokenizer) is not None else "none"
        if parser == "none":
            return None
    ids = marker_ids(tokenizer)
    if ids is None:
        raise ValueError(f"--reasoning-parser {parser}: this tokenizer has no single-token {START} / {END}")
    close = tuple(int(t) for t in tokenizer.encode("\n\n", add_special_tokens=False))
    return ThinkFormat(start_id=ids[0], end_id=ids[1], close_ids=(ids[1], *close), always_open=parser == "deepseek_r1")


def budget_for(thinking: Thinking, cap: int = 0) -> int | None:
    """The span's token budget (None: unlimited), with the precedence in the module docstring."""
    if thinking.enabled is False:
        budget: int | None = 0
    elif thinking.budget_tokens is not None:
        budget = thinking.budget_tokens
    elif thinking.effort is not None:
        budget = EFFORT_BUDGETS.get(thinking.effort)
    else:
        budget = None
    if cap > 0:
        return cap if budget is None else min(budget, cap)
    return budget


def takes_enable_thinking(tokenizer: Any) -> bool:
    return "enable_thinking" in (getattr(tokenizer, "chat_template", None) or "")
