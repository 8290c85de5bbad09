"""Dump records: one finished (or in-flight) request as data — its IR, its ordered deltas, its meta.

Owns: `DumpRecord` ↔ the JSON-ready dict written to dump files (`{"v": 1, "id", "request", "deltas",
"meta", "outcome"}`), the typed reading of the `{req:<shard>}:<id>:meta` hash and `compare()` (did a replay
produce the recorded output?). Re-encoding a record into SSE lives in `encoders.reencode`.
Secrets never land in dumps: `record_to_dict` redacts every credential-like field it writes (the raw
body was already redacted at ingest; redacting again is idempotent and byte-identical when clean).
Must not: do I/O (Redis reads live in ingest.dumps.dump_reader, files in ingest.dumps.dump_writer and cli/), or
know wire field names of deltas and requests (shared.codec does), or import encoders.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from shared import codec
from shared.codec import Meta
from shared.deltas import Content, Error, Finish, Reasoning, Refusal, StreamDelta, ToolCallArgs, ToolCallStart, is_terminal
from shared.ir import Protocol, Request
from shared.protocols import spec
from shared.redact import REDACTED, is_secret, redact

DUMP_VERSION = 1
FLOAT_META = (Meta.RECEIVED_AT, Meta.CLAIMED_AT, Meta.FIRST_TOKEN_AT, Meta.FINISHED_AT)
INT_META = (Meta.ATTEMPT, Meta.BATCH_MAX)
CONTEXT_CHARS = 60  # characters of text shown on each side of a divergence


@dataclass(frozen=True, slots=True, kw_only=True)
class DumpRecord:
    """One request as recorded: `meta` is the typed meta hash (timings as unix floats, attempt, worker...)."""

    id: str
    request: Request
    deltas: tuple[StreamDelta, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def outcome(self) -> str | None:
        """The worker's outcome (`stop`, `length`, `cancelled`, `error:<kind>`...), or None while unfinished."""
        recorded = self.meta.get(Meta.OUTCOME)
        if recorded:
            return str(recorded)
        return terminal_label(self.deltas) if self.deltas and is_terminal(self.deltas[-1]) else None


# ---- records <-> JSON ------------------------------------------------------------------------------


def record_to_dict(record: DumpRecord) -> dict[str, Any]:
    """The JSON-ready, redacted form written to dump files."""
    return {
        "v": DUMP_VERSION,
        "id": record.id,
        "request": _redacted_request(codec.request_to_dict(record.request)),
        "deltas": [codec.delta_to_dict(d) for d in record.deltas],
        "meta": redact(dict(record.meta)),
        "outcome": record.outcome,
    }


def record_from_dict(doc: Mapping[str, Any]) -> DumpRecord:
    if not isinstance(doc, Mapping) or doc.get("v") != DUMP_VERSION:
        raise codec.CodecError(f"unsupported dump version: {doc.get('v') if isinstance(doc, Mapping) else doc!r}")
    return DumpRecord(
        id=str(doc["id"]),
        request=codec.request_from_dict(dict(doc["request"])),
        deltas=tuple(codec.delta_from_dict(d) for d in doc["deltas"]),
        meta=dict(doc.get("meta") or {}),
    )


def record_to_line(record: DumpRecord) -> bytes:
    """One JSONL line (with its newline)."""
    return orjson.dumps(record_to_dict(record)) + b"\n"


def read_records(lines: Iterable[bytes | str]) -> list[DumpRecord]:
    """Records from JSONL text; blank lines are skipped."""
    return [record_from_dict(orjson.loads(line)) for line in lines if line.strip()]


def parse_meta(raw: Mapping[Any, Any]) -> dict[str, Any]:
    """The meta hash as Redis returns it (bytes) → typed values; unknown fields stay strings."""
    meta: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.decode() if isinstance(key, bytes) else str(key)
        text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        try:
            meta[name] = float(text) if name in FLOAT_META else int(float(text)) if name in INT_META else text
        except ValueError:
            meta[name] = text
    return meta


def display_status(meta: Mapping[str, Any]) -> str:
    """queued / running / finished / error / cancelled (a finished request split by its outcome), or `expired`."""
    status = str(meta.get(Meta.STATUS) or "expired")
    outcome = str(meta.get(Meta.OUTCOME) or "")
    if status == "finished" and outcome.startswith("error"):
        return "error"
    if status == "finished" and outcome == "cancelled":
        return "cancelled"
    return status


