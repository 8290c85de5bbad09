"""The versioned JSON codec: the only code that knows field names on the wire (Redis entries, dumps).

Owns: bytes <-> `Request` and bytes <-> `StreamDelta`; the fields of every Redis entry and of the request
meta hash (`delta_entry` / `delta_of`, `request_entry` / `request_of`, `Meta`, the finished feed and the
dead letters). Imports no redis: callers pass the mappings redis-py returns (bytes or str keys). Payloads are data, never code: orjson with a
`v` field; no pickle. Decoders reject a newer major version instead of guessing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

import orjson

from shared.deltas import (
    Content,
    Error,
    ErrorKind,
    Finish,
    FinishReason,
    Reasoning,
    Refusal,
    StreamDelta,
    TokenLogprob,
    ToolCallArgs,
    ToolCallStart,
    Usage,
)
from shared.ir import (
    Constraint,
    ConstraintKind,
    ContentPart,
    ImagePart,
    Message,
    Protocol,
    Request,
    Role,
    SamplingParams,
    TextCompletion,
    TextPart,
    Thinking,
    ToolCall,
    ToolKind,
    ToolSpec,
)

VERSION = 1

_DELTA_TAGS: dict[type, str] = {
    Content: "content",
    Reasoning: "reasoning",
    ToolCallStart: "tool_call_start",
    ToolCallArgs: "tool_call_args",
    Refusal: "refusal",
    Finish: "finish",
    Error: "error",
}
_DELTA_TYPES = {tag: cls for cls, tag in _DELTA_TAGS.items()}
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}  # per dataclass: its field names (dataclasses.fields is slow per call)


def _names(cls: Any) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


class CodecError(ValueError):
    """A payload that is not ours, or from a newer version."""


def _check_version(doc: dict[str, Any]) -> None:
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        raise CodecError(f"unsupported payload version: {doc.get('v') if isinstance(doc, dict) else doc!r}")


def _known(cls: Any, doc: dict[str, Any]) -> Any:
    """`cls` from the fields of `doc` it has: a field a newer minor version added is ignored, not a crash."""
    return cls(**{k: doc[k] for k in _names(cls) if k in doc})


def _asdict(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in _names(type(obj))}


def encode_delta(delta: StreamDelta) -> bytes:
    doc = _asdict(delta)
    if isinstance(delta, Content):  # on one delta of a request each: every other event stays as it was
        if not delta.prompt_logprobs:
            del doc["prompt_logprobs"]
        if delta.cached_tokens is None:
            del doc["cached_tokens"]
    doc["v"] = VERSION
    doc["t"] = _DELTA_TAGS[type(delta)]
    return orjson.dumps(doc)


def delta_to_dict(delta: StreamDelta) -> dict[str, Any]:
    """The JSON-ready form used in dumps (same fields as the stored event)."""
    doc: dict[str, Any] = orjson.loads(encode_delta(delta))
    return doc


def decode_delta(raw: bytes | str) -> StreamDelta:
    return delta_from_dict(orjson.loads(raw))


def delta_from_dict(doc: dict[str, Any]) -> StreamDelta:
    _check_version(doc)
    if doc.get("t") == "content" and not doc.get("logprobs") and not doc.get("prompt_logprobs") and "cached_tokens" not in doc:  # nearly every delta: built directly
        return Content(text=doc["text"], token_ids=tuple(doc.get("token_ids", ())), attempt=doc.get("attempt", 1))
    cls = _DELTA_TYPES.get(doc.get("t", ""))
    if cls is None:
        raise CodecError(f"unknown delta type {doc.get('t')!r}")
    kwargs = {name: doc[name] for name in _names(cls) if name in doc}
    if "token_ids" in kwargs:
        kwargs["token_ids"] = tuple(kwargs["token_ids"])
    if cls is Finish:
        kwargs["reason"] = FinishReason(kwargs["reason"])
        kwargs["usage"] = _known(Usage, kwargs["usage"])
    elif cls is Error:
        kwargs["kind"] = ErrorKind(kwargs.get("kind", ErrorKind.INTERNAL.value))
    elif cls is Content:
        for name in ("logprobs", "prompt_logprobs"):
            if kwargs.get(name):
                kwargs[name] = _logprobs_from_list(kwargs[name])
            elif name in kwargs:
                kwargs[name] = ()
    delta: StreamDelta = cls(**kwargs)
    return delta


def _logprobs_from_list(entries: list[dict[str, Any]]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(token=lp["token"], token_id=lp["token_id"], logprob=lp["logprob"], top=tuple(tuple(t) for t in lp.get("top", ()))) for lp in entries
    )


def encode_request(request: Request) -> bytes:
    doc = _asdict(request)
    doc["v"] = VERSION
    doc["messages"] = [message_to_dict(m) for m in request.messages]
    return orjson.dumps(doc)


def request_to_dict(request: Request) -> dict[str, Any]:
    doc: dict[str, Any] = orjson.loads(encode_request(request))
    return doc


def message_to_dict(message: Message) -> dict[str, Any]:
    doc = _asdict(message)
    doc["content"] = [{"type": "text" if isinstance(p, TextPart) else "image", **_asdict(p)} for p in message.content]
    return doc


def decode_request(raw: bytes | str) -> Request:
    return request_from_dict(orjson.loads(raw))


def request_from_dict(doc: dict[str, Any]) -> Request:
    _check_version(doc)
    kwargs = {f.name: doc[f.name] for f in fields(Request) if f.name in doc}
    kwargs["protocol"] = Protocol.define(kwargs["protocol"])  # a protocol module's own name too: workers need no row for it
    kwargs["messages"] = tuple(message_from_dict(m) for m in kwargs["messages"])
    kwargs["sampling"] = _sampling_from_dict(kwargs.get("sampling", {}))
    kwargs["tools"] = tuple(_tool_from_dict(t) for t in kwargs.get("tools", ()))
    kwargs["metadata"] = tuple((str(k), str(v)) for k, v in kwargs.get("metadata", ()))
    kwargs["reported_sampling"] = tuple((str(k), float(v)) for k, v in kwargs.get("reported_sampling", ()))
    kwargs["prompt_token_ids"] = tuple(kwargs.get("prompt_token_ids", ()))
    kwargs["constraint"] = _constraint_from_dict(kwargs.get("constraint"))
    kwargs["thinking"] = Thinking(**{f.name: v for f in fields(Thinking) if (v := kwargs.get("thinking", {}).get(f.name)) is not None})
    kwargs["completion"] = _completion_from_dict(kwargs.get("completion"))
    return Request(**kwargs)


def _tool_from_dict(doc: dict[str, Any]) -> ToolSpec:
    return ToolSpec(
        name=doc["name"],
        description=doc.get("description", ""),
        parameters_json=doc.get("parameters_json", "{}"),
        kind=ToolKind(doc.get("kind", ToolKind.FUNCTION.value)),
        input_format=_constraint_from_dict(doc.get("input_format")),
    )


def _tool_call_from_dict(doc: dict[str, Any]) -> ToolCall:
    return ToolCall(id=doc["id"], name=doc["name"], arguments=doc["arguments"], kind=ToolKind(doc.get("kind", ToolKind.FUNCTION.value)))


def _completion_from_dict(doc: dict[str, Any] | None) -> TextCompletion | None:
    if doc is None:
        return None
    kwargs = {f.name: doc[f.name] for f in fields(TextCompletion) if f.name in doc}
    kwargs["token_ids"] = tuple(kwargs.get("token_ids", ()))
    return TextCompletion(**kwargs)


def _constraint_from_dict(doc: dict[str, Any] | None) -> Constraint | None:
    if doc is None:
        return None
    return Constraint(
        kind=ConstraintKind(doc["kind"]), text=doc.get("text", ""), choices=tuple(doc.get("choices", ())), param=doc.get("param", ""), strict=bool(doc.get("strict", False))
    )


def _sampling_from_dict(doc: dict[str, Any]) -> SamplingParams:
    kwargs = {f.name: doc[f.name] for f in fields(SamplingParams) if f.name in doc}
    for name in ("stop", "stop_token_ids", "dry_sequence_breakers"):
        kwargs[name] = tuple(kwargs.get(name, ()))
    kwargs["logit_bias"] = tuple((int(t), float(b)) for t, b in kwargs.get("logit_bias", ()))
    return SamplingParams(**kwargs)


def message_from_dict(doc: dict[str, Any]) -> Message:
    parts: list[ContentPart] = []
    for part in doc.get("content", ()):
        kind = part.pop("type", "text")
        parts.append(_known(TextPart, part) if kind == "text" else _known(ImagePart, part))
    return Message(
        role=Role(doc["role"]),
        content=tuple(parts),
        name=doc.get("name"),
        tool_calls=tuple(_tool_call_from_dict(c) for c in doc.get("tool_calls", ())),
        tool_call_id=doc.get("tool_call_id"),
        reasoning=doc.get("reasoning"),
        sealed_reasoning=tuple((str(t), str(b)) for t, b in doc.get("sealed_reasoning", ())),
        is_error=bool(doc.get("is_error", False)),
    )


# ---- Redis entries and hashes: every field name on the wire ------------------------------------------

DELTA_FIELD = "d"  # a delta stream entry: {d: encoded StreamDelta} (workers.leases' script writes it)
STREAM_MARKER: dict[Any, Any] = {"created": b"1"}  # the entry ingest creates a delta stream with (at 0-1, trimmed at once)
REQUEST_FIELD = "req"  # a request stream entry: {v, id, req: encoded Request}
ID_FIELD = "id"  # the request id, on request stream, finished feed and dead-letter entries


class Meta:
    """Fields of a request's meta hash (shared.keys.request_meta); every value is a string on the wire.
    Written by ingest.http.publish (status queued .. received_at), workers.leases (status running .. emitted;
    the fenced script: first_token_at, status finished .. batch_max); read by dumps, the TUI, admission."""

    STATUS = "status"  # queued | running | finished (the values below)
    PROTOCOL = "protocol"
    MODEL = "model"
    ENDPOINT = "endpoint"
    RECEIVED_AT = "received_at"
    CLIENT = "client"  # who sent it, for `met top`: the address and the user agent's first product token (ingest.http.app), "batch" for a batch line
    OWNER = "owner"  # the caller id (an API key's digest) that made it: ingest.http.auth.owns scopes resume and stored responses
    ATTEMPT = "attempt"  # the fencing token: bumped by each claim
    WORKER = "worker"
    CLAIMED_AT = "claimed_at"
    DELIVERIES = "deliveries"
    EMITTED = "emitted"  # deltas the current attempt has written (a resend skips them)
    FIRST_TOKEN_AT = "first_token_at"
    OUTCOME = "outcome"  # a FinishReason value, or error:<kind>
    FINISHED_AT = "finished_at"
    BATCH_MAX = "batch_max"


QUEUED, RUNNING, FINISHED = "queued", "running", "finished"  # Meta.STATUS values


def _field(fields: Mapping[Any, Any], name: str) -> Any:
    return fields.get(name.encode(), fields.get(name))


def delta_entry(delta: StreamDelta) -> dict[Any, Any]:
    return {DELTA_FIELD: encode_delta(delta)}


def delta_of(fields: Mapping[Any, Any]) -> StreamDelta | None:
    """The delta in a delta stream entry; None for the stream's creation marker."""
    raw = _field(fields, DELTA_FIELD)
    return None if raw is None else decode_delta(raw)


