"""Re-encoding: any recorded delta stream as any protocol's SSE bytes (pure; used by `met replay
--encode-only` and dumps). Lives beside the encoders it dispatches to; `shared/` never imports it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from encoders.frames import Frame
from encoders.registry import codec
from shared.deltas import StreamDelta
from shared.ir import Protocol, Request


def encode_frames(request: Request, deltas: Iterable[StreamDelta], protocol: Protocol) -> list[Frame]:
    encoder = codec(protocol).stream_encoder(replace(request, protocol=protocol))
    frames: list[Frame] = []
    for delta in deltas:
        frames += encoder.feed(delta)
    return frames + encoder.finish()


def encode_sse(request: Request, deltas: Iterable[StreamDelta], protocol: Protocol) -> bytes:
    """The recorded deltas as `protocol`'s streaming SSE bytes, through that protocol's own stream encoder.

    Only `request.protocol` is switched; everything else (id, `created`, model, include_usage,
    return_token_ids, raw body echoes) is kept, and every id and timestamp in the output is derived from
    the recorded request id and `created`. So for the protocol the client spoke (and streamed) the bytes
    equal what it received, minus keep-alive pings (`event: ping` / `: ping` comments), which are timing,
    not content. A stream whose terminal event was never recorded ends as each encoder's `finish()`
    ends a cut stream. Each frame carries its stream position as `id:`, as served (encoders.wire).
    """
    return b"".join(frame.to_sse(position) for position, frame in enumerate(encode_frames(request, deltas, protocol)))
