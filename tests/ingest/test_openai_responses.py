"""OpenAI Responses parser: body → expected IR, the store/previous_response_id helpers, and bad input → ApiError."""

from __future__ import annotations

from typing import Any

import pytest

from ingest.parsers.openai_responses import namespaced_name, parse, previous_response_id, store_flag
from shared.errors import ApiError
from shared.ir import (
    Constraint,
    ConstraintKind,
    ImagePart,
    Message,
    Protocol,
    Request,
    Role,
    SamplingParams,
    TextPart,
    ToolCall,
    ToolKind,
    ToolSpec,
)


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny-chat", "input": "Hi"} | fields


def parsed(value: Any) -> Request:
    return parse(value, request_id="req01", created=1_700_000_000.0)


def error_for(value: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parsed(value)
    assert caught.value.status == 400 and caught.value.kind == "invalid_request"
    return caught.value


def user(text: str) -> Message:
    return Message(role=Role.USER, content=(TextPart(text=text),))


def test_a_string_input_becomes_one_user_message() -> None:
    assert parsed(body()) == Request(
        id="req01",
        protocol=Protocol.OPENAI_RESPONSES,
        model="tiny-chat",
        messages=(user("Hi"),),
        created=1_700_000_000.0,
        endpoint="/v1/responses",
    )


def test_instructions_become_a_leading_system_message() -> None:
    assert parsed(body(instructions="Be brief.")).messages == (Message(role=Role.SYSTEM, content=(TextPart(text="Be brief."),)), user("Hi"))


def test_sampling_stream_tools_and_extensions_are_read() -> None:
    req = parsed(
        body(
            max_output_tokens=128,
            temperature=0.3,
            top_p=0.8,
            stream=True,
            tools=[
                {"type": "function", "name": "get_weather", "description": "Weather now.", "parameters": {"type": "object"}, "strict": True}
            ],
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,
            metadata={"team": "search"},
            return_token_ids=True,
            text={"format": {"type": "json_object"}},
            reasoning={"effort": "low"},
            truncation="disabled",
        )
    )
    assert req.sampling == SamplingParams(temperature=0.3, top_p=0.8, max_tokens=128)
    assert req.tools == (ToolSpec(name="get_weather", description="Weather now.", parameters_json='{"type":"object"}'),)
    assert (req.stream, req.tool_choice, req.parallel_tool_calls, req.metadata, req.return_token_ids) == (
        True,
        "function:get_weather",
        False,
        (("team", "search"),),
        True,
    )
    fn = [{"type": "function", "name": "f"}]
    assert [parsed(body(tools=fn, tool_choice=c)).tool_choice for c in ("auto", "none", "required")] == ["auto", "none", "required"]


def test_tools_the_server_cannot_run_are_accepted_and_ignored() -> None:
    mixed = [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["v"]}, {"type": "function", "name": "f"}, {"type": "mcp", "server_label": "x"}]
    assert [t.name for t in parsed(body(tools=mixed)).tools] == ["f"]


def test_custom_tools_are_callable_with_their_grammar_and_a_named_custom_choice() -> None:
    tools = [
        {"type": "web_search"},
        {"type": "custom", "name": "apply_patch", "description": "Edit.", "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "x"'}},
        {"type": "custom", "name": "email", "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]+@x\\.com"}},
        {"type": "custom", "name": "note", "format": {"type": "text"}},
        {"type": "custom", "name": "plain"},
    ]
    request = parsed(body(tools=tools, tool_choice={"type": "custom", "name": "email"}))
    assert request.tools == (
        ToolSpec(name="apply_patch", description="Edit.", kind=ToolKind.CUSTOM, input_format=Constraint(kind=ConstraintKind.LARK, text='start: "x"', param="tools[1].format.definition")),
        ToolSpec(name="email", kind=ToolKind.CUSTOM, input_format=Constraint(kind=ConstraintKind.REGEX, text="[a-z]+@x\\.com", param="tools[2].format.definition")),
        ToolSpec(name="note", kind=ToolKind.CUSTOM),
        ToolSpec(name="plain", kind=ToolKind.CUSTOM),
    )
    assert request.tool_choice == "function:email"


