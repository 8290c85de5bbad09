"""The provider-neutral request IR.

Owns: the frozen, slotted, keyword-only types every protocol parser produces and every worker consumes.
Must not: know any protocol's field names (parsers in ingest/ map onto these), or hold I/O handles.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar


class _Protocols(type):
    """Iteration and `len` over the protocols defined so far, as over an enum's members."""

    def __iter__(cls) -> Iterator[Protocol]:
        return iter(list(Protocol._known.values()))

    def __len__(cls) -> int:
        return len(Protocol._known)


class Protocol(str, metaclass=_Protocols):
    """The API surface a request arrived on, by its wire name ("openai_chat"); encoders are chosen by it.

    An open set, not an enum: the four below are built in, and a protocol module defines its own
    (`Protocol.define`, called by shared.protocols.register), so adding a protocol edits no table here.
    Each name has one instance (`Protocol(name)` returns it, or raises ValueError for a name never
    defined), so `is` compares them and `.value` is the name, as with the enum this was."""

    __slots__ = ()
    _known: ClassVar[dict[str, Protocol]] = {}
    OPENAI_CHAT: ClassVar[Protocol]
    ANTHROPIC_MESSAGES: ClassVar[Protocol]
    OPENAI_RESPONSES: ClassVar[Protocol]
    OPENAI_COMPLETIONS: ClassVar[Protocol]

    def __new__(cls, value: str) -> Protocol:
        known = cls._known.get(str(value))
        if known is None:
            raise ValueError(f"{value!r} is not a known protocol")
        return known

    @classmethod
    def define(cls, value: str) -> Protocol:
        """The protocol named `value`, defined now if it is new."""
        known = cls._known.get(value)
        if known is None:
            if not value or not value.replace("_", "").isalnum():
                raise ValueError(f"a protocol name is letters, digits and '_': {value!r}")
            known = cls._known[value] = str.__new__(cls, value)
        return known

    @property
    def value(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"Protocol({self.value!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Protocol, (self.value,))


Protocol.OPENAI_CHAT = Protocol.define("openai_chat")
Protocol.ANTHROPIC_MESSAGES = Protocol.define("anthropic_messages")
Protocol.OPENAI_RESPONSES = Protocol.define("openai_responses")
Protocol.OPENAI_COMPLETIONS = Protocol.define("openai_completions")


class Role(enum.StrEnum):
    SYSTEM = "system"
    DEVELOPER = "developer"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True, slots=True, kw_only=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ImagePart:
    """An image the client sent; only a vision model may accept it (parsers reject it otherwise)."""

    url: str = ""
    media_type: str = ""


ContentPart = TextPart | ImagePart


class ToolKind(enum.StrEnum):
    """What a tool takes: `function` = JSON arguments against a schema; `custom` = free-form text
    (Responses `custom` tools), optionally constrained by a Lark or regex grammar."""

    FUNCTION = "function"
    CUSTOM = "custom"


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """A call the assistant made earlier in the conversation (arguments: a JSON document as text; for a
    custom tool, its raw input)."""

    id: str
    name: str
    arguments: str
    kind: ToolKind = ToolKind.FUNCTION


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    role: Role
    content: tuple[ContentPart, ...] = ()
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning: str | None = None
    # Reasoning the client sent back sealed, as (text it showed, sealed blob) pairs: opened by the API
    # node (`shared.seal.open_reasoning`) into `reasoning`, or dropped when a blob does not open.
    sealed_reasoning: tuple[tuple[str, str], ...] = ()
    is_error: bool = False  # a tool result that reports a failure (Anthropic `tool_result.is_error`)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSpec:
    """A tool the model may call. A function's `parameters_json` is its JSON Schema as JSON text; a
    custom tool's `input_format` is the grammar its raw input must match (a LARK or REGEX `Constraint`
    whose `param` names the client field), None for free text.

    `name` is what the model sees and calls. A tool the client grouped under a `namespace` (Responses'
    `{"type": "namespace", ...}`) is offered under one flattened name; `namespace` and `client_name`
    keep what the client knows it by, so an encoder can hand the call back under those."""

    name: str
    description: str = ""
    parameters_json: str = "{}"
    kind: ToolKind = ToolKind.FUNCTION
    input_format: Constraint | None = None
    namespace: str = ""
    client_name: str = ""


class ConstraintKind(enum.StrEnum):
    """What a `Constraint`'s `text` holds."""

    JSON_SCHEMA = "json_schema"  # a JSON Schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object (text unused)
    REGEX = "regex"  # a regular expression the whole output must match
    CHOICE = "choice"  # exactly one of `choices`
    LARK = "lark"  # a Lark grammar (llguidance's dialect)


@dataclass(frozen=True, slots=True, kw_only=True)
class Constraint:
    """The output must match this (structured output). `param` names the client field it came from,
    so an error found later (in the worker) can still name it."""

    kind: ConstraintKind
    text: str = ""
    choices: tuple[str, ...] = ()
    param: str = ""
    strict: bool = False  # a JSON schema the client asked to be enforced whole (OpenAI `strict: true`): never relaxed


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Per-request sampling. `None` means "not given": resolved once by `resolve()` with this precedence:

    request value → the operator's `--default-*` flags → the generation config (`--generation-config`:
    the model folder's generation_config.json, or the defaults shipped for the default model) → the
    fallback written in `FALLBACK`. The two middle layers arrive merged as one mapping
    (models/generation.py `sampling_defaults`). After resolution no field in `FALLBACK` is None; `seed`
    (None = nondeterministic), `max_tokens` (None = up to the context length, unless the operator set
    `--default-max-tokens`), `top_n_sigma` (None = off) and `prompt_logprobs` (None = not asked) may be.
    A model worker resolves every field as it claims the request (workers.loop.WorkerLoop.with_defaults);
    a gateway worker fills only the operator's layer (`apply_defaults`), leaving the rest to its upstream.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    top_n_sigma: float | None = None  # keep tokens within n standard deviations of the top logit
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    dry_multiplier: float = 0.0  # DRY repetition penalty (0 = off), as in llama.cpp / text-generation-webui
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # the prompt's own logprobs, top k per position (None: not asked)
    n: int = 1
    ignore_eos: bool = False
    speculative: bool = True  # False: this request never checks guessed tokens (workers.speculate); its output is the same either way

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


FALLBACK = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def resolve(params: SamplingParams, model_defaults: dict[str, float | int]) -> SamplingParams:
    """Fill every unset sampling field: request → operator flags → generation config (both in
    `model_defaults`) → FALLBACK. What a model worker runs (and the engine's own guarantee)."""
    return apply_defaults(params, {**FALLBACK, **model_defaults})


def apply_defaults(params: SamplingParams, defaults: dict[str, float | int]) -> SamplingParams:
    """Fill the unset fields `defaults` names and leave the rest unset: what a gateway worker does with
    the operator's layer, so that what nobody set stays the upstream's own default."""
    from dataclasses import replace

    filled: dict[str, Any] = {}
    for name in (*FALLBACK, "max_tokens"):
        value = defaults.get(name)
        if getattr(params, name) is None and value is not None:
            filled[name] = int(value) if name in ("top_k", "max_tokens") else value
    return replace(params, **filled) if filled else params


@dataclass(frozen=True, slots=True, kw_only=True)
class Thinking:
    """What the client asked of the model's reasoning channel; every protocol's fields map onto this.

    `enabled`: None leaves it to the model (a reasoning model reasons), False turns reasoning off (the
    template's `enable_thinking=False` where it has one, and a budget of 0). `budget_tokens` is an
    explicit budget (Anthropic `thinking.budget_tokens`); `effort` a level (`none` … `max`) that
    `models.reasoning.budget_for` maps to tokens when no explicit budget is given. The rest is how the
    reasoning goes out: Responses `reasoning.summary` (as summary text) and
    `include: ["reasoning.encrypted_content"]`; Anthropic `thinking.display: "omitted"`.
    """

    enabled: bool | None = None
    budget_tokens: int | None = None
    effort: str | None = None
    summary: str | None = None
    encrypted: bool = False
    omitted: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class TextCompletion:
    """A prompt used as the client gave it, with no chat template (legacy `/v1/completions`), and what
    that protocol adds on top of sampling.

    The prompt is `text` or `token_ids`: text is tokenized with the tokenizer's own special tokens (a
    BOS where the tokenizer adds one by default, as vLLM does), token ids are used as they are. For a
    token-id prompt with `echo`, ingest fills `text` with their decoding, so the encoder can echo it.
    `prompt_index` places the prompt in the client's list. `n` is how many choices the client gets;
    `sampling.n` is `best_of`, the candidates generated, and the `n` with the highest cumulative
    logprob are returned. `logprobs` is the legacy integer (None: not asked; `best_of` alone turns
    `sampling.logprobs` on to rank the candidates, and they are not shown).
    """

    text: str = ""
    token_ids: tuple[int, ...] = ()
    echo: bool = False
    prompt_index: int = 0
    n: int = 1
    logprobs: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """One accepted request, as every role sees it.

    `prompt_token_ids` is filled by ingest after rendering the chat template (or the raw prompt of a
    `completion`, which has no messages), so a worker never re-renders and a recorded request replays exactly. `raw_body` keeps the client's JSON (secrets
    never live in bodies we accept; headers are not recorded).
    """

    id: str
    protocol: Protocol
    model: str
    messages: tuple[Message, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    include_usage: bool = False
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None  # the most calls a turn may make (the Responses API's field; None: no cap)
    constraint: Constraint | None = None
    thinking: Thinking = field(default_factory=Thinking)
    completion: TextCompletion | None = None
    return_token_ids: bool = False
    add_generation_prompt: bool = True  # vLLM's chat fields: False with continue_final_message extends
    continue_final_message: bool = False  # the final assistant message instead of opening a new one
    priority: int = 0
    created: float = 0.0
    metadata: tuple[tuple[str, str], ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    endpoint: str = ""
    raw_body: str = ""
    # The sampling values the API node expects a worker to run where the request set none (its `--default-*`
    # over the model's generation config), for the fields the protocol's response reports (shared.protocols
    # `reports_sampling`): shown, never sampled with; a worker resolves with its own defaults.
    reported_sampling: tuple[tuple[str, float], ...] = ()
    cache_salt: str = ""  # prefix-cache isolation: blocks are shared only between equal salts (ingest.parsers.cache_salt)
    # the LoRA adapter the request's `model` named ("" the base model) and the folder it was registered from
    # (`met:loras`, ingest.http.loras): a worker loads it from there (workers.lora); a replay or resume keeps both
    adapter: str = ""
    adapter_path: str = ""


def prefix_salt(request: Request) -> str:
    """What a request's prefix-cache blocks are salted with (`shared.block_keys.salted_root`): its cache salt
    and its adapter, whose keys/values differ from the base model's for the same tokens."""
    if not request.adapter:
        return request.cache_salt
    return f"{request.cache_salt}\nadapter {request.adapter} from {request.adapter_path}"


def custom_tools(request: Request) -> frozenset[str]:
    """The names of the request's custom tools: a call to one carries raw input, not JSON arguments."""
    return frozenset(t.name for t in request.tools if t.kind is ToolKind.CUSTOM)
