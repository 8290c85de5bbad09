"""The JSON-shaped tool-call parsers: Llama 3 JSON and Mistral (pure; torch-free), and what they share.

Same contract as `workers.tools.HermesParser` (`ToolParser`): `push(text)` → deltas, `flush()` at the
end of generation, `calls` = calls seen. Model output only. Each call streams as `ToolCallStart` once the
name is complete, then `ToolCallArgs` fragments as the argument JSON arrives: the end of the arguments
is found by scanning the JSON (depth, strings, escapes), so a fragment is emitted as soon as it is read.
Syntax (`models.tool_formats`):

- llama3: the output is `{"name": ..., "parameters"|"arguments": {...}}`, optionally after
  `<|python_tag|>`, more calls after `;`. Output whose first non-space character (after the tag) is
  not `{` is content, all of it. Keys after the arguments (an `id`) are read and dropped.
- mistral: text, then `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`, or the
  v11+ `[TOOL_CALLS]name[ARGS]{...}`, repeatable. Text before the marker is content.

Malformed output (a wrapper that is not `{"name": "...", <arguments key>: ...`, a bad v11 name) falls
back to content: the text read since the call began is released as it was. Hand-written because the
deltas must stream and a streaming JSON parser would still need the same bookkeeping.
Must not: import torch, or know any protocol's field names.
"""

from __future__ import annotations

import re
from typing import Protocol

from models.tool_formats import ARGS, PYTHON_TAG, TOOL_CALLS
from shared.deltas import Content, StreamDelta, ToolCallArgs, ToolCallStart


class ToolParser(Protocol):
    @property
    def calls(self) -> int:
        """How many calls have been closed so far."""
        ...

    def push(self, text: str) -> list[StreamDelta]: ...

    def flush(self, cut: bool = False) -> list[StreamDelta]:
        """At the end of generation. `cut`: max_tokens ended it, so text that may be the start of a call's
        markup is dropped rather than shown (a call never leaks as content)."""
        ...


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
_WS = " \t\r\n"


def match_head(text: str, arg_keys: tuple[str, ...]) -> tuple[str, int] | bool:
    """Read `{"name": "<name>", "<arg key>":` (JSON spacing) from the start of text: (name, end) when
    complete, True while text is still a prefix of one, False when it cannot be one."""
    pos = 0
    pieces: list[tuple[str, ...] | str] = ["{", ("name",), ":", "NAME", ",", arg_keys, ":"]
    name = ""
    for piece in pieces:
        while pos < len(text) and text[pos] in _WS:
            pos += 1
        if pos == len(text):
            return True
        if isinstance(piece, tuple) or piece == "NAME":
            match = _STRING.match(text, pos)
            if match is None:
                if text[pos] != '"' or "\n" in text[pos:]:
                    return False
                partial = text[pos + 1 :]
                return piece == "NAME" or any(k.startswith(partial) for k in piece)
            if piece == "NAME":
                name = match.group(1)
            elif match.group(1) not in piece:
                return False
            pos = match.end()
        elif text[pos] == piece:
            pos += 1
        else:
            return False
    return _unescape(name), pos


def _unescape(name: str) -> str:
    import json

    return str(json.loads(f'"{name}"'))


class JsonScan:
    """Finds where one JSON value ends in text that arrives in pieces (`feed` the whole text so far).
    `depth` > 0 at the start scans the rest of an enclosing container instead (ends after its close)."""

    def __init__(self, depth: int = 0) -> None:
        self.pos = 0
        self.depth = depth
        self._in_string = self._escape = self._started = False

    def feed(self, text: str) -> int | None:
        """The end of the value (exclusive) once it is complete, else None."""
        while self.pos < len(text):
            ch, at = text[self.pos], self.pos
            self.pos += 1
            end = self._in_string_char(ch) if self._in_string else self._char(ch, at)
            if end is not None:
                return end
        return None

    def _in_string_char(self, ch: str) -> int | None:
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self._in_string = False
            return self.pos if self.depth == 0 else None
        return None

    def _char(self, ch: str, at: int) -> int | None:
        if not self._started and ch in _WS:
            return None
        first, self._started = not self._started, True
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            if self.depth == 0:
                return at  # a scalar ended by its container's close
            self.depth -= 1
            return self.pos if self.depth == 0 else None
        elif self.depth == 0 and not first and (ch in _WS or ch == ","):
            return at  # a scalar's end
        return None


