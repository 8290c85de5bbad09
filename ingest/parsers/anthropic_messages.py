"""Anthropic Messages body (POST /v1/messages) → `Request` IR (pure; raises `ApiError` naming the bad parameter).

Owns: the mapping of Messages fields onto the IR. A `tool_result` block becomes its own TOOL message
(in block order), `tool_use` blocks become the assistant turn's `ToolCall`s (arguments: the JSON text of
`input`), a signed `thinking` block becomes sealed reasoning (opened by the API node, shared.seal; an
unsigned one is dropped, as is `redacted_thinking`). `system`-role entries inside `messages` (sent by
recent Claude Code) are kept where they stand. A `x-anthropic-billing-header:` line in the system prompt
(Claude Code's attribution, its own first system block, whose version suffix and `cch` change between
conversations or even requests) is dropped as Anthropic's API lifts it: it means nothing to a model, and
at the very front of the prompt it would keep every conversation from sharing the cached system prompt
and tools (`BILLING_LINE`). `thinking` and `output_config.effort` become the IR's
`Thinking` (the reasoning budget); unknown fields are ignored (so `context_management`, `container`,
`mcp_servers`, `service_tier`, `cache_control` anywhere, and the beta query and headers all pass). Client
tools (no `type`, or `custom`) are offered to the model; typed server tools (`web_search_20250305`,
`bash_*`, `text_editor_*`, `computer_*`, `code_execution_*`, `memory_*`, `tool_search_tool_*`, ...) are
accepted and ignored, and so are the server-tool blocks (`server_tool_use`, `*_tool_result`) an assistant
turn replays: this server never ran them. A `document` block (in a user turn or a `tool_result`) becomes
the file's text under a `<file name="<title>">` header (ingest.parsers.file_inputs): a `base64` source
(`application/pdf`, whose text pypdf extracts, or `text/plain`), a `text` source, or a `content` source (its
text blocks; its images follow as image parts); `url` and `file` sources are refused (this server fetches
nothing and keeps no Anthropic files); `context` and `citations` are accepted and not used.
Parameters are named `messages[0].content[1].text`.
Must not: do I/O, render templates, or decide whether the model accepts images (the app does).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from ingest.parsers import constraints, file_inputs
from ingest.parsers import fields as f
from models.reasoning import EFFORT_BUDGETS
from shared.errors import invalid
from shared.ir import ContentPart, ImagePart, Message, Protocol, Request, Role, SamplingParams, TextPart, Thinking, ToolCall, ToolSpec

ROLES = {"user": Role.USER, "assistant": Role.ASSISTANT, "system": Role.SYSTEM}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
THINKING_TYPES = ("enabled", "disabled", "adaptive")
EFFORTS = tuple(EFFORT_BUDGETS)
MAX_MESSAGES = 2048
MAX_TOOLS = 128
BILLING_LINE = re.compile(r"^x-anthropic-billing-header:[^\n]*(?:\n|$)", re.MULTILINE)


def parse(body: Any, *, request_id: str, created: float) -> Request:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", None, "invalid_body")
    model = f.string(f.require(body, "model"), "model", allow_empty=False)
    max_tokens = f.integer(f.require(body, "max_tokens"), "max_tokens", lo=1, hi=f.MAX_TOKENS_CAP)
    file_inputs.check_total(body)
    raw_messages = f.array(f.require(body, "messages"), "messages", max_items=MAX_MESSAGES, allow_empty=False)
    messages = [*_system(body.get("system"))]
    for i, m in enumerate(raw_messages):
        messages.extend(_message(m, f"messages[{i}]"))
    thinking = _thinking(body.get("thinking"), body.get("output_config"))
    choice, parallel = _tool_choice(body.get("tool_choice"))
    raw_tools = f.array(body.get("tools") or [], "tools", max_items=MAX_TOOLS)
    tools = tuple(spec for i, t in enumerate(raw_tools) if (spec := _tool(t, f"tools[{i}]")) is not None)
    constraints.check_tool_choice(tools, choice, "tool_choice.name" if choice and choice.startswith("function:") else "tool_choice")
    return Request(
        id=request_id,
        protocol=Protocol.ANTHROPIC_MESSAGES,
        model=model,
        messages=tuple(messages),
        sampling=SamplingParams(
            temperature=f.number(body["temperature"], "temperature", lo=0.0, hi=1.0) if body.get("temperature") is not None else None,
            top_p=f.number(body["top_p"], "top_p", lo=0.0, hi=1.0) if body.get("top_p") is not None else None,
            top_k=f.integer(body["top_k"], "top_k", lo=0, hi=1_000_000) if body.get("top_k") is not None else None,
            max_tokens=max_tokens,
            stop=f.stop_list(f.array(body["stop_sequences"], "stop_sequences"), "stop_sequences")
            if body.get("stop_sequences") is not None
            else (),
            speculative=f.boolean(body["speculative"], "speculative") if body.get("speculative") is not None else True,
        ),
        stream=f.boolean(body["stream"], "stream") if body.get("stream") is not None else False,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        constraint=constraints.one_of(body, constraints.anthropic_output_format(body.get("output_config"))),
        thinking=thinking,
        return_token_ids=f.boolean(body["return_token_ids"], "return_token_ids") if body.get("return_token_ids") is not None else False,
        created=created,
        metadata=_metadata(body.get("metadata")),
        endpoint="/v1/messages",
    )



def parse_count_tokens(body: Any, *, request_id: str, created: float) -> Request:
    """`/v1/messages/count_tokens`: the Messages body without `max_tokens` (which it does not take)."""
    if isinstance(body, dict) and body.get("max_tokens") is None:
        body = {**body, "max_tokens": 1}
    return parse(body, request_id=request_id, created=created)

def _system(value: Any) -> list[Message]:
    if value is None:
        return []
    if isinstance(value, str):
        text = _without_billing_line(value)
        return [Message(role=Role.SYSTEM, content=(TextPart(text=text),))] if text else []
    parts: list[ContentPart] = []
    for i, block in enumerate(f.array(value, "system")):
        b = f.obj(block, f"system[{i}]")
        if b.get("type") != "text":
            raise invalid(
                f"Invalid value: {b.get('type')!r}. The system prompt accepts only 'text' blocks.", f"system[{i}].type", "invalid_value"
            )
        given = f.string(f.require(b, "text", f"system[{i}].text"), f"system[{i}].text")
        text = _without_billing_line(given)
        if text or not given:
            parts.append(TextPart(text=text))
    return [Message(role=Role.SYSTEM, content=tuple(parts))] if parts else []


def _without_billing_line(text: str) -> str:
    """The system text without Claude Code's attribution line (see the module docstring)."""
    return BILLING_LINE.sub("", text) if "x-anthropic-billing-header:" in text else text


