"""workers.coalesce (`--stream-interval`): merged Content deltas carry exactly what the unmerged ones did,
in the same order around every other delta, with the first at once."""

from __future__ import annotations

from shared.deltas import Content, Finish, FinishReason, ToolCallStart, Usage
from workers.coalesce import Coalescer
from workers.engine import Emission


def content(rid: str, text: str, token: int) -> Emission:
    return Emission(rid, Content(text=text, token_ids=(token,), attempt=2))


def finish(rid: str) -> Emission:
    return Emission(rid, Finish(reason=FinishReason.LENGTH, usage=Usage(completion_tokens=9), attempt=2))


def test_an_interval_of_one_writes_every_delta_as_it_comes() -> None:
    step = [content("a", "x", 1), content("b", "y", 2)]
    assert Coalescer(1).take(step) is step


def test_deltas_are_merged_by_the_interval_the_first_goes_out_at_once_and_the_end_flushes_the_rest() -> None:
    coalesce = Coalescer(4)
    written: list[Emission] = []
    for i in range(10):  # one token per step for two requests at once
        written += coalesce.take([content("a", f"a{i} ", 100 + i), content("b", f"b{i} ", 200 + i)])
    written += coalesce.take([finish("a")])
    mine = [e.delta for e in written if e.request_id == "a"]
    assert [len(d.token_ids) for d in mine[:-1]] == [1, 4, 4, 1]  # the first at once, then by four, the rest before the finish
    assert "".join(d.text for d in mine[:-1]) == "".join(f"a{i} " for i in range(10))  # type: ignore[union-attr]
    assert [t for d in mine[:-1] for t in d.token_ids] == list(range(100, 110))
    assert isinstance(mine[-1], Finish) and all(d.attempt == 2 for d in mine)
    assert coalesce.holding == 1  # b's last tokens wait for its next delta


def test_any_other_delta_flushes_what_is_held_first_so_the_order_is_unchanged() -> None:
    coalesce = Coalescer(8)
    out = coalesce.take([content("a", "one ", 1), content("a", "two ", 2), content("a", "three", 3)])
    call = Emission("a", ToolCallStart(index=0, id="call_1", name="f", attempt=2))
    out += coalesce.take([call, content("a", "after", 4)])
    out += coalesce.take([finish("a")])
    kinds = [(type(e.delta).__name__, getattr(e.delta, "text", "")) for e in out]
    assert kinds == [("Content", "one "), ("Content", "two three"), ("ToolCallStart", ""), ("Content", "after"), ("Finish", "")]


def test_a_forgotten_request_drops_what_was_held() -> None:
    coalesce = Coalescer(4)
    coalesce.take([content("a", "x", 1), content("a", "y", 2)])
    coalesce.forget("a")
    assert coalesce.holding == 0 and coalesce.take([finish("a")])[0].delta.reason is FinishReason.LENGTH  # type: ignore[union-attr]
