"""OpenAI Chat Completions body → `Request` IR (pure; raises `ApiError` naming the bad parameter).

Unknown fields are ignored, as OpenAI does. `user` is accepted and dropped. A `file` content part (its
`file.file_data`, or a `file.file_id` the API node resolved into `file_data` before parsing) becomes the
file's text under a `<file name="...">` header (ingest.parsers.file_inputs).
"""

from __future__ import annotations

from typing import Any

from ingest.parsers import constraints, file_inputs
from ingest.parsers import fields as f
from models.reasoning import EFFORT_BUDGETS
from shared.errors import invalid
from shared.ir import ContentPart, ImagePart, Message, Protocol, Request, Role, SamplingParams, TextPart, Thinking, ToolCall, ToolSpec

ROLES = {r.value: r for r in Role}
MAX_MESSAGES = 2048
MAX_TOOLS = 128
MAX_N = 16
MAX_LOGIT_BIAS = 300
MAX_METADATA = 16


def parse(body: Any, *, request_id: str, created: float) -> Request:
    body = f.obj(body, "body") if isinstance(body, dict) else _not_object(body)
    model = f.string(f.require(body, "model"), "model", allow_empty=False)
    file_inputs.check_total(body)
    messages = tuple(_message(m, i) for i, m in enumerate(f.array(f.require(body, "messages"), "messages", max_items=MAX_MESSAGES, allow_empty=False)))
    stream = f.boolean(body["stream"], "stream") if body.get("stream") is not None else False
    include_usage = False
    if body.get("stream_options") is not None:
        if not stream:
            raise invalid("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
        opts = f.obj(body["stream_options"], "stream_options")
        if opts.get("include_usage") is not None:
            include_usage = f.boolean(opts["include_usage"], "stream_options.include_usage")
    tools = tuple(_tool(t, i) for i, t in enumerate(f.array(body.get("tools") or [], "tools", max_items=MAX_TOOLS)))
    tool_choice = _tool_choice(body.get("tool_choice"))
    param = "tool_choice.function.name" if tool_choice and tool_choice.startswith("function:") else "tool_choice"
    constraints.check_tool_choice(tools, tool_choice, param)
    return Request(
        id=request_id,
        protocol=Protocol.OPENAI_CHAT,
        model=model,
        messages=messages,
        sampling=sampling(body),
        stream=stream,
        include_usage=include_usage,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=f.boolean(body["parallel_tool_calls"], "parallel_tool_calls") if body.get("parallel_tool_calls") is not None else True,
        constraint=constraints.one_of(body, constraints.chat_response_format(body.get("response_format"))),
        thinking=_thinking(body),
        return_token_ids=f.boolean(body["return_token_ids"], "return_token_ids") if body.get("return_token_ids") is not None else False,
        add_generation_prompt=(mode := prompt_mode(body, messages))[0],
        continue_final_message=mode[1],
        priority=f.integer(body["priority"], "priority", lo=-(2**31), hi=2**31) if body.get("priority") is not None else 0,
        created=created,
        metadata=metadata(body.get("metadata")),
        endpoint="/v1/chat/completions",
    )


def prompt_mode(body: dict[str, Any], messages: tuple[Message, ...]) -> tuple[bool, bool]:
    """vLLM's `add_generation_prompt` (default true) and `continue_final_message` (default false): the
    prompt ends with the final assistant message left open, and the output continues its text. Both true is
    refused, as vLLM does; continuing needs an assistant message last."""
    add = f.boolean(body["add_generation_prompt"], "add_generation_prompt") if body.get("add_generation_prompt") is not None else True
    extend = f.boolean(body["continue_final_message"], "continue_final_message") if body.get("continue_final_message") is not None else False
    if extend and add:
        raise invalid("Cannot set both 'continue_final_message' and 'add_generation_prompt' to true.", "continue_final_message")
    if extend and messages[-1].role is not Role.ASSISTANT:
        raise invalid("'continue_final_message' needs the last message to be from the assistant.", "continue_final_message")
    return add, extend


def reasoning_effort(value: Any, param: str) -> str | None:
    """A reasoning effort level (`none` … `xhigh`, models.reasoning's table), or None when not given."""
    if value is None:
        return None
    effort = f.string(value, param)
    if effort not in EFFORT_BUDGETS:
        supported = ", ".join(f"'{e}'" for e in EFFORT_BUDGETS)
        raise invalid(f"Invalid value: {effort!r}. Supported values are: {supported}.", param, "invalid_value")
    return effort


def _thinking(body: dict[str, Any]) -> Thinking:
    """`reasoning_effort` (`none` turns reasoning off), and vLLM's `chat_template_kwargs.enable_thinking`."""
    effort = reasoning_effort(body.get("reasoning_effort"), "reasoning_effort")
    enabled = False if effort == "none" else None
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("enable_thinking") is not None:
        enabled = f.boolean(kwargs["enable_thinking"], "chat_template_kwargs.enable_thinking")
    return Thinking(enabled=enabled, effort=effort)


def _not_object(body: Any) -> Any:
    raise invalid("The request body must be a JSON object.", None, "invalid_body")


def sampling(body: dict[str, Any]) -> SamplingParams:
    """Sampling fields shared by the OpenAI surfaces (chat uses all of them)."""
    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            max_tokens = f.integer(body[name], name, lo=1, hi=f.MAX_TOKENS_CAP)
            break
    n = f.integer(body["n"], "n", lo=1, hi=MAX_N) if body.get("n") is not None else 1
    logprobs = f.boolean(body["logprobs"], "logprobs") if body.get("logprobs") is not None else False
    top_logprobs = f.integer(body["top_logprobs"], "top_logprobs", lo=0, hi=20) if body.get("top_logprobs") is not None else 0
    if top_logprobs and not logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    return SamplingParams(
        temperature=_opt_number(body, "temperature", 0.0, 2.0),
        top_p=_opt_number(body, "top_p", 0.0, 1.0),
        top_k=f.integer(body["top_k"], "top_k", lo=-1, hi=1_000_000) if body.get("top_k") is not None else None,
        min_p=_opt_number(body, "min_p", 0.0, 1.0),
        top_n_sigma=_opt_number(body, "top_n_sigma", 0.0, 100.0),
        dry_multiplier=_opt_number(body, "dry_multiplier", 0.0, 100.0) or 0.0,
        dry_base=_opt_number(body, "dry_base", 1.0, 10.0) or 1.75,
        dry_allowed_length=f.integer(body["dry_allowed_length"], "dry_allowed_length", lo=1, hi=1000) if body.get("dry_allowed_length") is not None else 2,
        seed=f.integer(body["seed"], "seed", lo=-(2**63), hi=2**64 - 1) if body.get("seed") is not None else None,
        max_tokens=max_tokens,
        min_tokens=f.integer(body["min_tokens"], "min_tokens", lo=0, hi=f.MAX_TOKENS_CAP) if body.get("min_tokens") is not None else 0,
        stop=f.stop_list(body.get("stop"), "stop"),
        stop_token_ids=tuple(f.integer(t, "stop_token_ids", lo=0) for t in f.array(body.get("stop_token_ids") or [], "stop_token_ids", max_items=64)),
        presence_penalty=_opt_number(body, "presence_penalty", -2.0, 2.0) or 0.0,
        frequency_penalty=_opt_number(body, "frequency_penalty", -2.0, 2.0) or 0.0,
        repetition_penalty=_opt_number(body, "repetition_penalty", 0.01, 10.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=n,
        ignore_eos=f.boolean(body["ignore_eos"], "ignore_eos") if body.get("ignore_eos") is not None else False,
        speculative=f.boolean(body["speculative"], "speculative") if body.get("speculative") is not None else True,
    )


def _opt_number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    return f.number(body[name], name, lo=lo, hi=hi) if body.get(name) is not None else None


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    bias = f.obj(value, "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise invalid(f"Invalid 'logit_bias': at most {MAX_LOGIT_BIAS} entries, got {len(bias)}.", "logit_bias", "too_many_entries")
    out = []
    for key, b in bias.items():
        if not str(key).lstrip("-").isdigit():
            raise invalid(f"Invalid 'logit_bias': key {key!r} is not a token id.", "logit_bias")
        out.append((int(key), f.number(b, f"logit_bias.{key}", lo=-100, hi=100)))
    return tuple(out)


def metadata(value: Any) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    meta = f.obj(value, "metadata")
    if len(meta) > MAX_METADATA:
        raise invalid(f"Invalid 'metadata': at most {MAX_METADATA} entries, got {len(meta)}.", "metadata", "too_many_entries")
    return tuple((str(k), f.string(v, f"metadata.{k}")) for k, v in meta.items())


def _content(value: Any, param: str) -> tuple[ContentPart, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (TextPart(text=value),)
    parts: list[ContentPart] = []
    for i, part in enumerate(f.array(value, param)):
        p = f.obj(part, f"{param}[{i}]")
        kind = p.get("type")
        if kind == "text":
            parts.append(TextPart(text=f.string(f.require(p, "text", f"{param}[{i}].text"), f"{param}[{i}].text")))
        elif kind == "image_url":
            image = f.obj(f.require(p, "image_url", f"{param}[{i}].image_url"), f"{param}[{i}].image_url")
            parts.append(ImagePart(url=f.string(f.require(image, "url", f"{param}[{i}].image_url.url"), f"{param}[{i}].image_url.url")))
        elif kind == "file":
            where = f"{param}[{i}]"
            parts.append(file_inputs.openai_file(f.obj(f.require(p, "file", f"{where}.file"), f"{where}.file"), where, at=f"{where}.file"))
        else:
            raise invalid(f"Invalid value: {kind!r}. Supported content part types: 'text', 'image_url', 'file'.", f"{param}[{i}].type")
    return tuple(parts)


def _message(value: Any, i: int) -> Message:
    param = f"messages[{i}]"
    m = f.obj(value, param)
    role_name = f.string(f.require(m, "role", f"{param}.role"), f"{param}.role")
    role = ROLES.get(role_name)
    if role is None:
        raise invalid(f"Invalid value: '{role_name}'. Supported values are: 'system', 'developer', 'user', 'assistant', and 'tool'.", f"{param}.role", "invalid_value")
    tool_calls: tuple[ToolCall, ...] = ()
    if role is Role.ASSISTANT and m.get("tool_calls"):
        tool_calls = tuple(_tool_call(c, f"{param}.tool_calls[{j}]") for j, c in enumerate(f.array(m["tool_calls"], f"{param}.tool_calls")))
    if "content" not in m and not tool_calls:
        raise invalid(f"Missing required parameter: '{param}.content'.", f"{param}.content", "missing_required_parameter")
    tool_call_id = None
    if role is Role.TOOL:
        tool_call_id = f.string(f.require(m, "tool_call_id", f"{param}.tool_call_id"), f"{param}.tool_call_id")
    return Message(
        role=role,
        content=_content(m.get("content"), f"{param}.content"),
        name=f.string(m["name"], f"{param}.name") if m.get("name") is not None else None,
        tool_calls=tool_calls,
        tool_call_id=tool_call_id,
        reasoning=m.get("reasoning_content") if isinstance(m.get("reasoning_content"), str) else None,
    )


def _tool_call(value: Any, param: str) -> ToolCall:
    c = f.obj(value, param)
    fn = f.obj(f.require(c, "function", f"{param}.function"), f"{param}.function")
    return ToolCall(
        id=f.string(f.require(c, "id", f"{param}.id"), f"{param}.id"),
        name=f.string(f.require(fn, "name", f"{param}.function.name"), f"{param}.function.name"),
        arguments=f.string(fn.get("arguments", "{}"), f"{param}.function.arguments"),
    )


def _tool(value: Any, i: int) -> ToolSpec:
    param = f"tools[{i}]"
    t = f.obj(value, param)
    if t.get("type") != "function":
        raise invalid(f"Invalid value: {t.get('type')!r}. Supported values are: 'function'.", f"{param}.type")
    fn = f.obj(f.require(t, "function", f"{param}.function"), f"{param}.function")
    return ToolSpec(
        name=constraints.tool_name(f.require(fn, "name", f"{param}.function.name"), f"{param}.function.name"),
        description=f.string(fn.get("description") or "", f"{param}.function.description"),
        parameters_json=constraints.tool_parameters(fn.get("parameters"), f"{param}.function.parameters"),
    )


def _tool_choice(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise invalid(f"Invalid value: '{value}'. Supported values are: 'auto', 'none', 'required'.", "tool_choice")
        return value
    choice = f.obj(value, "tool_choice")
    fn = f.obj(f.require(choice, "function", "tool_choice.function"), "tool_choice.function")
    name = f.string(f.require(fn, "name", "tool_choice.function.name"), "tool_choice.function.name")
    return f"function:{name}"
