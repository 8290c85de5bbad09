"""The request IR → an upstream's `/v1/chat/completions` body, and what such a body cannot say.

Owns: `chat_body()` (what a gateway worker, workers/gateway.py, sends: always `stream: true` with
`stream_options.include_usage`), `continue_body()` (the same, continuing a partial answer) and `check_expressible()`, which the API node calls before anything is
queued, so a request the upstream's chat API cannot express is refused in the client's own protocol
(an `ApiError` naming the parameter, rendered by ingest) rather than silently dropped.

What maps: messages (system / developer as `system`, text and image parts, assistant tool calls,
tool results), function tools and `tool_choice` (`auto` / `none` / `required` / a named function),
`parallel_tool_calls: false`, `response_format` (JSON schema, JSON object), temperature, top_p, seed,
max_tokens, stop, presence / frequency penalty, logit_bias, logprobs / top_logprobs, reasoning effort.
The `vllm` flavour (`--upstream-flavor`, the default: vLLM, SGLang, llama.cpp's servers and Metrale
itself read these) adds the extension fields top_k, min_p, repetition_penalty, min_tokens,
stop_token_ids and ignore_eos; the strict `openai` flavour refuses them instead.
What never maps (refused whatever the flavour): regex / choice / Lark constraints, custom (free-form)
tools, DRY and top-n-sigma sampling, prompt logprobs, returned token ids, an explicit reasoning budget,
and raw-prompt completions (`/v1/completions`: the gateway speaks chat only).
Earlier turns' reasoning is not sent (chat templates drop it from the prompt anyway).
Special tokens as text: an upstream renders the messages with its chat template and tokenizes the result
with special tokens recognised (vLLM, SGLang and llama.cpp all do), so a client string spelling
`<|im_end|>` would forge a turn there. A chat API has no way to say "this is literal text", so every
client string (message text, tool results, tool-call arguments, names, tool descriptions and schemas) has
each special-token string of the served model broken by a zero-width space after its first character
(`specials`, the pattern the gateway builds from its local tokenizer): the upstream tokenizes it as
ordinary text, the model reads nearly the same characters, and no marker is forged. (A model worker
does better, tokenizing client text with the specials split: models/prompt.py.)
Must not: do I/O, or know any protocol's wire format beyond the upstream chat body.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import orjson

from shared.errors import invalid
from shared.ir import ConstraintKind, ImagePart, Message, Protocol, Request, Role, SamplingParams, TextPart, ToolKind

FLAVORS = ("vllm", "openai")
_EXTENSIONS = ("top_k", "min_p", "repetition_penalty")  # vLLM's sampling extension fields, sent when set
# Where a refused IR field came from, per protocol, when the client's name differs from the IR's.
_PARAM_NAMES: dict[Protocol, dict[str, str]] = {
    Protocol.ANTHROPIC_MESSAGES: {"stop": "stop_sequences"},
    Protocol.OPENAI_RESPONSES: {"max_tokens": "max_output_tokens", "top_logprobs": "top_logprobs"},
}


def _param(request: Request, name: str) -> str:
    return _PARAM_NAMES.get(request.protocol, {}).get(name, name)


def check_expressible(request: Request, *, flavor: str = "vllm") -> None:
    """Raise an `ApiError` naming the parameter when the upstream's chat API cannot express it."""
    if request.completion is not None:
        raise invalid("This server's model is served through an upstream chat API; /v1/completions is not available.", "prompt", "unsupported_parameter")
    for spec in request.tools:
        if spec.kind is ToolKind.CUSTOM:
            raise invalid(f"Custom tools cannot be sent to this server's upstream; '{spec.name}' must be a function tool.", "tools", "unsupported_parameter")
    constraint = request.constraint
    if constraint is not None and constraint.kind not in (ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT):
        raise invalid(f"A {constraint.kind.value} constraint cannot be sent to this server's upstream.", constraint.param or "response_format", "unsupported_parameter")
    if request.thinking.budget_tokens is not None:
        raise invalid("An explicit reasoning budget cannot be sent to this server's upstream.", "thinking.budget_tokens", "unsupported_parameter")
    if request.return_token_ids:
        raise invalid("Token ids cannot be returned by this server's upstream.", "return_token_ids", "unsupported_parameter")
    if request.max_tool_calls is not None:
        raise invalid("A cap on tool calls cannot be sent to this server's upstream.", "max_tool_calls", "unsupported_parameter")
    _check_sampling(request, request.sampling, flavor)


