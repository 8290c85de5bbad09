"""The request IR: frozen keyword-only types with tuples, message text, greedy detection, custom tools,
`resolve()`'s precedence (request → model defaults → FALLBACK) and `apply_defaults()` (no fallback)."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from shared import ir
from shared.ir import (
    FALLBACK,
    ImagePart,
    Message,
    Protocol,
    Request,
    Role,
    SamplingParams,
    TextPart,
    ToolKind,
    ToolSpec,
    apply_defaults,
    custom_tools,
    resolve,
)

IR_TYPES = [cls for _, cls in inspect.getmembers(ir, inspect.isclass) if dataclasses.is_dataclass(cls) and cls.__module__ == ir.__name__]


def test_the_module_defines_the_ir_types_the_checks_below_walk() -> None:
    assert {cls.__name__ for cls in IR_TYPES} >= {"Request", "Message", "SamplingParams", "ToolSpec", "Constraint", "Thinking"}


@pytest.mark.parametrize("cls", IR_TYPES, ids=lambda cls: cls.__name__)
def test_every_ir_type_is_frozen_slotted_and_keyword_only(cls: type) -> None:
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    assert params.frozen
    assert "__slots__" in cls.__dict__
    assert all(f.kw_only for f in dataclasses.fields(cls))


@pytest.mark.parametrize("cls", IR_TYPES, ids=lambda cls: cls.__name__)
def test_no_ir_field_holds_a_mutable_collection(cls: type) -> None:
    for f in dataclasses.fields(cls):
        annotation = str(f.type)
        assert not re.search(r"\b(list|dict|set)\[", annotation), f"{cls.__name__}.{f.name}: {annotation}"
        if f.default is not dataclasses.MISSING:
            assert not isinstance(f.default, list | dict | set), f"{cls.__name__}.{f.name}"


def test_a_message_cannot_be_changed_after_it_is_built() -> None:
    message = Message(role=Role.USER, content=(TextPart(text="hi"),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.role = Role.ASSISTANT  # type: ignore[misc]


def test_fields_cannot_be_passed_by_position() -> None:
    with pytest.raises(TypeError):
        TextPart("hi")  # type: ignore[call-arg]


def test_message_text_joins_the_text_parts_in_order_and_skips_images() -> None:
    message = Message(
        role=Role.USER,
        content=(TextPart(text="look "), ImagePart(url="data:image/png;base64,AA", media_type="image/png"), TextPart(text="here")),
    )
    assert message.text == "look here"


def test_a_message_with_no_text_parts_has_empty_text() -> None:
    assert Message(role=Role.ASSISTANT).text == ""
    assert Message(role=Role.USER, content=(ImagePart(url="u"),)).text == ""


@pytest.mark.parametrize(
    ("params", "greedy"),
    [
        (SamplingParams(temperature=0.0), True),
        (SamplingParams(top_k=1), True),
        (SamplingParams(temperature=0.7, top_k=1), True),
        (SamplingParams(temperature=0.7), False),
        (SamplingParams(top_k=0), False),  # 0: no top-k cut
        (SamplingParams(), False),  # unset is not greedy: resolution may still make it so
    ],
)
def test_greedy_means_temperature_zero_or_a_top_k_of_one(params: SamplingParams, greedy: bool) -> None:
    assert params.greedy is greedy


def test_every_request_gets_its_own_default_sampling_and_thinking() -> None:
    a = Request(id="a", protocol=Protocol.OPENAI_CHAT, model="m", messages=())
    b = Request(id="b", protocol=Protocol.OPENAI_CHAT, model="m", messages=())
    assert a.sampling == SamplingParams() and a.thinking == ir.Thinking()
    assert a.sampling is not b.sampling


def test_protocol_values_are_distinct() -> None:
    assert len({p.value for p in Protocol}) == len(Protocol)


def test_custom_tools_names_only_the_custom_ones() -> None:
    request = Request(
        id="r",
        protocol=Protocol.OPENAI_RESPONSES,
        model="m",
        messages=(),
        tools=(
            ToolSpec(name="get_weather"),
            ToolSpec(name="apply_patch", kind=ToolKind.CUSTOM),
            ToolSpec(name="sql", kind=ToolKind.CUSTOM),
        ),
    )
    assert custom_tools(request) == frozenset({"apply_patch", "sql"})


def test_a_request_without_tools_has_no_custom_tools() -> None:
    assert custom_tools(Request(id="r", protocol=Protocol.OPENAI_CHAT, model="m", messages=())) == frozenset()


# ---- resolve() ------------------------------------------------------------------------------------------


def test_an_empty_request_with_no_model_defaults_gets_the_fallback() -> None:
    resolved = resolve(SamplingParams(), {})
    assert {name: getattr(resolved, name) for name in FALLBACK} == FALLBACK
    assert resolved.max_tokens is None and resolved.seed is None


def test_model_defaults_win_over_the_fallback() -> None:
    resolved = resolve(SamplingParams(), {"temperature": 0.2, "top_p": 0.9, "top_k": 40})
    assert (resolved.temperature, resolved.top_p, resolved.top_k) == (0.2, 0.9, 40)
    assert resolved.min_p == FALLBACK["min_p"] and resolved.repetition_penalty == FALLBACK["repetition_penalty"]


def test_the_requests_own_values_win_over_model_defaults() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.5, top_k=7, min_p=0.1, repetition_penalty=1.3, max_tokens=5)
    resolved = resolve(params, {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 99})
    assert resolved == params


def test_a_falsy_request_value_is_still_the_requests_choice() -> None:
    resolved = resolve(SamplingParams(temperature=0.0, top_k=0, min_p=0.0), {"temperature": 0.7, "top_k": 40, "min_p": 0.1})
    assert (resolved.temperature, resolved.top_k, resolved.min_p) == (0.0, 0, 0.0)
    assert resolved.greedy


def test_a_falsy_model_default_is_used_rather_than_the_fallback() -> None:
    resolved = resolve(SamplingParams(), {"temperature": 0.0, "top_p": 0.0})
    assert resolved.temperature == 0.0 and resolved.top_p == 0.0


def test_max_tokens_comes_from_the_model_defaults_only_when_the_request_sets_none() -> None:
    assert resolve(SamplingParams(), {"max_tokens": 256}).max_tokens == 256
    assert resolve(SamplingParams(max_tokens=8), {"max_tokens": 256}).max_tokens == 8


def test_a_max_tokens_default_given_as_a_float_becomes_an_int() -> None:
    max_tokens = resolve(SamplingParams(), {"max_tokens": 256.0}).max_tokens
    assert max_tokens == 256 and isinstance(max_tokens, int)


def test_defaults_for_fields_resolve_does_not_own_are_ignored() -> None:
    resolved = resolve(SamplingParams(), {"seed": 7, "presence_penalty": 1.5})
    assert resolved.seed is None and resolved.presence_penalty == 0.0


def test_resolution_leaves_every_other_field_as_the_request_set_it() -> None:
    params = SamplingParams(seed=3, stop=("END",), stop_token_ids=(2,), logit_bias=((5, -1.0),), n=2, min_tokens=4, logprobs=True, top_logprobs=3)
    resolved = resolve(params, {"temperature": 0.2, "max_tokens": 64})
    unowned = [f.name for f in dataclasses.fields(SamplingParams) if f.name not in FALLBACK and f.name != "max_tokens"]
    assert {n: getattr(resolved, n) for n in unowned} == {n: getattr(params, n) for n in unowned}


@pytest.mark.parametrize("defaults", [{}, {"temperature": 0.3}, {"top_k": 20, "max_tokens": 12}])
def test_no_fallback_field_is_none_after_resolution(defaults: dict[str, float | int]) -> None:
    resolved = resolve(SamplingParams(top_p=0.8), defaults)
    assert all(getattr(resolved, name) is not None for name in FALLBACK)


def test_resolving_twice_with_the_same_defaults_changes_nothing() -> None:
    defaults: dict[str, float | int] = {"temperature": 0.4, "max_tokens": 32}
    once = resolve(SamplingParams(top_k=5), defaults)
    assert resolve(once, defaults) == once
    assert resolve(once, {"temperature": 1.5, "top_k": 99, "max_tokens": 1}) == once  # nothing left unset to fill



def test_a_top_k_default_given_as_a_float_becomes_an_int() -> None:
    top_k = resolve(SamplingParams(), {"top_k": 40.0}).top_k
    assert top_k == 40 and isinstance(top_k, int)


# ---- apply_defaults() -----------------------------------------------------------------------------------


def test_apply_defaults_fills_only_the_fields_it_is_given_and_leaves_the_rest_unset() -> None:
    applied = apply_defaults(SamplingParams(), {"temperature": 0.3, "max_tokens": 64})
    assert (applied.temperature, applied.max_tokens) == (0.3, 64)
    assert all(getattr(applied, name) is None for name in FALLBACK if name != "temperature")


def test_apply_defaults_never_overrides_the_requests_own_values() -> None:
    params = SamplingParams(temperature=0.0, top_k=0, max_tokens=5)
    assert apply_defaults(params, {"temperature": 0.9, "top_k": 40, "max_tokens": 99}) == params


def test_apply_defaults_with_nothing_given_changes_nothing() -> None:
    assert apply_defaults(SamplingParams(top_p=0.5), {}) == SamplingParams(top_p=0.5)


def test_apply_defaults_then_resolve_is_resolve_over_the_same_defaults() -> None:
    defaults: dict[str, float | int] = {"top_p": 0.7, "max_tokens": 10}
    params = SamplingParams(temperature=0.5)
    assert resolve(apply_defaults(params, defaults), {}) == resolve(params, defaults)
