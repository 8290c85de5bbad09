"""Tool-call syntax families: one row per family (name, marker texts, grammar builder) and the one
place that picks a family from the chat template.

A family is the syntax a model writes its calls in; the worker parses it (`workers.tools.PARSERS`, one
parser per row here, keyed by `ToolFormat.name`) and `tool_choice` grammars make the model write it:

- `hermes` (Qwen, Hermes, and our own prompt for templates without tool support, `models.tools`):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one call per tag, calls one per line.
  Custom (free-form) tools are hermes-only: `<tool_call>{"name": ...}` + newline + the raw input.
- `llama3` (Llama 3.1 / 3.2 JSON tool calling): the whole output is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`, several calls separated by `; `.
- `mistral`: `[TOOL_CALLS]` then a JSON array `[{"name": ..., "arguments": {...}}, ...]` (the grammar
  writes this form; the parser also reads the v11+ `[TOOL_CALLS]name[ARGS]{...}`).

`select(template, setting)`: `--tool-parser auto` picks by what the template text spells: `<tool_call>`
→ hermes; `[TOOL_CALLS]` → mistral; `<|python_tag|>` or the `ipython` role → llama3; anything else
(including a template that renders no tools, which gets our hermes prompt) → hermes. A request with a
custom tool always uses hermes (`for_request`): the other families have no raw-input call form.

Grammar shape (llguidance Lark, arguments as `%json` of each tool's schema, compact JSON):
`required` = the whole output is calls (several when parallel calls are allowed and no tool is named);
`auto` = free text that never spells the family's opening, or text then calls. An opening the
tokenizer has as a special token (a real Mistral's `[TOOL_CALLS]`) is written as that token
(`<[id]>`), the way the model writes it. Hermes call heads are literals (`{"name": "x", "arguments": `)
and only the arguments are `%json`, so function and custom calls share one lexer. A custom tool with a
lark / regex format gets its input from a named sub-grammar (`@input<i>`); since llguidance lexemes are
greedy, such an input cannot be followed by a closing tag it might itself contain, so that call ends the
output (no closing tag, the parser takes the input to the end). A free-text custom input ends at the
first `</tool_call>` (a lazy lexeme).
Must not: import torch, know any protocol's field names, or parse model output (workers do).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shared.ir import ConstraintKind, Request, ToolKind, ToolSpec

SETTINGS = ("auto", "hermes", "llama3", "mistral", "none")  # the values `--tool-parser` accepts
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


Rules = tuple[str, list[str], list[tuple[str, str]]]  # (the calls expression, Lark rules, named sub-grammars)


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One family. `markers`: the texts its parser must see (kept by the detokenizer when the tokenizer
    has them as special tokens); `opening`: what starts the calls, which `auto` text never spells ("":
    the calls are the whole output, text never starts with `{`); `calls`: the Lark rules for the calls
    after the opening, given the allowed tools and whether several calls may follow."""

    name: str
    markers: tuple[str, ...]
    opening: str
    calls: Callable[[tuple[ToolSpec, ...], bool], Rules]


def _lit(text: str) -> str:
    return json.dumps(text)


def _rx(text: str) -> str:
    return re.escape(text).replace("/", "\\/")


def _functions(tools: tuple[ToolSpec, ...], keys: tuple[str, str]) -> list[str]:
    names = [f"f{i}" for i in range(len(tools))]
    return ["call: " + " | ".join(names), *(f"f{i}: %json {json.dumps(_call_schema(t, keys))}" for i, t in enumerate(tools))]


def _llama3_calls(tools: tuple[ToolSpec, ...], several: bool) -> Rules:
    more = 'calls: call | call "; " calls' if several else "calls: call"
    return "calls", [more, *_functions(tools, ("name", "parameters"))], []


def _mistral_calls(tools: tuple[ToolSpec, ...], several: bool) -> Rules:
    more = 'items: call | call ", " items' if several else "items: call"
    return '"[" items "]"', [more, *_functions(tools, ("name", "arguments"))], []


def _hermes_calls(tools: tuple[ToolSpec, ...], several: bool) -> Rules:
    """Hermes rules after `<tool_call>`: `closed` calls end with the closing tag (more may follow),
    `final` ones (custom input from a sub-grammar) end the output."""
    closed, final, rules, subs = [], [], [], []
    for i, t in enumerate(tools):
        if t.kind is ToolKind.FUNCTION:
            closed.append(f"f{i}")
            head = _lit(json.dumps({"name": t.name})[:-1] + ', "arguments": ')  # a literal head, as custom calls have: one lexer decides
            rules.append(f"f{i}: {head} %json {json.dumps(_args_schema(t))} {_lit('}' + HERMES_CLOSE)}")
            continue
        head = _lit(json.dumps({"name": t.name}) + "\n")
        if t.input_format is None:
            closed.append(f"c{i}")
            rules += [f"c{i}: {head} c{i}_raw", f"c{i}_raw[lazy]: /(.|\\n)*{_rx(HERMES_CLOSE)}/"]
        else:
            final.append(f"c{i}")
            rules.append(f"c{i}: {head} @input{i}")
            subs.append((f"input{i}", _sub_grammar(t)))
    rules.append("one: " + " | ".join([*closed, *final]))
    if closed:
        rules.append("closed: " + " | ".join(closed))
        rules.append(f'seq: one | closed "\\n" {_lit(HERMES_OPEN)} seq')
    else:
        rules.append("seq: one")
    return ("seq" if several else "one"), rules, subs


