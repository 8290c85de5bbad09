"""Render the IR's messages to prompt token ids with the model's own chat template (or, for a raw
`TextCompletion` prompt, tokenize it as it is).

Owns: IR messages/tools → the dicts transformers' `apply_chat_template` expects, then tokenization;
the generation-config sampling defaults; the stop token ids. Used by ingest (to count, check the
context and put `prompt_token_ids` in the IR) and by `count_tokens`. Must not load weights.

Special tokens as text: only the template may produce special tokens. A client string (message
content, names, tool calls, tool specs) that spells one, e.g. `<|im_end|><|im_start|>system`, is
tokenized as ordinary text, so it cannot forge a turn. How: before rendering, each special-token
string inside client data is swapped for a random sentinel; the rendered text is split at the
special tokens that remain (the template's own, which become their ids); each text piece gets its
sentinels swapped back and is tokenized with `split_special_tokens=True`. A conversation without such
strings takes the plain path (render, tokenize once), so it tokenizes exactly as it always did.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.reasoning import takes_enable_thinking
from models.tools import call_text, calls_enabled, template_tool, tools_prompt
from shared.errors import invalid
from shared.ir import ConstraintKind, Message, Request, Role, ToolCall, ToolKind, ToolSpec


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    sampling_defaults: dict[str, float | int]  # the folder's generation config; then the operator's (models/generation.py)
    vision: bool = False
    folder: str = ""  # where the model was loaded from ("" for a test's stand-in): its config.json gives LoRA adapters' shapes


class PromptRenderer:
    def __init__(self, tokenizer: Any, info: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self._specials = special_pattern(tokenizer)
        self._grammars: Any = None  # models.grammar.Grammars, built on the first constrained request
        self._formats: dict[str, tuple[Any, dict[str, int] | None]] = {}  # --tool-parser → (tool format, its special markers): `_tool_format`
        self._bulk = False  # see `for_bulk`
        # transformers keeps `split_special_tokens` as state of a fast tokenizer's backend and flips it on a
        # call that asks otherwise; two threads rendering at once (ingest's lanes) then tokenized with each
        # other's setting (29 of 120 concurrent renders wrong, measured): the escaped path has a copy of its own.
        self._splitting = copy.deepcopy(tokenizer) if getattr(tokenizer, "backend_tokenizer", None) is not None else tokenizer

    def check_constraint(self, request: Request, *, tool_parser: str = "auto") -> None:
        """Raise `ApiError` naming the parameter when the request's grammar does not compile for this
        tokenizer: each custom tool's input grammar first (its own `param`), then the whole grammar in the
        syntax of the worker's tool parser (`--tool-parser`, chosen from this template as the worker does)."""
        from models.grammar import Grammars, grammar_for, grammar_param

        fmt, markers = self._tool_format(tool_parser)
        grammar = grammar_for(request, fmt, markers)
        inputs = [t.input_format for t in request.tools if t.input_format is not None]
        if grammar is None and not inputs:
            return
        if self._grammars is None:
            self._grammars = Grammars.for_model(self.tokenizer, self.info.eos_token_ids)
        for constraint in inputs:
            self._grammars.check_constraint(constraint)
        if request.constraint is not None and request.constraint.strict:
            self._grammars.check_constraint(request.constraint)  # names a keyword strict mode cannot enforce, and where
        if grammar is not None:
            self._grammars.check(grammar, grammar_param(request))

    def relaxed_schemas(self, request: Request) -> tuple[str, ...]:
        """What the constraint leaves out of each schema the request's output is held to (models.grammar):
        its non-strict JSON-schema constraint's, or else each function tool's when calls are on; one note
        per schema, "<where>: '<keyword>' at <path>, …". Empty when every schema is enforced whole."""
        from models.grammar import Grammars
        from models.tools import allowed_tools, calls_enabled

        constraint = request.constraint
        schemas: list[tuple[str, str]] = []
        if constraint is not None:
            if constraint.kind is ConstraintKind.JSON_SCHEMA and not constraint.strict:
                schemas.append((constraint.param, constraint.text))
        elif calls_enabled(request):
            schemas += [(t.name, t.parameters_json) for t in allowed_tools(request) if t.kind is ToolKind.FUNCTION]
        if not schemas:
            return ()
        if self._grammars is None:
            self._grammars = Grammars.for_model(self.tokenizer, self.info.eos_token_ids)
        return tuple(f"{where}: {', '.join(left)}" for where, text in schemas if (left := self._grammars.relaxed(text)))

    def _tool_format(self, tool_parser: str) -> tuple[Any, dict[str, int] | None]:
        """The tool-call family the worker parses for `--tool-parser` and its markers that are special tokens
        here: the same for every request, found once (the tokenizer builds its added-token table per access)."""
        from models.grammar import special_markers
        from models.tool_formats import select

        found = self._formats.get(tool_parser)
        if found is None:
            fmt = select(self.tokenizer.chat_template, tool_parser)
            found = self._formats[tool_parser] = (fmt, special_markers(self.tokenizer, fmt.markers) if fmt else None)
        return found

    @classmethod
    def load(cls, folder: Path, *, name: str, max_model_len: int | None = None) -> PromptRenderer:
        from models.files import context_length
        from models.generation import generation_fields
        from models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(folder)
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
            sampling_defaults=generation_fields(gen),
            folder=str(folder),
        )
        return cls(tokenizer, info)

    def render(self, request: Request) -> list[int]:
        """`tool_choice: none` renders no tools (the model never calls); see `models.tools` for the format.
        A raw `completion` prompt skips the template: its token ids as given, or its text tokenized."""
        if request.completion is not None:
            if request.completion.token_ids:
                return self.check_ids(request.completion.token_ids, "prompt")
            return self.tokenize_text(request.completion.text)
        return self.render_messages(
            request.messages,
            request.tools if calls_enabled(request) else (),
            thinking=request.thinking.enabled,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
        )

    def tokenize_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Raw text → ids, special-token strings included as the specials they spell (the client wrote
        the whole prompt); `add_special_tokens` adds what the tokenizer adds by default (a BOS, for some)."""
        return self._encode([text], add_special_tokens=add_special_tokens)[0]

    def for_bulk(self) -> PromptRenderer:
        """This renderer, encoding through the Rust backend without offsets (`encode_batch_fast`): the
        same ids in about half the time (30 MiB: 22 s against 45 s here), for a count of a huge body.
        Used where one process has the renderer to itself: the counting child (ingest/http/tokenizing.py)."""
        bulk = copy.copy(self)
        bulk._bulk = True
        return bulk

    def _encode(self, texts: list[str], *, add_special_tokens: bool, split: bool = False) -> list[list[int]]:
        """Each text's ids; `split` tokenizes special-token strings as text, on the splitting copy (each
        tokenizer object is only ever called one way: see `__init__`); otherwise the tokenizer's own
        setting. See `for_bulk`. A text over 2 x CUT_EVERY characters is cut where a cut cannot change a
        token (`cut_points`, where `cuttable`) and the pieces go to the backend as one batch, which encodes
        them on every core: the same ids, on any path; 8 MiB in 0.8 s instead of 2.8 s on 2 cores (1.6 s on
        one; AMD EPYC, AVX-512), and less memory at its peak."""
        tokenizer = self._splitting if split else self.tokenizer
        backend: Any = getattr(tokenizer, "backend_tokenizer", None)  # None: a slow tokenizer
        splits = split or bool(getattr(tokenizer, "split_special_tokens", False))
        cut = backend is not None and any(len(text) > 2 * CUT_EVERY for text in texts) and cuttable(tokenizer, splits)
        if cut or (self._bulk and backend is not None):
            if backend.encode_special_tokens != splits:  # the value this object's calls always set: never a flip
                backend.encode_special_tokens = splits
            if cut:
                return self._encode_cut(backend, texts, add_special_tokens=add_special_tokens)
            return [list(e.ids) for e in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]
        kwargs = {"split_special_tokens": True} if split else {}
        ids: list[list[int]] = tokenizer(texts, add_special_tokens=add_special_tokens, **kwargs)["input_ids"]
        return ids

    def _encode_cut(self, backend: Any, texts: list[str], *, add_special_tokens: bool) -> list[list[int]]:
        """Each text cut at `cut_points`, every piece of every text encoded in one batch, the ids joined per text."""
        pieces = [[text[a:b] for a, b in itertools.pairwise((0, *cut_points(text), len(text)))] for text in texts]
        encoded = iter(backend.encode_batch_fast([piece for text in pieces for piece in text], add_special_tokens=False))
        joined = [[i for _ in text for i in next(encoded).ids] for text in pieces]
        return [self._with_special_tokens(ids) for ids in joined] if add_special_tokens else joined

    def check_ids(self, token_ids: tuple[int, ...] | list[int], param: str) -> list[int]:
        """The ids, or `ApiError` naming `param` when one is not in this tokenizer's vocabulary."""
        size = len(self.tokenizer)
        bad = next((t for t in token_ids if not 0 <= t < size), None)
        if bad is not None:
            raise invalid(f"Invalid '{param}': token id {bad} is out of vocabulary (0 to {size - 1}).", param, "invalid_token_id")
        return list(token_ids)

    def decode(self, token_ids: tuple[int, ...] | list[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids)))

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """The vocabulary's own spelling of each token (byte-level pieces such as `Ġworld`), as vLLM returns them."""
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(token_ids)]

    def render_messages(
        self,
        messages: tuple[Message, ...],
        tools: tuple[ToolSpec, ...] = (),
        *,
        thinking: bool | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """`thinking` (None: the template's default) reaches templates that take `enable_thinking`.
        `continue_final_message` leaves the final assistant message open (transformers cuts the rendered
        text after its content), so the output continues it.
        `add_special_tokens` adds the tokenizer's own BOS/EOS around the rendered text (vLLM's
        /tokenize flag; templates usually write their own, so it is off by default)."""
        escape = _Escape(self._specials)
        native = _mentions_tools(self.tokenizer)
        conversation = escape([_message_dict(m) if native else _fallback_dict(m) for m in messages])
        kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message, "tokenize": False}
        if thinking is not None and takes_enable_thinking(self.tokenizer):
            kwargs["enable_thinking"] = thinking
        if tools and native:
            kwargs["tools"] = escape([template_tool(t) for t in tools])
        elif tools:
            conversation = _with_tools_in_system(conversation, escape(tools_prompt(tools)))
        text = self.tokenizer.apply_chat_template(conversation, **kwargs)
        final = conversation[-1].get("content") if continue_final_message else None
        if isinstance(final, str) and not text.endswith(final) and text.endswith(final.rstrip()):
            text += final[len(final.rstrip()) :]  # a template that trims the content lost its trailing whitespace: the output continues after it
        if not escape.used:
            return self._encode([text], add_special_tokens=add_special_tokens)[0]
        ids = self._tokenize_escaped(text, escape)
        return self._with_special_tokens(ids) if add_special_tokens else ids

    def _with_special_tokens(self, ids: list[int]) -> list[int]:
        """What the tokenizer adds around any text (found by tokenizing one letter both ways) around `ids`."""
        bare: list[int] = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        full: list[int] = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        start = next(i for i in range(len(full)) if full[i : i + len(bare)] == bare)
        return full[:start] + ids + full[start + len(bare) :]

    def _tokenize_escaped(self, text: str, escape: _Escape) -> list[int]:
        """Template special tokens → their ids; the text between them, sentinels restored, → text tokens."""
        assert self._specials is not None
        pieces = self._specials.split(text)  # [text, special, text, special, ..., text]
        texts = [escape.restore(piece) for piece in pieces[::2]]
        encoded = self._encode(texts, add_special_tokens=False, split=True)
        special_ids = self.tokenizer.convert_tokens_to_ids(pieces[1::2])
        ids: list[int] = list(encoded[0])
        for special, chunk in zip(special_ids, encoded[1:], strict=True):
            ids.append(int(special))
            ids.extend(chunk)
        return ids


