"""The pure parts of Responses compaction, input items and their pages (ingest.http.responses_compact)."""

from __future__ import annotations

import logging

import pytest

from ingest.http.responses_compact import (
    COMPACT_MAX_TOKENS,
    COMPACT_PROMPT,
    SUMMARY_PREFIX,
    compaction_body,
    open_compactions,
    page,
    user_items,
)
from ingest.http.responses_store import input_items
from ingest.parsers.openai_responses import COMPACTION, parse
from shared.errors import ApiError
from shared.ir import Message, Role, TextPart
from shared.seal import Sealer, new_key

CONVERSATION = [
    {"role": "user", "content": "Plan a trip."},
    {"role": "assistant", "content": "Where to?"},
    {"type": "message", "id": "msg_mine", "role": "user", "content": [{"type": "input_text", "text": "Rome."}]},
    {"type": "function_call", "call_id": "c1", "name": "book", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "booked"},
]


def test_a_compact_body_becomes_a_greedy_bounded_unstored_create_with_the_summarizing_prompt_last() -> None:
    create = compaction_body({"model": "m", "input": CONVERSATION, "instructions": "Be brief.", "tools": [{"type": "function", "name": "x"}]})
    assert create["input"][:-1] == CONVERSATION and create["input"][-1]["content"][0]["text"] == COMPACT_PROMPT
    assert create["instructions"] == "Be brief." and "tools" not in create  # a compact body has no tools
    assert (create["store"], create["temperature"], create["max_output_tokens"]) == (False, 0, COMPACT_MAX_TOKENS)
    assert compaction_body({"model": "m", "input": "Hi"})["input"][0] == {"role": "user", "content": "Hi"}
    assert compaction_body({"model": "m", "previous_response_id": "resp_1"})["input"][0]["content"][0]["text"] == COMPACT_PROMPT
    with pytest.raises(ApiError) as caught:
        compaction_body({"model": "m"})
    assert caught.value.param == "input"


def test_a_compaction_keeps_the_user_messages_verbatim_with_ids_and_drops_the_rest() -> None:
    earlier = [
        Message(role=Role.USER, content=(TextPart(text="Before."),)),
        Message(role=Role.ASSISTANT, content=(TextPart(text="Sure."),)),
        Message(role=Role.USER, name=COMPACTION, content=(TextPart(text=SUMMARY_PREFIX + "old"),)),  # an opened summary: not kept
    ]
    kept = user_items(earlier, {"input": CONVERSATION}, "resp_abc")
    assert [item["content"] for item in kept] == [
        [{"type": "input_text", "text": "Before."}],
        [{"type": "input_text", "text": "Plan a trip."}],
        [{"type": "input_text", "text": "Rome."}],
    ]
    assert [item["id"] for item in kept] == ["msg_abc0000", "msg_abc0001", "msg_mine"]
    assert all(item["type"] == "message" and item["role"] == "user" and item["status"] == "completed" for item in kept)


def test_a_compaction_item_opens_into_its_summary_and_a_foreign_one_is_dropped_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    ours, theirs = Sealer(new_key()), Sealer(new_key())
    items = [
        {"type": "compaction", "id": "cmp_1", "encrypted_content": ours.seal("They want Rome.")},
        {"type": "compaction", "encrypted_content": theirs.seal("Someone else's.")},
        {"role": "user", "content": "Go on."},
    ]
    request = parse({"model": "m", "input": items}, request_id="r1", created=0.0)
    with caplog.at_level(logging.INFO, logger="met.api"):
        opened = open_compactions(request, ours)
    assert opened.messages == (
        Message(role=Role.USER, name=COMPACTION, content=(TextPart(text=SUMMARY_PREFIX + "They want Rome."),)),
        Message(role=Role.USER, content=(TextPart(text="Go on."),)),
    )
    assert [r.getMessage() for r in caplog.records] == ["request r1: a compaction item that does not open with this deployment's key was dropped"]
    assert [m.text for m in open_compactions(request, None).messages] == ["Go on."]  # no seal loaded: none opens


def test_input_items_are_the_inputs_as_openai_lists_them_with_stable_ids() -> None:
    assert input_items({"input": "Hi"}, "resp_r") == [
        {"id": "msg_r0000", "type": "message", "role": "user", "status": "completed", "content": [{"type": "input_text", "text": "Hi"}]}
    ]
    items = input_items({"input": CONVERSATION}, "resp_r")
    assert [i["id"] for i in items] == ["msg_r0000", "msg_r0001", "msg_mine", "fc_r0003", "fco_r0004"]
    assert items[1]["content"] == [{"type": "output_text", "text": "Where to?"}]
    assert items == input_items({"input": CONVERSATION}, "resp_r")


def test_pages_follow_order_after_and_limit() -> None:
    items = [{"id": f"i{n}"} for n in range(5)]
    first = page(items, {"limit": ["2"], "order": ["asc"]})
    assert ([i["id"] for i in first["data"]], first["first_id"], first["last_id"], first["has_more"]) == (["i0", "i1"], "i0", "i1", True)
    last = page(items, {"limit": ["2"], "order": ["asc"], "after": ["i2"]})
    assert ([i["id"] for i in last["data"]], last["has_more"]) == (["i3", "i4"], False)
    assert [i["id"] for i in page(items, {})["data"]] == ["i4", "i3", "i2", "i1", "i0"]  # desc by default
    assert page([], {}) == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    for query, param in (({"limit": ["0"]}, "limit"), ({"limit": ["x"]}, "limit"), ({"order": ["up"]}, "order"), ({"after": ["nope"]}, "after")):
        with pytest.raises(ApiError) as caught:
            page(items, query)
        assert caught.value.param == param