HERMES = ToolFormat("hermes", (HERMES_OPEN, HERMES_CLOSE), HERMES_OPEN, _hermes_calls)
LLAMA3 = ToolFormat("llama3", (PYTHON_TAG,), "", _llama3_calls)
MISTRAL = ToolFormat("mistral", (TOOL_CALLS, ARGS), TOOL_CALLS, _mistral_calls)
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL)}


def select(template: Any, setting: str) -> ToolFormat | None:
    """The family a worker parses (None: `--tool-parser none`). `template` is the tokenizer's
    `chat_template` (a string, a list of named templates, or None)."""
    if setting == "none":
        return None
    if setting != "auto":
        return FORMATS[setting]
    text = _template_text(template)
    if HERMES_OPEN in text:
        return HERMES
    if TOOL_CALLS in text:
        return MISTRAL
    if PYTHON_TAG in text or "ipython" in text:
        return LLAMA3
    return HERMES


def _template_text(template: Any) -> str:
    if isinstance(template, str):
        return template
    if isinstance(template, dict):
        return "\n".join(str(v) for v in template.values())
    if isinstance(template, list):
        return "\n".join(str(t.get("template", "")) if isinstance(t, dict) else str(t) for t in template)
    return ""


def for_request(fmt: ToolFormat, request: Request) -> ToolFormat:
    """The family a request's calls use: hermes when it has a custom tool, else the model's."""
    return HERMES if any(t.kind is ToolKind.CUSTOM for t in request.tools) else fmt


def grammar(fmt: ToolFormat, request: Request, tools: tuple[ToolSpec, ...], special: Mapping[str, int]) -> str:
    """The llguidance grammar (Lark text, or a JSON grammar list when custom tools need sub-grammars).
    `special`: the marker texts this tokenizer has as special tokens, with their ids; an opening that is
    one is written as that token (`<[id]>`), as the model would write it."""
    choice = request.tool_choice or "auto"
    named = choice.startswith("function:")
    expr, rules, subs = fmt.calls(tools, request.parallel_tool_calls and not named)
    token = special.get(fmt.opening) if fmt.opening else None
    if choice == "required" or named:
        opening = f"<[{token}]>" if token is not None else _lit(fmt.opening) if fmt.opening else ""
        start = [f"start: {opening} {expr}".replace("  ", " ")]
    elif token is not None:  # free text cannot contain a special token: it ends where the token comes
        start = [f"start: TEXT | TEXT? <[{token}]> {expr}", "TEXT: /(.|\\n)+/"]
    elif fmt.opening:
        start = [
            f"start: TEXT | prefix {expr}",
            f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{_rx(fmt.opening)}(.|\\n)*/",
            f"prefix[lazy]: /(.|\\n)*{_rx(fmt.opening)}/",
        ]
    else:
        start = [f"start: TEXT | {expr}", "TEXT: /\\s*[^{\\s](.|\\n)*/"]
    main = "\n".join([*start, *rules]) + "\n"
    if not subs:
        return main
    return json.dumps({"grammars": [{"lark_grammar": main}, *({"name": n, "lark_grammar": g} for n, g in subs)]})


def _sub_grammar(tool: ToolSpec) -> str:
    """A custom tool's input grammar as Lark text."""
    from llguidance import LLMatcher

    assert tool.input_format is not None
    if tool.input_format.kind is ConstraintKind.REGEX:
        spec = json.loads(LLMatcher.grammar_from_regex(tool.input_format.text))
        return str(spec["grammars"][0]["lark_grammar"])
    return tool.input_format.text


RELAXED = {"whitespace_flexible": False, "lenient": True}  # a tool's schema is never refused: what llguidance cannot enforce is left out (models.grammar)


def _args_schema(tool: ToolSpec) -> dict[str, Any]:
    """The tool's parameters schema as the root (its refs resolve as written), compact."""
    params = json.loads(tool.parameters_json) or {"type": "object"}
    return {**params, "x-guidance": RELAXED}


def _call_schema(tool: ToolSpec, keys: tuple[str, str]) -> dict[str, Any]:
    """{name: const, arguments: the tool's schema}; its `$defs` / `definitions` move to the root so refs resolve."""
    params = json.loads(tool.parameters_json) or {"type": "object"}
    hoisted = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
    name_key, args_key = keys
    return {
        "type": "object",
        "properties": {name_key: {"const": tool.name}, args_key: params},
        "required": [name_key, args_key],
        "additionalProperties": False,
        "x-guidance": RELAXED,
        **hoisted,
    }