class _CallStream:
    """Shared bookkeeping: the buffer, the call counter, the text of the call being read (for the
    fallback to content), and the streaming of one call's arguments."""

    def __init__(self, call_id_prefix: str) -> None:
        self._prefix = call_id_prefix
        self._buf = ""
        self._raw = ""  # text consumed since the current call began (released as content if it turns out malformed)
        self._scan = JsonScan()
        self._sent = 0
        self._args_begun = False
        self._mode = ""  # the subclass's state; each mode is a method `_<mode>(out) -> progressed`
        self.calls = 0

    def push(self, text: str) -> list[StreamDelta]:
        self._buf += text
        out: list[StreamDelta] = []
        while getattr(self, f"_{self._mode}")(out):
            pass
        return out

    def _args(self, out: list[StreamDelta]) -> bool:
        """`args` mode: stream the arguments; then skip the rest of the wrapper object."""
        if not self._stream_args(out):
            return False
        self._scan, self._mode = JsonScan(depth=1), "wrapper"
        return True

    def _wrapper(self, out: list[StreamDelta]) -> bool:
        if not self._end_wrapper():
            return False
        self._mode = "between"
        return True

    def _take(self, n: int) -> str:
        taken, self._buf = self._buf[:n], self._buf[n:]
        self._raw += taken
        return taken

    def _start_call(self, name: str, out: list[StreamDelta]) -> None:
        out.append(ToolCallStart(index=self.calls, id=f"{self._prefix}_{self.calls}", name=name))
        self._scan, self._sent, self._args_begun = JsonScan(), 0, False

    def _stream_args(self, out: list[StreamDelta]) -> bool:
        """Emit the arguments read so far; True (and the buffer past them) once they are complete."""
        end = self._scan.feed(self._buf)
        upto = len(self._buf) if end is None else end
        text = self._buf[self._sent : upto]
        text = text if self._args_begun else text.lstrip()  # spaces before the value are not part of it
        if text:
            self._args_begun = True
            out.append(ToolCallArgs(index=self.calls, arguments=text))
        self._sent = upto
        if end is None:
            return False
        self._take(end)
        return True

    def _end_wrapper(self) -> bool:
        """Skip to the close of the call's wrapper object (other keys are dropped); True once there."""
        end = self._scan.feed(self._buf)
        if end is None:
            return False
        self._take(end)
        self.calls += 1
        self._raw = ""
        return True


class Llama3Parser(_CallStream):
    KEYS = ("parameters", "arguments")

    def __init__(self, call_id_prefix: str) -> None:
        super().__init__(call_id_prefix)
        self._mode = "start"  # start | content | head | args | wrapper | between

    def flush(self, cut: bool = False) -> list[StreamDelta]:
        out: list[StreamDelta] = []
        if self._mode in ("args", "wrapper"):  # an unterminated call: its arguments read so far are out already
            self.calls += 1
        elif cut and (self._mode == "head" or (self._mode == "start" and PYTHON_TAG.startswith(self._buf.lstrip()))):
            pass  # a call's head (or the tag before it) that max_tokens cut: dropped, never shown as text
        elif self._mode in ("start", "head", "content"):
            text = self._raw + self._buf
            if text and not (self.calls and text.isspace()):
                out.append(Content(text=text))
        self._buf = self._raw = ""
        return out

    def _start(self, out: list[StreamDelta]) -> bool:
        stripped = self._buf.lstrip()
        if not stripped or (PYTHON_TAG.startswith(stripped) and stripped != PYTHON_TAG):
            return False
        if stripped.startswith(PYTHON_TAG):
            self._buf = stripped[len(PYTHON_TAG) :]
            return True
        self._mode = "head" if stripped.startswith("{") else "content"
        return True

    def _content(self, out: list[StreamDelta]) -> bool:
        if self._raw + self._buf:
            out.append(Content(text=self._raw + self._buf))
        self._buf = self._raw = ""
        return False

    def _head(self, out: list[StreamDelta]) -> bool:
        head = match_head(self._buf, self.KEYS)
        if head is True:
            return False
        if head is False:
            self._mode = "content"
            return True
        name, end = head
        self._take(end)
        self._start_call(name, out)
        self._mode = "args"
        return True

    def _between(self, out: list[StreamDelta]) -> bool:
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        if stripped.startswith(";"):
            self._buf, self._mode = stripped[1:].lstrip(), "head"
            return bool(self._buf)
        self._buf, self._mode = stripped, "content"
        return True


