"""ingest.parsers.fields: each reader returns the value it checked, or raises a 400 `ApiError` whose
`param` is the path it was given and whose message says what was expected and what came."""

from __future__ import annotations

from typing import Any

import pytest

from ingest.parsers import fields
from shared.errors import ApiError


def refused(read: Any, *args: Any, **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        read(*args, **kwargs)
    assert caught.value.status == 400 and caught.value.kind == "invalid_request"
    return caught.value


def test_require_names_the_full_path_of_a_missing_or_null_field() -> None:
    assert fields.require({"model": "m"}, "model") == "m"
    error = refused(fields.require, {"role": None}, "role", "messages[3].role")
    assert (error.param, error.code) == ("messages[3].role", "missing_required_parameter")
    assert "'messages[3].role'" in error.message
    assert refused(fields.require, {}, "model").param == "model"


@pytest.mark.parametrize(
    ("read", "good", "bad", "came"),
    [
        (fields.string, "hi", 3, "a number"),
        (fields.boolean, True, "true", "a string"),
        (fields.integer, 3, "3", "a string"),
        (fields.number, 0.5, None, "null"),
        (fields.array, [1], {"a": 1}, "an object"),
        (fields.obj, {"a": 1}, [1], "an array"),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_each_reader_returns_its_kind_and_refuses_another_naming_what_came(read: Any, good: Any, bad: Any, came: str) -> None:
    assert read(good, "p") == good
    error = refused(read, bad, "tools[0].x")
    assert (error.param, error.code) == ("tools[0].x", "invalid_type")
    assert error.message.endswith(f"but got {came}.")


def test_booleans_are_not_numbers_and_whole_floats_are_integers() -> None:
    assert refused(fields.integer, True, "n").code == "invalid_type"
    assert refused(fields.number, False, "temperature").code == "invalid_type"
    assert fields.integer(8.0, "max_tokens") == 8 and isinstance(fields.integer(8.0, "max_tokens"), int)
    assert refused(fields.integer, 8.5, "max_tokens").code == "invalid_type"
    assert fields.number(1, "top_p") == 1.0 and isinstance(fields.number(1, "top_p"), float)


def test_ranges_are_inclusive_and_name_the_bound() -> None:
    assert fields.integer(1, "n", lo=1, hi=8) == 1 and fields.integer(8, "n", lo=1, hi=8) == 8
    low = refused(fields.integer, 0, "n", lo=1)
    assert (low.code, low.message) == ("below_min_value", "Invalid 'n': 0 is less than the minimum of 1.")
    high = refused(fields.number, 2.5, "temperature", hi=2)
    assert (high.param, high.code) == ("temperature", "above_max_value") and "maximum of 2" in high.message


def test_arrays_and_strings_may_be_required_non_empty_and_arrays_are_capped() -> None:
    assert refused(fields.array, [], "messages", allow_empty=False).code == "empty_array"
    assert refused(fields.string, "", "stop[0]", allow_empty=False).code == "empty_string"
    assert fields.array([0] * fields.MAX_ITEMS, "x") == [0] * fields.MAX_ITEMS
    too_long = refused(fields.array, [0] * (fields.MAX_ITEMS + 1), "x")
    assert too_long.code == "array_above_max_length" and str(fields.MAX_ITEMS + 1) in too_long.message


def test_a_stop_is_one_string_or_a_list_of_non_empty_strings_naming_the_bad_item() -> None:
    assert fields.stop_list(None, "stop") == ()
    assert fields.stop_list("END", "stop") == ("END",)
    assert fields.stop_list(["a", "b"], "stop") == ("a", "b")
    assert refused(fields.stop_list, ["a", ""], "stop").param == "stop[1]"
    assert refused(fields.stop_list, ["a", 5], "stop").param == "stop[1]"
    assert refused(fields.stop_list, "", "stop").param == "stop"
    assert refused(fields.stop_list, ["s"] * (fields.MAX_STOP + 1), "stop").code == "array_above_max_length"
