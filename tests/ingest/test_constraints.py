"""Structured-output fields of the three protocols → one `Constraint`; bad ones name their parameter."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ingest.parsers import anthropic_messages, openai_chat, openai_responses
from shared.errors import ApiError
from shared.ir import Constraint, ConstraintKind

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "m", "input": "hi"}
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def chat(**extra: Any) -> Constraint | None:
    return openai_chat.parse({**CHAT, **extra}, request_id="r", created=0).constraint


def responses(**extra: Any) -> Constraint | None:
    return openai_responses.parse({**RESPONSES, **extra}, request_id="r", created=0).constraint


def messages(**extra: Any) -> Constraint | None:
    return anthropic_messages.parse({**MESSAGES, **extra}, request_id="r", created=0).constraint


def test_each_protocols_official_json_schema_field_becomes_the_same_kind_of_constraint() -> None:
    got = [
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}),
        responses(text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}}),
        messages(output_config={"format": {"type": "json_schema", "schema": SCHEMA}, "effort": "low"}),
    ]
    assert [c.param for c in got if c] == ["response_format.json_schema.schema", "text.format.schema", "output_config.format.schema"]
    assert all(c is not None and c.kind is ConstraintKind.JSON_SCHEMA and json.loads(c.text) == SCHEMA for c in got)


def test_json_object_and_text_formats() -> None:
    assert chat(response_format={"type": "json_object"}) == Constraint(kind=ConstraintKind.JSON_OBJECT, param="response_format")
    assert responses(text={"format": {"type": "json_object"}}) == Constraint(kind=ConstraintKind.JSON_OBJECT, param="text.format")
    assert chat(response_format={"type": "text"}) is None and responses(text={"format": {"type": "text"}}) is None


@pytest.mark.parametrize("parse", [chat, responses, messages], ids=["chat", "responses", "messages"])
def test_the_extension_fields_work_on_every_protocol(parse: Any) -> None:
    assert parse(regex="[0-9]+") == Constraint(kind=ConstraintKind.REGEX, text="[0-9]+", param="regex")
    assert parse(choice=["yes", "no"]) == Constraint(kind=ConstraintKind.CHOICE, choices=("yes", "no"), param="choice")
    assert parse(grammar='start: "a"') == Constraint(kind=ConstraintKind.LARK, text='start: "a"', param="grammar")


BAD: list[tuple[Any, dict[str, Any], str]] = [
    (chat, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema"),
    (chat, {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name"),
    (chat, {"response_format": {"type": "yaml"}}, "response_format.type"),
    (chat, {"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
    (chat, {"regex": "a", "choice": ["a"]}, "choice"),
    (chat, {"choice": []}, "choice"),
    (chat, {"choice": ["a", 3]}, "choice[1]"),
    (responses, {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"properties": 5}}}}, "text.format.schema"),
    (responses, {"text": {"format": {"type": "xml"}}}, "text.format.type"),
    (messages, {"output_config": {"format": {"type": "json_schema", "schema": {"required": "a"}}}}, "output_config.format.schema"),
    (messages, {"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type"),
    (messages, {"grammar": ""}, "grammar"),
]


@pytest.mark.parametrize(("parse", "extra", "param"), BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_structured_output_fields_name_their_parameter(parse: Any, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse(**extra)
    assert caught.value.status == 400 and caught.value.param == param
