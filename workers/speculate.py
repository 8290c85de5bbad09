"""Model-free speculative decoding's proposer: prompt lookup (n-gram) over a sequence's own tokens (torch-free).

The longest n-gram, n from `ngram_max` down to `ngram_min`, that ends the sequence (prompt + output) and
occurred earlier in it proposes the tokens that followed its most recent earlier occurrence, up to k of
them. No draft model: what a coding agent writes is mostly in its context already (the file it edits, a
path, a tool result), and there the proposals are right. The engine checks them against the model in one
step (`workers.scheduler.Draft`), so a wrong proposal costs rows of a step, never a wrong token.

Written here rather than taken from a library: transformers' prompt-lookup decoding scans the whole input
with tensor ops each call and drives its own generate loop; vLLM's proposer lives in vLLM. This one keeps,
per sequence and per n, a dict from each n-gram to the end of its latest occurrence, updated with each
token (O(ngram_max - ngram_min + 1) per token), so a proposal costs a few dict lookups whatever the length.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class NgramIndex:
    """The n-grams of one token sequence, n in [lo, hi], each mapped to the end (exclusive) of its latest
    occurrence that is not the sequence's current suffix. `extend` it with every token the sequence gets."""

    lo: int
    hi: int
    tokens: list[int] = field(default_factory=list)
    _seen: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._seen = {n: {} for n in range(self.lo, self.hi + 1)}
        given, self.tokens = self.tokens, []
        self.extend(given)

    def extend(self, new: list[int]) -> None:
        toks = self.tokens
        for token in new:
            # the n-grams ending at the current last token become "earlier" ones once a token follows them
            end = len(toks)
            for n, seen in self._seen.items():
                if end >= n:
                    seen[tuple(toks[end - n : end])] = end
            toks.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix n-gram."""
        toks = self.tokens
        end = len(toks)
        for n in range(self.hi, self.lo - 1, -1):
            if end < n:
                continue
            at = self._seen[n].get(tuple(toks[end - n :]))
            if at is not None:
                return toks[at : at + k]
        return []
