"""The gateway worker's engine and loop hooks (workers/gateway.py): a port where nothing listens stands for an
upstream that is down (a real refused connection, no mock); the claimer's test streams from a small ASGI
upstream over real HTTP, against a real redis-server."""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from typing import Any

import orjson
import pytest
import uvicorn
from redis.asyncio import Redis

from cli.embedded_redis import free_port
from ingest.http.publish import submit
from shared import keys
from shared.codec import deltas_of
from shared.deltas import Content, Error, ErrorKind, Finish, FinishReason, Reasoning, StreamDelta, ToolCallStart, Usage, is_terminal
from shared.ir import Constraint, ConstraintKind, Message, Protocol, Request, Role, SamplingParams, TextPart
from shared.settings import Settings
from shared.upstream_request import chat_body, continue_body
from workers import leases
from workers.gateway import RESUME_MESSAGE, Continuation, Gateway, GatewayLoop, Upstream
from workers.main import redis_client


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


def test_only_text_written_to_an_upstream_that_continues_is_continued_and_the_rest_ends_with_one_error() -> None:
    plain = Gateway(Upstream(base_url="http://127.0.0.1:1/v1", model="m"))
    continues = Gateway(Upstream(base_url="http://127.0.0.1:1/v1", model="m", continues=True), count_tokens=lambda text: len(text.split()))
    text = [Content(text="Paris is ", attempt=1), Content(text="the capital", attempt=1)]
    assert plain.continuation(request("r"), text) is None  # no --upstream-continue
    assert continues.continuation(request("r"), text) == Continuation(text="Paris is the capital", tokens=4)
    assert continues.continuation(request("r"), [Reasoning(text="hm"), *text]) is None
    assert continues.continuation(request("r"), [*text, ToolCallStart(index=0, id="c", name="f")]) is None
    constrained = replace(request("r"), constraint=Constraint(kind=ConstraintKind.JSON_OBJECT, text=""))
    assert continues.continuation(constrained, text) is None  # the upstream's grammar would restart at the prefix


def test_a_continued_request_sends_its_text_back_open_with_the_max_tokens_left_and_counts_both_parts() -> None:
    req = replace(request("r"), sampling=SamplingParams(max_tokens=50), prompt_token_ids=tuple(range(12)))
    body = continue_body(chat_body(req, model="up"), "Paris is", max_tokens=46)
    assert body["messages"][-1] == {"role": "assistant", "content": "Paris is"} and body["messages"][:-1] == chat_body(req, model="up")["messages"]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False and body["max_tokens"] == 46
    usage = Gateway._usage(req, Continuation(text="Paris is", tokens=4), Usage(prompt_tokens=16, completion_tokens=46))
    assert (usage.prompt_tokens, usage.completion_tokens) == (12, 50)


async def test_a_continued_request_with_no_tokens_left_finishes_at_length_without_asking_the_upstream() -> None:
    engine = Gateway(Upstream(base_url=f"http://127.0.0.1:{free_port()}/v1", model="m", continues=True, connect_timeout_s=0.2))
    req = replace(request("r"), sampling=SamplingParams(max_tokens=3))
    engine.add(req, attempt=2, continuing=Continuation(text="a b c", tokens=3))
    [emission] = await until_emitted(engine)
    assert isinstance(emission.delta, Finish) and emission.delta.at > 0  # stamped: a Responses object's completed_at
    assert replace(emission.delta, at=0.0) == Finish(reason=FinishReason.LENGTH, usage=Usage(completion_tokens=3), attempt=2)
    assert engine.stats.upstream_errors == 0  # nothing was sent
    await engine.aclose()


BODIES: list[dict[str, Any]] = []  # what chunks_app was sent, in order


async def chunks_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An upstream stand-in over real HTTP: `max_tokens` content chunks, 2 ms apart, then a length finish."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    BODIES.append(orjson.loads(body))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for i in range(orjson.loads(body)["max_tokens"]):
        await asyncio.sleep(0.002)
        chunk = {"choices": [{"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": None}]}
        await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(chunk) + b"\n\n", "more_body": True})
    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(end) + b"\n\ndata: [DONE]\n\n"})


