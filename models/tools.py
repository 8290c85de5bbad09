"""Tool calls on the model side: the call syntax, the prompt for templates without tool support, and the
grammar that enforces `tool_choice`.

The call syntax is hermes / Qwen's, one call per tag, the name first so it streams as soon as known:

    <tool_call>{"name": "<tool name>", "arguments": {<arguments, JSON>}}</tool_call>

Templates that render `tools=` themselves (they mention `tools`) get the tools through the template.
For the others (SmolLM2's drops them), `TOOLS_PROMPT` below, with every tool as one JSON line, goes at
the end of the system message (one is added when the conversation has none); assistant turns with
calls render their calls in the syntax above and tool results as `<tool_response>` blocks, so the
model sees its own format in the history.

Grammars (llguidance Lark, arguments as `%json` of the tool's schema):
- `required`: the whole output is one call (or, with parallel calls allowed, several, one per line)
  to the tools, arguments valid against their schema. A named tool: exactly one call to it (a small
  model allowed more repeats the same call until max_tokens).
- `auto` (or unset): free text that never contains the call tag, or text then calls: a lazy lexeme
  ends the text at the first `<tool_call>`, from which on the call is constrained.
- `none`: no grammar, no tools in the prompt, no parsing.
Must not: know any protocol's field names.
"""

from __future__ import annotations

import json
from typing import Any

from shared.ir import Request, ToolSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOLS_PROMPT = (
    "You can call tools. To call one, answer with exactly\n"
    f'{OPEN}{{"name": "<tool name>", "arguments": {{<the arguments as JSON>}}}}{CLOSE}\n'
    "Tool results come back in <tool_response></tool_response> blocks. The tools (JSON Schema):\n"
)


def calls_enabled(request: Request) -> bool:
    return bool(request.tools) and request.tool_choice != "none"


def allowed_tools(request: Request) -> tuple[ToolSpec, ...]:
    choice = request.tool_choice or ""
    if choice.startswith("function:"):
        return tuple(t for t in request.tools if t.name == choice.removeprefix("function:"))
    return request.tools


def tools_prompt(tools: tuple[ToolSpec, ...]) -> str:
    lines = [json.dumps({"name": t.name, "description": t.description, "parameters": json.loads(t.parameters_json)}) for t in tools]
    return TOOLS_PROMPT + "\n".join(lines)


def call_text(name: str, arguments: Any) -> str:
    return OPEN + json.dumps({"name": name, "arguments": arguments}) + CLOSE


def tool_grammar(request: Request) -> str | None:
    """The Lark grammar enforcing the request's tool_choice, or None when calls are off."""
    from llguidance import LLMatcher

    if not calls_enabled(request):
        return None
    tools = allowed_tools(request)
    bodies = [f"call{i}: %json " + json.dumps(_call_schema(t)) for i, t in enumerate(tools)]
    body = "body: " + " | ".join(f"call{i}" for i in range(len(tools)))
    named = (request.tool_choice or "").startswith("function:")
    more = [f'more: ("\\n" "{OPEN}" body "{CLOSE}")*'] if request.parallel_tool_calls and not named else []
    tail = " more" if more else ""
    if request.tool_choice == "required" or (request.tool_choice or "").startswith("function:"):
        start = [f'start: "{OPEN}" body "{CLOSE}"{tail}']
    else:
        start = [
            f'start: TEXT | prefix body "{CLOSE}"{tail}',
            f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{OPEN}(.|\\n)*/",
            f"prefix[lazy]: /(.|\\n)*{OPEN}/",
        ]
    return LLMatcher.grammar_from_lark("\n".join([*start, *more, body, *bodies]) + "\n")


def _call_schema(tool: ToolSpec) -> dict[str, Any]:
    """{"name": const, "arguments": the tool's schema}; its `$defs` / `definitions` move to the root so refs resolve."""
    params = json.loads(tool.parameters_json) or {"type": "object"}
    hoisted = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
        **hoisted,
    }
