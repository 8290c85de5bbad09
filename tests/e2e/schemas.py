"""Twenty varied JSON Schemas for the structured-output e2e tests: nested objects, arrays, enums,
required and optional properties, bounded numbers, constants, unions. Each with a prompt that invites it."""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "maxLength": 24}

# "weather"'s kph is an integer: as a bounded "number" its fraction has no length limit in the grammar, and
# greedy SmolLM2 wrote "1.1522522514242256233333…" until max_tokens on the lean path (session 11). That is
# the model's loop, not the constraint's; "bounded_number" and "array_of_objects" keep fractional numbers.
SCHEMAS: list[tuple[str, str, dict[str, Any]]] = [
    ("person", "Describe a person.", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False}),
    ("flag", "Is the sky blue?", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"], "additionalProperties": False}),
    ("color_enum", "Pick a color.", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"], "additionalProperties": False}),
    ("bounded_number", "Give a temperature in Celsius.", {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}}, "required": ["celsius"], "additionalProperties": False}),
    ("int_array", "List three small numbers.", {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 3}}, "required": ["numbers"], "additionalProperties": False}),
    ("string_array", "Name some fruits.", {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}}, "required": ["fruits"], "additionalProperties": False}),
    ("nested_address", "Where does Alice live?", {"type": "object", "properties": {"name": NAME, "address": {"type": "object", "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"], "additionalProperties": False}}, "required": ["name", "address"], "additionalProperties": False}),
    ("optional_fields", "Describe a book.", {"type": "object", "properties": {"title": NAME, "pages": {"type": "integer", "minimum": 1, "maximum": 2000}, "subtitle": NAME}, "required": ["title"], "additionalProperties": False}),
    ("const", "Say hello as JSON.", {"type": "object", "properties": {"kind": {"const": "greeting"}, "text": NAME}, "required": ["kind", "text"], "additionalProperties": False}),
    ("array_of_objects", "List two cities with populations.", {"type": "object", "properties": {"cities": {"type": "array", "items": {"type": "object", "properties": {"name": NAME, "millions": {"type": "number", "minimum": 0, "maximum": 40}}, "required": ["name", "millions"], "additionalProperties": False}, "minItems": 1, "maxItems": 2}}, "required": ["cities"], "additionalProperties": False}),
    ("top_level_array", "List colors.", {"type": "array", "items": {"enum": ["red", "green", "blue", "black"]}, "minItems": 1, "maxItems": 4}),
    ("enum_and_int", "Rate a movie.", {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "verdict": {"enum": ["good", "bad", "meh"]}}, "required": ["stars", "verdict"], "additionalProperties": False}),
    ("nullable", "Is there a middle name?", {"type": "object", "properties": {"middle_name": {"anyOf": [NAME, {"type": "null"}]}}, "required": ["middle_name"], "additionalProperties": False}),
    ("deep_nesting", "Describe a company.", {"type": "object", "properties": {"company": {"type": "object", "properties": {"ceo": {"type": "object", "properties": {"name": NAME, "since": {"type": "integer", "minimum": 1900, "maximum": 2030}}, "required": ["name", "since"], "additionalProperties": False}}, "required": ["ceo"], "additionalProperties": False}}, "required": ["company"], "additionalProperties": False}),
    ("exclusive_bounds", "Give a percentage.", {"type": "object", "properties": {"percent": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}}, "required": ["percent"], "additionalProperties": False}),
    ("date_pattern", "When is new year?", {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}, "required": ["date"], "additionalProperties": False}),
    ("bool_array", "Answer yes or no three times.", {"type": "object", "properties": {"answers": {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3}}, "required": ["answers"], "additionalProperties": False}),
    ("union_types", "Give an id.", {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999}, {"type": "string", "maxLength": 8}]}}, "required": ["id"], "additionalProperties": False}),
    ("ref_defs", "Describe two points.", {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}}, "required": ["x", "y"], "additionalProperties": False}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}, "required": ["a", "b"], "additionalProperties": False}),
    ("weather", "What is the weather in Paris?", {"type": "object", "properties": {"city": NAME, "condition": {"enum": ["sunny", "rainy", "cloudy"]}, "humidity": {"type": "integer", "minimum": 0, "maximum": 100}, "wind": {"type": "object", "properties": {"kph": {"type": "integer", "minimum": 0, "maximum": 200}}, "required": ["kph"], "additionalProperties": False}}, "required": ["city", "condition", "humidity", "wind"], "additionalProperties": False}),
]
