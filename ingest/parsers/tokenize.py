"""vLLM's `POST /tokenize` and `POST /detokenize`: body → answer through the prompt renderer.

Tokenize takes `{"prompt", "add_special_tokens": true}` (raw text, tokenized as `/v1/completions`
tokenizes it) or `{"messages", "add_generation_prompt": true, "continue_final_message": false, "add_special_tokens": false, "tools"}`
(rendered through the chat template exactly as `/v1/chat/completions` renders them, messages and
tools read by the chat parser), and answers `{"count", "max_model_len", "tokens", "token_strs"}`
(`token_strs` null unless `return_token_strs`). Detokenize takes `{"tokens"}` and answers `{"prompt"}`.
`model` is optional, as in vLLM. Bad input raises `ApiError` naming the parameter.
Must not: reach Redis or a worker (nothing here is queued).
"""

from __future__ import annotations

from typing import Any

from ingest.parsers import fields as f
from ingest.parsers.openai_chat import MAX_MESSAGES, MAX_TOOLS, _message, _tool, prompt_mode
from models.prompt import PromptRenderer
from shared.errors import invalid

MAX_TOKENS = 1_000_000


def _body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", None, "invalid_body")
    if body.get("model") is not None:
        f.string(body["model"], "model")
    return body


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    return f.boolean(body[name], name) if body.get(name) is not None else default


def tokenize(renderer: PromptRenderer, body: Any) -> dict[str, Any]:
    body = _body(body)
    if body.get("messages") is not None:
        messages = tuple(_message(m, i) for i, m in enumerate(f.array(body["messages"], "messages", max_items=MAX_MESSAGES, allow_empty=False)))
        tools = tuple(_tool(t, i) for i, t in enumerate(f.array(body.get("tools") or [], "tools", max_items=MAX_TOOLS)))
        add_generation_prompt, continue_final_message = prompt_mode(body, messages)
        ids = renderer.render_messages(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            add_special_tokens=_flag(body, "add_special_tokens", False),
        )
    elif body.get("prompt") is not None:
        ids = renderer.tokenize_text(f.string(body["prompt"], "prompt"), add_special_tokens=_flag(body, "add_special_tokens", True))
    else:
        raise invalid("Missing required parameter: 'prompt' (or 'messages').", "prompt", "missing_required_parameter")
    strs = renderer.token_strs(ids) if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": renderer.info.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(renderer: PromptRenderer, body: Any) -> dict[str, Any]:
    body = _body(body)
    tokens = [f.integer(t, "tokens", lo=0) for t in f.array(f.require(body, "tokens"), "tokens", max_items=MAX_TOKENS)]
    return {"prompt": renderer.decode(renderer.check_ids(tokens, "tokens"))}
