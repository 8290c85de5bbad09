"""The gateway worker's engine and loop hooks (workers/gateway.py) without an upstream running: a port where
nothing listens stands for an upstream that is down (a real refused connection, no mock)."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from cli.embedded_redis import free_port
from shared.deltas import Content, Error, ErrorKind, Finish, FinishReason
from shared.ir import Message, Protocol, Request, Role, TextPart
from shared.settings import Settings
from workers.gateway import RESUME_MESSAGE, Gateway, GatewayLoop, Upstream


def request(rid: str) -> Request:
    return Request(id=rid, protocol=Protocol.OPENAI_CHAT, model="m", messages=(Message(role=Role.USER, content=(TextPart(text="hi"),)),))


def down(connect_timeout_s: float) -> Gateway:
    return Gateway(Upstream(base_url=f"http://127.0.0.1:{free_port()}/v1", model="m", connect_timeout_s=connect_timeout_s))


async def until_emitted(engine: Gateway) -> list[object]:
    for _ in range(200):
        out = await engine.step(wait_s=0.05)
        if out:
            return out
    raise AssertionError("nothing was emitted")


async def test_a_reclaimed_request_that_had_written_output_ends_with_one_error_and_is_not_sent_again() -> None:
    engine = down(5.0)
    loop = GatewayLoop(Redis.from_url("redis://127.0.0.1:1"), engine, settings=Settings(), worker_id="w", info={})
    [emission] = loop.start(request("r1"), attempt=2, recorded=[Content(text="Hel", attempt=1)])
    assert emission.delta == Error(message=RESUME_MESSAGE, kind=ErrorKind.INTERNAL, attempt=2)
    assert not engine.has_work()
    assert loop.start(request("r2"), attempt=2, recorded=[]) == [] and engine.active_ids() == ["r2"]  # nothing written yet: sent afresh
    await engine.aclose()


async def test_an_unreachable_upstream_fails_the_request_with_one_error_after_the_upstream_timeout() -> None:
    engine = down(0.3)
    engine.add(request("r"), attempt=3)
    [emission] = await until_emitted(engine)
    assert isinstance(emission.delta, Error) and emission.delta.kind is ErrorKind.OVERLOADED and emission.delta.attempt == 3
    assert "upstream is unavailable" in emission.delta.message
    await asyncio.sleep(0)
    assert not engine.has_work() and engine.stats.upstream_errors >= 1 and not engine.stats.healthy
    assert await engine.probe() is False and engine.stats.last_error == "ConnectError"
    await engine.aclose()


async def test_a_cancel_ends_the_request_once_and_stops_its_upstream_task() -> None:
    engine = down(30.0)
    engine.add(request("r"), attempt=1)
    [emission] = engine.cancel("r")
    assert isinstance(emission.delta, Finish) and emission.delta.reason is FinishReason.CANCELLED
    assert engine.cancel("r") == [] and engine.active_ids() == []
    await asyncio.sleep(0.05)
    assert not engine.has_work()  # the task is gone: nothing more comes for it
    await engine.aclose()
