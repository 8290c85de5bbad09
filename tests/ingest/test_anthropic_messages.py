"""Anthropic Messages parser: body → expected IR, and bad input → ApiError naming the parameter."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from ingest.parsers.anthropic_messages import parse
from shared.errors import ApiError
from shared.ir import ImagePart, Message, Protocol, Request, Role, SamplingParams, TextPart, Thinking, ToolCall, ToolSpec


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny-chat", "max_tokens": 256, "messages": [{"role": "user", "content": "Hi"}]} | fields


def parsed(value: Any) -> Request:
    return parse(value, request_id="req01", created=1_700_000_000.0)


def error_for(value: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parsed(value)
    assert caught.value.status == 400 and caught.value.kind == "invalid_request"
    return caught.value


def user(text: str) -> Message:
    return Message(role=Role.USER, content=(TextPart(text=text),))


def test_a_minimal_body_becomes_a_request_with_the_protocol_and_endpoint() -> None:
    assert parsed(body()) == Request(
        id="req01",
        protocol=Protocol.ANTHROPIC_MESSAGES,
        model="tiny-chat",
        messages=(user("Hi"),),
        sampling=SamplingParams(max_tokens=256),
        created=1_700_000_000.0,
        endpoint="/v1/messages",
    )


def test_sampling_stream_metadata_and_token_ids_are_read() -> None:
    req = parsed(
        body(
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            stop_sequences=["\n\nHuman:", "END"],
            stream=True,
            metadata={"user_id": "u-42", "other": 1},
            return_token_ids=True,
            unknown_field={"ignored": True},
        )
    )
    assert req.sampling == SamplingParams(temperature=0.5, top_p=0.9, top_k=40, max_tokens=256, stop=("\n\nHuman:", "END"))
    assert (req.stream, req.metadata, req.return_token_ids) == (True, (("user_id", "u-42"),), True)


def test_a_system_string_and_system_blocks_become_one_leading_system_message() -> None:
    assert parsed(body(system="Be brief.")).messages[0] == Message(role=Role.SYSTEM, content=(TextPart(text="Be brief."),))
    blocks = [
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Be brief."},
    ]
    assert parsed(body(system=blocks)).messages == (
        Message(role=Role.SYSTEM, content=(TextPart(text="You are Claude Code."), TextPart(text="Be brief."))),
        user("Hi"),
    )
    assert parsed(body(system="")).messages == (user("Hi"),)


def test_claude_codes_attribution_line_is_dropped_from_the_system_prompt_and_nothing_else() -> None:
    """Claude Code's first system block is `x-anthropic-billing-header: cc_version=<v>.<hash>; ...` whose
    suffix changes between conversations (and its `cch=` between requests): kept, no two conversations
    would share a cached prefix (tests/e2e/test_agent_fixtures.py shows the cache hit it gives)."""
    header = "x-anthropic-billing-header: cc_version=2.1.332.1c9; cc_entrypoint=sdk-cli; cch=36ee5;"
    blocks = [{"type": "text", "text": header}, {"type": "text", "text": "You are Claude Code."}]
    assert parsed(body(system=blocks)).messages[0] == Message(role=Role.SYSTEM, content=(TextPart(text="You are Claude Code."),))
    assert parsed(body(system=f"{header}\nYou are Claude Code.")).messages[0] == Message(role=Role.SYSTEM, content=(TextPart(text="You are Claude Code."),))
    assert parsed(body(system=header)).messages == (user("Hi"),)
    kept = "Quote it: x-anthropic-billing-header: is a line Claude Code sends."  # not at a line's start
    assert parsed(body(system=kept)).messages[0] == Message(role=Role.SYSTEM, content=(TextPart(text=kept),))
    in_a_turn = [{"role": "user", "content": header}]
    assert parsed(body(messages=in_a_turn)).messages == (user(header),)  # only the system prompt is Claude Code's


def test_system_role_entries_inside_messages_are_kept_in_place() -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Reminder."}]},
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Late note."},
    ]
    assert parsed(body(messages=messages)).messages == (
        Message(role=Role.SYSTEM, content=(TextPart(text="Reminder."),)),
        user("Hi"),
        Message(role=Role.SYSTEM, content=(TextPart(text="Late note."),)),
    )


def test_a_tool_use_round_trip_becomes_an_assistant_tool_call_and_tool_messages() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Need the tool.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    "is_error": True,
                },
                {"type": "text", "text": "Thanks."},
            ],
        },
    ]
    assert parsed(body(messages=messages)).messages == (
        user("Weather in Paris?"),
        Message(
            role=Role.ASSISTANT,
            content=(TextPart(text="Checking."),),
            tool_calls=(ToolCall(id="toolu_1", name="get_weather", arguments='{"city":"Paris"}'),),
            sealed_reasoning=(("Need the tool.", "sig"),),  # opened (or dropped) by the API node: shared.seal
        ),
        Message(role=Role.TOOL, content=(TextPart(text="18C"),), tool_call_id="toolu_1"),
        Message(role=Role.TOOL, content=(TextPart(text="a"), TextPart(text="b")), tool_call_id="toolu_2", is_error=True),
        user("Thanks."),
    )


def test_images_become_image_parts_for_base64_and_url_sources() -> None:
    content = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
        {"type": "text", "text": "What is this?"},
    ]
    assert parsed(body(messages=[{"role": "user", "content": content}])).messages[0].content == (
        ImagePart(url="data:image/png;base64,iVBORw0", media_type="image/png"),
        ImagePart(url="https://example.com/cat.jpg"),
        TextPart(text="What is this?"),
    )


def test_tools_and_tool_choice_map_onto_the_ir() -> None:
    tools = [{"name": "get_weather", "description": "Weather now.", "input_schema": {"type": "object", "properties": {}}}]
    req = parsed(body(tools=tools, tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}))
    assert req.tools == (ToolSpec(name="get_weather", description="Weather now.", parameters_json='{"type":"object","properties":{}}'),)
    assert (req.tool_choice, req.parallel_tool_calls) == ("function:get_weather", False)
    choices = {"auto": "auto", "any": "required", "none": "none"}
    assert {kind: parsed(body(tools=tools, tool_choice={"type": kind})).tool_choice for kind in choices} == choices


def test_thinking_and_effort_become_the_reasoning_budget() -> None:
    assert parsed(body(thinking={"type": "enabled", "budget_tokens": 2048})).thinking == Thinking(enabled=True, budget_tokens=2048)
    assert parsed(body(thinking={"type": "disabled"})).thinking == Thinking(enabled=False)
    adaptive = parsed(body(thinking={"type": "adaptive", "display": "omitted"}, output_config={"effort": "high"})).thinking
    assert adaptive == Thinking(enabled=True, effort="high", omitted=True)
    assert parsed(body()).thinking == Thinking()


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
        (body(max_tokens=0), "max_tokens"),
        (body(max_tokens="10"), "max_tokens"),
        (body(model=""), "model"),
        ({"max_tokens": 5, "messages": []}, "model"),
        (body(messages=[]), "messages"),
        (body(messages="Hi"), "messages"),
        (body(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
        (body(messages=[{"content": "x"}]), "messages[0].role"),
        (body(messages=[{"role": "user"}]), "messages[0].content"),
        (body(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
        (body(messages=[{"role": "user", "content": [{"type": "video", "source": {}}]}]), "messages[0].content[0].type"),
        (body(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text"),
        (
            body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]),
            "messages[0].content[0].type",
        ),
        (body(messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]), "messages[0].content[0].type"),
        (
            body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": "{}"}]}]),
            "messages[0].content[0].input",
        ),
        (body(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]), "messages[0].content[0].tool_use_id"),
        (
            body(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]),
            "messages[0].content[0].source.type",
        ),
        (
            body(messages=[{"role": "system", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]),
            "messages[0].content[0].type",
        ),
        (body(system=[{"type": "image"}]), "system[0].type"),
        (body(system=5), "system"),
        (body(temperature=1.5), "temperature"),
        (body(temperature="hot"), "temperature"),
        (body(top_p=-0.1), "top_p"),
        (body(top_k=-1), "top_k"),
        (body(stop_sequences="END"), "stop_sequences"),
        (body(stop_sequences=[""]), "stop_sequences[0]"),
        (body(stream="yes"), "stream"),
        (body(metadata=[]), "metadata"),
        (body(metadata={"user_id": 7}), "metadata.user_id"),
        (body(tools=[{"name": "t"}]), "tools[0].input_schema"),
        (body(tools=[{"type": 7, "name": "web_search"}]), "tools[0].type"),
        (body(messages=[{"role": "assistant", "content": [{"type": "frobnicate"}]}]), "messages[0].content[0].type"),
        (body(tools=[{"input_schema": {}}]), "tools[0].name"),
        (body(tool_choice={"type": "function"}), "tool_choice.type"),
        (body(tool_choice={"type": "tool"}), "tool_choice.name"),
        (body(tool_choice="auto"), "tool_choice"),
        (body(thinking={"type": "enabled"}), "thinking.budget_tokens"),
        (body(thinking={"type": "sometimes"}), "thinking.type"),
        (body(return_token_ids=1), "return_token_ids"),
    ],
)
def test_bad_input_is_rejected_naming_the_parameter(value: dict[str, Any], param: str) -> None:
    assert error_for(value).param == param


def test_a_body_that_is_not_an_object_is_rejected() -> None:
    assert error_for(["not", "an", "object"]).param is None


def test_cache_control_on_system_tools_and_message_blocks_is_accepted_and_changes_nothing() -> None:
    mark = {"type": "ephemeral"}
    tool = {"name": "get_weather", "description": "Weather now.", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    plain = body(system=[{"type": "text", "text": "Be brief."}], tools=[tool], messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    marked = body(
        system=[{"type": "text", "text": "Be brief.", "cache_control": mark}],
        tools=[{**tool, "cache_control": mark}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}],
    )
    a, b = parsed(plain), parsed(marked)
    assert a.messages == b.messages and a.tools == b.tools
    assert a.messages[0] == Message(role=Role.SYSTEM, content=(TextPart(text="Be brief."),))


SERVER_TOOLS = [
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
    {"type": "web_fetch_20250910", "name": "web_fetch"},
    {"type": "code_execution_20250825", "name": "code_execution"},
    {"type": "bash_20250124", "name": "bash"},
    {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
    {"type": "computer_20250124", "name": "computer", "display_width_px": 1024, "display_height_px": 768},
    {"type": "memory_20250818", "name": "memory"},
    {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"},
    {"type": "some_future_tool_20270101", "name": "future"},
]


def test_typed_server_tools_are_accepted_and_only_client_tools_are_offered() -> None:
    client = {"name": "Bash", "description": "Run a command.", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}
    extras = {"cache_control": {"type": "ephemeral"}, "defer_loading": True, "strict": True, "input_examples": [{"command": "ls"}], "eager_input_streaming": True}
    req = parsed(body(tools=[*SERVER_TOOLS, {**client, **extras}, {**client, "name": "Read", "type": "custom"}]))
    assert [t.name for t in req.tools] == ["Bash", "Read"]
    assert req.tools[0] == ToolSpec(name="Bash", description="Run a command.", parameters_json='{"type":"object","properties":{"command":{"type":"string"}}}')


def test_server_tool_blocks_replayed_in_an_assistant_turn_are_dropped() -> None:
    turn = [
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "q"}},
        {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
        {"type": "text", "text": "Found it."},
    ]
    req = parsed(body(messages=[{"role": "user", "content": "Search"}, {"role": "assistant", "content": turn}, {"role": "user", "content": "Thanks"}]))
    assert req.messages[1] == Message(role=Role.ASSISTANT, content=(TextPart(text="Found it."),))


def test_the_fields_claude_code_sends_are_accepted_and_change_nothing_the_ir_holds_but_the_thinking() -> None:
    extras = {
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "container": "container_1",
        "mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "x"}],
        "service_tier": "auto",
    }
    with_extras = parsed(body(**extras))
    assert with_extras.thinking == Thinking(enabled=True, effort="high", omitted=True)
    assert replace(with_extras, thinking=Thinking()) == parsed(body())
    summarized = parsed(body(thinking={"type": "enabled", "budget_tokens": 1024, "display": "summarized"}))
    assert replace(summarized, thinking=Thinking()) == parsed(body()) and summarized.thinking.budget_tokens == 1024
    claude = parsed(body(max_tokens=128000, top_k=5, stop_sequences=["END"], metadata={"user_id": '{"device_id":"d"}'}, model="claude-opus-4-5"))
    assert (claude.model, claude.sampling.max_tokens, claude.sampling.top_k, claude.sampling.stop) == ("claude-opus-4-5", 128000, 5, ("END",))
    assert claude.metadata == (("user_id", '{"device_id":"d"}'),)
