"""The delta types: the FinishReason table (code against its docstring and against the official SDKs'
allowed values), error kinds, usage totals, which deltas are terminal, and the frozen keyword-only shape."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest
from anthropic.types import ErrorType, StopReason
from openai.types.chat.chat_completion import Choice
from openai.types.responses import ResponseStatus
from openai.types.responses.response import IncompleteDetails

from shared.deltas import (
    TERMINAL,
    Content,
    Error,
    ErrorKind,
    Finish,
    FinishReason,
    Reasoning,
    Refusal,
    StreamDelta,
    TokenLogprob,
    ToolCallArgs,
    ToolCallStart,
    Usage,
    is_terminal,
)

ONE_OF_EACH: list[StreamDelta] = [
    Content(text="a"),
    Reasoning(text="b"),
    ToolCallStart(index=0, id="t", name="f"),
    ToolCallArgs(index=0, arguments="{}"),
    Refusal(text="no"),
    Finish(reason=FinishReason.STOP, usage=Usage()),
    Error(message="boom"),
]
DELTA_TYPES = typing.get_args(StreamDelta)
TokenBearing = Content | Reasoning | ToolCallStart | ToolCallArgs | Refusal | Finish  # every delta but Error
ROW = re.compile(r'^\s*([A-Z_]+)\s+"([a-z_]+)"\s+"([a-z_]+)"\s+([a-z_]+)(?: \(([a-z_]+)\))?\s*$')


def literal_values(annotation: object) -> set[str]:
    """The strings a `Literal[...]` (possibly inside `Optional`) allows."""
    values: set[str] = set()
    for arg in typing.get_args(annotation):
        if isinstance(arg, str):
            values.add(arg)
        else:
            values |= literal_values(arg)
    return values


def docstring_table() -> dict[str, tuple[str, str, str, str | None]]:
    """FinishReason's docstring table: name → (OpenAI chat, Anthropic, Responses status, incomplete reason)."""
    rows = {}
    for line in (FinishReason.__doc__ or "").splitlines():
        if (match := ROW.match(line)) and match.group(1) in FinishReason.__members__:
            name, openai, anthropic, status, reason = match.groups()
            rows[name] = (openai, anthropic, status, reason)
    return rows


# ---- FinishReason ----------------------------------------------------------------------------------------


def test_the_docstring_table_has_a_row_for_every_finish_reason() -> None:
    assert set(docstring_table()) == set(FinishReason.__members__)


@pytest.mark.parametrize("reason", list(FinishReason), ids=str)
def test_each_reason_maps_as_its_docstring_row_says(reason: FinishReason) -> None:
    openai, anthropic, status, incomplete = docstring_table()[reason.name]
    assert (reason.openai, reason.anthropic, reason.responses_status, reason.responses_incomplete_reason) == (openai, anthropic, status, incomplete)


@pytest.mark.parametrize("reason", list(FinishReason), ids=str)
def test_each_reason_maps_to_values_the_official_sdks_accept(reason: FinishReason) -> None:
    assert reason.openai in literal_values(Choice.model_fields["finish_reason"].annotation)
    assert reason.anthropic in literal_values(StopReason)
    assert reason.responses_status in literal_values(ResponseStatus)
    if reason.responses_incomplete_reason is not None:
        assert reason.responses_incomplete_reason in literal_values(IncompleteDetails.model_fields["reason"].annotation)


@pytest.mark.parametrize("reason", list(FinishReason), ids=str)
def test_a_responses_incomplete_reason_is_given_exactly_when_the_status_is_incomplete(reason: FinishReason) -> None:
    assert (reason.responses_incomplete_reason is not None) == (reason.responses_status == "incomplete")


def test_a_stop_sequence_is_only_told_apart_from_a_stop_by_anthropic() -> None:
    stop, sequence = FinishReason.STOP, FinishReason.STOP_SEQUENCE
    assert stop.openai == sequence.openai and stop.responses_status == sequence.responses_status
    assert stop.anthropic != sequence.anthropic == "stop_sequence"


def test_a_timeout_reads_as_a_length_cut_in_every_protocol() -> None:
    timeout, length = FinishReason.TIMEOUT, FinishReason.LENGTH
    assert (timeout.openai, timeout.anthropic, timeout.responses_status, timeout.responses_incomplete_reason) == (
        length.openai,
        length.anthropic,
        length.responses_status,
        length.responses_incomplete_reason,
    )


def test_a_cancel_is_never_reported_as_incomplete_in_responses() -> None:
    # incomplete's only reasons are max_output_tokens and content_filter, neither true of a cancel
    assert FinishReason.CANCELLED.responses_status not in ("incomplete", "completed")


def test_finish_reasons_round_trip_through_their_values() -> None:
    assert all(FinishReason(reason.value) is reason for reason in FinishReason)
    with pytest.raises(ValueError):
        FinishReason("end_turn")  # a protocol's word is not a FinishReason


# ---- ErrorKind and Usage ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(ErrorKind), ids=str)
def test_every_error_kind_is_an_anthropic_error_type(kind: ErrorKind) -> None:
    assert kind.value in literal_values(ErrorType)


def test_error_kinds_are_distinct() -> None:
    assert len({kind.value for kind in ErrorKind}) == len(ErrorKind)


def test_an_error_defaults_to_an_internal_error_of_the_first_attempt() -> None:
    error = Error(message="x")
    assert error.kind is ErrorKind.INTERNAL and error.attempt == 1


def test_total_tokens_is_prompt_plus_completion_without_counting_cached_or_reasoning_twice() -> None:
    usage = Usage(prompt_tokens=10, completion_tokens=7, cached_tokens=4, reasoning_tokens=3)
    assert usage.total_tokens == 17
    assert Usage().total_tokens == 0


# ---- the deltas ------------------------------------------------------------------------------------------


def test_one_of_each_covers_every_delta_type() -> None:
    assert {type(d) for d in ONE_OF_EACH} == set(DELTA_TYPES)


@pytest.mark.parametrize("delta", ONE_OF_EACH, ids=lambda d: type(d).__name__)
def test_only_finish_and_error_are_terminal(delta: StreamDelta) -> None:
    assert is_terminal(delta) is isinstance(delta, Finish | Error)


def test_the_terminal_types_are_delta_types() -> None:
    assert set(TERMINAL) == {Finish, Error} and set(TERMINAL) <= set(DELTA_TYPES)


@pytest.mark.parametrize("cls", [*DELTA_TYPES, Usage, TokenLogprob], ids=lambda cls: cls.__name__)
def test_every_delta_type_is_frozen_slotted_and_keyword_only(cls: type) -> None:
    assert cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert "__slots__" in cls.__dict__
    assert all(f.kw_only for f in dataclasses.fields(cls))


@pytest.mark.parametrize("delta", ONE_OF_EACH, ids=lambda d: type(d).__name__)
def test_every_delta_says_which_attempt_wrote_it_defaulting_to_the_first(delta: StreamDelta) -> None:
    assert delta.attempt == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        delta.attempt = 2  # type: ignore[misc]


@pytest.mark.parametrize("delta", [d for d in ONE_OF_EACH if not isinstance(d, Error)], ids=lambda d: type(d).__name__)
def test_every_token_bearing_delta_carries_its_token_ids(delta: TokenBearing) -> None:
    assert dataclasses.replace(delta, token_ids=(5, 6)).token_ids == (5, 6)