def _message(value: Any, param: str) -> list[Message]:
    """One Messages entry → IR messages: a user turn may split into TOOL messages and user text."""
    m = f.obj(value, param)
    role_name = f.string(f.require(m, "role", f"{param}.role"), f"{param}.role")
    role = ROLES.get(role_name)
    if role is None:
        raise invalid(
            f"Invalid value: '{role_name}'. Supported values are: 'user', 'assistant' and 'system'.", f"{param}.role", "invalid_value"
        )
    content = f.require(m, "content", f"{param}.content")
    if isinstance(content, str):
        return [Message(role=role, content=(TextPart(text=content),))]
    blocks = [f.obj(b, f"{param}.content[{j}]") for j, b in enumerate(f.array(content, f"{param}.content"))]
    if role is Role.ASSISTANT:
        return [_assistant(blocks, f"{param}.content")]
    return _user_or_system(role, blocks, f"{param}.content")


def _assistant(blocks: list[dict[str, Any]], param: str) -> Message:
    parts: list[ContentPart] = []
    calls: list[ToolCall] = []
    sealed: list[tuple[str, str]] = []
    for j, b in enumerate(blocks):
        kind, where = b.get("type"), f"{param}[{j}]"
        if kind == "text":
            parts.append(_text(b, where))
        elif kind == "tool_use":
            calls.append(
                ToolCall(
                    id=f.string(f.require(b, "id", f"{where}.id"), f"{where}.id", allow_empty=False),
                    name=f.string(f.require(b, "name", f"{where}.name"), f"{where}.name", allow_empty=False),
                    arguments=orjson.dumps(f.obj(f.require(b, "input", f"{where}.input"), f"{where}.input")).decode(),
                )
            )
        elif kind == "thinking":
            text = f.string(f.require(b, "thinking", f"{where}.thinking"), f"{where}.thinking")
            signature = b.get("signature")
            if isinstance(signature, str) and signature:  # unsigned thinking cannot be verified: dropped
                sealed.append((text, signature))
        elif kind != "redacted_thinking" and not _server_block(kind):
            raise _bad_block(kind, where, "'text', 'tool_use', 'thinking', 'redacted_thinking'")
    return Message(role=Role.ASSISTANT, content=tuple(parts), tool_calls=tuple(calls), sealed_reasoning=tuple(sealed))