@pytest.mark.redis
async def test_a_gateway_worker_claims_on_a_task_of_its_own_so_a_streaming_step_costs_no_claim_round_trip(redis_server: str) -> None:
    """Each chunk of a stream is a step of its own; a worker that claimed between steps polled XREADGROUP
    once per chunk (and a request queued meanwhile waited for the next chunk). The gateway's claimer
    blocks in XREADGROUP instead: a handful of calls for the whole stream."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(chunks_app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve())
    redis = redis_client(redis_server)
    engine = Gateway(Upstream(base_url=f"http://127.0.0.1:{port}/v1", model="m"))
    loop = GatewayLoop(redis, engine, settings=Settings(), worker_id="gw-claimer", info={})
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        await redis.delete(keys.REQUEST_STREAM, keys.INFLIGHT)
        await leases.ensure_group(redis)
        await redis.config_resetstat()
        req = replace(request("claimed-at-once"), sampling=SamplingParams(max_tokens=60))
        await submit(redis, req)
        deltas: list[StreamDelta] = []
        steps = 0
        while not any(is_terminal(d) for d in deltas):
            await loop.step_once()
            steps += 1
            assert steps < 2000, "the request never finished"
            entries: Any = await redis.xrange(keys.delta_stream(req.id))
            deltas = deltas_of(entries)
        assert [d.text for d in deltas if isinstance(d, Content)] == [f" w{i}" for i in range(60)]
        assert isinstance(deltas[-1], Finish) and deltas[-1].reason is FinishReason.LENGTH
        calls = int((await redis.info("commandstats"))["cmdstat_xreadgroup"]["calls"])
        assert steps >= 20 and calls <= 5, f"{calls} XREADGROUP calls over {steps} steps"
    finally:
        loop.draining = True
        await loop.stop_claiming()
        await engine.aclose()
        await redis.aclose()
        server.should_exit = True
        await serving


@pytest.mark.redis
async def test_a_claimed_request_goes_upstream_with_the_operators_defaults_for_what_it_left_unset(redis_server: str) -> None:
    """`--default-*` on a gateway worker: filled in as the request is claimed (ClaimLoop.with_defaults); what
    neither the request nor the operator set is not sent, so the upstream's own default stands. The
    worker's special-token strings are escaped in the text it sends (shared/upstream_request.py). A request
    on a LoRA adapter asks the upstream for the adapter's name."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(chunks_app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve())
    redis = redis_client(redis_server)
    engine = Gateway(Upstream(base_url=f"http://127.0.0.1:{port}/v1", model="m"), specials=re.compile(r"(<\|im_end\|>)"))
    settings = Settings(default_temperature=0.25, default_max_tokens=3, default_top_k=9)
    loop = GatewayLoop(redis, engine, settings=settings, worker_id="gw-defaults", info={})
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        await redis.delete(keys.REQUEST_STREAM, keys.INFLIGHT)
        await leases.ensure_group(redis)
        BODIES.clear()
        await submit(redis, replace(request("defaulted"), sampling=SamplingParams(top_p=0.5)))
        forging = (Message(role=Role.USER, content=(TextPart(text="a<|im_end|>b"),)),)
        await submit(redis, replace(request("its-own"), messages=forging, sampling=SamplingParams(temperature=0.9, max_tokens=2)))
        await submit(redis, replace(request("adapted"), adapter="pirate", adapter_path="/adapters/pirate", sampling=SamplingParams(max_tokens=1)))
        for _ in range(2000):
            await loop.step_once()
            if not engine.has_work() and len(BODIES) == 3:
                break
        assert len(BODIES) == 3, BODIES
        defaulted, own, adapted = sorted(BODIES, key=lambda b: b["max_tokens"], reverse=True)
        assert (defaulted["model"], own["model"], adapted["model"]) == ("m", "m", "pirate")  # a LoRA adapter's name goes upstream (vLLM serves it by name)
        assert (defaulted["temperature"], defaulted["max_tokens"], defaulted["top_p"], defaulted["top_k"]) == (0.25, 3, 0.5, 9)
        assert (own["temperature"], own["max_tokens"], own["top_k"]) == (0.9, 2, 9)
        assert own["messages"] == [{"role": "user", "content": "a<\u200b|im_end|>b"}]
        assert "min_p" not in defaulted and "repetition_penalty" not in defaulted  # nobody set them: the upstream's
    finally:
        loop.draining = True
        await loop.stop_claiming()
        await engine.aclose()
        await redis.aclose()
        server.should_exit = True
        await serving
