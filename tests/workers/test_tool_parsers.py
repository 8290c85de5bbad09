"""The llama3 and mistral tool-call parsers (and hermes' custom-tool calls): real-looking model output in
token-sized chunks and one character at a time → the same Content / ToolCallStart / ToolCallArgs, the
concatenated arguments exactly the JSON the model wrote; malformed output falls back to content."""

from __future__ import annotations

import json

import pytest

from models.tool_formats import FORMATS
from shared.deltas import StreamDelta, ToolCallArgs, ToolCallStart
from workers.tool_parsers import JsonScan, Llama3Parser, MistralParser, match_head
from workers.tools import PARSERS, HermesParser, make_parser

from .test_tools import summary

WEATHER = '{"city": "Paris", "days": [1, 2], "note": "a } and a \\" inside"}'
TIME = '{"tz":"CET"}'

# (parser, model output, what a client accumulates)
CASES: dict[str, tuple[type, str, list[tuple[str, object]]]] = {
    "llama3_one_call": (Llama3Parser, f'{{"name": "get_weather", "parameters": {WEATHER}}}', [("start", (0, "c_0", "get_weather")), ("args0", WEATHER)]),
    "llama3_python_tag_two_calls": (
        Llama3Parser,
        f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; {{"name":"get_time","arguments":{TIME}}}',
        [("start", (0, "c_0", "get_weather")), ("args0", WEATHER), ("start", (1, "c_1", "get_time")), ("args1", TIME)],
    ),
    "llama3_extra_keys_dropped": (
        Llama3Parser,
        f'\n{{"name": "get_time", "parameters": {TIME}, "id": "x1"}}',
        [("start", (0, "c_0", "get_time")), ("args0", TIME)],
    ),
    "llama3_text_is_content": (Llama3Parser, 'The weather is {"fine"}.', [("text", 'The weather is {"fine"}.')]),
    "llama3_malformed_is_content": (Llama3Parser, '{"tool": "get_weather", "parameters": {}}', [("text", '{"tool": "get_weather", "parameters": {}}')]),
    "mistral_array_after_text": (
        MistralParser,
        f'Let me check. [TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "get_time", "arguments": {TIME}, "id": "a1b2c3d4e"}}]',
        [("text", "Let me check. "), ("start", (0, "c_0", "get_weather")), ("args0", WEATHER), ("start", (1, "c_1", "get_time")), ("args1", TIME)],
    ),
    "mistral_v11_two_calls": (
        MistralParser,
        f"[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]get_time[ARGS]{TIME}",
        [("start", (0, "c_0", "get_weather")), ("args0", WEATHER), ("start", (1, "c_1", "get_time")), ("args1", TIME)],
    ),
    "mistral_plain_text": (MistralParser, "No tools needed [TOOL it is.", [("text", "No tools needed [TOOL it is.")]),
    "mistral_malformed_is_content": (MistralParser, "Hi [TOOL_CALLS] not a call at all", [("text", "Hi [TOOL_CALLS] not a call at all")]),
    "hermes_custom_then_function": (
        HermesParser,
        f'Patching.<tool_call>{{"name": "apply_patch"}}\n*** Begin Patch\n  "quoted" </tool\n*** End Patch</tool_call>\n<tool_call>{{"name": "get_time", "arguments": {TIME}}}</tool_call>',
        [("text", "Patching."), ("start", (0, "c_0", "apply_patch")), ("args0", '*** Begin Patch\n  "quoted" </tool\n*** End Patch'), ("start", (1, "c_1", "get_time")), ("args1", TIME)],
    ),
    "hermes_custom_to_the_end": (HermesParser, '<tool_call>{"name": "email"}\n ab@cd.com', [("start", (0, "c_0", "email")), ("args0", " ab@cd.com")]),
}


def feed(parser_cls: type, text: str, size: int) -> list[StreamDelta]:
    parser = parser_cls("c")
    out: list[StreamDelta] = []
    for i in range(0, len(text), size):
        out.extend(parser.push(text[i : i + size]))
    return out + parser.flush()


@pytest.mark.parametrize("size", [1, 3, 5, 1000])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_output_parses_the_same_in_any_chunking(case: str, size: int) -> None:
    parser_cls, text, expected = CASES[case]
    assert summary(feed(parser_cls, text, size)) == expected


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_call_split_at_every_character_streams_its_arguments_exactly(case: str) -> None:
    parser_cls, text, expected = CASES[case]
    deltas = feed(parser_cls, text, 1)
    for index, start in enumerate(d for d in deltas if isinstance(d, ToolCallStart)):
        position = deltas.index(start)
        fragments = [d.arguments for d in deltas if isinstance(d, ToolCallArgs) and d.index == index]
        assert all(isinstance(d, ToolCallStart) or d.index == index for d in deltas[position + 1 : position + 1 + len(fragments)])  # type: ignore[union-attr]
        assert "".join(fragments) == dict(expected)[f"args{index}"]
        if parser_cls is not HermesParser:
            json.loads("".join(fragments))
            assert len(fragments) > 5  # streamed in pieces, not held to the end


def test_the_name_streams_before_the_arguments_are_complete() -> None:
    parser = Llama3Parser("c")
    out = parser.push('{"name": "get_weather", "parameters": {"ci')
    assert [type(d) for d in out] == [ToolCallStart, ToolCallArgs] and out[1].arguments == '{"ci'  # type: ignore[union-attr]


def test_call_counts_and_an_unterminated_call() -> None:
    for parser_cls, text in ((Llama3Parser, '{"name": "f", "parameters": {"a": 1'), (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1')):
        parser = parser_cls("c")
        deltas = parser.push(text) + parser.flush()
        assert summary(deltas) == [("start", (0, "c_0", "f")), ("args0", '{"a": 1')] and parser.calls == 1
    parser = Llama3Parser("c")
    assert summary(parser.push("Hello") + parser.flush()) == [("text", "Hello")] and parser.calls == 0


def test_the_head_matcher_tells_a_prefix_from_a_mismatch() -> None:
    keys = ("parameters", "arguments")
    assert match_head('{"name": "f", "parameters": {}', keys) == ("f", 27)
    assert match_head('{"na', keys) is True and match_head('{"name": "f", "par', keys) is True
    assert match_head('{"nope', keys) is False and match_head('{"name": 3', keys) is False and match_head("[", keys) is False


def test_the_json_scanner_finds_the_end_of_a_value_in_pieces() -> None:
    scan, text = JsonScan(), ""
    for ch in ' {"a": "}]", "b": [1, {"c": null}]} tail':
        text += ch
        if (end := scan.feed(text)) is not None:
            break
    assert text[:end] == ' {"a": "}]", "b": [1, {"c": null}]}'
    assert JsonScan().feed("42, ") == 2 and JsonScan(depth=1).feed(', "id": "x"} more') == 12


def test_every_family_has_a_parser() -> None:
    assert set(PARSERS) == set(FORMATS)
    assert all(type(make_parser(fmt, "c")) is PARSERS[name] for name, fmt in FORMATS.items())
