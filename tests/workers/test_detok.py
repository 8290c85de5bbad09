"""Incremental detokenization and stop strings, with a byte-level tokenizer."""

from __future__ import annotations

from workers.detok import IncrementalDetokenizer, StopMatcher

from .fakes import ByteTokenizer


def stream(text: str) -> list[str]:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    return [detok.push(t) for t in tok.encode(text)]


def test_multibyte_characters_are_never_split() -> None:
    pieces = stream("é✓ ok")
    assert "".join(pieces) == "é✓ ok"
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[:2] == ["", "é"]  # the first byte of é is held until the second arrives


def feed(stops: tuple[str, ...], chunks: list[str]) -> tuple[str, str | None]:
    matcher = StopMatcher(stops)
    out = ""
    for chunk in chunks:
        text, matched = matcher.push(chunk)
        out += text
        if matched:
            return out, matched
    return out + matcher.flush(), None


def test_a_stop_string_split_across_tokens_is_caught_and_not_emitted() -> None:
    assert feed(("END",), ["one two E", "N", "D three"]) == ("one two ", "END")


def test_text_that_only_looks_like_a_stop_start_is_released() -> None:
    matcher = StopMatcher(("END",))
    assert matcher.push("the E") == ("the ", None)
    assert matcher.push("ND") == ("", "END")
    matcher = StopMatcher(("END",))
    assert matcher.push("the E") == ("the ", None)
    assert matcher.push("asy") == ("Easy", None)


def test_the_earliest_of_several_stops_wins_and_held_text_flushes_at_the_end() -> None:
    assert feed(("cd", "b"), ["abcd"]) == ("a", "b")
    assert feed(("xyz",), ["abc x"]) == ("abc x", None)
