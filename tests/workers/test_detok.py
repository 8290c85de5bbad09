"""Incremental detokenization and stop strings, with a byte-level tokenizer."""

from __future__ import annotations

import random
from typing import Any

from workers.detok import IncrementalDetokenizer, StopMatcher, _SlowDecoder, _special_ids

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


def test_the_rust_decode_stream_gives_the_same_pieces_as_the_python_method_on_the_real_tokenizer(tokenizer: Any) -> None:
    """The default model's tokenizer goes through tokenizers' DecodeStream; piece by piece it must give
    what the prefix/read-offset method gives in Python (and the whole text what `decode` gives), on text
    with multi-byte characters and on random ids (byte tokens cut mid-character, special tokens)."""
    rng = random.Random(0)
    text = "Héllo wörld! 日本語 🎉 def f(x):\n    return x**2\n" * 5
    sequences = [tokenizer.encode(text, add_special_tokens=False), [rng.randrange(len(tokenizer)) for _ in range(2000)]]
    special = sorted(_special_ids(tokenizer))
    keep = frozenset(special[:2])
    for ids in sequences:
        for kept in (frozenset(), keep):
            fast = IncrementalDetokenizer(tokenizer, kept)
            assert fast._stream is not None  # the real tokenizer has a Rust backend
            slow = _SlowDecoder(tokenizer, _special_ids(tokenizer) - kept if kept else frozenset())
            pieces = [fast.push(t) for t in ids]
            assert pieces == [slow.push(t) for t in ids]
            if not kept:
                assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
