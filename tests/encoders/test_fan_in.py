"""Several choices in one stream (chat n > 1, completions' prompts x n): each choice's deltas arrive
interleaved with the others'; the stream carries every choice under its index, closes once (one usage
chunk, one `[DONE]`), and is resumable from any event although a re-read interleaves differently."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from encoders import openai_chat, openai_completions
from encoders.fan_in import FanInEncoder, Tagged, tag_terminal
from encoders.wire import Slotted
from ingest.http.resume import event_positions
from shared.deltas import Content, Error, ErrorKind, Finish, FinishReason, StreamDelta, Usage
from shared.ir import Protocol, Request, TextCompletion

from .recorded import PROMPT_IDS, request

CHOICES: list[list[StreamDelta]] = [
    [Content(text="Hel", token_ids=(1,)), Content(text="lo", token_ids=(2,)), Finish(reason=FinishReason.STOP, usage=Usage(prompt_tokens=4, completion_tokens=2))],
    [Content(text="Bon", token_ids=(3,)), Content(text="jour", token_ids=(4,)), Content(text="!", token_ids=(5,)),
     Finish(reason=FinishReason.LENGTH, usage=Usage(prompt_tokens=4, completion_tokens=3))],
]  # fmt: skip


def chat_parts(n: int, **overrides: Any) -> tuple[Request, list[Request]]:
    parent = request(Protocol.OPENAI_CHAT, stream=True, include_usage=True, **overrides)
    return parent, [replace(parent, id=f"{parent.id}-{i}") for i in range(n)]


def interleave(order: list[int], choices: list[list[StreamDelta]] = CHOICES) -> list[Tagged]:
    """The choices' deltas in the order the slots in `order` name (each slot's deltas stay in order)."""
    cursors = [iter(c) for c in choices]
    done: set[int] = set()
    return [tag_terminal(slot, next(cursors[slot]), done, len(choices)) for slot in order]


def frames_of(encoder: FanInEncoder, tagged: list[Tagged]) -> list[tuple[int, Any]]:
    out = [pair for t in tagged for pair in encoder.feed(t)]
    return [(slot, f.data if f.data == "[DONE]" else json.loads(f.data)) for slot, f in out + encoder.finish()]


ORDER = [1, 0, 1, 0, 1, 0, 1]  # choice 1 finishes first


def test_two_chat_choices_stream_as_one_under_their_indexes_with_one_usage_and_one_done() -> None:
    parent, parts = chat_parts(2)
    frames = frames_of(openai_chat.choices_encoder(parent, parts), interleave(ORDER))
    payloads = [p for _, p in frames]
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    chunks = [ChatCompletionChunk.model_validate(p) for p in payloads[:-1]]
    assert {c.id for c in chunks} == {"chatcmpl-req01"}  # the request's id, not its parts'
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert usage_chunks == [chunks[-1]] and chunks[-1].choices == []
    assert chunks[-1].usage is not None and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (4, 5)
    # The SDK's own accumulator rebuilds both choices by index.
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(c)
    final = state.current_completion_snapshot  # (get_final_completion refuses a "length" finish: it parses)
    assert [(c.index, c.message.content, c.finish_reason) for c in final.choices] == [(0, "Hello", "stop"), (1, "Bonjour!", "length")]
    # A finished choice's slot closes nothing; the stream closes after the last choice.
    assert [slot for slot, _ in frames][-2:] == [2, 2]


def test_an_error_in_one_choice_ends_the_stream_with_that_error_then_done() -> None:
    parent, parts = chat_parts(2)
    encoder = openai_chat.choices_encoder(parent, parts)
    failing = [[CHOICES[0][0], Error(message="boom", kind=ErrorKind.INTERNAL)], CHOICES[1]]
    frames = frames_of(encoder, interleave([0, 1, 0], failing))
    payloads = [p for _, p in frames]
    assert payloads[-1] == "[DONE]" and payloads[-2]["error"]["message"] == "boom"
    assert sum(1 for p in payloads if isinstance(p, dict) and "error" in p) == 1
    assert encoder.feed(Tagged(1, CHOICES[1][1])) == [] and encoder.finish() == []  # closed: the other choice is not sent on


def test_a_stream_cut_before_every_choice_finished_still_ends_with_done() -> None:
    parent, parts = chat_parts(2)
    frames = frames_of(openai_chat.choices_encoder(parent, parts), interleave([0, 1]))
    assert frames[-1] == (2, "[DONE]") and not any(isinstance(p, dict) and p.get("usage") for _, p in frames)


def test_completions_of_two_prompts_echo_each_prompt_and_count_each_prompt_once() -> None:
    base = request(Protocol.OPENAI_COMPLETIONS, stream=True, include_usage=True)
    parts = [
        replace(base, id="req01", completion=TextCompletion(text="A:", echo=True, prompt_index=0)),
        replace(base, id="req01-p1", completion=TextCompletion(text="B:", echo=True, prompt_index=1)),
    ]
    frames = frames_of(openai_completions.choices_encoder(parts[0], parts), interleave(ORDER))
    chunks = [p for _, p in frames[:-1]]  # (the SDK streams these unvalidated: finish_reason is null until the end)
    text = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i) for i in (0, 1)}
    assert text == {0: "A:Hello", 1: "B:Bonjour!"}
    assert {c["id"] for c in chunks} == {"cmpl-req01"}
    usage = Completion.model_validate({**chunks[-1], "choices": []}).usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (2 * len(PROMPT_IDS), 5)


def per_slot(events: list[Any], slots: int) -> list[list[str]]:
    """The events' data grouped by the slot each came from (a choice's index, or the close)."""
    out: list[list[str]] = [[] for _ in range(slots)]
    for event in events:
        payload = event.data if event.data == "[DONE]" else json.loads(event.data)
        choices = payload.get("choices") if isinstance(payload, dict) else None
        out[choices[0]["index"] if choices else slots - 1].append(event.data)
    return out


def encoded(order: list[int], skip: tuple[int, ...] | None = None) -> list[Any]:
    parent, parts = chat_parts(2)
    encoder = openai_chat.choices_encoder(parent, parts)
    numbering = Slotted(3, skip)
    return [event for t in interleave(order) for event in numbering.send(encoder.feed(t))]


@pytest.mark.parametrize("resumed_order", [ORDER, [0, 0, 0, 1, 1, 1, 1]])
def test_a_resume_from_any_event_gets_every_choice_from_where_it_was_though_the_reread_interleaves_otherwise(resumed_order: list[int]) -> None:
    whole = encoded(ORDER)
    expected = per_slot(whole, 3)
    for cut in range(1, len(whole)):
        seen = whole[:cut]
        skip = event_positions(seen[-1].id, 3, "Last-Event-ID")
        rest = encoded(resumed_order, skip)
        got = per_slot(seen + rest, 3)
        assert got == expected, f"cut after event {cut}"
        # ...and a second resume from any event of the resumed stream repeats nothing either.
        for again in range(1, len(rest)):
            second = encoded(ORDER, event_positions(rest[again - 1].id, 3, "Last-Event-ID"))
            assert per_slot(seen + rest[:again] + second, 3) == expected, f"cut after {cut}, then {again}"


def test_event_ids_carry_one_position_per_choice_and_the_close() -> None:
    ids = [e.id for e in encoded(ORDER)]
    assert ids[:2] == ["0.-1.-1", "0.0.-1"]  # both openings (role chunks) first, in index order
    assert ids[-1] == "3.4.1"  # choice 0: 4 frames (role, 2 texts, finish); choice 1: 5; the close: 2
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("bad", ["3", "1.2", "1.2.3.4", "a.b.c", "1.-5.0"])
def test_a_resume_id_that_is_not_of_this_stream_is_refused_naming_the_header(bad: str) -> None:
    with pytest.raises(Exception) as caught:
        event_positions(bad, 3, "Last-Event-ID")
    assert getattr(caught.value, "param", None) == "Last-Event-ID"


def test_every_interleaving_of_the_choices_yields_the_same_frames_per_choice() -> None:
    reference = per_slot(encoded(ORDER), 3)
    for order in set(itertools.permutations(ORDER)):
        assert per_slot(encoded(list(order)), 3) == reference
