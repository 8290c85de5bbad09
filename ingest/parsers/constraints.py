"""Structured-output fields of every protocol → the IR's `Constraint` (pure; raises `ApiError` naming the parameter).

Owns: the official fields (OpenAI chat `response_format`, Responses `text.format`, Anthropic
`output_config.format`) and the extension fields every protocol accepts beside them, as vLLM does:
`regex` (a regular expression the whole output matches), `choice` (a list of strings, the output is
one of them) and `grammar` (a Lark grammar in llguidance's dialect). At most one of all these per
request. A JSON Schema is checked here against its metaschema (the `jsonschema` library); whether
llguidance can compile it for this tokenizer is checked by the app (`PromptRenderer.check_constraint`).
Must not: do I/O or import llguidance (that check needs the tokenizer, which the app holds).
"""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import orjson

from ingest.parsers import fields as f
from shared.errors import invalid
from shared.ir import Constraint, ConstraintKind, ToolSpec

EXTENSIONS = ("regex", "choice", "grammar")
MAX_CHOICES = 256


def check_json_schema(schema: Any, param: str) -> dict[str, Any]:
    """A client's JSON Schema: an object that passes its metaschema (draft from `$schema`, else the latest)."""
    if not isinstance(schema, dict):
        raise invalid(f"Invalid type for '{param}': a JSON Schema must be an object.", param, "invalid_json_schema")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise invalid(f"Invalid schema for '{param}': {exc.message}", param, "invalid_json_schema") from None
    return schema


def json_schema(schema: Any, param: str, *, strict: bool = False) -> Constraint:
    """`strict`: the client asked for the schema to be enforced whole (OpenAI's `strict: true`), so one that
    the constraint engine cannot enforce is refused (models.grammar) instead of relaxed."""
    return Constraint(kind=ConstraintKind.JSON_SCHEMA, text=orjson.dumps(check_json_schema(schema, param)).decode(), param=param, strict=strict)


def json_object(param: str) -> Constraint:
    return Constraint(kind=ConstraintKind.JSON_OBJECT, param=param)


def extension(body: dict[str, Any]) -> Constraint | None:
    """The extension field a body carries (`regex`, `choice`, `grammar`), or None; two of them → 400."""
    given = [name for name in EXTENSIONS if body.get(name) is not None]
    if len(given) > 1:
        raise invalid(f"Only one of 'regex', 'choice' and 'grammar' may be given, got {given}.", given[1], "conflicting_constraints")
    if not given:
        return None
    name = given[0]
    if name == "choice":
        items = f.array(body[name], name, max_items=MAX_CHOICES, allow_empty=False)
        return Constraint(kind=ConstraintKind.CHOICE, choices=tuple(f.string(c, f"choice[{i}]", allow_empty=False) for i, c in enumerate(items)), param=name)
    kind = ConstraintKind.REGEX if name == "regex" else ConstraintKind.LARK
    return Constraint(kind=kind, text=f.string(body[name], name, allow_empty=False), param=name)


def one_of(body: dict[str, Any], official: Constraint | None) -> Constraint | None:
    """The request's constraint: the official field's or an extension's, never both."""
    ext = extension(body)
    if ext is not None and official is not None:
        raise invalid(f"'{ext.param}' cannot be combined with '{official.param}'.", ext.param, "conflicting_constraints")
    return ext or official


def chat_response_format(value: Any) -> Constraint | None:
    """OpenAI chat `response_format`: text | json_object | json_schema {name, schema, strict}."""
    if value is None:
        return None
    fmt = f.obj(value, "response_format")
    kind = f.string(f.require(fmt, "type", "response_format.type"), "response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object("response_format")
    if kind == "json_schema":
        spec = f.obj(f.require(fmt, "json_schema", "response_format.json_schema"), "response_format.json_schema")
        f.string(f.require(spec, "name", "response_format.json_schema.name"), "response_format.json_schema.name", allow_empty=False)
        strict = spec.get("strict") is not None and f.boolean(spec["strict"], "response_format.json_schema.strict")
        return json_schema(spec.get("schema") or {}, "response_format.json_schema.schema", strict=bool(strict))
    raise invalid(f"Invalid value: '{kind}'. Supported values are: 'text', 'json_object' and 'json_schema'.", "response_format.type", "invalid_value")


def responses_text_format(value: Any) -> Constraint | None:
    """Responses `text.format`: text | json_object | json_schema {name, schema, strict} (flat)."""
    if value is None:
        return None
    text = f.obj(value, "text")
    if text.get("format") is None:
        return None
    fmt = f.obj(text["format"], "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object("text.format")
    if kind == "json_schema":
        f.string(f.require(fmt, "name", "text.format.name"), "text.format.name", allow_empty=False)
        strict = fmt.get("strict") is not None and f.boolean(fmt["strict"], "text.format.strict")
        return json_schema(f.require(fmt, "schema", "text.format.schema"), "text.format.schema", strict=bool(strict))
    raise invalid(f"Invalid value: {kind!r}. Supported values are: 'text', 'json_object' and 'json_schema'.", "text.format.type", "invalid_value")


def anthropic_output_format(value: Any) -> Constraint | None:
    """Anthropic `output_config.format`: {"type": "json_schema", "schema": {...}} (`effort` is accepted and ignored)."""
    if value is None:
        return None
    config = f.obj(value, "output_config")
    if config.get("format") is None:
        return None
    fmt = f.obj(config["format"], "output_config.format")
    kind = fmt.get("type")
    if kind != "json_schema":
        raise invalid(f"Invalid value: {kind!r}. Supported values are: 'json_schema'.", "output_config.format.type", "invalid_value")
    return json_schema(f.require(fmt, "schema", "output_config.format.schema"), "output_config.format.schema")


_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def tool_name(value: Any, param: str) -> str:
    """A function name as every protocol allows it: ^[a-zA-Z0-9_-]{1,64}$."""
    name = f.string(value, param, allow_empty=False)
    if not _TOOL_NAME.match(name):
        raise invalid(f"Invalid '{param}': {name!r} does not match '^[a-zA-Z0-9_-]{{1,64}}$'.", param, "invalid_value")
    return name


def tool_parameters(value: Any, param: str) -> str:
    """A tool's parameters / input_schema: an object schema that passes its metaschema, as JSON text."""
    schema = check_json_schema({} if value is None else value, param)
    if schema.get("type", "object") != "object":
        raise invalid(f"Invalid '{param}': a tool's parameters must be a JSON Schema of type 'object'.", param, "invalid_json_schema")
    return orjson.dumps(schema).decode()


def check_tool_choice(tools: tuple[ToolSpec, ...], choice: str | None, param: str) -> None:
    """A named choice must name one of `tools`; `required` needs at least one tool."""
    if choice == "required" and not tools:
        raise invalid("'tool_choice' requires at least one tool in 'tools'.", param, "invalid_value")
    if choice is not None and choice.startswith("function:"):
        name = choice.removeprefix("function:")
        if name not in {t.name for t in tools}:
            raise invalid(f"Invalid '{param}': no tool named {name!r} in 'tools'.", param, "invalid_value")