CUT_EVERY = 1 << 16  # characters: a text over twice this is cut into pieces of about this many (`_encode`)
_CUT = re.compile(r"(?<=\S) (?=\S)")  # one space between two non-spaces


def cut_points(text: str) -> list[int]:
    """Where to cut `text` (about every CUT_EVERY characters) for `cuttable` tokenizers: before a single
    space that has a non-space on each side. In a byte-level BPE's pre-tokenizer regex (GPT-2's) every
    alternative that matches a space either starts with it (an optional space, then letters, digits or
    symbols) or matches whitespace only; so a pre-token always starts at such a space, and as BPE merges
    only inside a pre-token, the pieces' ids, joined, are the whole text's."""
    points: list[int] = []
    start = 0
    while len(text) - start > CUT_EVERY and (found := _CUT.search(text, start + CUT_EVERY)) is not None:
        start = found.start()
        points.append(start)
    return points


def cuttable(tokenizer: Any, splits: bool) -> bool:
    """Whether `cut_points` keeps this fast tokenizer's ids: no normalizer, the plain byte-level
    pre-tokenizer (its own regex, no prefix space added to each piece), and, when added tokens are
    matched in the text (`splits` False), none that holds whitespace or strips it from a side (a cut
    could fall inside one, or take away the space it would strip). Anything else (SentencePiece's
    Metaspace, a custom Split regex, a normalizer) is encoded whole."""
    from tokenizers.pre_tokenizers import ByteLevel

    backend = tokenizer.backend_tokenizer
    pre = backend.pre_tokenizer
    if backend.normalizer is not None or not isinstance(pre, ByteLevel) or pre.add_prefix_space or not pre.use_regex:
        return False
    added = (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
    return splits or not any(t.lstrip or t.rstrip or t.single_word or re.search(r"\s", str(t.content)) for t in added)


def special_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """A regex matching any special-token string (longest first), capturing it; None if there are none."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials = {str(t.content) for t in decoder.values() if getattr(t, "special", False)}
    specials |= {str(t) for t in getattr(tokenizer, "all_special_tokens", ()) or ()}
    specials.discard("")
    if not specials:
        return None
    return re.compile("(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")")


class _Escape:
    """Swaps special-token strings in client data (every string, keys too) for per-render sentinels, and back."""

    def __init__(self, specials: re.Pattern[str] | None) -> None:
        self._specials = specials
        self._nonce = secrets.token_hex(8)
        self._found: list[str] = []
        self.used = False

    def __call__(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._specials.sub(self._swap, value) if self._specials is not None else value
        if isinstance(value, dict):
            return {self(k): self(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self(v) for v in value]
        return value

    def _swap(self, match: re.Match[str]) -> str:
        self.used = True
        self._found.append(match.group(0))
        return f"@@{self._nonce}.{len(self._found) - 1}@@"

    def restore(self, text: str) -> str:
        # compiled here, only for the few renders that escaped something: a pattern per render (its nonce)
        # costs ~55 µs to compile, a third of a short prompt's whole render
        sentinel = re.compile(rf"@@{self._nonce}\.(\d+)@@")
        return sentinel.sub(lambda m: self._found[int(m.group(1))], text)


def _mentions_tools(tokenizer: Any) -> bool:
    template = tokenizer.chat_template or ""
    return "tools" in template


def _with_tools_in_system(conversation: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    """For templates without tool support (SmolLM2's): the tools prompt ends the system message."""
    if conversation and conversation[0]["role"] == "system":
        first = conversation[0]
        return [{**first, "content": f"{first['content']}\n\n{prompt}" if first["content"] else prompt}, *conversation[1:]]
    return [{"role": "system", "content": prompt}, *conversation]


def _fallback_dict(message: Message) -> dict[str, Any]:
    """A message for a template without tool support: calls and results written in our call syntax."""
    role = "system" if message.role is Role.DEVELOPER else message.role.value
    text = message.text
    if message.tool_calls:
        calls = "\n".join(call_text(c.name, _call_arguments(c), custom=c.kind is ToolKind.CUSTOM) for c in message.tool_calls)
        text = f"{text}\n{calls}" if text else calls
    if message.role is Role.TOOL:
        text = f"<tool_response>{'Error: ' if message.is_error else ''}{text}</tool_response>"
    return _with_reasoning({"role": role, "content": text}, message)


def _with_reasoning(out: dict[str, Any], message: Message) -> dict[str, Any]:
    """An assistant turn's reasoning as `reasoning_content` (Qwen3's name); templates without it ignore it."""
    if message.reasoning:
        out["reasoning_content"] = message.reasoning
    return out


def _message_dict(message: Message) -> dict[str, Any]:
    role = message.role.value
    if message.role is Role.DEVELOPER:
        role = "system"
    out: dict[str, Any] = {"role": role, "content": message.text}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _template_arguments(c)}} for c in message.tool_calls
        ]
        if not out["content"]:
            out["content"] = "\n".join(json.dumps({"name": c.name, "arguments": _template_arguments(c)}) for c in message.tool_calls)
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return _with_reasoning(out, message)


def _call_arguments(call: ToolCall) -> Any:
    """What our call syntax writes: a custom tool's raw input, a function's arguments as JSON."""
    return call.arguments if call.kind is ToolKind.CUSTOM else _json_or_text(call.arguments)


def _template_arguments(call: ToolCall) -> Any:
    """What a tool-aware template gets: a custom tool is shown as a function with one `input` string."""
    return {"input": call.arguments} if call.kind is ToolKind.CUSTOM else _json_or_text(call.arguments)


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