def test_custom_tool_calls_and_outputs_in_input_render_as_a_call_and_its_result() -> None:
    items = [
        {"role": "user", "content": "Fix it"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done."},
    ]
    messages = parsed(body(input=items)).messages
    assert messages[1] == Message(role=Role.ASSISTANT, tool_calls=(ToolCall(id="c1", name="apply_patch", arguments="*** Begin Patch", kind=ToolKind.CUSTOM),))
    assert messages[2] == Message(role=Role.TOOL, content=(TextPart(text="Done."),), tool_call_id="c1")


def test_input_items_become_messages_with_merged_assistant_turns() -> None:
    items = [
        {"role": "developer", "content": "Use tools."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather?"}, {"type": "input_image", "image_url": "https://example.com/sky.png"}],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "short"}],
            "content": [{"type": "reasoning_text", "text": "Need "}, {"type": "reasoning_text", "text": "a tool."}],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "All set."}]},
        {"role": "assistant", "content": "It is 18C at noon."},
        {"role": "user", "content": "Thanks."},
    ]
    assert parsed(body(input=items)).messages == (
        Message(role=Role.DEVELOPER, content=(TextPart(text="Use tools."),)),
        Message(role=Role.USER, content=(TextPart(text="Weather?"), ImagePart(url="https://example.com/sky.png"))),
        Message(
            role=Role.ASSISTANT,
            content=(TextPart(text="Checking."),),
            tool_calls=(
                ToolCall(id="call_1", name="get_weather", arguments='{"city":"Paris"}'),
                ToolCall(id="call_2", name="get_time", arguments="{}"),
            ),
            reasoning="Need a tool.",
        ),
        Message(role=Role.TOOL, content=(TextPart(text="18C"),), tool_call_id="call_1"),
        Message(role=Role.TOOL, content=(TextPart(text="noon"),), tool_call_id="call_2"),
        Message(role=Role.ASSISTANT, content=(TextPart(text="It is 18C at noon."),), reasoning="All set."),
        user("Thanks."),
    )


