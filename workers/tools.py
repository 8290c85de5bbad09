"""Tool-call parsers: the model's streamed text → Content / ToolCallStart / ToolCallArgs deltas (pure).

Owns: `PARSERS`, the parser class of each family in `models.tool_formats` (the engine builds one per
request with `make_parser`), and the hermes parser. The JSON-shaped families (llama3, mistral) live in
`workers.tool_parsers`. Every parser parses model output only (the engine feeds it generated text,
never a prompt; on resume, the text an earlier attempt emitted, so it is where it was).

Hermes / Qwen syntax, as `models.tools` prompts for and its grammars enforce:
`<tool_call>{"name": "...", "arguments": {...}}</tool_call>`; a custom tool's call is
`<tool_call>{"name": "..."}` + newline + its raw input, up to `</tool_call>` or the end of the output
(its `ToolCallArgs` carry that raw text). Hand-written as a small state machine
because the deltas must stream: `ToolCallStart` as soon as the name is complete, `ToolCallArgs` as the
argument JSON arrives. Text that might be the start of the call tag is held back until disproved;
the wrapper's closing `}` is held back until the closing tag shows it is not part of the arguments.
Whitespace between and after calls is dropped. Deltas come out without token ids or attempt: the
engine attaches those.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from models.tool_formats import HERMES, LLAMA3, MISTRAL, ToolFormat
from models.tools import CLOSE, OPEN
from shared.deltas import Content, StreamDelta, ToolCallArgs, ToolCallStart
from workers.tool_parsers import Llama3Parser, MistralParser, ToolParser, partial_suffix

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*(?:,\s*"arguments"\s*:\s*|(\}\n))')


class HermesParser:
    def __init__(self, call_id_prefix: str) -> None:
        self._prefix = call_id_prefix
        self._buf = ""
        self._mode = "text"  # text | head (after the tag, name not yet complete) | args | raw (a custom tool's input)
        self._sent = 0  # argument characters already emitted for the open call
        self.calls = 0

    def push(self, text: str) -> list[StreamDelta]:
        self._buf += text
        out: list[StreamDelta] = []
        while True:
            step = {"text": self._text, "head": self._head, "args": self._args, "raw": self._raw}[self._mode]
            if not step(out):
                return out

    def flush(self, cut: bool = False) -> list[StreamDelta]:
        """At the end of generation: held-back text, or what is left of an unterminated call's arguments.
        `cut` (max_tokens ended it): a call whose head was not complete, or a tag's first characters, are
        dropped; an unterminated call keeps what was streamed of it (the finish says `length`)."""
        out: list[StreamDelta] = []
        if cut and self._mode in ("text", "head"):
            self._buf = self._buf[: len(self._buf) - partial_suffix(self._buf, OPEN)] if self._mode == "text" else ""
        if self._mode == "text" and self._buf and not (self.calls and self._buf.isspace()):
            out.append(Content(text=self._buf))
        elif self._mode == "head" and not cut:
            out.append(Content(text=OPEN + self._buf))
        elif self._mode == "args" and len(self._buf) > self._sent:
            out.append(ToolCallArgs(index=self.calls, arguments=self._buf[self._sent :]))
            self.calls += 1
        elif self._mode == "raw":  # a custom input the grammar ended without a closing tag
            if self._buf:
                out.append(ToolCallArgs(index=self.calls, arguments=self._buf))
            self.calls += 1
        self._buf = ""
        return out

    def _text(self, out: list[StreamDelta]) -> bool:
        if self.calls:
            self._buf = self._buf.lstrip()
        at = self._buf.find(OPEN)
        if at >= 0:
            if self._buf[:at].strip() or (at and not self.calls):
                out.append(Content(text=self._buf[:at]))
            self._buf, self._mode = self._buf[at + len(OPEN) :], "head"
            return True
        keep = partial_suffix(self._buf, OPEN)
        if len(self._buf) > keep:
            out.append(Content(text=self._buf[: len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _head(self, out: list[StreamDelta]) -> bool:
        match = _HEAD.match(self._buf)
        if match is not None and match.group(2) is None and match.end() == len(self._buf):
            return False  # whitespace before the arguments may still be coming
        if match is None:
            if CLOSE in self._buf:  # a tag without a call inside: it was text after all
                end = self._buf.index(CLOSE) + len(CLOSE)
                out.append(Content(text=OPEN + self._buf[:end]))
                self._buf, self._mode = self._buf[end:], "text"
                return True
            return False
        name = json.loads(f'"{match.group(1)}"')
        out.append(ToolCallStart(index=self.calls, id=f"{self._prefix}_{self.calls}", name=name))
        self._buf, self._mode, self._sent = self._buf[match.end() :], "raw" if match.group(2) else "args", 0
        return True

    def _raw(self, out: list[StreamDelta]) -> bool:
        at = self._buf.find(CLOSE)
        end = at if at >= 0 else len(self._buf) - partial_suffix(self._buf, CLOSE)
        if end > 0:
            out.append(ToolCallArgs(index=self.calls, arguments=self._buf[:end]))
        if at < 0:
            self._buf = self._buf[end:]
            return False
        self.calls += 1
        self._buf, self._mode = self._buf[at + len(CLOSE) :], "text"
        return True

    def _args(self, out: list[StreamDelta]) -> bool:
        at = self._buf.find(CLOSE)
        if at >= 0:
            region = self._buf[:at].rstrip()
            arguments = region[:-1].rstrip() if region.endswith("}") else region
            if len(arguments) > self._sent:
                out.append(ToolCallArgs(index=self.calls, arguments=arguments[self._sent :]))
            self.calls += 1
            self._buf, self._mode = self._buf[at + len(CLOSE) :], "text"
            return True
        safe = self._buf[: len(self._buf) - partial_suffix(self._buf, CLOSE)].rstrip()
        end = len(safe) - 1 if safe.endswith("}") else len(safe)
        if end > self._sent:
            out.append(ToolCallArgs(index=self.calls, arguments=self._buf[self._sent : end]))
            self._sent = end
        return False


class RepeatGuard:
    """Ends a turn whose calls are forced (`tool_choice: required`) with parallel calls allowed when the
    model repeats a call: that grammar lets calls follow calls until max_tokens, and a small model writes
    the same call again and again (the last one cut mid-way). A call with the name of an earlier one is
    held back while its argument text is still a prefix of that call's, released the moment it differs,
    and dropped when it turns out the same whole; then `repeated` is set and the engine ends the turn
    (finish `tool_calls`). Wraps any family's parser (it sees only deltas)."""

    def __init__(self, inner: ToolParser) -> None:
        self._inner = inner
        self._done: list[tuple[str, str]] = []  # the calls complete so far: (name, argument text)
        self._current: list[str] | None = None  # [name, argument text so far] of the call in progress
        self._held: list[StreamDelta] | None = None  # the call in progress's deltas, while it may be a repeat
        self._index = -1  # the call in progress's index
        self.repeated = False

    @property
    def calls(self) -> int:
        return self._inner.calls

    def push(self, text: str) -> list[StreamDelta]:
        return self._guard(self._inner.push(text))

    def flush(self, cut: bool = False) -> list[StreamDelta]:
        out = self._guard(self._inner.flush(cut), cut=cut)
        if self._held is not None:  # the output ended while it was still a prefix: its own (shorter) call
            out += self._held
            self._held = None
        return out

    def _guard(self, deltas: list[StreamDelta], *, cut: bool = False) -> list[StreamDelta]:
        out: list[StreamDelta] = []
        for delta in deltas:
            if self.repeated:
                break
            if isinstance(delta, ToolCallStart):
                self._settle(out, closed=True)
                if self.repeated:
                    break
                if self._current is not None:
                    self._done.append((self._current[0], self._current[1]))
                self._current, self._index = [delta.name, ""], delta.index
                if any(name == delta.name for name, _ in self._done):
                    self._held = [delta]
                else:
                    out.append(delta)
                continue
            if isinstance(delta, ToolCallArgs) and self._current is not None:
                self._current[1] += delta.arguments
            if self._held is None:
                out.append(delta)
            else:
                self._held.append(delta)
                self._settle(out, closed=False)
        self._settle(out, closed=self._inner.calls > self._index, cut=cut)
        return out

    def _settle(self, out: list[StreamDelta], *, closed: bool, cut: bool = False) -> None:
        """The held call: a repeat once it is closed with the same text (or cut by max_tokens while it
        still was one's prefix: it was on its way to being one); released once it differs."""
        if self._held is None or self._current is None:
            return
        name, args = self._current
        if (closed and (name, args) in self._done) or (cut and any(n == name and a.startswith(args) for n, a in self._done)):
            self.repeated, self._held = True, None
        elif closed or not any(n == name and a.startswith(args) for n, a in self._done):
            out += self._held
            self._held = None


    @property
    def ended(self) -> bool:
        return self.repeated


