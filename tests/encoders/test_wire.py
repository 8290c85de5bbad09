"""The wire module against a real Redis: tailing through a bus.tails hub, keep-alive pings in silence,
disconnect → abandon."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionChunk
from redis.asyncio import Redis

from bus.tails import Pace, Tails
from cli.embedded_redis import EmbeddedRedis
from encoders.anthropic_messages import MessagesStreamEncoder
from encoders.openai_chat import ChatStreamEncoder
from encoders.wire import LOST_REDIS, ClientLink, Event, Numbered, Presence, sse_events, sse_response, tail
from shared import keys
from shared.codec import DELTA_FIELD, encode_delta
from shared.ir import Protocol

from .recorded import SCENARIOS, request


def hub(redis: Redis, **pace: float) -> Tails:
    return Tails(redis, node=f"test-{time.monotonic_ns()}", field=DELTA_FIELD, pace=Pace(**{"quiet_s": 0.1, **pace}))  # type: ignore[arg-type]


async def flat(batches: AsyncIterator[list[Event]]) -> list[Event]:
    return [event async for batch in batches for event in batch]


async def write_slowly(redis: Redis, rid: str, pause: float) -> None:
    for i, delta in enumerate(SCENARIOS["plain_text"]):
        if i == 1:
            await asyncio.sleep(pause)  # a long silence mid-stream (queueing, a long prefill)
        await redis.xadd(keys.delta_stream(rid), {"d": encode_delta(delta)})


def test_anthropic_pings_during_silence_and_ends_after_the_terminal_event(redis_server: str) -> None:
    async def scenario() -> list[tuple[str | None, str]]:
        redis = Redis.from_url(redis_server)
        req = request(Protocol.ANTHROPIC_MESSAGES, id=f"wire-{time.monotonic_ns()}")
        encoder = MessagesStreamEncoder(req)
        abandoned: list[bool] = []

        async def abandon() -> None:
            abandoned.append(True)

        writer = asyncio.create_task(write_slowly(redis, req.id, pause=1.0))
        tails = hub(redis)
        deltas = tail(tails, req.id, deadline=time.time() + 30)
        link = ClientLink(presence=Presence(), on_abandon=abandon)
        events = [(e.event, e.data) for e in await flat(sse_events(deltas, encoder, ping=lambda: [encoder.ping()], ping_interval=0.3, client=link))]
        await writer
        await tails.close()
        await redis.aclose()
        assert not abandoned
        return events

    events = asyncio.run(scenario())
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    pings = [i for i, name in enumerate(names) if name == "ping"]
    assert len(pings) >= 2
    assert all(names[i] == "ping" for i in range(pings[0], pings[-1] + 1))
    assert all(data == '{"type":"ping"}' for name, data in events if name == "ping")


def test_keep_alives_between_numbered_chat_events_pass_the_openai_sdk_decoder(redis_server: str) -> None:
    """A ping in a chat stream after its first `id:` must not reach the SDK as an event: its decoder
    keeps the last id and yields an empty event at every blank line, which it then fails to parse."""

    async def scenario() -> bytes:
        redis = Redis.from_url(redis_server)
        req = request(Protocol.OPENAI_CHAT, id=f"ka-{time.monotonic_ns()}", stream=True)

        async def abandon() -> None:
            return None

        writer = asyncio.create_task(write_slowly(redis, req.id, pause=1.0))
        tails = hub(redis)
        deltas = tail(tails, req.id, deadline=time.time() + 30)
        link = ClientLink(presence=Presence(), on_abandon=abandon)
        events = sse_events(deltas, ChatStreamEncoder(req), ping=lambda: [], ping_interval=0.3, client=link)
        response = sse_response(events, headers=[])
        assert response.content is not None
        body = b"".join([chunk async for chunk in response.content.get_parts()])
        await writer
        await tails.close()
        await redis.aclose()
        return body

    body = asyncio.run(scenario())
    assert body.count(b": ping\n") >= 2 and b"id: 1\n" in body  # pings went out after the first numbered events
    with openai.OpenAI(api_key="x", base_url="http://unused") as client:
        stream = openai.Stream(cast_to=ChatCompletionChunk, response=httpx.Response(200, content=body), client=client)
        chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, world"


def test_a_client_that_disconnects_is_abandoned_and_its_stream_stops(redis_server: str) -> None:
    async def scenario() -> tuple[int, list[bool]]:
        redis = Redis.from_url(redis_server)
        req = request(Protocol.OPENAI_CHAT, id=f"gone-{time.monotonic_ns()}", stream=True)
        abandoned: list[bool] = []
        presence = Presence()

        async def abandon() -> None:
            abandoned.append(True)

        writer = asyncio.create_task(write_slowly(redis, req.id, pause=2.0))
        asyncio.get_running_loop().call_later(0.3, presence.leave)  # the client hangs up mid-silence
        tails = hub(redis, quiet_s=30)  # no quiet wake-up: leaving alone must end the wait
        deltas = tail(tails, req.id, deadline=time.time() + 30, presence=presence)
        link = ClientLink(presence=presence, on_abandon=abandon)
        started = time.monotonic()
        events = await flat(sse_events(deltas, ChatStreamEncoder(req), ping=lambda: [], ping_interval=10, client=link))
        assert time.monotonic() - started < 1.5  # ended when the client left, not when the next delta came (2 s)
        writer.cancel()
        await tails.close()
        await redis.aclose()
        return len(events), abandoned

    count, abandoned = asyncio.run(scenario())
    assert abandoned == [True]
    assert count == 2  # the role chunk and the first text chunk; nothing after the client left


def test_no_terminal_event_before_the_deadline_yields_a_timeout_error(redis_server: str) -> None:
    async def scenario() -> list[object]:
        redis = Redis.from_url(redis_server)
        tails = hub(redis)
        out = [d async for batch in tail(tails, f"nobody-{time.monotonic_ns()}", deadline=time.time() + 0.3) if batch for d in batch]
        await tails.close()
        await redis.aclose()
        return out

    out = asyncio.run(scenario())
    assert out[-1].kind.value == "timeout_error"  # type: ignore[attr-defined]


def test_every_encoder_frame_has_its_position_as_id_and_a_resumed_stream_sends_exactly_the_rest(redis_server: str) -> None:
    req = request(Protocol.ANTHROPIC_MESSAGES, id=f"resume-{time.monotonic_ns()}")

    async def record() -> None:
        redis = Redis.from_url(redis_server)
        for delta in SCENARIOS["reasoning_then_text"]:
            await redis.xadd(keys.delta_stream(req.id), {"d": encode_delta(delta)})
        await redis.aclose()

    async def scenario(skip: int) -> list[bytes]:
        redis = Redis.from_url(redis_server)

        async def abandon() -> None:
            return None

        link = ClientLink(presence=Presence(), on_abandon=abandon)
        tails = hub(redis)
        deltas = tail(tails, req.id, deadline=time.time() + 30)
        encoder = MessagesStreamEncoder(req)
        out = await flat(sse_events(deltas, encoder, ping=lambda: [encoder.ping()], ping_interval=10, client=link, numbering=Numbered(skip)))
        await tails.close()
        await redis.aclose()
        return [(e.id or "").encode() + b"|" + e.data.encode() for e in out]

    asyncio.run(record())
    whole = asyncio.run(scenario(-1))
    assert [line.split(b"|")[0] for line in whole] == [str(i).encode() for i in range(len(whole))]
    for after in (0, 4, len(whole) - 2):
        assert asyncio.run(scenario(after)) == whole[after + 1 :]


@pytest.mark.redis
def test_a_redis_restart_mid_tail_is_ridden_out_and_a_long_outage_ends_the_stream_with_one_error_and_no_cancel(tmp_path: Path) -> None:
    server = EmbeddedRedis(str(tmp_path))
    url = server.start()
    deltas = SCENARIOS["plain_text"]

    async def scenario(outage_s: float, retry_s: float) -> tuple[list[str], list[bool]]:
        redis = Redis.from_url(url)
        req = request(Protocol.OPENAI_CHAT, id=f"blip-{time.monotonic_ns()}", stream=True)
        await redis.xadd(keys.delta_stream(req.id), {"d": encode_delta(deltas[0])})
        abandoned: list[bool] = []

        async def abandon() -> None:
            abandoned.append(True)

        async def restart() -> None:
            await asyncio.sleep(0.5)
            assert server.proc is not None
            server.proc.kill()  # kill -9; AOF keeps what was written
            server.proc.wait()
            await asyncio.sleep(outage_s)
            server.start()  # on this thread: a server started from a to_thread worker gets SIGTERM when that thread exits (its parent-death signal)
            writer = Redis.from_url(url)
            for delta in deltas[1:]:
                await writer.xadd(keys.delta_stream(req.id), {"d": encode_delta(delta)})
            await writer.aclose()

        blip = asyncio.create_task(restart())
        tails = hub(redis, retry_s=retry_s)
        stream = tail(tails, req.id, deadline=time.time() + 60)
        link = ClientLink(presence=Presence(), on_abandon=abandon)
        events = [e.data for e in await flat(sse_events(stream, ChatStreamEncoder(req), ping=lambda: [], ping_interval=10, client=link)) if e.data]
        await blip
        await tails.close()
        await redis.aclose()
        return events, abandoned

    try:
        events, abandoned = asyncio.run(scenario(outage_s=2.0, retry_s=20.0))
        assert events[-1] == "[DONE]" and not abandoned
        text = "".join(orjson.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1] if orjson.loads(e)["choices"])
        assert text == "Hello, world"  # every delta, none twice
        events, abandoned = asyncio.run(scenario(outage_s=4.0, retry_s=1.0))
        assert [orjson.loads(e)["error"]["message"] for e in events if e.startswith('{"error"')] == [LOST_REDIS]
        assert events[-1] == "[DONE]" and not abandoned  # one error in the protocol's shape; the generation is not cancelled
    finally:
        server.stop()
