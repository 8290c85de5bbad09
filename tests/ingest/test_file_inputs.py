"""File inputs: the shared module (decoding, kinds, PDF text, limits, file-id rewriting) and each protocol's
parser turning its file part into the prompt's text, every refusal naming the part."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from ingest.parsers import anthropic_messages, file_inputs, openai_chat, openai_responses
from ingest.parsers.errors import error_body
from shared.errors import ApiError
from shared.ir import ImagePart, Protocol, Request, Role, TextPart

from ..pdfs import pdf_with_text

NOTES = "Shopping list:\n- apples\n- pears\n"
DATA = {"name": "kiwi", "count": 3}


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def responses(*parts: dict[str, Any]) -> Request:
    body = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Read this."}, *parts]}]}
    return openai_responses.parse(body, request_id="r", created=1.0)


def responses_error(*parts: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        responses(*parts)
    assert caught.value.status == 400
    return caught.value


# ---- the shared module --------------------------------------------------------------------------------


def test_a_text_file_is_rendered_under_a_header_naming_it() -> None:
    part = file_inputs.text_part(NOTES.encode(), name="notes.txt", media_type="", where="w")
    assert part == TextPart(text=f'\n<file name="notes.txt">\n{NOTES.rstrip(chr(10))}\n</file>\n')


@pytest.mark.parametrize(
    ("name", "media_type", "data", "kind"),
    [
        ("data.json", "", b"{}", file_inputs.TEXT),
        ("x", "application/json", b"{}", file_inputs.TEXT),
        ("x", "application/vnd.api+json", b"{}", file_inputs.TEXT),
        ("main.rs", "", b"fn main() {}", file_inputs.TEXT),
        ("README.md", "application/octet-stream", b"# hi", file_inputs.TEXT),  # a generic type: the name decides
        ("table.csv", "", b"a,b", file_inputs.TEXT),
        ("Makefile", "", b"all:\n\ttrue\n", file_inputs.TEXT),  # nothing says: it reads as UTF-8 text
        ("paper.pdf", "", b"", file_inputs.PDF),
        ("scan", "", b"%PDF-1.7 ...", file_inputs.PDF),  # nothing says: the signature
        ("photo.png", "", b"\x89PNG", "image/png"),
        ("a.txt", "image/png", b"hi", "image/png"),  # the declared type wins
        ("song.mp3", "", b"ID3", "audio/mpeg"),
        ("blob", "", b"\x00\x01\xff", "application/octet-stream"),
    ],
)
def test_a_files_kind_comes_from_its_media_type_then_its_name_then_its_bytes(name: str, media_type: str, data: bytes, kind: str) -> None:
    assert file_inputs.classify(data, name=name, media_type=media_type) == kind


def test_a_pdf_is_extracted_page_by_page() -> None:
    text = file_inputs.pdf_text(pdf_with_text("Alpha page", "Beta page"), "w")
    assert text == "--- page 1 ---\nAlpha page\n--- page 2 ---\nBeta page"


def test_a_pdf_locked_by_an_owner_password_alone_is_read() -> None:
    assert "Open book" in file_inputs.pdf_text(pdf_with_text("Open book", password=""), "w")


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (pdf_with_text("", ""), "pdf_without_text"),
        (pdf_with_text("Hidden", password="pw"), "pdf_encrypted"),
        (pdf_with_text("Cut short")[:300], "invalid_pdf"),
        (b"%PDF-1.4 not really", "invalid_pdf"),
    ],
)
def test_a_pdf_without_text_encrypted_or_damaged_is_refused_naming_the_part(data: bytes, code: str) -> None:
    with pytest.raises(ApiError) as caught:
        file_inputs.text_part(data, name="f.pdf", media_type="application/pdf", where="input[0].content[1]")
    assert caught.value.param == "input[0].content[1]" and caught.value.code == code
    assert "input[0].content[1]" in caught.value.message


def test_a_pdf_over_the_page_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_inputs, "MAX_PDF_PAGES", 2)
    with pytest.raises(ApiError) as caught:
        file_inputs.pdf_text(pdf_with_text("a", "b", "c"), "w")
    assert caught.value.code == "pdf_too_long" and "3" in caught.value.message


def test_bare_base64_and_data_urls_decode_and_wrapped_base64_is_accepted() -> None:
    assert file_inputs.decode_data(b64("hi"), "p", where="w") == ("", b"hi")
    assert file_inputs.decode_data("data:text/csv;base64," + b64("a,b"), "p", where="w") == ("text/csv", b"a,b")
    wrapped = b64("x" * 100)
    assert file_inputs.decode_data(wrapped[:40] + "\n" + wrapped[40:], "p", where="w")[1] == b"x" * 100
    for bad in ("data:text/plain,hello", "not base64!"):
        with pytest.raises(ApiError) as caught:
            file_inputs.decode_data(bad, "input[0].content[1].file_data", where="w")
        assert caught.value.param == "input[0].content[1].file_data"


def test_file_ids_are_rewritten_into_data_without_touching_the_clients_body() -> None:
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}, {"type": "input_file", "file_id": "file-1"}]}]}
    chat = {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-2", "filename": "mine.md"}}]}]}
    (ref,) = file_inputs.file_parts(body)
    (chat_ref,) = file_inputs.file_parts(chat)
    assert (ref.where, file_inputs.file_reference(ref)) == ("input[0].content[1]", ("input[0].content[1].file_id", "file-1"))
    assert file_inputs.file_reference(chat_ref) == ("messages[0].content[0].file.file_id", "file-2")
    resolved = file_inputs.with_file_data(body, ref, data_url="data:x;base64,aGk=", filename="a.txt")
    assert resolved["input"][0]["content"][1] == {"type": "input_file", "file_data": "data:x;base64,aGk=", "filename": "a.txt"}
    assert body["input"][0]["content"][1] == {"type": "input_file", "file_id": "file-1"}  # the client's body is left as sent
    assert file_inputs.with_file_data(chat, chat_ref, data_url="d", filename="stored.md")["messages"][0]["content"][0]["file"] == {
        "file_data": "d",
        "filename": "mine.md",  # the client's own name wins
    }
    assert file_inputs.without_references(body)["input"][0]["content"] == [{"type": "input_text", "text": "x"}]


# ---- Responses `input_file` -----------------------------------------------------------------------------


def test_responses_text_json_and_pdf_files_reach_the_prompt() -> None:
    request = responses(
        {"type": "input_file", "filename": "notes.txt", "file_data": "data:text/plain;base64," + b64(NOTES)},
        {"type": "input_file", "filename": "fruit.json", "file_data": b64(f"{DATA}")},
        {"type": "input_file", "filename": "report.pdf", "file_data": "data:application/pdf;base64," + b64(pdf_with_text("Quarterly numbers rose"))},
        {"type": "input_file", "filename": "inline.csv", "file_url": "data:text/csv;base64," + b64("a,b\n1,2")},
    )
    (message,) = request.messages
    assert message.role is Role.USER and message.content[0] == TextPart(text="Read this.")
    texts = [p.text for p in message.content[1:] if isinstance(p, TextPart)]
    assert texts[0].startswith('\n<file name="notes.txt">\nShopping list:') and texts[1].startswith('\n<file name="fruit.json">\n{')
    assert '<file name="report.pdf">\n--- page 1 ---\nQuarterly numbers rose\n</file>' in texts[2]
    assert "a,b\n1,2" in texts[3]


@pytest.mark.parametrize(
    ("part", "param", "code"),
    [
        ({"type": "input_file", "filename": "cat.png", "file_data": b64(b"\x89PNG\r\n")}, "input[0].content[1]", "unsupported_file_type"),
        ({"type": "input_file", "filename": "a.zip", "file_data": b64(b"PK\x03\x04")}, "input[0].content[1]", "unsupported_file_type"),
        ({"type": "input_file", "filename": "s.pdf", "file_data": b64(pdf_with_text(""))}, "input[0].content[1]", "pdf_without_text"),
        ({"type": "input_file", "filename": "l.txt", "file_data": b64(b"caf\xe9")}, "input[0].content[1]", "invalid_file_encoding"),
        ({"type": "input_file", "file_url": "https://example.com/a.pdf"}, "input[0].content[1].file_url", "unsupported_file_url"),
        ({"type": "input_file", "file_id": "file-x"}, "input[0].content[1].file_id", "unsupported_file_id"),  # reached a parser unresolved
        ({"type": "input_file", "file_id": "file-x", "file_data": b64("a")}, "input[0].content[1]", "invalid_value"),
        ({"type": "input_file", "filename": "a.txt"}, "input[0].content[1].file_data", "missing_required_parameter"),
    ],
)
def test_responses_refused_files_name_the_part(part: dict[str, Any], param: str, code: str) -> None:
    err = responses_error(part)
    assert (err.param, err.code) == (param, code)


def test_a_file_over_the_size_limit_and_files_over_the_request_total_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_inputs, "MAX_FILE_BYTES", 30)
    err = responses_error({"type": "input_file", "filename": "a.txt", "file_data": b64("x" * 60)})
    assert (err.param, err.code) == ("input[0].content[1]", "file_too_large")
    monkeypatch.setattr(file_inputs, "MAX_REQUEST_FILE_BYTES", 50)
    small = {"type": "input_file", "filename": "a.txt", "file_data": b64("x" * 27)}
    err = responses_error(small, small)
    assert (err.param, err.code) == ("input[0].content[2]", "files_too_large")


# ---- Chat `file` parts and Anthropic `document` blocks ------------------------------------------------


def test_a_chat_file_part_reaches_the_prompt_and_a_refused_one_names_the_part() -> None:
    def chat(part: dict[str, Any]) -> Request:
        body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, part]}]}
        return openai_chat.parse(body, request_id="r", created=1.0)

    pdf = {"type": "file", "file": {"filename": "doc.pdf", "file_data": "data:application/pdf;base64," + b64(pdf_with_text("Chat PDF text"))}}
    assert "--- page 1 ---\nChat PDF text" in chat(pdf).messages[0].text
    with pytest.raises(ApiError) as caught:
        chat({"type": "file", "file": {"filename": "clip.mp4", "file_data": b64(b"\x00\x00\x00\x18ftypmp42")}})
    assert (caught.value.param, caught.value.code) == ("messages[0].content[1]", "unsupported_file_type")


def test_anthropic_documents_of_every_source_reach_the_prompt_named_by_their_title() -> None:
    pdf = {"type": "document", "title": "Annual report", "source": {"type": "base64", "media_type": "application/pdf", "data": b64(pdf_with_text("Profits up"))}}
    text = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Plain words"}, "context": "ignored"}
    content = {"type": "document", "title": "Chunks", "source": {"type": "content", "content": [{"type": "text", "text": "One"}, {"type": "text", "text": "Two"}]}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [text]}
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
            {"role": "user", "content": [result, pdf, content]},
        ],
    }
    request = anthropic_messages.parse(body, request_id="r", created=1.0)
    tool, user = request.messages[1], request.messages[2]
    assert tool.role is Role.TOOL and tool.text == '\n<file name="document.txt">\nPlain words\n</file>\n'
    assert '<file name="Annual report">\n--- page 1 ---\nProfits up\n</file>' in user.text
    assert '<file name="Chunks">\nOne\nTwo\n</file>' in user.text
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(b"png")}}
    mixed = {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "Caption"}, image]}}
    parts = anthropic_messages.parse({**body, "messages": [{"role": "user", "content": [mixed]}]}, request_id="r", created=1.0).messages[0].content
    assert isinstance(parts[0], TextPart) and isinstance(parts[1], ImagePart)


@pytest.mark.parametrize(
    ("source", "param"),
    [
        ({"type": "url", "url": "https://example.com/a.pdf"}, "messages[0].content[0].source.type"),
        ({"type": "file", "file_id": "file_1"}, "messages[0].content[0].source.type"),
        ({"type": "base64", "media_type": "image/png", "data": b64(b"png")}, "messages[0].content[0].source.media_type"),
        ({"type": "base64", "media_type": "application/pdf", "data": b64(b"not a pdf")}, "messages[0].content[0]"),
    ],
)
def test_anthropic_documents_it_cannot_read_are_refused_naming_the_block(source: dict[str, Any], param: str) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": source}]}]}
    with pytest.raises(ApiError) as caught:
        anthropic_messages.parse(body, request_id="r", created=1.0)
    assert caught.value.status == 400 and caught.value.param == param
    assert "messages[0].content[0]" in error_body(Protocol.ANTHROPIC_MESSAGES, caught.value)["error"]["message"]