def test_store_and_previous_response_id_are_read_by_helpers_not_the_ir() -> None:
    assert store_flag(body()) is True and store_flag(body(store=False)) is False
    assert previous_response_id(body()) is None
    assert previous_response_id(body(previous_response_id="resp_abc")) == "resp_abc"
    continued = {"model": "tiny-chat", "previous_response_id": "resp_abc", "instructions": "Be brief."}
    assert parsed(continued).messages == (Message(role=Role.SYSTEM, content=(TextPart(text="Be brief."),)),)
    assert parsed(body(store=False, previous_response_id="resp_abc")) == parsed(body())


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ({"input": "Hi"}, "model"),
        ({"model": "tiny-chat"}, "input"),
        (body(input=5), "input"),
        (body(input=[{"role": "tool", "content": "x"}]), "input[0].role"),
        (body(input=[{"type": "message", "content": "x"}]), "input[0].role"),
        (body(input=[{"role": "user"}]), "input[0].content"),
        (body(input=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]), "input[0].content[0].type"),
        (body(input=[{"role": "user", "content": [{"type": "input_text"}]}]), "input[0].content[0].text"),
        (body(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]), "input[0].content[0].image_url"),
        (body(input=[{"type": "frobnicate", "id": "msg_1"}]), "input[0].type"),
        (body(input=[{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch"}]), "input[0].input"),
        (body(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": ""}]), "input[0].namespace"),
        (body(tools=[{"type": "namespace", "name": "ns"}]), "tools[0].tools"),
        (body(tools=[{"type": "namespace", "name": "n s", "tools": []}]), "tools[0].name"),
        (body(tools=[{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f", "parameters": []}]}]), "tools[0].tools[0].parameters"),
        (body(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), "input[0].call_id"),
        (body(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]), "input[0].arguments"),
        (body(input=[{"type": "function_call_output", "call_id": "c"}]), "input[0].output"),
        (body(input=[{"type": "reasoning", "summary": [{"type": "summary_text"}]}]), "input[0].summary[0].text"),
        (body(input=["Hi"]), "input[0]"),
        (body(instructions=["Be brief."]), "instructions"),
        (body(max_output_tokens=0), "max_output_tokens"),
        (body(temperature=2.5), "temperature"),
        (body(top_p=1.5), "top_p"),
        (body(tools=[{"name": "f"}]), "tools[0].type"),
        (body(tools=[{"type": "function"}]), "tools[0].name"),
        (body(tools=[{"type": "function", "name": "f", "parameters": "{}"}]), "tools[0].parameters"),
        (body(tool_choice="any"), "tool_choice"),
        (body(tool_choice={"type": "file_search"}), "tool_choice.type"),
        (body(tool_choice={"type": "function"}), "tool_choice.name"),
        (body(tools=[{"type": "custom", "name": "p"}], tool_choice={"type": "custom", "name": "q"}), "tool_choice.name"),
        (body(tools=[{"type": "custom"}]), "tools[0].name"),
        (body(tools=[{"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "ebnf", "definition": "x"}}]), "tools[0].format.syntax"),
        (body(tools=[{"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "lark"}}]), "tools[0].format.definition"),
        (body(tools=[{"type": "custom", "name": "p", "format": {"type": "json"}}]), "tools[0].format.type"),
        (body(input=[{"type": "custom_tool_call", "call_id": "c", "name": "p"}]), "input[0].input"),
        (body(parallel_tool_calls="no"), "parallel_tool_calls"),
        (body(store="yes"), "store"),
        (body(previous_response_id=""), "previous_response_id"),
        (body(text={"format": {"type": "xml"}}), "text.format.type"),
        (body(text="plain"), "text"),
        (body(metadata={"k": 1}), "metadata.k"),
        (body(stream=1), "stream"),
        (body(return_token_ids="true"), "return_token_ids"),
    ],
)
def test_bad_input_is_rejected_naming_the_parameter(value: dict[str, Any], param: str) -> None:
    assert error_for(value).param == param


def test_a_body_that_is_not_an_object_is_rejected() -> None:
    assert error_for("Hi").param is None


NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        {"type": "function", "name": "spawn_agent", "description": "Spawn.", "strict": False, "parameters": {"type": "object", "properties": {}}},
        {"type": "function", "name": "close_agent", "description": "Close.", "strict": False, "parameters": {"type": "object", "properties": {}}},
    ],
}


def test_a_namespace_tool_offers_its_functions_under_flattened_names_that_remember_the_namespace() -> None:
    tools = parsed(body(tools=[{"type": "function", "name": "exec_command"}, NAMESPACE, {"type": "web_search", "external_web_access": False}])).tools
    assert [t.name for t in tools] == ["exec_command", "multi_agent_v1__spawn_agent", "multi_agent_v1__close_agent"]
    assert tools[1] == ToolSpec(
        name="multi_agent_v1__spawn_agent",
        description="Spawn.",
        parameters_json='{"type":"object","properties":{}}',
        namespace="multi_agent_v1",
        client_name="spawn_agent",
    )
    assert parsed(body(tools=[NAMESPACE], tool_choice={"type": "function", "name": "multi_agent_v1__close_agent"})).tool_choice == "function:multi_agent_v1__close_agent"


def test_a_namespaced_name_stays_a_valid_unique_tool_name_when_long() -> None:
    long_a, long_b = namespaced_name("n" * 40, "a" * 40), namespaced_name("n" * 40, "a" * 39 + "b")
    assert len(long_a) == 64 and long_a != long_b
    assert all(c.isalnum() or c in "_-" for c in long_a)
    assert parsed(body(tools=[{**NAMESPACE, "name": "n" * 40, "tools": [{"type": "function", "name": "a" * 40}]}])).tools[0].name == long_a


def test_an_earlier_namespaced_call_comes_back_under_the_name_the_model_was_offered() -> None:
    items = [
        {"role": "user", "content": "Close it."},
        {"type": "function_call", "call_id": "c1", "name": "close_agent", "namespace": "multi_agent_v1", "arguments": "{}", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "closed"},
    ]
    messages = parsed(body(input=items, tools=[NAMESPACE])).messages
    assert messages[1].tool_calls == (ToolCall(id="c1", name="multi_agent_v1__close_agent", arguments="{}"),)


def test_custom_tool_calls_are_rendered_as_calls_with_their_input_and_hosted_tool_items_are_dropped() -> None:
    items = [
        {"role": "user", "content": "Patch it."},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "q"}},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done"},
        {"type": "local_shell_call", "call_id": "c2", "id": "ls_1", "status": "completed", "action": {"type": "exec", "command": ["ls"]}},
        {"type": "compaction_summary", "encrypted_content": "opaque"},  # a `compaction` item is kept, sealed (tests/ingest/test_responses_compact.py)
    ]
    assert parsed(body(input=items)).messages == (
        user("Patch it."),
        Message(role=Role.ASSISTANT, tool_calls=(ToolCall(id="c1", name="apply_patch", arguments="*** Begin Patch", kind=ToolKind.CUSTOM),)),
        Message(role=Role.TOOL, content=(TextPart(text="Done"),), tool_call_id="c1"),
    )


def test_the_fields_codex_sends_are_accepted() -> None:
    items = [
        {"type": "message", "id": "msg_1", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"type": "message", "id": "msg_2", "role": "developer", "content": [{"type": "input_text", "text": "Skills."}]},
        {"type": "message", "id": "msg_3", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Think."}], "encrypted_content": "gAAAA"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
    ]
    extras = {
        "include": ["reasoning.encrypted_content", "web_search_call.action.sources"],
        "store": False,
        "prompt_cache_key": "k",
        "client_metadata": {"session_id": "s"},
        "reasoning": {"summary": "auto", "effort": "high"},
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "text": {"verbosity": "low"},
        "service_tier": "auto",
        "safety_identifier": "user-1",
        "user": "u",
        "metadata": {"k": "v"},
        "truncation": "auto",
        "top_logprobs": 0,
        "stream_options": {"include_obfuscation": False},
        "background": False,
    }
    req = parsed(body(input=items, **extras))
    assert [m.role for m in req.messages] == [Role.DEVELOPER, Role.DEVELOPER, Role.USER, Role.ASSISTANT]
    # the encrypted content wins over the shown summary (opened, or dropped, by the API node: shared.seal)
    assert req.messages[3] == Message(role=Role.ASSISTANT, content=(TextPart(text="Hello"),), sealed_reasoning=(("", "gAAAA"),))
    assert req.metadata == (("k", "v"),) and req.tool_choice == "auto" and req.constraint is None
