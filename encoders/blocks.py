"""One block open at a time over deltas that may interleave (parallel tool calls).

Owns: the order in which content blocks (Anthropic content blocks, Responses output items) are opened,
appended to and closed, for protocols whose streams allow only one open block. A worker may interleave
the argument fragments of parallel tool calls (`ToolCallArgs` for call 0 after `ToolCallStart` of
call 1), and may write text after a call has started; nothing of it may be dropped. The rule:

- Deltas go, in arrival order, into logical blocks: a `ToolCallStart` opens a new tool block, its
  `ToolCallArgs` go to that block wherever it stands; a text-like delta joins the last block when that
  is of the same group (and not a tool block), else starts a new block.
- The first block not yet closed is the *live* block: its pieces stream at once. Pieces of later blocks
  are held until they become live.
- The live block closes when a later block exists and it is complete: a text-like block is complete as
  soon as something follows it; a tool block once its arguments form a whole JSON value (so a call's
  late fragment is never cut off), or, for a tool named in `raw` (custom tools: raw input, not JSON), as
  soon as something follows it (workers emit a raw input whole before the next call). At the end
  (`finish`) every block closes, in order.

Encoders turn the resulting `Op`s into their own events; the stream and the final body are built from
the same ops, so they agree. Pure; hand-written because it is this protocol rule and nothing more.
Must not: know any protocol's event names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from shared.deltas import StreamDelta, ToolCallArgs, ToolCallStart

TOOL = "tool"


@dataclass(frozen=True, slots=True)
class Op:
    """`open` block `index` (its first delta is `delta`: a ToolCallStart or a text-like delta),
    `append` `delta` to it, or `close` it."""

    kind: str  # "open" | "append" | "close"
    index: int
    group: str
    delta: StreamDelta | None = None


@dataclass
class _Block:
    group: str
    pieces: list[StreamDelta] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)  # tool blocks: argument fragments so far
    raw: bool = False  # a custom tool's call: its arguments are raw text, complete once something follows
    streamed: int = 0  # pieces already handed out as ops
    opened: bool = False
    closed: bool = False

    def args_complete(self) -> bool:
        if self.raw:
            return True
        try:
            orjson.loads("".join(self.arguments))
        except orjson.JSONDecodeError:
            return False
        return True


class BlockSequencer:
    def __init__(self, raw: frozenset[str] = frozenset()) -> None:
        self._raw = raw  # tool names whose arguments are raw text
        self._blocks: list[_Block] = []
        self._tools: dict[int, int] = {}  # ToolCallStart.index → block index
        self._live = 0  # index of the first block not closed

    def feed(self, delta: StreamDelta, group: str) -> list[Op]:
        """Place one non-terminal delta (`group`: the block kind it belongs to; TOOL for tool deltas)."""
        if isinstance(delta, ToolCallStart):
            self._tools[delta.index] = len(self._blocks)
            self._blocks.append(_Block(TOOL, [delta], raw=delta.name in self._raw))
        elif isinstance(delta, ToolCallArgs):
            index = self._tools.get(delta.index)
            if index is None or not delta.arguments:
                return []  # arguments of a call that never started: nothing to attach them to
            block = self._blocks[index]
            block.pieces.append(delta)
            block.arguments.append(delta.arguments)
        else:
            last = self._blocks[-1] if self._blocks else None
            if last is not None and last.group == group and not last.closed:
                last.pieces.append(delta)
            else:
                self._blocks.append(_Block(group, [delta]))
        return self._advance(final=False)

    def finish(self) -> list[Op]:
        """Close every block, in order (the terminal delta came)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> list[Op]:
        ops: list[Op] = []
        while self._live < len(self._blocks):
            index, block = self._live, self._blocks[self._live]
            if not block.opened:
                block.opened = True
                ops.append(Op("open", index, block.group, block.pieces[0]))
                block.streamed = 1
            ops.extend(Op("append", index, block.group, piece) for piece in block.pieces[block.streamed :])
            block.streamed = len(block.pieces)
            later = index + 1 < len(self._blocks)
            if not (final or (later and (block.group != TOOL or block.args_complete()))):
                break
            block.closed = True
            ops.append(Op("close", index, block.group))
            self._live += 1
        return ops
