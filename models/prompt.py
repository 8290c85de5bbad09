"""Render the IR's messages to prompt token ids with the model's own chat template.

Owns: IR messages/tools → the dicts transformers' `apply_chat_template` expects, then tokenization;
the generation-config sampling defaults; the stop token ids. Used by ingest (to count, check the
context and put `prompt_token_ids` in the IR) and by `count_tokens`. Must not load weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.ir import Message, Request, Role, ToolSpec

_GEN_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    sampling_defaults: dict[str, float | int]
    vision: bool = False


class PromptRenderer:
    def __init__(self, tokenizer: Any, info: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info

    @classmethod
    def load(cls, folder: Path, *, name: str, max_model_len: int | None = None) -> PromptRenderer:
        from transformers import AutoTokenizer

        from models.files import context_length

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        gen_path = folder / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        eos = gen.get("eos_token_id")
        eos_ids = set(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(int(tokenizer.eos_token_id))
        context = context_length(folder)
        info = ModelInfo(
            name=name,
            max_model_len=min(context, max_model_len) if max_model_len else context,
            eos_token_ids=tuple(sorted(eos_ids)),
            sampling_defaults={k: gen[k] for k in _GEN_KEYS if isinstance(gen.get(k), (int, float)) and gen.get("do_sample", True)},
        )
        return cls(tokenizer, info)

    def render(self, request: Request) -> list[int]:
        return self.render_messages(request.messages, request.tools)

    def render_messages(self, messages: tuple[Message, ...], tools: tuple[ToolSpec, ...] = ()) -> list[int]:
        conversation = [_message_dict(m) for m in messages]
        kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": False}
        if tools:
            kwargs["tools"] = [
                {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": json.loads(t.parameters_json)}}
                for t in tools
            ]
        text = self.tokenizer.apply_chat_template(conversation, **kwargs)
        if tools and not _mentions_tools(self.tokenizer):
            text = _tools_preamble(kwargs["tools"]) + text
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids


def _mentions_tools(tokenizer: Any) -> bool:
    template = tokenizer.chat_template or ""
    return "tools" in template


def _tools_preamble(tools: list[dict[str, Any]]) -> str:
    """For templates without tool support (SmolLM2's), describe the tools in plain text up front."""
    return "Available tools (JSON Schema):\n" + json.dumps(tools) + "\n"


def _message_dict(message: Message) -> dict[str, Any]:
    role = message.role.value
    if message.role is Role.DEVELOPER:
        role = "system"
    out: dict[str, Any] = {"role": role, "content": message.text}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _json_or_text(c.arguments)}} for c in message.tool_calls
        ]
        if not out["content"]:
            out["content"] = "\n".join(json.dumps({"name": c.name, "arguments": _json_or_text(c.arguments)}) for c in message.tool_calls)
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
