"""shared.protocols: the pure half of the protocol registry (routes, CLI names, error shapes, finish words)."""

from __future__ import annotations

import pytest

from shared import protocols
from shared.deltas import FinishReason
from shared.ir import Protocol


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry and the protocol names as they are, restored after the test (nothing it defines leaks)."""
    monkeypatch.setattr(protocols, "_SPECS", dict(protocols._SPECS))
    monkeypatch.setattr(Protocol, "_known", dict(Protocol._known))


def test_the_four_built_in_protocols_have_distinct_routes_and_names() -> None:
    built_in = {s.protocol: (s.path, s.name, s.errors) for s in protocols.specs()}
    assert built_in == {
        Protocol.OPENAI_CHAT: ("/v1/chat/completions", "openai", protocols.OPENAI_ERRORS),
        Protocol.ANTHROPIC_MESSAGES: ("/v1/messages", "anthropic", protocols.ANTHROPIC_ERRORS),
        Protocol.OPENAI_RESPONSES: ("/v1/responses", "responses", protocols.OPENAI_ERRORS),
        Protocol.OPENAI_COMPLETIONS: ("/v1/completions", "completions", protocols.OPENAI_ERRORS),
    }


def test_context_errors_use_each_protocols_own_parameter_names() -> None:
    responses, completions = protocols.spec(Protocol.OPENAI_RESPONSES), protocols.spec(Protocol.OPENAI_COMPLETIONS)
    assert (responses.prompt_param, responses.max_tokens_param) == ("input", "max_output_tokens")
    assert (completions.prompt_param, completions.max_tokens_param) == ("prompt", "max_tokens")
    assert protocols.spec(Protocol.ANTHROPIC_MESSAGES).prompt_param == "messages"


@pytest.mark.parametrize("reason", list(FinishReason), ids=lambda r: r.value)
def test_finish_labels_are_each_protocols_own_words(reason: FinishReason) -> None:
    assert protocols.spec(Protocol.OPENAI_CHAT).finish_label(reason) == reason.openai
    assert protocols.spec(Protocol.ANTHROPIC_MESSAGES).finish_label(reason) == reason.anthropic
    label = protocols.spec(Protocol.OPENAI_RESPONSES).finish_label(reason)
    assert label.split(" ")[0] == reason.responses_status
    assert (reason.responses_incomplete_reason or "") in label


def test_a_new_protocol_registers_and_a_taken_route_or_name_is_refused(registry: None) -> None:
    toy = Protocol.define("toy_spec_test")
    with pytest.raises(KeyError, match="toy_spec_test"):
        protocols.spec(toy)
    with pytest.raises(ValueError, match="/v1/messages"):
        protocols.register_spec(protocols.ProtocolSpec(protocol=toy, path="/v1/messages", name="toy"))
    with pytest.raises(ValueError, match="openai"):
        protocols.register_spec(protocols.ProtocolSpec(protocol=toy, path="/v1/toy", name="openai"))
    registered = protocols.register_spec(protocols.ProtocolSpec(protocol=toy, path="/v1/toy", name="toy"))
    assert protocols.spec(toy) is registered and registered in protocols.specs()
    again = protocols.register_spec(protocols.ProtocolSpec(protocol=toy, path="/v1/toy2", name="toy"))  # its own row: replaced
    assert protocols.spec(toy) is again and len([s for s in protocols.specs() if s.protocol is toy]) == 1

