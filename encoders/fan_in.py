"""Several choices in one stream: chat `n` > 1, legacy completions with `n` > 1 or several prompts.

Each choice is its own request with its own delta stream (ingest.http.app.fan_out), so its deltas arrive
interleaved with the other choices' in whatever order the worker wrote them. Each choice is encoded
by its protocol's encoder for one choice (its `index`, `closes=False`); this encoder routes a
choice's deltas to it and closes the stream once for all of them: the usage of every choice (when
asked for) and `[DONE]` after the last choice finished, or at once after an error in any of them
(that choice's error event, then `[DONE]`, as vLLM ends such a stream).

Every choice's opening (chat: its role chunk) goes out first, in index order, when the first delta
arrives, as vLLM does: the `openai` SDK's stream accumulator builds its snapshot from the first chunk
and fails on a first chunk whose index is not 0.

Frames come out tagged with their slot: the choice's number, or `len(members)` for the close. The
wire (encoders.wire) numbers each slot's frames on their own, which is what makes a stream whose
interleaving is not reproducible resumable anyway: a choice re-encoded from its first delta yields
the same frames in the same order, whatever the other choices did meanwhile.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from encoders.frames import Frame
from shared.deltas import Error, Finish, StreamDelta, Usage, is_terminal


class Member(Protocol):
    """One choice's encoder (ChatStreamEncoder, CompletionStreamEncoder with `closes=False`)."""

    def feed(self, delta: StreamDelta) -> list[Frame]: ...
    def opening(self) -> list[Frame]: ...
    def close(self, usage: Usage | None) -> list[Frame]: ...


@dataclass(frozen=True, slots=True)
class Tagged:
    """A delta of choice `slot`; `last`: the stream's final delta (every choice done, or an error)."""

    slot: int
    delta: StreamDelta
    last: bool = False


class FanInEncoder:
    """Tagged deltas of several choices → (slot, frame) pairs of one stream."""

    def __init__(self, members: Sequence[Member], total: Callable[[list[Usage]], Usage]) -> None:
        self._members = list(members)
        self._total = total  # the usages of all choices → the stream's usage (the protocol's rule)
        self._usage: dict[int, Usage] = {}
        self._closed = False
        self._opened = False

    @property
    def close_slot(self) -> int:
        return len(self._members)

    def feed(self, tagged: Tagged) -> list[tuple[int, Frame]]:
        if self._closed or tagged.slot in self._usage:
            return []
        delta = tagged.delta
        out = [] if self._opened else [(slot, frame) for slot, member in enumerate(self._members) for frame in member.opening()]
        self._opened = True
        out += [(tagged.slot, frame) for frame in self._members[tagged.slot].feed(delta)]
        if isinstance(delta, Error):
            return out + self._close(None)
        if isinstance(delta, Finish):
            self._usage[tagged.slot] = delta.usage
            if len(self._usage) == len(self._members):
                out += self._close(self._total([self._usage[i] for i in range(len(self._members))]))
        return out

    def finish(self) -> list[tuple[int, Frame]]:
        """The close, if the deltas ended without one (a stream cut short still gets `[DONE]`)."""
        return [] if self._closed else self._close(None)

    def _close(self, usage: Usage | None) -> list[tuple[int, Frame]]:
        self._closed = True
        return [(self.close_slot, frame) for frame in self._members[0].close(usage)]


def is_last(tagged: Tagged) -> bool:
    return tagged.last


def tag_terminal(slot: int, delta: StreamDelta, done: set[int], slots: int) -> Tagged:
    """Tag a choice's delta; the stream's last is an error or the last choice's terminal delta."""
    if is_terminal(delta):
        done.add(slot)
    return Tagged(slot, delta, last=isinstance(delta, Error) or len(done) == slots)
