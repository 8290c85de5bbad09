"""File inputs → prompt text (pure), shared by the three protocols' parsers: Responses `input_file` parts,
Chat `file` parts and Anthropic `document` blocks each become one `TextPart`.

Owns: decoding a file's bytes (a `data:<media type>;base64,<data>` URL or bare base64), telling what a file
is (its declared media type, else its name's extension, else the `%PDF-` signature, else whether it is
UTF-8 text), PDF text extraction (pypdf, page by page), the size limits, and the one rendering every
protocol shares — the file's name on a header line, its text, a closing line, on lines of their own:

    <file name="notes.txt">
    ...the file's text...
    </file>

A PDF's text comes page by page, each page after a line `--- page N ---`. Text-like files (`text/*`, JSON,
XML, YAML, TOML, JavaScript, shell, SQL, ..., or a code, markup or data extension such as .md .py .csv
.yaml .rs) must decode as UTF-8. Everything else — images (they are `input_image` / `image_url` / `image`
parts), audio, video, archives, office documents — and a PDF that has no extractable text (scanned), is
encrypted, or cannot be read is refused: a 400 naming the part (`input[0].content[1]`) and the reason.
Limits: `MAX_FILE_BYTES` per file (decoded), `MAX_REQUEST_FILE_BYTES` for the files of one request
(`check_total`), `MAX_PDF_PAGES` per PDF (text extraction is CPU work; the app parses a body with files
off the event loop).
Also: `file_parts(body)` finds the file parts of any of the three protocols' bodies; the API node uses it to
resolve `file_id` references (ingest.http.file_refs) into `file_data` before a body is parsed, so a parser
only ever sees a file's bytes.
Must not: do I/O (a `file_url` that is not a data URL is refused, never fetched; a `file_id` that reached a
parser unresolved is refused).
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import mimetypes
from dataclasses import dataclass
from typing import Any

from pypdf import PasswordType, PdfReader

from ingest.parsers import fields as f
from shared.errors import ApiError, invalid
from shared.ir import TextPart

MAX_FILE_BYTES = 32 * 2**20  # one file, decoded (OpenAI's and Anthropic's documented 32 MB for a PDF input)
MAX_REQUEST_FILE_BYTES = 50 * 2**20  # every file of one request together, decoded (OpenAI's per-request total for file inputs)
MAX_PDF_PAGES = 100  # pages of one PDF (the page count OpenAI and Anthropic document for PDF inputs)
FILE_PART_TYPES = ("input_file", "file", "document")  # Responses, Chat, Anthropic
GENERIC_TYPES = ("", "application/octet-stream", "binary/octet-stream", "application/unknown")
TEXT_TYPES = frozenset({
    "application/json", "application/x-ndjson", "application/jsonl", "application/xml", "application/yaml", "application/x-yaml",
    "application/toml", "application/javascript", "application/x-javascript", "application/typescript", "application/x-sh",
    "application/x-python", "application/sql", "application/x-tex", "application/x-latex", "application/csv", "application/rtf",
    "application/graphql", "application/x-httpd-php", "application/x-perl", "application/x-ruby",
})
TEXT_SUFFIXES = frozenset({  # names that are text whatever media type they would be guessed to have
    ".txt", ".text", ".md", ".markdown", ".rst", ".adoc", ".org", ".tex", ".log", ".csv", ".tsv", ".json", ".jsonl", ".ndjson",
    ".xml", ".yaml", ".yml", ".toml", ".ini", ".cfg", ".conf", ".env", ".properties", ".html", ".htm", ".css", ".scss", ".sass",
    ".less", ".svg", ".py", ".pyi", ".ipynb", ".js", ".mjs", ".cjs", ".jsx", ".ts", ".tsx", ".java", ".kt", ".kts", ".scala",
    ".groovy", ".gradle", ".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".cs", ".go", ".rs", ".rb", ".php", ".pl", ".pm",
    ".lua", ".r", ".jl", ".swift", ".m", ".mm", ".dart", ".ex", ".exs", ".erl", ".hs", ".ml", ".clj", ".elm", ".vue", ".svelte",
    ".sh", ".bash", ".zsh", ".fish", ".ps1", ".bat", ".sql", ".graphql", ".proto", ".tf", ".hcl", ".dockerfile", ".mk", ".cmake",
    ".diff", ".patch", ".srt", ".vtt",
})
PDF, TEXT = "application/pdf", "text"


@dataclass(frozen=True, slots=True)
class FileRef:
    """A file part of a body: `where` names it (`input[0].content[1]`), `path` leads to it from the body."""

    where: str
    path: tuple[str | int, ...]
    part: dict[str, Any]


def file_parts(body: Any) -> list[FileRef]:
    """Every file part of a body, in order: the `content` (or Responses' `output`) blocks of each `input` /
    `messages` item, and those inside an Anthropic `tool_result`."""
    out: list[FileRef] = []
    if not isinstance(body, dict):
        return out
    for root in ("input", "messages"):
        items = body.get(root)
        for i, item in enumerate(items if isinstance(items, list) else []):
            for key in ("content", "output"):
                if isinstance(item, dict):
                    out.extend(_in_blocks(item.get(key), (root, i, key)))
    return out


def _in_blocks(blocks: Any, path: tuple[str | int, ...]) -> list[FileRef]:
    out: list[FileRef] = []
    for j, block in enumerate(blocks if isinstance(blocks, list) else []):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in FILE_PART_TYPES:
            out.append(FileRef(where=_where((*path, j)), path=(*path, j), part=block))
        elif kind == "tool_result":
            out.extend(_in_blocks(block.get("content"), (*path, j, "content")))
    return out


def _where(path: tuple[str | int, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path))


def check_total(body: Any) -> None:
    """A 400 naming the part at which a request's files pass `MAX_REQUEST_FILE_BYTES` together (sizes
    reckoned from the base64 length, before anything is decoded)."""
    total = 0
    for ref in file_parts(body):
        total += _declared_size(ref.part)
        if total > MAX_REQUEST_FILE_BYTES:
            raise invalid(
                f"Invalid '{ref.where}': the files of one request may hold at most {MAX_REQUEST_FILE_BYTES // 2**20} MB together.",
                ref.where,
                "files_too_large",
            )


def _declared_size(part: dict[str, Any]) -> int:
    inner = part.get("file") if part.get("type") == "file" else part.get("source") if part.get("type") == "document" else part
    if not isinstance(inner, dict):
        return 0
    if inner.get("type") == "text":  # an Anthropic plain-text source
        return len(inner["data"]) if isinstance(inner.get("data"), str) else 0
    value = next((inner[k] for k in ("file_data", "file_url", "data") if isinstance(inner.get(k), str)), "")
    return len(value.partition(",")[2] if value.startswith("data:") else value) * 3 // 4


def openai_file(fields: dict[str, Any], where: str, *, at: str) -> TextPart:
    """A Responses `input_file` part (`fields` is the part, `at` == `where`) or a Chat `file` part (`fields`
    is its `file` object, `at` is `where.file`): exactly one of `file_data` / `file_url` (a data URL) /
    `file_id` (resolved into `file_data` by the API node before parsing), and an optional `filename`."""
    given = [key for key in ("file_data", "file_id", "file_url") if fields.get(key) is not None]
    if not given:
        raise invalid(f"Missing required parameter: '{at}.file_data' (or '{at}.file_id').", f"{at}.file_data", "missing_required_parameter")
    if len(given) > 1:
        raise invalid(f"Invalid '{where}': give one of 'file_data', 'file_id' and 'file_url', not {' and '.join(given)}.", where, "invalid_value")
    key = given[0]
    value = f.string(fields[key], f"{at}.{key}", allow_empty=False)
    if key == "file_id":
        raise invalid(f"Invalid '{at}.file_id': file ids are not accepted on this route; send the file's contents as 'file_data'.", f"{at}.file_id", "unsupported_file_id")
    if key == "file_url" and not value.startswith("data:"):
        raise invalid(
            f"Invalid '{at}.file_url': this server fetches nothing from the network; send the file as 'file_data' "
            "(base64 or a data URL), or upload it (POST /v1/files) and send its 'file_id'.",
            f"{at}.file_url",
            "unsupported_file_url",
        )
    name = f.string(fields["filename"], f"{at}.filename") if fields.get("filename") is not None else ""
    media_type, data = decode_data(value, f"{at}.{key}", where=where)
    return text_part(data, name=name, media_type=media_type, where=where)


def decode_data(value: str, param: str, *, where: str) -> tuple[str, bytes]:
    """(declared media type or "", bytes) of a `data:<media type>;base64,<data>` URL or bare base64; a
    file over `MAX_FILE_BYTES` is refused before it is decoded."""
    media_type, payload = "", value
    if value.startswith("data:"):
        header, comma, payload = value.partition(",")
        if not comma or not header.endswith(";base64"):
            raise invalid(f"Invalid '{param}': a data URL must read 'data:<media type>;base64,<data>'.", param, "invalid_file_data")
        media_type = header[len("data:") : -len(";base64")]
    if len(payload) * 3 // 4 > MAX_FILE_BYTES:
        raise too_large(where)
    return media_type, base64_bytes(payload, param)


def base64_bytes(payload: str, param: str) -> bytes:
    """Standard base64 (line breaks allowed, as MIME wraps it); anything else is a 400 naming `param`."""
    try:
        wrapped = any(space in payload for space in "\n\r\t ")
        return base64.b64decode("".join(payload.split()) if wrapped else payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"Invalid '{param}': not valid base64 data.", param, "invalid_file_data") from None


def too_large(where: str) -> ApiError:
    return invalid(f"Invalid '{where}': a file may hold at most {MAX_FILE_BYTES // 2**20} MB.", where, "file_too_large")


def text_part(data: bytes, *, name: str, media_type: str, where: str) -> TextPart:
    """A file's bytes as the prompt's rendering of it (a PDF's extracted text, a text file's UTF-8 text),
    or a 400 naming `where` when the file is too large or of a kind this server cannot read."""
    if len(data) > MAX_FILE_BYTES:
        raise too_large(where)
    kind = classify(data, name=name, media_type=media_type)
    if kind == PDF:
        return TextPart(text=render(name or "document.pdf", pdf_text(data, where)))
    if kind == TEXT:
        return TextPart(text=render(name or "file.txt", utf8_text(data, where)))
    hint = " Send images as image parts, not files." if kind.startswith("image/") else ""
    raise invalid(
        f"Invalid '{where}': files of type {kind!r} are not supported; supported are PDF and text files (plain text, "
        f"Markdown, JSON, CSV, XML, YAML, code, ...).{hint}",
        where,
        "unsupported_file_type",
    )


def classify(data: bytes, *, name: str, media_type: str) -> str:
    """`PDF`, `TEXT`, or the media type of a file this server cannot read. The declared media type wins
    unless it is generic (octet-stream); then the name's extension; then the bytes themselves."""
    declared = media_type.split(";")[0].strip().lower()
    suffix = ("." + name.rsplit(".", 1)[-1].lower()) if "." in name else ""
    kind = declared if declared not in GENERIC_TYPES else ("text/plain" if suffix in TEXT_SUFFIXES else _media_types().guess_type(name or "x")[0] or "")
    if kind == PDF or (not kind and data.startswith(b"%PDF-")):
        return PDF
    if kind.startswith("text/") or kind in TEXT_TYPES or kind.endswith(("+json", "+xml", "+yaml")):
        return TEXT
    if not kind:  # nothing says what it is: text if it reads as text
        return TEXT if b"\x00" not in data[:8192] and _is_utf8(data) else "application/octet-stream"
    return kind