def _user_or_system(role: Role, blocks: list[dict[str, Any]], param: str) -> list[Message]:
    """Blocks in order; each `tool_result` is its own TOOL message, runs of other blocks one `role` message."""
    out: list[Message] = []
    run: list[ContentPart] = []
    for j, b in enumerate(blocks):
        kind, where = b.get("type"), f"{param}[{j}]"
        if kind == "tool_result" and role is Role.USER:
            if run:
                out.append(Message(role=role, content=tuple(run)))
                run = []
            out.append(_tool_result(b, where))
        elif kind in ("text", "image"):
            run.append(_part(b, where, images=role is Role.USER))
        elif kind == "document" and role is Role.USER:
            run.extend(_document(b, where))
        else:
            raise _bad_block(kind, where, "'text', 'image', 'document', 'tool_result'" if role is Role.USER else "'text'")
    if run or not out:
        out.append(Message(role=role, content=tuple(run)))
    return out


def _tool_result(b: dict[str, Any], where: str) -> Message:
    tool_use_id = f.string(f.require(b, "tool_use_id", f"{where}.tool_use_id"), f"{where}.tool_use_id", allow_empty=False)
    content = b.get("content")
    if content is None or isinstance(content, str):
        parts: tuple[ContentPart, ...] = (TextPart(text=content or ""),)
    else:
        items = f.array(content, f"{where}.content")
        parts = tuple(part for k, p in enumerate(items) for part in _result_part(f.obj(p, f"{where}.content[{k}]"), f"{where}.content[{k}]"))
    is_error = f.boolean(b["is_error"], f"{where}.is_error") if b.get("is_error") is not None else False
    return Message(role=Role.TOOL, content=parts, tool_call_id=tool_use_id, is_error=is_error)


def _result_part(b: dict[str, Any], where: str) -> tuple[ContentPart, ...]:
    return _document(b, where) if b.get("type") == "document" else (_part(b, where, images=True),)


def _document(b: dict[str, Any], where: str) -> tuple[ContentPart, ...]:
    """A `document` block: its file's text (ingest.parsers.file_inputs), named by its `title`; a `content`
    source's images after it."""
    at = f"{where}.source"
    source = f.obj(f.require(b, "source", at), at)
    name = f.string(b["title"], f"{where}.title") if b.get("title") is not None else ""
    kind = source.get("type")
    if kind == "base64":
        media_type = f.string(f.require(source, "media_type", f"{at}.media_type"), f"{at}.media_type")
        if media_type not in ("application/pdf", "text/plain"):
            raise invalid(f"Invalid value: {media_type!r}. Supported document media types: 'application/pdf', 'text/plain'.", f"{at}.media_type", "invalid_value")
        _, data = file_inputs.decode_data(f.string(f.require(source, "data", f"{at}.data"), f"{at}.data", allow_empty=False), f"{at}.data", where=where)
        return (file_inputs.text_part(data, name=name or ("document.pdf" if media_type == "application/pdf" else "document.txt"), media_type=media_type, where=where),)
    if kind == "text":
        text = f.string(f.require(source, "data", f"{at}.data"), f"{at}.data")
        return (file_inputs.text_part(text.encode(), name=name or "document.txt", media_type="text/plain", where=where),)
    if kind == "content":
        return _content_document(source.get("content"), name or "document.txt", at)
    if kind in ("url", "file"):
        raise invalid(
            f"Invalid '{where}': document sources of type {kind!r} are not supported (this server fetches nothing and keeps no "
            "Anthropic files); send the document as a 'base64' or 'text' source.",
            f"{at}.type",
            "invalid_value",
        )
    raise invalid(f"Invalid value: {kind!r}. Supported document source types: 'base64', 'text', 'content'.", f"{at}.type", "invalid_value")


def _content_document(content: Any, name: str, at: str) -> tuple[ContentPart, ...]:
    """A `content` source: a string, or text and image blocks (the text is the document, the images follow it)."""
    if isinstance(content, str):
        return (TextPart(text=file_inputs.render(name, content)),)
    texts: list[str] = []
    images: list[ContentPart] = []
    for k, raw in enumerate(f.array(content, f"{at}.content")):
        block = f.obj(raw, f"{at}.content[{k}]")
        if block.get("type") == "text":
            texts.append(_text(block, f"{at}.content[{k}]").text)
        else:
            images.append(_part(block, f"{at}.content[{k}]", images=True))
    return (TextPart(text=file_inputs.render(name, "\n".join(texts))), *images)


def _part(b: dict[str, Any], where: str, *, images: bool) -> ContentPart:
    kind = b.get("type")
    if kind == "text":
        return _text(b, where)
    if kind == "image" and images:
        return _image(b, where)
    raise _bad_block(kind, where, "'text', 'image'" if images else "'text'")


def _text(b: dict[str, Any], where: str) -> TextPart:
    return TextPart(text=f.string(f.require(b, "text", f"{where}.text"), f"{where}.text"))


