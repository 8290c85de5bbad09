"""Constraints → llguidance grammars, checked against the model's tokenizer; compiled matchers, cached.

Owns: turning the IR's `Constraint` (and, for tool calls, the request's tools and tool_choice, see
`models.tools`) into llguidance grammar text; checking that text against the tokenizer (the API
node does this before anything is queued: `check()` raises `ApiError` naming the parameter); and,
in the worker, a bounded LRU of compiled `LLMatcher`s, one pristine copy per distinct grammar, each
sequence getting a `deep_copy()` (microseconds) instead of a fresh compile.
Must not: import torch (masks are applied in `workers.sampling`) or know any protocol's field names.

Engine choice: llguidance (issue 10 measured it here: a 3 MB wheel, no dependencies, 0.2–0.7 ms to
compile a 3-field schema, a batch mask fill that releases the GIL, special tokens blocked inside
strings by default). JSON is generated compact (`whitespace_flexible: false`): a small model given
free whitespace can spend its whole budget on newlines inside an object.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
from llguidance import LLMatcher, LLTokenizer

from shared.errors import invalid
from shared.ir import Constraint, ConstraintKind, Request

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from models.tool_formats import ToolFormat

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
CACHE_SIZE = 64  # distinct grammars kept compiled per worker (a pristine matcher each)


def tokenizer_for(hf_tokenizer: Any, eos_ids: tuple[int, ...]) -> LLTokenizer:
    """The llguidance view of a transformers fast tokenizer (~0.3 s to build: build it once)."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=list(eos_ids) or None)


def json_schema_grammar(schema: dict[str, Any] | str) -> str:
    return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def constraint_grammar(constraint: Constraint) -> str:
    """The llguidance grammar text for one constraint (not yet checked)."""
    kind = constraint.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        return json_schema_grammar(constraint.text)
    if kind is ConstraintKind.JSON_OBJECT:
        return json_schema_grammar({"type": "object"})
    if kind is ConstraintKind.REGEX:
        return LLMatcher.grammar_from_regex(constraint.text)
    if kind is ConstraintKind.CHOICE:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint.choices))
    return LLMatcher.grammar_from_lark(constraint.text)


class Grammars:
    """The tokenizer-bound grammar book: `check` (API node) and `matcher` (worker, cached)."""

    def __init__(self, tokenizer: LLTokenizer, *, cache_size: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self.compiles = 0
        self.hits = 0  # matchers served from the cache (no compile)

    @classmethod
    def for_model(cls, hf_tokenizer: Any, eos_ids: tuple[int, ...]) -> Grammars:
        return cls(tokenizer_for(hf_tokenizer, eos_ids))

    def check(self, grammar: str, param: str) -> None:
        """Raise `ApiError` naming `param` when llguidance refuses the grammar with this tokenizer."""
        try:
            error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        except ValueError as exc:
            error = str(exc)
        if error:
            raise invalid(f"Invalid '{param}': {_first_line(error)}", param, "invalid_grammar")

    def check_constraint(self, constraint: Constraint) -> None:
        self.check(constraint_grammar(constraint), constraint.param)

    def matcher(self, grammar: str) -> LLMatcher:
        """A fresh matcher at the start of `grammar`; check `is_error()` (a bad grammar never raises)."""
        pristine = self._compiled.get(grammar)
        if pristine is None:
            pristine = LLMatcher(self.tokenizer, grammar, log_level=0)
            self.compiles += 1
            self._compiled[grammar] = pristine
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self.hits += 1
            self._compiled.move_to_end(grammar)
        return pristine.deep_copy()

    @property
    def cached(self) -> int:
        return len(self._compiled)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else message


def grammar_for(request: Request, tool_format: ToolFormat | None, special: Mapping[str, int] | None = None) -> str | None:
    """The grammar a request's output must match, or None when it is free text. A structured-output
    constraint wins over tools; tool calls are constrained in `tool_format`'s syntax (None, i.e.
    `--tool-parser none`: left unconstrained; `special`: its markers that are special tokens here)."""
    from models.tools import tool_grammar

    if request.constraint is not None:
        return constraint_grammar(request.constraint)
    return tool_grammar(request, tool_format, special) if tool_format is not None else None


def special_markers(hf_tokenizer: Any, markers: tuple[str, ...]) -> dict[str, int]:
    """Those `markers` this tokenizer has as special tokens, with their ids (the others are plain text)."""
    decoder = getattr(hf_tokenizer, "added_tokens_decoder", None) or {}
    return {str(t.content): int(i) for i, t in decoder.items() if getattr(t, "special", False) and str(t.content) in markers}


def grammar_param(request: Request) -> str:
    """The client parameter a request's grammar comes from (named in errors)."""
    return request.constraint.param if request.constraint is not None else "tools"
