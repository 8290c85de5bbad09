"""OpenAI Responses body (POST /v1/responses) → `Request` IR (pure; raises `ApiError` naming the bad parameter).

Owns: the mapping of Responses fields onto the IR. `instructions` becomes a leading system message;
`input` items become messages, with each run of assistant-side items (`reasoning`, assistant `message`,
`function_call`, `custom_tool_call`) merged into one assistant turn, as chat templates expect;
`function_call_output` / `custom_tool_call_output` become TOOL messages. An `input_file` part (inline
`file_data`, a data-URL `file_url`, or a `file_id` the API node resolved into `file_data` before parsing)
becomes the file's text under a `<file name="...">` header (ingest.parsers.file_inputs). Tools: `function` and
`custom` (free-form input, optionally a Lark / regex `format` grammar) are callable, and a
`namespace` tool's functions are offered under one flattened name (`namespaced_name`) and keep their
namespace in the IR so the encoder hands calls back as the client named them. A `compaction` item (what
POST /v1/responses/compact returned) becomes a USER message holding its sealed summary as a
`sealed_reasoning` pair marked `COMPACTION` (`compaction()`), opened by the API node
(ingest.http.responses_compact.open_compactions). Items of the hosted tools
(`web_search_call`, `local_shell_call`, ...) are accepted and dropped; every other tool
type is accepted and ignored. `store` and `previous_response_id` are not IR: read them with `store_flag()`
and `previous_response_id()` (the app resolves the previous response). Unknown fields are ignored.
Must not: do I/O, look up stored responses or files, or render templates.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

from ingest.parsers import constraints, file_inputs
from ingest.parsers import fields as f
from ingest.parsers.openai_chat import metadata as metadata_pairs
from ingest.parsers.openai_chat import reasoning_effort, sampling
from shared.errors import invalid
from shared.ir import (
    Constraint,
    ConstraintKind,
    ContentPart,
    ImagePart,
    Message,
    Protocol,
    Request,
    Role,
    TextPart,
    Thinking,
    ToolCall,
    ToolKind,
    ToolSpec,
)

ROLES = {"user": Role.USER, "assistant": Role.ASSISTANT, "system": Role.SYSTEM, "developer": Role.DEVELOPER}
TEXT_PARTS = ("input_text", "output_text")
# Sampling fields the Responses API shares, name for name, with chat (so `sampling()` names them right).
SHARED_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "speculative")
MAX_ITEMS = 2048
SUMMARIES = ("auto", "concise", "detailed")
MAX_TOOLS = 128
MAX_NAME = 64
# Items of tools the server hosts (OpenAI runs them, the client only replays them): dropped on input.
HOSTED_ITEMS = frozenset({
    "web_search_call", "file_search_call", "code_interpreter_call", "image_generation_call", "computer_call", "computer_call_output",
    "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output", "apply_patch_call", "apply_patch_call_output",
    "mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "tool_search_call", "tool_search_output",
    "item_reference", "compaction_summary",
})


def parse(body: Any, *, request_id: str, created: float) -> Request:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", None, "invalid_body")
    model = f.string(f.require(body, "model"), "model", allow_empty=False)
    previous = previous_response_id(body)
    file_inputs.check_total(body)
    messages: list[Message] = []
    if body.get("instructions") is not None:
        messages.append(Message(role=Role.SYSTEM, content=(TextPart(text=f.string(body["instructions"], "instructions")),)))
    if body.get("input") is not None or previous is None:
        messages.extend(_input(f.require(body, "input")))
    stream = f.boolean(body["stream"], "stream") if body.get("stream") is not None else False
    params = sampling({k: body[k] for k in SHARED_SAMPLING if k in body})
    if body.get("top_logprobs") is not None:
        top = f.integer(body["top_logprobs"], "top_logprobs", lo=0, hi=20)
        params = replace(params, logprobs=True, top_logprobs=top)
    if body.get("max_output_tokens") is not None:
        params = replace(params, max_tokens=f.integer(body["max_output_tokens"], "max_output_tokens", lo=1, hi=f.MAX_TOKENS_CAP))
    store_flag(body)
    background_flag(body)
    raw_tools = f.array(body.get("tools") or [], "tools", max_items=MAX_TOOLS)
    tools = tuple(spec for i, t in enumerate(raw_tools) for spec in _tools(t, f"tools[{i}]"))
    if len(tools) > MAX_TOOLS:
        raise invalid(f"Invalid 'tools': at most {MAX_TOOLS} functions (namespaces counted by their functions), got {len(tools)}.", "tools", "too_many_tools")
    tool_choice = _tool_choice(body.get("tool_choice"))
    constraints.check_tool_choice(tools, tool_choice, "tool_choice.name" if tool_choice and tool_choice.startswith("function:") else "tool_choice")
    return Request(
        id=request_id,
        protocol=Protocol.OPENAI_RESPONSES,
        model=model,
        messages=tuple(messages),
        sampling=params,
        stream=stream,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=f.boolean(body["parallel_tool_calls"], "parallel_tool_calls")
        if body.get("parallel_tool_calls") is not None
        else True,
        max_tool_calls=f.integer(body["max_tool_calls"], "max_tool_calls", lo=1, hi=MAX_ITEMS) if body.get("max_tool_calls") is not None else None,
        constraint=constraints.one_of(body, constraints.responses_text_format(body.get("text"))),
        thinking=_thinking(body.get("reasoning"), body.get("include")),
        return_token_ids=f.boolean(body["return_token_ids"], "return_token_ids") if body.get("return_token_ids") is not None else False,
        created=created,
        metadata=metadata_pairs(body.get("metadata")),
        endpoint="/v1/responses",
    )


def store_flag(body: dict[str, Any]) -> bool:
    """`store` (default true): whether the app keeps the response for a later `previous_response_id`."""
    return f.boolean(body["store"], "store") if body.get("store") is not None else True


def background_flag(body: dict[str, Any]) -> bool:
    """`background: true`: answered at once with a queued response, polled, cancelled or streamed later by id."""
    background = f.boolean(body["background"], "background") if body.get("background") is not None else False
    if background and not store_flag(body):
        raise invalid("Background responses need 'store' (they are fetched later by id).", "background", "invalid_value")
    return background


def previous_response_id(body: dict[str, Any]) -> str | None:
    """The response this one continues, or None; the app loads it and prepends its conversation."""
    value = body.get("previous_response_id")
    return f.string(value, "previous_response_id", allow_empty=False) if value is not None else None


COMPACTION = "compaction"  # the mark of a compaction summary's sealed pair (`compaction()`)


def compaction(sealed: str) -> Message:
    """A `compaction` item: a USER message with no text yet, its summary sealed (shared.seal), marked
    `COMPACTION` in its one `sealed_reasoning` pair; the API node opens it into the summary's text or
    drops it (ingest.http.responses_compact.open_compactions)."""
    return Message(role=Role.USER, sealed_reasoning=((COMPACTION, sealed),))


def is_compaction(message: Message) -> bool:
    return message.role is Role.USER and any(mark == COMPACTION for mark, _ in message.sealed_reasoning)


def _input(value: Any) -> list[Message]:
    if isinstance(value, str):
        return [Message(role=Role.USER, content=(TextPart(text=value),))]
    out: list[Message] = []
    turn = _AssistantTurn()
    for i, raw in enumerate(f.array(value, "input", max_items=MAX_ITEMS)):
        param = f"input[{i}]"
        item = f.obj(raw, param)
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") == "assistant":
            turn.parts.extend(_content(f.require(item, "content", f"{param}.content"), f"{param}.content"))
        elif kind in ("function_call", "custom_tool_call"):
            turn.calls.append(_function_call(item, param) if kind == "function_call" else _custom_tool_call(item, param))
        elif kind == "reasoning" and isinstance(item.get("encrypted_content"), str) and item["encrypted_content"]:
            turn.sealed.append(("", item["encrypted_content"]))  # the sealed text wins over the shown summary
        elif kind == "reasoning":
            turn.reasoning.append(_reasoning(item, param))
        elif kind == "compaction":
            out.extend(turn.flush())
            out.append(compaction(f.string(f.require(item, "encrypted_content", f"{param}.encrypted_content"), f"{param}.encrypted_content")))
        elif kind in ("message", "function_call_output", "custom_tool_call_output"):
            out.extend(turn.flush())
            out.append(_message(item, param) if kind == "message" else _function_call_output(item, param))
        elif kind not in HOSTED_ITEMS:
            supported = "'message', 'function_call', 'function_call_output', 'custom_tool_call', 'custom_tool_call_output', 'reasoning', 'compaction'"
            raise invalid(f"Invalid value: {kind!r}. Supported input item types: {supported}.", f"{param}.type", "invalid_value")
    out.extend(turn.flush())
    return out


class _AssistantTurn:
    """Consecutive assistant-side items, merged into one assistant message when a non-assistant item follows."""

    def __init__(self) -> None:
        self.parts: list[ContentPart] = []
        self.calls: list[ToolCall] = []
        self.reasoning: list[str] = []
        self.sealed: list[tuple[str, str]] = []  # `encrypted_content` blobs, opened by the API node (shared.seal)

    def flush(self) -> list[Message]:
        if not (self.parts or self.calls or self.reasoning or self.sealed):
            return []
        message = Message(
            role=Role.ASSISTANT,
            content=tuple(self.parts),
            tool_calls=tuple(self.calls),
            reasoning="".join(self.reasoning) if self.reasoning else None,
            sealed_reasoning=tuple(self.sealed),
        )
        self.parts, self.calls, self.reasoning, self.sealed = [], [], [], []
        return [message]


def _message(item: dict[str, Any], param: str) -> Message:
    role_name = f.string(f.require(item, "role", f"{param}.role"), f"{param}.role")
    role = ROLES.get(role_name)
    if role is None:
        raise invalid(
            f"Invalid value: '{role_name}'. Supported values are: 'user', 'assistant', 'system' and 'developer'.",
            f"{param}.role",
            "invalid_value",
        )
    return Message(role=role, content=_content(f.require(item, "content", f"{param}.content"), f"{param}.content"))


def _content(value: Any, param: str) -> tuple[ContentPart, ...]:
    if isinstance(value, str):
        return (TextPart(text=value),)
    parts: list[ContentPart] = []
    for j, raw in enumerate(f.array(value, param)):
        where = f"{param}[{j}]"
        part = f.obj(raw, where)
        kind = part.get("type")
        if kind in TEXT_PARTS:
            parts.append(TextPart(text=f.string(f.require(part, "text", f"{where}.text"), f"{where}.text")))
        elif kind == "refusal":
            parts.append(TextPart(text=f.string(f.require(part, "refusal", f"{where}.refusal"), f"{where}.refusal")))
        elif kind == "input_image":
            url = part.get("image_url")
            if url is None:
                raise invalid(
                    "Only images given by 'image_url' are supported (no file ids).", f"{where}.image_url", "missing_required_parameter"
                )
            parts.append(ImagePart(url=f.string(url, f"{where}.image_url", allow_empty=False)))
        elif kind == "input_file":
            parts.append(file_inputs.openai_file(part, where, at=where))
        else:
            supported = "'input_text', 'output_text', 'refusal', 'input_image', 'input_file'"
            raise invalid(f"Invalid value: {kind!r}. Supported content types: {supported}.", f"{where}.type", "invalid_value")
    return tuple(parts)


def _function_call(item: dict[str, Any], param: str) -> ToolCall:
    """An earlier call; one to a namespaced function (`namespace` beside `name`) gets the flattened name
    the model was offered it under."""
    name = f.string(f.require(item, "name", f"{param}.name"), f"{param}.name", allow_empty=False)
    if item.get("namespace") is not None:
        name = namespaced_name(f.string(item["namespace"], f"{param}.namespace", allow_empty=False), name)
    return ToolCall(
        id=f.string(f.require(item, "call_id", f"{param}.call_id"), f"{param}.call_id", allow_empty=False),
        name=name,
        arguments=f.string(f.require(item, "arguments", f"{param}.arguments"), f"{param}.arguments"),
    )


def _custom_tool_call(item: dict[str, Any], param: str) -> ToolCall:
    return ToolCall(
        id=f.string(f.require(item, "call_id", f"{param}.call_id"), f"{param}.call_id", allow_empty=False),
        name=f.string(f.require(item, "name", f"{param}.name"), f"{param}.name", allow_empty=False),
        arguments=f.string(f.require(item, "input", f"{param}.input"), f"{param}.input"),
        kind=ToolKind.CUSTOM,
    )


def _function_call_output(item: dict[str, Any], param: str) -> Message:
    call_id = f.string(f.require(item, "call_id", f"{param}.call_id"), f"{param}.call_id", allow_empty=False)
    output = item.get("output")
    if output is None:
        raise invalid(f"Missing required parameter: '{param}.output'.", f"{param}.output", "missing_required_parameter")
    return Message(role=Role.TOOL, content=_content(output, f"{param}.output"), tool_call_id=call_id)


def _thinking(reasoning: Any, include: Any) -> Thinking:
    """`reasoning.effort` (the budget, models.reasoning; `none` turns reasoning off), `reasoning.summary`
    (reasoning goes out as summary text) and `include: ["reasoning.encrypted_content"]`."""
    encrypted = "reasoning.encrypted_content" in f.array(include or [], "include")
    if reasoning is None:
        return Thinking(encrypted=encrypted)
    value = f.obj(reasoning, "reasoning")
    effort = reasoning_effort(value.get("effort"), "reasoning.effort")
    summary = value.get("summary") if value.get("summary") is not None else value.get("generate_summary")
    if summary is not None and summary not in SUMMARIES:
        raise invalid(f"Invalid value: {summary!r}. Supported values are: 'auto', 'concise' and 'detailed'.", "reasoning.summary", "invalid_value")
    return Thinking(enabled=False if effort == "none" else None, effort=effort, summary=summary, encrypted=encrypted)


def _reasoning(item: dict[str, Any], param: str) -> str:
    """The reasoning text: its `content` (raw reasoning) when given, else its `summary`."""
    for key in ("content", "summary"):
        texts = []
        for j, raw in enumerate(f.array(item.get(key) or [], f"{param}.{key}")):
            part = f.obj(raw, f"{param}.{key}[{j}]")
            texts.append(f.string(f.require(part, "text", f"{param}.{key}[{j}].text"), f"{param}.{key}[{j}].text"))
        if texts:
            return "".join(texts)
    return ""


def _tools(value: Any, param: str) -> list[ToolSpec]:
    """A `function` or `custom` tool, or a `namespace` tool's functions (flattened); any other type
    (web_search, file_search, code_interpreter, mcp, computer_use_preview, image_generation, local_shell,
    ...) is one this server cannot run: accepted and ignored, as agent clients send mixed arrays."""
    t = f.obj(value, param)
    kind = f.string(f.require(t, "type", f"{param}.type"), f"{param}.type")
    if kind == "function":
        return [_function(t, param)]
    if kind == "custom":
        return [
            ToolSpec(
                name=constraints.tool_name(f.require(t, "name", f"{param}.name"), f"{param}.name"),
                description=f.string(t.get("description") or "", f"{param}.description"),
                kind=ToolKind.CUSTOM,
                input_format=_custom_format(t.get("format"), f"{param}.format"),
            )
        ]
    if kind != "namespace":
        return []
    namespace = constraints.tool_name(f.require(t, "name", f"{param}.name"), f"{param}.name")
    inner = f.array(f.require(t, "tools", f"{param}.tools"), f"{param}.tools", max_items=MAX_TOOLS)
    out = []
    for j, raw in enumerate(inner):
        where = f"{param}.tools[{j}]"
        tool = f.obj(raw, where)
        if tool.get("type", "function") == "function":
            spec = _function(tool, where)
            out.append(replace(spec, name=namespaced_name(namespace, spec.name), namespace=namespace, client_name=spec.name))
    return out


def _function(t: dict[str, Any], param: str) -> ToolSpec:
    return ToolSpec(
        name=constraints.tool_name(f.require(t, "name", f"{param}.name"), f"{param}.name"),
        description=f.string(t.get("description") or "", f"{param}.description"),
        parameters_json=constraints.tool_parameters(t.get("parameters"), f"{param}.parameters"),
    )


GRAMMAR_SYNTAX = {"lark": ConstraintKind.LARK, "regex": ConstraintKind.REGEX}


def _custom_format(value: Any, param: str) -> Constraint | None:
    """A custom tool's `format`: absent or `text` (free text, None) or `grammar` {syntax: lark | regex, definition}.
    The grammar compiles or not at the app (`PromptRenderer.check_constraint`), named by its `param`."""
    if value is None:
        return None
    fmt = f.obj(value, param)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind != "grammar":
        raise invalid(f"Invalid value: {kind!r}. Supported values are: 'text' and 'grammar'.", f"{param}.type", "invalid_value")
    syntax = fmt.get("syntax")
    if syntax not in GRAMMAR_SYNTAX:
        raise invalid(f"Invalid value: {syntax!r}. Supported values are: 'lark' and 'regex'.", f"{param}.syntax", "invalid_value")
    definition = f.string(f.require(fmt, "definition", f"{param}.definition"), f"{param}.definition", allow_empty=False)
    return Constraint(kind=GRAMMAR_SYNTAX[syntax], text=definition, param=f"{param}.definition")


def namespaced_name(namespace: str, name: str) -> str:
    """The one name a namespaced function is offered under: `{namespace}__{name}`, within the 64 characters
    every tool name may have (a longer one is cut and ends in a digest of the whole, so it stays unique)."""
    flat = f"{namespace}__{name}"
    if len(flat) <= MAX_NAME:
        return flat
    digest = hashlib.sha256(flat.encode()).hexdigest()[:8]
    return f"{flat[: MAX_NAME - len(digest) - 1]}_{digest}"


def _tool_choice(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise invalid(f"Invalid value: '{value}'. Supported values are: 'auto', 'none', 'required'.", "tool_choice", "invalid_value")
        return value
    choice = f.obj(value, "tool_choice")
    if choice.get("type") not in ("function", "custom"):  # a named tool of either kind: "function:<name>" in the IR
        raise invalid(
            f"Invalid value: {choice.get('type')!r}. Supported tool_choice types: 'function', 'custom'.", "tool_choice.type", "invalid_value"
        )
    return f"function:{f.string(f.require(choice, 'name', 'tool_choice.name'), 'tool_choice.name', allow_empty=False)}"
