"""encoders.registry: the encoder half of the protocol registry (one `Codec` per protocol)."""

from __future__ import annotations

import pytest

from encoders import registry
from shared.ir import Protocol
from shared.protocols import specs

from .recorded import SCENARIOS, request


def test_every_registered_spec_has_a_codec_under_its_own_protocol() -> None:
    for spec in specs():
        assert registry.codec(spec.protocol).protocol is spec.protocol


def test_an_unregistered_protocol_is_a_key_error_that_names_it_and_says_where_codecs_come_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Protocol, "_known", dict(Protocol._known))  # the name defined here does not outlive the test
    with pytest.raises(KeyError, match=r"nocodec_test.*--protocol-module"):
        registry.codec(Protocol.define("nocodec_test"))


def test_only_anthropic_has_a_keep_alive_event_of_its_own() -> None:
    """Anthropic streams `ping` events; the OpenAI protocols keep alive with SSE comments (the HTTP layer's)."""
    for protocol in (Protocol.OPENAI_CHAT, Protocol.OPENAI_RESPONSES, Protocol.OPENAI_COMPLETIONS):
        codec = registry.codec(protocol)
        assert codec.ping(codec.stream_encoder(request(protocol)))() == []
    messages = registry.MESSAGES
    (frame,) = messages.ping(messages.stream_encoder(request(Protocol.ANTHROPIC_MESSAGES)))()
    assert frame.event == "ping"


def test_chats_choices_combine_into_one_body_with_each_choice_at_its_index() -> None:
    """(Completions' combine also picks `best_of`'s most likely: tests/encoders/test_openai_completions.py.)"""
    codec = registry.CHAT
    req = request(Protocol.OPENAI_CHAT)
    accumulators = []
    for scenario in ("plain_text", "max_tokens"):
        accumulator = codec.accumulator(req)
        for delta in SCENARIOS[scenario]:
            accumulator.feed(delta)
        accumulators.append(accumulator)
    body = codec.combine(req, accumulators)
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    assert [choice["finish_reason"] for choice in body["choices"]] == ["stop", "length"]
