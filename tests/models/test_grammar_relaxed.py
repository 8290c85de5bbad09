"""Schemas llguidance cannot enforce whole are relaxed, not refused (models.grammar): what is left out is
named with its JSON pointer; a strict constraint with such a keyword is a 400 naming both; the relaxed
grammar still holds the rest of the schema (a generated value matches it token by token)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from llguidance import LLMatcher

from models.grammar import Grammars, json_schema_grammar, keyword_paths
from shared.errors import ApiError
from shared.ir import Constraint, ConstraintKind

# Claude Code 2.1.197's TaskCreate `metadata` (the schema that made it exit 1 at once).
TASK_METADATA = {
    "type": "object",
    "properties": {
        "subject": {"type": "string"},
        "metadata": {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {}},
    },
    "required": ["subject"],
}


@pytest.fixture(scope="module")
def grammars(tokenizer: Any) -> Grammars:
    return Grammars.for_model(tokenizer, (tokenizer.eos_token_id,))


def test_what_cannot_be_enforced_is_named_with_its_path(grammars: Grammars) -> None:
    assert grammars.relaxed(TASK_METADATA) == ("'propertyNames' at /properties/metadata",)
    assert grammars.relaxed({"type": "object", "properties": {"a": {"type": "integer"}}}) == ()
    nested = {"$defs": {"propertyNames": {"type": "object", "not": {"required": ["x"]}}}, "$ref": "#/$defs/propertyNames"}
    assert grammars.relaxed(nested) == ("'not' at /$defs/propertyNames",)  # a name under $defs is not the keyword


def test_keyword_paths_skip_property_names_and_escape_pointers() -> None:
    schema = {"properties": {"if": {"type": "string"}, "a/b": {"if": {}, "then": {}}}, "if": {}}
    assert keyword_paths(schema, "if") == ["/", "/properties/a~1b"]


def test_a_strict_constraint_with_an_unenforceable_keyword_is_a_400_naming_it(grammars: Grammars) -> None:
    strict = Constraint(kind=ConstraintKind.JSON_SCHEMA, text=json.dumps(TASK_METADATA), param="response_format", strict=True)
    with pytest.raises(ApiError) as caught:
        grammars.check_constraint(strict)
    assert caught.value.param == "response_format"
    assert "'propertyNames' at /properties/metadata" in str(caught.value) and "strict" in str(caught.value)
    grammars.check_constraint(Constraint(kind=ConstraintKind.JSON_SCHEMA, text=json.dumps(TASK_METADATA), param="response_format"))


def test_the_relaxed_grammar_still_enforces_the_rest(grammars: Grammars, tokenizer: Any) -> None:
    grammar = json_schema_grammar(TASK_METADATA)
    whole = LLMatcher.grammar_from_json_schema(TASK_METADATA, defaults={"whitespace_flexible": False})
    assert "Unimplemented keys" in LLMatcher.validate_grammar(whole, grammars.tokenizer)  # what the server answered 400 with
    assert not LLMatcher.validate_grammar(grammar, grammars.tokenizer)

    def accepts(text: str) -> bool:
        matcher = grammars.matcher(grammar)
        ok = all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
        return ok and not matcher.is_error()

    good = '{"subject":"x","metadata":{"k":1}}'
    jsonschema.validate(json.loads(good), TASK_METADATA)
    assert accepts(good)
    assert not accepts('{"metadata":{"k":1}}')  # `required` is still enforced
    assert not accepts('{"subject":7}')  # and the types of the rest
