"""Fitting a prompt and max_tokens into the context: clamp by default, refuse when strict, each protocol's words."""

from __future__ import annotations

import re

import pytest

from ingest.parsers.context import ContextPolicy, fit_max_tokens
from ingest.parsers.errors import error_body
from shared.errors import ApiError
from shared.ir import Protocol

CONTEXT = ContextPolicy(context=8192)
STRICT = ContextPolicy(context=8192, strict=True)
# Claude Code 2.1.332 (its bundled cli.js) matches these whole, then reads the numbers to retry or compact.
CLAUDE_RETRY = re.compile(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)")
CLAUDE_TOO_LONG = re.compile(r"^prompt is too long: \d+ tokens > \d+ maximum$")


def refusal(protocol: Protocol, prompt: int, max_tokens: int | None, policy: ContextPolicy) -> ApiError:
    with pytest.raises(ApiError) as caught:
        fit_max_tokens(protocol, prompt, max_tokens, policy)
    assert caught.value.status == 400 and caught.value.code == "context_length_exceeded"
    return caught.value


@pytest.mark.parametrize("protocol", list(Protocol))
def test_a_max_tokens_past_the_context_is_clamped_to_what_the_context_leaves(protocol: Protocol) -> None:
    assert fit_max_tokens(protocol, 1000, 32000, CONTEXT) == 7192
    assert fit_max_tokens(protocol, 1000, 7192, CONTEXT) == 7192
    assert fit_max_tokens(protocol, 1000, 50, CONTEXT) == 50
    assert fit_max_tokens(protocol, 1000, None, CONTEXT) is None


def test_the_operator_cap_bounds_every_request_also_one_that_names_no_max_tokens() -> None:
    capped = ContextPolicy(context=8192, output_cap=64)
    assert [fit_max_tokens(Protocol.OPENAI_RESPONSES, 1000, n, capped) for n in (None, 10, 128000)] == [64, 10, 64]
    assert fit_max_tokens(Protocol.OPENAI_CHAT, 8150, None, capped) == 42


def test_the_operators_default_max_tokens_fills_only_a_request_that_names_none_clamped_never_refused() -> None:
    """--default-max-tokens is known at ingest, so the queued request (and the rate-limit charge) carries it."""
    policy = ContextPolicy(context=8192, strict=True, default_max_tokens=100)
    assert [fit_max_tokens(Protocol.OPENAI_CHAT, 1000, n, policy) for n in (None, 10, 500)] == [100, 10, 500]
    assert fit_max_tokens(Protocol.ANTHROPIC_MESSAGES, 8150, None, policy) == 42  # strict refuses the client's number, not ours
    assert fit_max_tokens(Protocol.OPENAI_CHAT, 1000, None, ContextPolicy(context=8192, output_cap=64, default_max_tokens=100)) == 64


def test_strict_refuses_on_anthropic_in_anthropics_words_which_claude_code_parses() -> None:
    err = refusal(Protocol.ANTHROPIC_MESSAGES, 12700, 32000, ContextPolicy(context=32768, strict=True))
    body = error_body(Protocol.ANTHROPIC_MESSAGES, err)
    message = body["error"]["message"]
    assert message == (
        "input length and `max_tokens` exceed context limit: 12700 + 32000 > 32768, decrease input length or `max_tokens` and try again"
    )
    match = CLAUDE_RETRY.search(message)
    assert match is not None and match.groups() == ("12700", "32000", "32768")
    assert body == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}


@pytest.mark.parametrize(("protocol", "param"), [(Protocol.OPENAI_CHAT, "max_tokens"), (Protocol.OPENAI_RESPONSES, "max_output_tokens")])
def test_strict_refuses_on_openai_surfaces_naming_the_output_limit(protocol: Protocol, param: str) -> None:
    err = refusal(protocol, 1000, 8000, STRICT)
    assert err.param == param
    assert err.message == "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens (1000 in the messages, 8000 in the completion)."
    assert fit_max_tokens(protocol, 1000, 7192, STRICT) == 7192


def test_a_prompt_that_does_not_fit_is_refused_in_each_protocols_words() -> None:
    anthropic = refusal(Protocol.ANTHROPIC_MESSAGES, 9000, 10, CONTEXT)
    message = error_body(Protocol.ANTHROPIC_MESSAGES, anthropic)["error"]["message"]
    assert message == "prompt is too long: 9000 tokens > 8192 maximum" and CLAUDE_TOO_LONG.match(message)  # the context, as OpenAI's says
    exact = error_body(Protocol.ANTHROPIC_MESSAGES, refusal(Protocol.ANTHROPIC_MESSAGES, 8192, 10, CONTEXT))["error"]["message"]
    assert exact == "prompt is too long: 8192 tokens > 8191 maximum"  # no room for one output token: still "n > m"
    for protocol, param in ((Protocol.OPENAI_CHAT, "messages"), (Protocol.OPENAI_RESPONSES, "input")):
        err = refusal(protocol, 8192, None, CONTEXT)
        assert err.param == param and "maximum context length is 8192 tokens" in err.message
