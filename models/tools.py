"""Tool calls on the model side: our call syntax, the prompt for templates without tool support, and
the grammar that enforces `tool_choice` (per family, see `models.tool_formats`).

Our syntax (hermes / Qwen's), one call per tag, the name first so it streams as soon as known:

    <tool_call>{"name": "<tool name>", "arguments": {<arguments, JSON>}}</tool_call>

A custom (free-form) tool is called in the same wrapper with its raw input, not JSON-escaped, after a
newline: `<tool_call>{"name": "apply_patch"}` + "\n" + `<the input as is></tool_call>`. Raw, because
llguidance cannot constrain the *decoded* content of a JSON string by a Lark grammar, but can constrain
raw text by one (a sub-grammar); so the input the client gets is exactly what its grammar matched.

Templates that render `tools=` themselves (they mention `tools`) get the tools through the template
(a custom tool as a function with one string parameter `input`, its description saying how it is
called). For the others (SmolLM2's drops them), `TOOLS_PROMPT` below, with every tool as one JSON line,
goes at the end of the system message (one is added when the conversation has none); assistant turns
with calls render their calls in the syntax above and tool results as `<tool_response>` blocks, so the
model sees its own format in the history. The prompt always asks for hermes; the grammar and parser
follow the model's family.

`tool_choice`: `required` / a named tool / `auto` (or unset) get a grammar (`tool_grammar`); `none`
gets no grammar, no tools in the prompt, no parsing.
Must not: know any protocol's field names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from models.tool_formats import HERMES_CLOSE, HERMES_OPEN, ToolFormat, for_request, grammar
from shared.ir import ConstraintKind, Request, ToolKind, ToolSpec

OPEN, CLOSE = HERMES_OPEN, HERMES_CLOSE
TOOLS_PROMPT = (
    "You can call tools. To call one, answer with exactly\n"
    f'{OPEN}{{"name": "<tool name>", "arguments": {{<the arguments as JSON>}}}}{CLOSE}\n'
    "Tool results come back in <tool_response></tool_response> blocks. The tools (JSON Schema):\n"
)
CUSTOM_PROMPT = (
    'A tool listed with "input" instead of "parameters" takes free-form text: call it with\n'
    f'{OPEN}{{"name": "<tool name>"}}\n<the input, as is>{CLOSE}\n'
)
CUSTOM_HOW = 'Call it as <tool_call>{"name": "%s"} then a newline and the raw input, then </tool_call>.'
INPUT_KINDS = {None: "free text", ConstraintKind.LARK: "text matching this Lark grammar: ", ConstraintKind.REGEX: "text matching the regex "}


def calls_enabled(request: Request) -> bool:
    return bool(request.tools) and request.tool_choice != "none"


def allowed_tools(request: Request) -> tuple[ToolSpec, ...]:
    choice = request.tool_choice or ""
    if choice.startswith("function:"):
        return tuple(t for t in request.tools if t.name == choice.removeprefix("function:"))
    return request.tools


def tools_prompt(tools: tuple[ToolSpec, ...]) -> str:
    lines = [json.dumps({"name": t.name, "description": t.description, **_shape(t)}) for t in tools]
    custom = "\n" + CUSTOM_PROMPT if any(t.kind is ToolKind.CUSTOM for t in tools) else ""
    return TOOLS_PROMPT + "\n".join(lines) + custom


def _shape(tool: ToolSpec) -> dict[str, Any]:
    if tool.kind is ToolKind.FUNCTION:
        return {"parameters": json.loads(tool.parameters_json)}
    return {"input": _input_text(tool)}


def _input_text(tool: ToolSpec) -> str:
    fmt = tool.input_format
    return INPUT_KINDS[fmt.kind if fmt else None] + (fmt.text if fmt else "")


def template_tool(tool: ToolSpec) -> dict[str, Any]:
    """A tool as templates that render `tools=` expect it (OpenAI function shape)."""
    if tool.kind is ToolKind.FUNCTION:
        function = {"name": tool.name, "description": tool.description, "parameters": json.loads(tool.parameters_json)}
    else:
        description = " ".join(p for p in (tool.description, CUSTOM_HOW % tool.name, f"Input: {_input_text(tool)}") if p)
        schema = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
        function = {"name": tool.name, "description": description, "parameters": schema}
    return {"type": "function", "function": function}


def call_text(name: str, arguments: Any, *, custom: bool = False) -> str:
    """One call in our syntax; a custom tool's `arguments` is its raw input (a string)."""
    if custom:
        return OPEN + json.dumps({"name": name}) + "\n" + str(arguments) + CLOSE
    return OPEN + json.dumps({"name": name, "arguments": arguments}) + CLOSE


def tool_grammar(request: Request, fmt: ToolFormat, special: Mapping[str, int] | None = None) -> str | None:
    """The grammar enforcing the request's tool_choice in `fmt`'s syntax, or None when calls are off
    (`special`: the family's markers that are special tokens of this tokenizer, see `tool_formats.grammar`)."""
    if not calls_enabled(request):
        return None
    return grammar(for_request(fmt, request), request, allowed_tools(request), special or {})