def _check_sampling(request: Request, params: SamplingParams, flavor: str) -> None:
    defaults = SamplingParams()
    never = {
        "dry_multiplier": params.dry_multiplier != defaults.dry_multiplier,
        "top_n_sigma": params.top_n_sigma is not None,
        "prompt_logprobs": params.prompt_logprobs is not None,
    }
    extensions = {
        **{name: getattr(params, name) is not None for name in _EXTENSIONS},
        "min_tokens": params.min_tokens != 0,
        "stop_token_ids": bool(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
    }
    for name, used in never.items():
        if used:
            raise invalid(f"'{_param(request, name)}' cannot be sent to this server's upstream.", _param(request, name), "unsupported_parameter")
    if flavor == "openai":
        for name, used in extensions.items():
            if used:
                raise invalid(f"'{_param(request, name)}' is not part of this server's upstream API.", _param(request, name), "unsupported_parameter")


ZWSP = "\u200b"  # what breaks a special-token string in client text (see the module docstring)


def escape_specials(text: str, specials: re.Pattern[str] | None) -> str:
    """`text` with every match of `specials` broken by a zero-width space after its first character."""
    if specials is None or not text:
        return text
    return specials.sub(lambda m: m.group(0)[0] + ZWSP + m.group(0)[1:], text)


def chat_body(request: Request, *, model: str, flavor: str = "vllm", specials: re.Pattern[str] | None = None) -> dict[str, Any]:
    """The upstream body for `request` (checked with `check_expressible` at the API node); client
    strings have the special-token strings `specials` matches escaped (`escape_specials`)."""
    esc = partial(escape_specials, specials=specials)
    body: dict[str, Any] = {
        "model": model,
        "messages": [_message(m, esc) for m in request.messages],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.tools:
        body["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": esc(t.description), "parameters": orjson.loads(esc(t.parameters_json or "{}"))}}
            for t in request.tools
        ]
        if request.tool_choice:
            name = request.tool_choice.removeprefix("function:")
            body["tool_choice"] = {"type": "function", "function": {"name": name}} if request.tool_choice.startswith("function:") else request.tool_choice
        if not request.parallel_tool_calls:
            body["parallel_tool_calls"] = False
    constraint = request.constraint
    if constraint is not None and constraint.kind is ConstraintKind.JSON_SCHEMA:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": orjson.loads(constraint.text), "strict": True}}
    elif constraint is not None and constraint.kind is ConstraintKind.JSON_OBJECT:
        body["response_format"] = {"type": "json_object"}
    if request.thinking.effort:
        body["reasoning_effort"] = request.thinking.effort
    body.update(_sampling(request.sampling, flavor))
    return body


def continue_body(body: dict[str, Any], text: str, *, max_tokens: int | None) -> dict[str, Any]:
    """`body` continued after `text` (what the request already streamed): the text as an open assistant
    message (vLLM's `continue_final_message`, which SGLang and Metrale take too), `max_tokens` what is left."""
    out = {**body, "messages": [*body["messages"], {"role": "assistant", "content": text}], "continue_final_message": True, "add_generation_prompt": False}
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    return out


def _sampling(params: SamplingParams, flavor: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("temperature", "top_p", "seed", "max_tokens"):
        if getattr(params, name) is not None:
            out[name] = getattr(params, name)
    if params.stop:
        out["stop"] = list(params.stop)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(params, name):
            out[name] = getattr(params, name)
    if params.logit_bias:
        out["logit_bias"] = {str(token): bias for token, bias in params.logit_bias}
    if params.logprobs:
        out["logprobs"] = True
        if params.top_logprobs:
            out["top_logprobs"] = params.top_logprobs
    if flavor == "vllm":
        out.update(_extensions(params))
    return out


def _extensions(params: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(params, name) for name in _EXTENSIONS if getattr(params, name) is not None}
    if params.min_tokens:
        out["min_tokens"] = params.min_tokens
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        out["ignore_eos"] = True
    return out


def _message(message: Message, esc: Callable[[str], str]) -> dict[str, Any]:
    role = "system" if message.role is Role.DEVELOPER else message.role.value
    out: dict[str, Any] = {"role": role}
    images = [p for p in message.content if isinstance(p, ImagePart)]
    if images:
        out["content"] = [
            {"type": "text", "text": esc(p.text)} if isinstance(p, TextPart) else {"type": "image_url", "image_url": {"url": p.url}} for p in message.content
        ]
    else:
        out["content"] = esc(message.text)
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": esc(c.arguments)}} for c in message.tool_calls]
        if not message.text:
            out["content"] = None
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None and message.role is not Role.TOOL:
        out["name"] = esc(message.name)
    return out