_V11_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class MistralParser(_CallStream):
    KEYS = ("arguments",)

    def __init__(self, call_id_prefix: str) -> None:
        super().__init__(call_id_prefix)
        self._mode = "text"  # text | form | head | args | wrapper | between | name | v11args

    def flush(self, cut: bool = False) -> list[StreamDelta]:
        out: list[StreamDelta] = []
        if self._mode in ("args", "v11args", "wrapper"):  # an unterminated call: its arguments read so far are out already
            self.calls += 1
        elif cut and self._mode in ("form", "head", "name"):
            pass  # `[TOOL_CALLS]` and a call head that max_tokens cut: dropped, never shown as text
        elif cut and self._mode == "text":
            text = self._buf[: len(self._buf) - partial_suffix(self._buf, TOOL_CALLS)]
            if text and not (self.calls and text.isspace()):
                out.append(Content(text=text))
        elif self._mode != "between":
            text = self._raw + self._buf
            if text and not (self.calls and text.isspace()):
                out.append(Content(text=text))
        self._buf = self._raw = ""
        return out

    def _text(self, out: list[StreamDelta]) -> bool:
        at = self._buf.find(TOOL_CALLS)
        if at >= 0:
            if self._buf[:at].strip() or (at and not self.calls):
                out.append(Content(text=self._buf[:at]))
            self._buf, self._raw, self._mode = self._buf[at + len(TOOL_CALLS) :], TOOL_CALLS, "form"
            return True
        keep = partial_suffix(self._buf, TOOL_CALLS)
        if len(self._buf) > keep and (self._buf[: len(self._buf) - keep].strip() or not self.calls):
            out.append(Content(text=self._buf[: len(self._buf) - keep]))
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _form(self, out: list[StreamDelta]) -> bool:
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        if stripped.startswith("["):
            self._take(len(self._buf) - len(stripped) + 1)
            self._mode = "head"
        else:
            self._mode = "name"
        return True

    def _head(self, out: list[StreamDelta]) -> bool:
        head = match_head(self._buf, self.KEYS)
        if head is True:
            return False
        if head is False:
            return self._release(out)
        name, end = head
        self._take(end)
        self._start_call(name, out)
        self._mode = "args"
        return True

    def _release(self, out: list[StreamDelta]) -> bool:
        out.append(Content(text=self._raw + self._buf))
        self._buf, self._raw, self._mode = "", "", "text"
        return False

    def _between(self, out: list[StreamDelta]) -> bool:
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        self._buf = stripped[1:]
        if stripped[0] == ",":
            self._mode = "head"
        elif stripped[0] == "]":
            self._mode = "text"
        else:
            self._buf = stripped
            return self._release(out)
        return True

    def _name(self, out: list[StreamDelta]) -> bool:
        at = self._buf.find(ARGS)
        if at < 0:
            if len(self._buf) > 64 + len(ARGS) or "\n" in self._buf:
                return self._release(out)
            return False
        name = self._buf[:at].strip()
        if not _V11_NAME.match(name):
            return self._release(out)
        self._take(at + len(ARGS))
        self._start_call(name, out)
        self._mode = "v11args"
        return True

    def _v11args(self, out: list[StreamDelta]) -> bool:
        if not self._stream_args(out):
            return False
        self.calls += 1
        self._raw, self._mode = "", "text"
        return True
