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

Schemas llguidance cannot enforce whole (`propertyNames`, `if`/`then`, `contains`, `not`, `uniqueItems`,
`unevaluatedProperties`, `dependentRequired`…, all valid JSON Schema) are relaxed, not refused: compiled
with llguidance's `lenient` option, which leaves the keywords it cannot enforce out (a `propertyNames`
dropped leaves the object as open as it was declared). A tool's schema is always relaxed (a client's
agent must never be refused for its tool list: Claude Code's `TaskCreate` carries `propertyNames`), and
so is a structured-output schema unless the client asked for it whole (OpenAI's `strict: true`), which
is refused naming the keyword and where it is. `relaxed()` says what was left out of a schema (the API
node reports it: a log line and the `X-Metrale-Schema-Relaxed` header).
"""

from __future__ import annotations

import json
import re
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

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}  # whole: an unenforceable keyword is an error
RELAXED_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "lenient": True}  # what cannot be enforced is left out
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")
_NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependentRequired")  # keys there are names, not keywords
CACHE_SIZE = 64  # distinct grammars kept compiled per worker (a pristine matcher each)


def tokenizer_for(hf_tokenizer: Any, eos_ids: tuple[int, ...]) -> LLTokenizer:
    """The llguidance view of a transformers fast tokenizer (~0.3 s to build: build it once)."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=list(eos_ids) or None)


def json_schema_grammar(schema: dict[str, Any] | str, *, strict: bool = False) -> str:
    """The grammar of a JSON schema: whole (`strict`), or relaxed (see the module docstring)."""
    return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS if strict else RELAXED_OPTIONS)


def constraint_grammar(constraint: Constraint) -> str:
    """The llguidance grammar text for one constraint (not yet checked)."""
    kind = constraint.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        return json_schema_grammar(constraint.text, strict=constraint.strict)
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
        self._relaxed: OrderedDict[str, tuple[str, ...]] = OrderedDict()  # schema text → what `relaxed()` found
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
        if constraint.kind is ConstraintKind.JSON_SCHEMA and constraint.strict:
            left_out = self.relaxed(constraint.text)
            if left_out:
                raise invalid(
                    f"Invalid '{constraint.param}': strict mode cannot enforce {'; '.join(left_out)}. Remove the keyword, "
                    "or set strict to false to have it left out of the constraint.",
                    constraint.param,
                    "invalid_json_schema",
                )
        self.check(constraint_grammar(constraint), constraint.param)

    def relaxed(self, schema: str | dict[str, Any]) -> tuple[str, ...]:
        """What of `schema` llguidance cannot enforce, as "'<keyword>' at <JSON pointer>" (empty: all of
        it). Found by compiling it whole; cached per schema (agents send the same tools every turn)."""
        text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
        found = self._relaxed.get(text)
        if found is None:
            found = self._relaxed[text] = self._left_out(text)
            while len(self._relaxed) > self.cache_size:
                self._relaxed.popitem(last=False)
        return found

    def _left_out(self, text: str) -> tuple[str, ...]:
        try:
            error = LLMatcher.validate_grammar(json_schema_grammar(text, strict=True), self.tokenizer)
        except ValueError as exc:
            error = str(exc)
        match = _UNIMPLEMENTED.search(error or "")
        if match is None:
            return ()
        keywords = [k.strip().strip('"') for k in match.group(1).split(",") if k.strip()]
        return tuple(f"'{k}' at {path}" for k in keywords for path in keyword_paths(json.loads(text), k)) or tuple(f"'{k}'" for k in keywords)

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


def keyword_paths(schema: Any, keyword: str, path: str = "") -> list[str]:
    """JSON pointers of the subschemas of `schema` that use `keyword` ("" is the root: shown as "/")."""
    found: list[str] = []
    if isinstance(schema, dict):
        if keyword in schema:
            found.append(path or "/")
        for key, value in schema.items():
            here = f"{path}/{_pointer(key)}"
            if key in _NAME_MAPS and isinstance(value, dict):  # a map of names to subschemas: its keys are not keywords
                for name, sub in value.items():
                    found += keyword_paths(sub, keyword, f"{here}/{_pointer(name)}")
            elif isinstance(value, dict | list):
                found += keyword_paths(value, keyword, here)
    elif isinstance(schema, list):
        for i, item in enumerate(schema):
            found += keyword_paths(item, keyword, f"{path}/{i}")
    return found


def _pointer(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


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