def _image(b: dict[str, Any], where: str) -> ImagePart:
    source = f.obj(f.require(b, "source", f"{where}.source"), f"{where}.source")
    kind = source.get("type")
    if kind == "base64":
        media_type = f.string(f.require(source, "media_type", f"{where}.source.media_type"), f"{where}.source.media_type", allow_empty=False)
        data = f.string(f.require(source, "data", f"{where}.source.data"), f"{where}.source.data", allow_empty=False)
        return ImagePart(url=f"data:{media_type};base64,{data}", media_type=media_type)
    if kind == "url":
        return ImagePart(url=f.string(f.require(source, "url", f"{where}.source.url"), f"{where}.source.url", allow_empty=False))
    raise invalid(f"Invalid value: {kind!r}. Supported image source types: 'base64', 'url'.", f"{where}.source.type", "invalid_value")


def _bad_block(kind: Any, where: str, supported: str) -> Exception:
    return invalid(f"Invalid value: {kind!r}. Supported content block types here: {supported}.", f"{where}.type", "invalid_value")


def _server_block(kind: Any) -> bool:
    """A block of a tool Anthropic's servers run (`server_tool_use`, `web_search_tool_result`, ...)."""
    return isinstance(kind, str) and (kind in ("server_tool_use", "mcp_tool_use", "mcp_tool_result") or kind.endswith("_tool_result"))


def _tool(value: Any, param: str) -> ToolSpec | None:
    """A client tool (no `type`, or `custom`) → its spec; a typed server tool → None (accepted, not offered)."""
    t = f.obj(value, param)
    if t.get("type") not in (None, "custom"):
        f.string(t["type"], f"{param}.type", allow_empty=False)
        return None
    return ToolSpec(
        name=constraints.tool_name(f.require(t, "name", f"{param}.name"), f"{param}.name"),
        description=f.string(t.get("description") or "", f"{param}.description"),
        parameters_json=constraints.tool_parameters(f.obj(f.require(t, "input_schema", f"{param}.input_schema"), f"{param}.input_schema"), f"{param}.input_schema"),
    )


def _tool_choice(value: Any) -> tuple[str | None, bool]:
    """`tool_choice` → (IR choice, parallel_tool_calls); `disable_parallel_tool_use` clears the latter."""
    if value is None:
        return None, True
    choice = f.obj(value, "tool_choice")
    kind = f.string(f.require(choice, "type", "tool_choice.type"), "tool_choice.type")
    parallel = (
        not f.boolean(choice["disable_parallel_tool_use"], "tool_choice.disable_parallel_tool_use")
        if choice.get("disable_parallel_tool_use") is not None
        else True
    )
    if kind == "tool":
        return f"function:{f.string(f.require(choice, 'name', 'tool_choice.name'), 'tool_choice.name', allow_empty=False)}", parallel
    if kind not in TOOL_CHOICES:
        raise invalid(
            f"Invalid value: '{kind}'. Supported values are: 'auto', 'any', 'tool' and 'none'.", "tool_choice.type", "invalid_value"
        )
    return TOOL_CHOICES[kind], parallel


def _thinking(value: Any, output_config: Any) -> Thinking:
    """`thinking` and `output_config.effort` → the IR's Thinking: `enabled` with its `budget_tokens`,
    `adaptive` (the effort's budget, models.reasoning), `disabled`; `display: "omitted"` sends
    thinking blocks with their signature only."""
    effort = None
    if isinstance(output_config, dict) and output_config.get("effort") is not None:
        effort = f.string(output_config["effort"], "output_config.effort")
        if effort not in EFFORTS:
            raise invalid(f"Invalid value: '{effort}'. Supported values are: {_quoted(EFFORTS)}.", "output_config.effort", "invalid_value")
    if value is None:
        return Thinking(effort=effort)
    thinking = f.obj(value, "thinking")
    kind = f.string(f.require(thinking, "type", "thinking.type"), "thinking.type")
    if kind not in THINKING_TYPES:
        raise invalid(
            f"Invalid value: '{kind}'. Supported values are: 'enabled', 'disabled' and 'adaptive'.", "thinking.type", "invalid_value"
        )
    omitted = thinking.get("display") == "omitted"
    if kind == "disabled":
        return Thinking(enabled=False, effort=effort)
    budget = None
    if kind == "enabled":
        budget = f.integer(f.require(thinking, "budget_tokens", "thinking.budget_tokens"), "thinking.budget_tokens", lo=1, hi=f.MAX_TOKENS_CAP)
    return Thinking(enabled=True, budget_tokens=budget, effort=effort, omitted=omitted)


def _quoted(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


def _metadata(value: Any) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    user_id = f.obj(value, "metadata").get("user_id")
    return (("user_id", f.string(user_id, "metadata.user_id")),) if user_id is not None else ()