@functools.cache
def _media_types() -> mimetypes.MimeTypes:
    """Python's own extension table only (not the machine's /etc/mime.types): the same answer everywhere."""
    return mimetypes.MimeTypes()


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def utf8_text(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8-sig")  # a leading byte-order mark is not text
    except UnicodeDecodeError:
        raise invalid(f"Invalid '{where}': a text file must be UTF-8; this one is not.", where, "invalid_file_encoding") from None


def pdf_text(data: bytes, where: str) -> str:
    """The text of every page of a PDF, each after a `--- page N ---` line; a 400 naming `where` for an
    unreadable, encrypted, over-long or textless (scanned) PDF."""
    reader = _open_pdf(data, where)
    try:
        count = len(reader.pages)
        if count > MAX_PDF_PAGES:
            raise invalid(f"Invalid '{where}': a PDF may have at most {MAX_PDF_PAGES} pages; this one has {count}.", where, "pdf_too_long")
        pages = [page.extract_text() for page in reader.pages]
    except ApiError:
        raise
    except Exception:  # pypdf fails on a damaged page tree or content stream in many ways (its own errors, KeyError, ValueError, ...)
        raise _unreadable(where) from None
    if not any(text.strip() for text in pages):
        raise invalid(
            f"Invalid '{where}': the PDF has no extractable text (a scanned document?); send its pages as images instead.", where, "pdf_without_text"
        )
    return "\n".join(f"--- page {n} ---\n{text.strip()}" for n, text in enumerate(pages, start=1))


def _open_pdf(data: bytes, where: str) -> PdfReader:
    try:
        reader = PdfReader(io.BytesIO(data))
    except Exception:  # not a PDF, or a damaged one: pypdf raises its own errors and builtin ones alike
        raise _unreadable(where) from None
    if reader.is_encrypted:
        try:
            opened = reader.decrypt("") is not PasswordType.NOT_DECRYPTED  # an owner password alone still lets it be read
        except Exception:  # a cipher pypdf cannot run here
            opened = False
        if not opened:
            raise invalid(f"Invalid '{where}': the PDF is encrypted; send it without a password.", where, "pdf_encrypted")
    return reader


def _unreadable(where: str) -> ApiError:
    return invalid(f"Invalid '{where}': the PDF could not be read (damaged or not a PDF).", where, "invalid_pdf")


def render(name: str, text: str) -> str:
    """The file as the prompt shows it (module docstring); newlines around it keep it off its neighbours' lines."""
    label = " ".join(name.replace('"', "'").split())
    return f'\n<file name="{label}">\n{text.removesuffix(chr(10))}\n</file>\n'


# ---- file ids (the API node resolves them before parsing: ingest.http.file_refs) -----------------------


def file_reference(ref: FileRef) -> tuple[str, str] | None:
    """(the parameter naming it, the id) of a Responses / Chat file part that names an uploaded file by
    `file_id` alone; None for any other part."""
    kind = ref.part.get("type")
    fields, at = (ref.part.get("file"), f"{ref.where}.file") if kind == "file" else (ref.part, ref.where)
    if kind == "document" or not isinstance(fields, dict) or not isinstance(fields.get("file_id"), str):
        return None
    if fields.get("file_data") is not None or fields.get("file_url") is not None:
        return None  # several sources: the parser refuses it, naming the part
    return f"{at}.file_id", fields["file_id"]


def with_file_data(body: Any, ref: FileRef, *, data_url: str, filename: str) -> Any:
    """A copy of `body` whose part at `ref` carries `data_url` as its `file_data` in place of its `file_id`
    (its own `filename` kept, else `filename`). Only the containers on the way to the part are copied."""

    def carried(fields: dict[str, Any]) -> dict[str, Any]:
        rest = {k: v for k, v in fields.items() if k != "file_id"}
        return rest | {"file_data": data_url, "filename": fields.get("filename") or filename}

    part = ref.part
    resolved = {**part, "file": carried(part["file"])} if part.get("type") == "file" else carried(part)
    return _replaced(body, ref.path, resolved)


def without_references(body: Any) -> Any:
    """A copy of `body` without the parts that name a file by `file_id` (for checks that cannot read files:
    a batch line at creation, resolved when it is dispatched)."""
    for ref in reversed(file_parts(body)):  # last first: earlier paths stay valid
        if file_reference(ref) is not None:
            body = _replaced(body, ref.path, None)
    return body


def _replaced(value: Any, path: tuple[str | int, ...], new: Any) -> Any:
    """`value` with the item at `path` replaced by `new` (removed from its list when `new` is None)."""
    key, rest = path[0], path[1:]
    if isinstance(value, list) and isinstance(key, int):
        items = list(value)
        if rest:
            items[key] = _replaced(value[key], rest, new)
        elif new is None:
            del items[key]
        else:
            items[key] = new
        return items
    assert isinstance(value, dict) and isinstance(key, str)
    return {**value, key: _replaced(value[key], rest, new) if rest else new}