class CallCap:
    """Ends a turn once it holds `cap` whole calls (the Responses API's `max_tool_calls`): the engine
    finishes the request the moment the cap-th call closes (`ended`), and any delta of a later call the
    same text already opened is dropped. Wraps any parser, or a `RepeatGuard`."""

    def __init__(self, inner: ToolParser, cap: int) -> None:
        self._inner = inner
        self._cap = cap

    @property
    def calls(self) -> int:
        return min(self._inner.calls, self._cap)

    @property
    def ended(self) -> bool:
        return self._inner.calls >= self._cap or bool(getattr(self._inner, "ended", False))

    def push(self, text: str) -> list[StreamDelta]:
        return self._within(self._inner.push(text))

    def flush(self, cut: bool = False) -> list[StreamDelta]:
        return self._within(self._inner.flush(cut))

    def _within(self, deltas: list[StreamDelta]) -> list[StreamDelta]:
        return [d for d in deltas if not isinstance(d, ToolCallStart | ToolCallArgs) or d.index < self._cap]


PARSERS: dict[str, Callable[[str], ToolParser]] = {HERMES.name: HermesParser, LLAMA3.name: Llama3Parser, MISTRAL.name: MistralParser}


def make_parser(fmt: ToolFormat, call_id_prefix: str) -> ToolParser:
    """The parser for `fmt`'s syntax; call ids are `<prefix>_<index>`."""
    return PARSERS[fmt.name](call_id_prefix)
