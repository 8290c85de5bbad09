"""encoders.frames: a `Frame`'s bytes on the wire, field by field in the order the HTTP layer writes them."""

from __future__ import annotations

import orjson

from encoders.frames import Frame, json_frame


def test_a_data_only_frame_is_one_data_line_and_a_blank_line() -> None:
    assert Frame('{"a":1}').to_sse() == b'data: {"a":1}\n\n'


def test_id_comment_event_and_data_come_in_that_order() -> None:
    frame = Frame('{"type":"ping"}', event="ping", comment="keep-alive")
    assert frame.to_sse(7) == b'id: 7\n: keep-alive\nevent: ping\ndata: {"type":"ping"}\n\n'
    assert frame.to_sse("12-0") == b'id: 12-0\n: keep-alive\nevent: ping\ndata: {"type":"ping"}\n\n'
    assert frame.to_sse(0).startswith(b"id: 0\n")  # position 0 is a position, not "none"


def test_a_comment_only_frame_has_no_data_line() -> None:
    assert Frame("", comment="ping").to_sse() == b": ping\n\n"


def test_json_frame_serializes_its_payload_compactly_with_the_event_name() -> None:
    frame = json_frame({"type": "message_stop", "text": "é\n"}, "message_stop")
    assert frame.event == "message_stop"
    assert orjson.loads(frame.data) == {"type": "message_stop", "text": "é\n"}
    assert "\n" not in frame.data  # one data line: a newline in the text is escaped in the JSON
