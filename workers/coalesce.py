"""`--stream-interval`: several tokens of one request in one Content delta (vLLM's flag of that name).

With an interval of k > 1, a request's Content deltas are held and merged (text, token ids and logprobs
joined, in order) until they hold k tokens, and then written as one: a k-th of the deltas, Redis
writes, SSE events and client reads per token, for clients that do not need every token the moment it
is sampled (a batch job, a dashboard, a proxy that buffers anyway). What is held goes out at once, ahead
of it, when any other delta of the request comes (a tool call, reasoning, its terminal event), so the
order of everything a client sees is unchanged; a request's first Content goes out at once (time to
first token is not traded). An interval of 1 (the default) changes nothing.

Held deltas are not written yet, so a worker that dies holding some has emitted fewer tokens than it
sampled: the request's next attempt resumes after what was written (exactly once, as always). Pure: the
worker loop (workers.loop) passes each step's emissions through `take` before writing them.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.deltas import Content
from workers.engine import Emission


@dataclass(slots=True)
class _Held:
    content: Content | None = None
    started: bool = False  # the request's first Content went out


class Coalescer:
    """Holds and merges each request's Content emissions until `interval` tokens (see the module)."""

    def __init__(self, interval: int) -> None:
        self.interval = max(1, interval)
        self._held: dict[str, _Held] = {}

    def take(self, emissions: list[Emission]) -> list[Emission]:
        """What to write now of `emissions` (in order, behind what was held), holding the rest."""
        if self.interval == 1:
            return emissions
        out: list[Emission] = []
        for e in emissions:
            held = self._held.setdefault(e.request_id, _Held())
            delta = e.delta
            if type(delta) is Content and not delta.prompt_logprobs and not e.terminal:
                merged = delta if held.content is None else _join(held.content, delta)
                if held.started and len(merged.token_ids) < self.interval:
                    held.content = merged
                    continue
                held.content, held.started = None, True
                out.append(Emission(e.request_id, merged))
                continue
            if held.content is not None:
                out.append(Emission(e.request_id, held.content))
                held.content = None
            out.append(e)
            if e.terminal:
                del self._held[e.request_id]
        return out

    def forget(self, request_id: str) -> None:
        """Drop what is held for a request this worker no longer runs (another attempt owns it)."""
        self._held.pop(request_id, None)

    @property
    def holding(self) -> int:
        """Requests with deltas held now."""
        return sum(1 for h in self._held.values() if h.content is not None)


def _join(first: Content, then: Content) -> Content:
    return Content(
        text=first.text + then.text,
        token_ids=first.token_ids + then.token_ids,
        attempt=then.attempt,
        logprobs=first.logprobs + then.logprobs,
    )
