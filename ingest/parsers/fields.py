"""Typed field readers for protocol parsers: each raises `ApiError` naming the offending parameter.

Written by hand because the checks are per-protocol wording on plain JSON already parsed by orjson;
a schema library would add a second model of every body without removing these messages.
"""

from __future__ import annotations

from typing import Any

from shared.errors import invalid

MAX_STOP = 16
MAX_TOKENS_CAP = 1_000_000
MAX_ITEMS = 4096  # any array without a tighter limit of its own (content parts, tool calls...)


def require(body: dict[str, Any], name: str, param: str | None = None) -> Any:
    """`body[name]`, or an error naming `param` (the full path, e.g. `messages[0].role`; default `name`)."""
    if body.get(name) is None:
        param = param or name
        raise invalid(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    return body[name]


def string(value: Any, param: str, *, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise invalid(f"Invalid type for '{param}': expected a string, but got {_kind(value)}.", param, "invalid_type")
    if not allow_empty and not value:
        raise invalid(f"Invalid '{param}': empty string.", param, "empty_string")
    return value


def boolean(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(f"Invalid type for '{param}': expected a boolean, but got {_kind(value)}.", param, "invalid_type")
    return value


def integer(value: Any, param: str, *, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise invalid(f"Invalid type for '{param}': expected an integer, but got {_kind(value)}.", param, "invalid_type")
    _check_range(value, param, lo, hi)
    return value


def number(value: Any, param: str, *, lo: float | None = None, hi: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"Invalid type for '{param}': expected a number, but got {_kind(value)}.", param, "invalid_type")
    _check_range(value, param, lo, hi)
    return float(value)


def array(value: Any, param: str, *, max_items: int = MAX_ITEMS, allow_empty: bool = True) -> list[Any]:
    if not isinstance(value, list):
        raise invalid(f"Invalid type for '{param}': expected an array, but got {_kind(value)}.", param, "invalid_type")
    if not allow_empty and not value:
        raise invalid(f"Invalid '{param}': empty array. Expected an array with minimum length 1.", param, "empty_array")
    if len(value) > max_items:
        raise invalid(f"Invalid '{param}': array too long. Expected at most {max_items} items, got {len(value)}.", param, "array_above_max_length")
    return value


def obj(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(f"Invalid type for '{param}': expected an object, but got {_kind(value)}.", param, "invalid_type")
    return value


def stop_list(value: Any, param: str) -> tuple[str, ...]:
    """A stop string or list of stop strings (non-empty strings, at most MAX_STOP)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else array(value, param, max_items=MAX_STOP)
    return tuple(string(s, f"{param}[{i}]" if not isinstance(value, str) else param, allow_empty=False) for i, s in enumerate(items))


def optional(body: dict[str, Any], name: str) -> Any:
    return body.get(name)


def _check_range(value: float, param: str, lo: float | None, hi: float | None) -> None:
    if lo is not None and value < lo:
        raise invalid(f"Invalid '{param}': {value} is less than the minimum of {lo}.", param, "below_min_value")
    if hi is not None and value > hi:
        raise invalid(f"Invalid '{param}': {value} is greater than the maximum of {hi}.", param, "above_max_value")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__
    )
