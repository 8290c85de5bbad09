"""Fit a rendered prompt and its `max_tokens` into the model's context (pure; raises `ApiError`).

Owns: the one decision every protocol shares once the prompt is rendered, with each protocol's wording.
- A prompt that does not fit at all (prompt >= context) is refused. Anthropic's words are its API's own,
  `prompt is too long: {n} tokens > {m} maximum`, which Claude Code recognises (it offers /compact and
  reads both numbers); `m` is the context, the number OpenAI's message names too (but for a prompt of
  exactly the context, which leaves no room for an output token: then the context less one).
- A prompt that fits with a `max_tokens` the rest of the context cannot hold: by default `max_tokens` is
  clamped to what the context leaves (the finish is then `length` / `max_tokens`), as llama.cpp and
  Ollama do; agents ask for 32k-128k tokens whatever the model. The worker clamps to the same figure
  (workers/engine.py `budget`), so both roles agree. With `--strict-max-tokens` it is refused instead; on
  Anthropic exactly as Anthropic words it, ``input length and `max_tokens` exceed context limit: {prompt}
  + {max_tokens} > {context}, decrease input length or `max_tokens` and try again``: Claude Code parses
  the three numbers with a regex and retries with a `max_tokens` that fits.
- A request that names no `max_tokens` gets the operator's `--default-max-tokens` (fitted as above but
  clamped, never refused: it is not the client's number), so the rate limiter charges what the worker
  will allow; without it, up to the context.
- The operator's `--max-output-tokens` caps every request's `max_tokens` (also one that names none).
Anthropic errors carry no `param` (its error shape has none, and a `param: ` prefix would break the
clients that match these messages whole); OpenAI-style errors name the protocol's own field: chat's
`messages` / `max_tokens`, Responses' `input` / `max_output_tokens`.
Must not: render, do I/O, or know anything of a protocol beyond these messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import invalid
from shared.ir import Protocol
from shared.protocols import ANTHROPIC_ERRORS, spec


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextPolicy:
    """The limits a request's tokens must fit: the context, whether an oversized `max_tokens` is refused
    (`strict`) or clamped, the operator's output cap (0 = none) and `max_tokens` for a request naming none."""

    context: int
    strict: bool = False
    output_cap: int = 0
    default_max_tokens: int | None = None


def fit_max_tokens(protocol: Protocol, prompt_tokens: int, max_tokens: int | None, policy: ContextPolicy) -> int | None:
    """The `max_tokens` to queue the request with (None: up to the context, as the worker resolves it), or
    an `ApiError` in the protocol's wording when the prompt cannot fit, or `max_tokens` cannot while strict."""
    limit = policy.context
    row = spec(protocol)  # its wording: Anthropic's messages, or OpenAI's naming the protocol's own fields
    prompt_field, limit_field, anthropic = row.prompt_param, row.max_tokens_param, row.errors == ANTHROPIC_ERRORS
    if prompt_tokens >= limit:
        if anthropic:
            # the context, as OpenAI's message says it; a prompt of exactly the context leaves no output token
            # and still reads "n > m" (Claude Code parses both numbers)
            maximum = limit if prompt_tokens > limit else limit - 1
            raise invalid(f"prompt is too long: {prompt_tokens} tokens > {maximum} maximum", None, "context_length_exceeded")
        raise invalid(
            f"This model's maximum context length is {limit} tokens. However, your {prompt_field} resulted in {prompt_tokens} tokens.",
            prompt_field,
            "context_length_exceeded",
        )
    room = limit - prompt_tokens
    if max_tokens is not None and max_tokens > room and policy.strict:
        if anthropic:
            raise invalid(
                f"input length and `max_tokens` exceed context limit: {prompt_tokens} + {max_tokens} > {limit}, "
                "decrease input length or `max_tokens` and try again",
                None,
                "context_length_exceeded",
            )
        raise invalid(
            f"This model's maximum context length is {limit} tokens. However, you requested {prompt_tokens + max_tokens} tokens "
            f"({prompt_tokens} in the messages, {max_tokens} in the completion).",
            limit_field,
            "context_length_exceeded",
        )
    if max_tokens is None and policy.default_max_tokens is not None:
        max_tokens = policy.default_max_tokens
    if max_tokens is not None:
        max_tokens = min(max_tokens, room)
    if policy.output_cap:
        max_tokens = min(max_tokens or room, policy.output_cap)
    return max_tokens
