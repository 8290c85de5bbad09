"""The reasoning seal: what a client sends back opens only if this deployment sealed it, unaltered."""

from __future__ import annotations

from shared.ir import Message, Protocol, Request, Role
from shared.seal import Sealer, new_key, open_reasoning


def turn(*sealed: tuple[str, str], reasoning: str | None = None) -> Request:
    message = Message(role=Role.ASSISTANT, sealed_reasoning=sealed, reasoning=reasoning)
    return Request(id="r", protocol=Protocol.ANTHROPIC_MESSAGES, model="m", messages=(message,))


def test_a_sealed_span_opens_to_its_text_and_a_tampered_or_foreign_one_does_not() -> None:
    sealer = Sealer(new_key())
    blob = sealer.seal("Six sevens are 42.")
    assert blob != sealer.seal("Six sevens are 42.")  # a fresh nonce each time
    assert sealer.open(blob) == "Six sevens are 42."
    flipped = blob[:20] + ("A" if blob[20] != "A" else "B") + blob[21:]
    assert sealer.open(flipped) is None
    assert Sealer(new_key()).open(blob) is None
    assert sealer.open("not base64!") is None and sealer.open("") is None


def test_open_reasoning_restores_verified_spans_and_drops_the_rest() -> None:
    sealer = Sealer(new_key())
    good, other = sealer.seal("first"), sealer.seal("second")
    opened = open_reasoning(turn(("first", good), ("", other), ("forged", sealer.seal("real")), ("x", "junk")), sealer)
    assert opened.messages[0].reasoning == "firstsecond" and opened.messages[0].sealed_reasoning == ()
    assert open_reasoning(turn(("first", good)), None).messages[0].reasoning is None
    kept = open_reasoning(turn(("", good), reasoning="plain "), sealer)
    assert kept.messages[0].reasoning == "plain first"
