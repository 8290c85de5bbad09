"""The protocol registry, pure half: what every layer may know of a protocol without its code.

A protocol is a parser (ingest), an encoder (encoders) and one row: `ingest.http.surfaces.register(Surface(...))`,
whose pure part is a `ProtocolSpec` here (read by shared, encoders, ingest and cli), whose encoder part is
an `encoders.registry.Codec`, and whose HTTP part is the `Surface` itself. The four built-in protocols'
specs are below; a protocol module (`--protocol-module`) registers its own, so nothing here changes for it.

Owns: `ProtocolSpec` (the route, the CLI name, the error shape, the context wording, the finish-reason
column) and the registry (`register_spec`, `spec`, `specs`).
Must not: import encoders, ingest or cli (they register into it), or do I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.deltas import FinishReason
from shared.ir import Protocol

OPENAI_ERRORS, ANTHROPIC_ERRORS = "openai", "anthropic"  # the two error-body shapes (ingest.parsers.errors)


def _responses_label(reason: FinishReason) -> str:
    incomplete = reason.responses_incomplete_reason
    return reason.responses_status + (f" ({incomplete})" if incomplete else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProtocolSpec:
    """One protocol as every layer may know it."""

    protocol: Protocol
    path: str  # its generation route, also a batch line's `url`
    name: str  # its name for `met replay --as` (the protocol's own value is accepted too)
    errors: str = OPENAI_ERRORS  # the error-body shape and overload status: OPENAI_ERRORS (503) or ANTHROPIC_ERRORS (529)
    prompt_param: str = "messages"  # how a context error names the prompt ...
    max_tokens_param: str = "max_tokens"  # ... and the output limit (an Anthropic-shaped protocol uses Anthropic's wording)
    finish_label: Callable[[FinishReason], str] = lambda reason: reason.value  # a finish reason in the protocol's own words (dumps, replay)
    # Sampling fields the protocol's response reports as the values used: for those a request leaves unset the
    # API node records what a worker runs by its flags (ingest.http.app `Api.prepare`, `Request.reported_sampling`).
    reports_sampling: tuple[str, ...] = ()


_SPECS: dict[Protocol, ProtocolSpec] = {}


def register_spec(spec: ProtocolSpec) -> ProtocolSpec:
    """Add (or replace) `spec` (its `protocol` made by `Protocol.define(name)`); a path or CLI name taken by another protocol is a ValueError."""
    for other in _SPECS.values():
        if other.protocol is not spec.protocol and (other.path == spec.path or other.name == spec.name):
            raise ValueError(f"protocol {spec.protocol.value!r}: path {spec.path!r} or name {spec.name!r} is taken by {other.protocol.value!r}")
    _SPECS[spec.protocol] = spec
    return spec


def spec(protocol: Protocol) -> ProtocolSpec:
    """The spec of a registered protocol (KeyError naming it otherwise)."""
    try:
        return _SPECS[protocol]
    except KeyError:
        raise KeyError(f"protocol {protocol!r} is not registered (is its module in --protocol-module?)") from None


def specs() -> tuple[ProtocolSpec, ...]:
    return tuple(_SPECS.values())


CHAT = register_spec(ProtocolSpec(protocol=Protocol.OPENAI_CHAT, path="/v1/chat/completions", name="openai", finish_label=lambda r: r.openai))
MESSAGES = register_spec(
    ProtocolSpec(protocol=Protocol.ANTHROPIC_MESSAGES, path="/v1/messages", name="anthropic", errors=ANTHROPIC_ERRORS, finish_label=lambda r: r.anthropic)
)
RESPONSES = register_spec(
    ProtocolSpec(
        protocol=Protocol.OPENAI_RESPONSES, path="/v1/responses", name="responses", prompt_param="input", max_tokens_param="max_output_tokens",
        finish_label=_responses_label,
        reports_sampling=("temperature", "top_p"),
    )
)
COMPLETIONS = register_spec(
    ProtocolSpec(protocol=Protocol.OPENAI_COMPLETIONS, path="/v1/completions", name="completions", prompt_param="prompt", finish_label=lambda r: r.openai)
)
