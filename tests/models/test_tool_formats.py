"""Tool-call families: the choice from the chat template (snippets modeled on the real templates), and
each family's tool_choice grammar accepting exactly its own syntax, which its parser then reads as calls
(custom tools: the raw input constrained by the tool's regex / Lark grammar)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from llguidance import LLMatcher

from models.grammar import tokenizer_for
from models.tool_formats import HERMES, LLAMA3, MISTRAL, ToolFormat, for_request, select
from models.tools import tool_grammar
from shared.deltas import ToolCallArgs, ToolCallStart
from shared.ir import Constraint, ConstraintKind, Protocol, Request, ToolKind, ToolSpec
from workers.tools import make_parser

QWEN = """{%- if tools %}{{- '<|im_start|>system\\n' }}# Tools\\n<tools>{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}</tools>
For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>{%- endif %}"""
LLAMA31 = """{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{%- for message in messages %}{%- if message.role == "ipython" or message.role == "tool" %}{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
{%- elif 'tool_calls' in message %}{{- '<|python_tag|>' + tool_call.name + '.call(' }}{%- endif %}{%- endfor %}"""
LLAMA32 = """{%- if tools is not none and not tools_in_user_message %}{{- 'Given the following functions, please respond with a JSON for a function call '
 'with its proper arguments. Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}{%- endif %}
{%- if message.role == "ipython" or message.role == "tool" %}{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}{%- endif %}"""
MISTRAL_V3 = """{%- if tools is not none and (message == user_messages[-1]) %}{{- "[AVAILABLE_TOOLS] [" }}{%- endif %}
{%- elif message.tool_calls is defined and message.tool_calls is not none %}{{- "[TOOL_CALLS] [" }}{%- endif %}"""
HERMES3_LLAMA = """<|start_header_id|>system<|end_header_id|>You are a function calling AI model. <tools>{{ tools }}</tools>
For each function call return a json object with function name and arguments within <tool_call></tool_call> XML tags."""
SMOLLM2 = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"


@pytest.mark.parametrize(
    ("template", "family"),
    [(QWEN, HERMES), (LLAMA31, LLAMA3), (LLAMA32, LLAMA3), (MISTRAL_V3, MISTRAL), (HERMES3_LLAMA, HERMES), (SMOLLM2, HERMES), (None, HERMES)],
    ids=["qwen", "llama3.1", "llama3.2", "mistral", "hermes3-llama", "smollm2-no-tools", "no-template"],
)
def test_auto_picks_the_family_the_template_spells(template: str | None, family: ToolFormat) -> None:
    assert select(template, "auto") is family


def test_an_explicit_setting_wins_and_none_turns_calls_off() -> None:
    assert select(QWEN, "llama3") is LLAMA3 and select(LLAMA31, "mistral") is MISTRAL and select(QWEN, "none") is None
    assert select([{"name": "default", "template": MISTRAL_V3}, {"name": "tool_use", "template": ""}], "auto") is MISTRAL


@pytest.fixture(scope="module")
def lltok(tokenizer: Any) -> Any:
    return tokenizer_for(tokenizer, (tokenizer.eos_token_id,))


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
WEATHER = ToolSpec(name="get_weather", parameters_json=json.dumps(SCHEMA))
TIME = ToolSpec(name="get_time", parameters_json=json.dumps({"type": "object", "properties": {"tz": {"enum": ["CET"]}}, "required": ["tz"]}))


def ask(*tools: ToolSpec, choice: str = "required", parallel: bool = True) -> Request:
    return Request(id="r", protocol=Protocol.OPENAI_RESPONSES, model="m", messages=(), tools=tools, tool_choice=choice, parallel_tool_calls=parallel)


def accepts(lltok: Any, tokenizer: Any, grammar: str, text: str) -> bool:
    matcher = LLMatcher(lltok, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return bool(matcher.consume_tokens(tokenizer.encode(text))) and matcher.is_accepting()


def parsed(fmt: ToolFormat, text: str) -> list[tuple[str, str]]:
    parser = make_parser(fmt, "c")
    deltas = parser.push(text) + parser.flush()
    names = [d.name for d in deltas if isinstance(d, ToolCallStart)]
    return [(n, "".join(d.arguments for d in deltas if isinstance(d, ToolCallArgs) and d.index == i)) for i, n in enumerate(names)]


# (family, a valid output with two calls, the same calls in another family's syntax)
OUTPUTS = {
    "hermes": ('<tool_call>{"name": "get_weather", "arguments": {"city":"Rome"}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz":"CET"}}</tool_call>', '{"name":"get_weather","parameters":{"city":"Rome"}}'),
    "llama3": ('{"name":"get_weather","parameters":{"city":"Rome"}}; {"name":"get_time","parameters":{"tz":"CET"}}', '<tool_call>{"name":"get_weather","arguments":{"city":"Rome"}}</tool_call>'),
    "mistral": ('[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Rome"}}, {"name":"get_time","arguments":{"tz":"CET"}}]', '{"name":"get_weather","parameters":{"city":"Rome"}}'),
}


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=lambda f: f.name)
def test_required_accepts_the_family_syntax_its_parser_reads_and_no_other(fmt: ToolFormat, lltok: Any, tokenizer: Any) -> None:
    two, foreign = OUTPUTS[fmt.name]
    grammar = tool_grammar(ask(WEATHER, TIME), fmt)
    assert grammar is not None
    assert accepts(lltok, tokenizer, grammar, two)
    assert parsed(fmt, two) == [("get_weather", '{"city":"Rome"}'), ("get_time", '{"tz":"CET"}')]
    assert not accepts(lltok, tokenizer, grammar, foreign)
    one = tool_grammar(ask(WEATHER, TIME, parallel=False), fmt)
    assert one is not None and not accepts(lltok, tokenizer, one, two)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=lambda f: f.name)
def test_auto_allows_plain_text_or_calls_and_a_named_choice_only_that_tool(fmt: ToolFormat, lltok: Any, tokenizer: Any) -> None:
    two, _ = OUTPUTS[fmt.name]
    auto = tool_grammar(ask(WEATHER, TIME, choice="auto"), fmt)
    assert auto is not None and accepts(lltok, tokenizer, auto, "It is sunny.") and accepts(lltok, tokenizer, auto, ("Checking. " if fmt.opening else "") + two)
    named = tool_grammar(ask(WEATHER, TIME, choice="function:get_time"), fmt)
    assert named is not None and not accepts(lltok, tokenizer, named, two) and not accepts(lltok, tokenizer, named, "It is sunny.")


def custom(name: str, kind: ConstraintKind | None = None, text: str = "") -> ToolSpec:
    fmt = Constraint(kind=kind, text=text, param="tools[0].format.definition") if kind is not None else None
    return ToolSpec(name=name, kind=ToolKind.CUSTOM, input_format=fmt)


def test_a_custom_tool_input_is_constrained_by_its_regex_or_lark_grammar(lltok: Any, tokenizer: Any) -> None:
    email = custom("email", ConstraintKind.REGEX, r"[a-z]{2,8}@[a-z]{2,8}\.com")
    sum_tool = custom("calc", ConstraintKind.LARK, 'start: NUM (" + " NUM)*\nNUM: /[0-9]{1,3}/')
    for tool, good, bad in ((email, "ab@cd.com", "AB@cd.org"), (sum_tool, "1 + 22 + 333", "1 +")):
        grammar = tool_grammar(ask(tool, WEATHER, choice=f"function:{tool.name}"), LLAMA3)  # a custom tool → hermes syntax
        assert grammar is not None
        head = "<tool_call>" + json.dumps({"name": tool.name}) + "\n"
        assert accepts(lltok, tokenizer, grammar, head + good) and not accepts(lltok, tokenizer, grammar, head + bad)
        assert parsed(for_request(LLAMA3, ask(tool)), head + good) == [(tool.name, good)]


def test_a_free_text_custom_input_ends_at_the_closing_tag_and_more_calls_may_follow(lltok: Any, tokenizer: Any) -> None:
    note = custom("note")
    grammar = tool_grammar(ask(note, WEATHER), HERMES)
    text = '<tool_call>{"name": "note"}\nBuy "milk"\n{and} eggs</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city":"Rome"}}</tool_call>'
    assert grammar is not None and accepts(lltok, tokenizer, grammar, text)
    assert parsed(HERMES, text) == [("note", 'Buy "milk"\n{and} eggs'), ("get_weather", '{"city":"Rome"}')]
    assert tool_grammar(replace(ask(note), tool_choice="none"), HERMES) is None