def _redacted_request(doc: dict[str, Any]) -> dict[str, Any]:
    """Redact credential-like fields: anywhere in the dict, in metadata pairs, in the raw body and in
    earlier tool calls' JSON arguments. Tool parameter schemas are left alone (property names, no values)."""
    doc = redact(doc)
    doc["metadata"] = [[k, REDACTED if is_secret(str(k)) else v] for k, v in doc.get("metadata", ())]
    doc["raw_body"] = _redact_json_text(doc.get("raw_body", ""))
    for message in doc.get("messages", ()):
        for call in message.get("tool_calls", ()):
            call["arguments"] = _redact_json_text(call.get("arguments", ""))
    return doc


def _redact_json_text(text: str) -> str:
    try:
        value = orjson.loads(text) if text else None
    except orjson.JSONDecodeError:
        return text
    cleaned = redact(value)
    return text if cleaned == value else orjson.dumps(cleaned).decode()


# ---- comparing a replay with the record ------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    """Whether a replay produced the recorded output: generated token ids, text and finish reason."""

    matches: bool
    recorded_tokens: int
    new_tokens: int
    first_divergent_token: int | None  # index into the generated token ids; None when they agree
    recorded_finish: str
    new_finish: str
    diff: str = ""  # readable, "" when matching


def generated_token_ids(deltas: Iterable[StreamDelta]) -> list[int]:
    """Every generated token id in order (Finish carries the held-back ones; Error carries none)."""
    return [t for d in deltas if not isinstance(d, Error) for t in d.token_ids]


def generated_text(deltas: Iterable[StreamDelta]) -> str:
    """What the model said, all kinds of output in order; a tool call shows as `<tool_call name>`."""
    parts: list[str] = []
    for d in deltas:
        if isinstance(d, Content | Reasoning | Refusal):
            parts.append(d.text)
        elif isinstance(d, ToolCallStart):
            parts.append(f"<tool_call {d.name}>")
        elif isinstance(d, ToolCallArgs):
            parts.append(d.arguments)
    return "".join(parts)


def terminal_label(deltas: Sequence[StreamDelta], protocol: Protocol | None = None) -> str:
    """The finish reason (in `protocol`'s own words when given), `error:<kind>` (just `error` with a
    protocol: not every wire carries the kind), or `unfinished`."""
    last = deltas[-1] if deltas else None
    if isinstance(last, Error):
        return "error" if protocol else f"error:{last.kind.value}"
    if not isinstance(last, Finish):
        return "unfinished"
    return spec(protocol).finish_label(last.reason) if protocol is not None else last.reason.value


def compare(recorded: Sequence[StreamDelta], new: Sequence[StreamDelta], *, protocol: Protocol | None = None) -> Comparison:
    """Compare a replay's deltas with the recorded ones. `protocol` compares finish reasons as that
    protocol reports them (for replays read back over HTTP, where the exact reason is not on the wire)."""
    old_ids, new_ids = generated_token_ids(recorded), generated_token_ids(new)
    old_text, new_text = generated_text(recorded), generated_text(new)
    old_finish, new_finish = terminal_label(recorded, protocol), terminal_label(new, protocol)
    first = _first_difference(old_ids, new_ids)
    matches = first is None and old_text == new_text and old_finish == new_finish
    lines: list[str] = []
    if first is not None:
        lines.append(f"first divergent token: #{first} ({_token_at(old_ids, first)} recorded, {_token_at(new_ids, first)} now)")
    elif old_text != new_text:
        lines.append("token ids agree, but the text differs (detokenization changed)")
    at = _first_difference(old_text, new_text)
    if at is not None:
        lines += [
            f"text before:  {_quote(old_text[max(0, at - CONTEXT_CHARS) : at], left=at > CONTEXT_CHARS)}",
            f"recorded:     {_quote(old_text[at : at + CONTEXT_CHARS], right=len(old_text) > at + CONTEXT_CHARS)}",
            f"now:          {_quote(new_text[at : at + CONTEXT_CHARS], right=len(new_text) > at + CONTEXT_CHARS)}",
        ]
    if old_finish != new_finish:
        lines.append(f"finish reason: {old_finish} recorded, {new_finish} now")
    return Comparison(
        matches=matches,
        recorded_tokens=len(old_ids),
        new_tokens=len(new_ids),
        first_divergent_token=first,
        recorded_finish=old_finish,
        new_finish=new_finish,
        diff="" if matches else "\n".join(lines),
    )


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _token_at(ids: Sequence[int], index: int) -> str:
    return f"token {ids[index]}" if index < len(ids) else "ended"


def _quote(text: str, *, left: bool = False, right: bool = False) -> str:
    return ("…" if left else "") + orjson.dumps(text).decode() + ("…" if right else "")