def deltas_of(entries: Iterable[tuple[Any, Mapping[Any, Any]]]) -> list[StreamDelta]:
    """The deltas of XRANGE entries, in order (markers skipped)."""
    return [d for _id, fields in entries if (d := delta_of(fields)) is not None]


def request_entry(request: Request, encoded: bytes | None = None) -> dict[Any, Any]:
    return {"v": VERSION, ID_FIELD: request.id, REQUEST_FIELD: encoded if encoded is not None else encode_request(request)}


def request_of(fields: Mapping[Any, Any]) -> Request:
    """The request in a request stream entry (CodecError when it has none)."""
    raw = _field(fields, REQUEST_FIELD)
    if raw is None:
        raise CodecError("a request entry without its request")
    return decode_request(raw)


def request_id_of(fields: Mapping[Any, Any] | None) -> str:
    """The request id an entry names ("" when none): request stream, finished feed, dead letters."""
    raw = _field(fields or {}, ID_FIELD)
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw or "")


def finished_entry(request_id: str, outcome: str) -> dict[Any, Any]:
    """An entry of the finished feed (shared.keys.FINISHED)."""
    return {ID_FIELD: request_id, Meta.OUTCOME: outcome}


def dead_letter_entry(request_id: str, *, entry: str, deliveries: int, now: float, reason: str = "") -> dict[Any, Any]:
    """An entry of the dead letters (shared.keys.DEAD_LETTER)."""
    doc: dict[Any, Any] = {ID_FIELD: request_id, "entry": entry, "deliveries": deliveries, "at": now}
    if reason:
        doc["reason"] = reason
    return doc


AdapterCounts = tuple[tuple[str, int, int], ...]  # LoRA adapters: (name, running, waiting), most running first


def adapter_counts(counts: Mapping[str, tuple[int, int]]) -> AdapterCounts:
    """name → (running, waiting) in the order `met top` shows them: most running, then most waiting, then by name."""
    return tuple((name, r, w) for name, (r, w) in sorted(counts.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0])))


def adapters_field(counts: AdapterCounts) -> str:
    """The worker heartbeat's `adapters` field: "name=running/waiting,..." ("" when none)."""
    return ",".join(f"{name}={r}/{w}" for name, r, w in counts)


def adapters_of(field: str) -> AdapterCounts:
    """`adapters_field` read back; malformed items are skipped."""
    out = []
    for item in filter(None, field.split(",")):
        name, _, pair = item.rpartition("=")
        running, _, waiting = pair.partition("/")
        if name and running.isdigit() and waiting.isdigit():
            out.append((name, int(running), int(waiting)))
    return tuple(out)
