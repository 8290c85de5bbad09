"""Scheduling through the live server: 32 concurrent SDK clients, admission at the queue limit, n > 1,
priorities, and the figures each worker writes to Redis."""

from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import openai
import pytest

from shared import keys

from ..conftest import LIVE_MAX_QUEUE, LiveServer

pytestmark = pytest.mark.e2e


def test_32_concurrent_sdk_clients_complete_and_the_overflow_request_is_refused(live_server: LiveServer) -> None:
    base = f"{live_server.base_url}/v1"

    async def scenario() -> tuple[list[int], list[int]]:
        started = asyncio.Event()
        begun: list[int] = []

        async def one(api: openai.AsyncOpenAI, i: int) -> int:
            stream = await api.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": f"Story number {i}:"}],
                max_tokens=48,
                temperature=0.7,
                seed=i,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            begun.append(i)
            if len(begun) == LIVE_MAX_QUEUE:
                started.set()
            tokens = 0
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return tokens

        async with openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0, timeout=300) as api:
            clients = [asyncio.ensure_future(one(api, i)) for i in range(LIVE_MAX_QUEUE)]
            await asyncio.wait_for(started.wait(), 120)
            statuses = []
            with pytest.raises(openai.InternalServerError) as refused:  # OpenAI's 503 "overloaded", not a key's 429
                await api.chat.completions.create(model="m", messages=[{"role": "user", "content": "one more"}], stream=True)
            statuses.append(refused.value.status_code)
            assert refused.value.response.headers["retry-after"] == "1"
            assert refused.value.code == "queue_full" and refused.value.type == "server_error"  # type: ignore[attr-defined]
            async with anthropic.AsyncAnthropic(base_url=live_server.base_url, api_key="x", max_retries=0) as claude:
                with pytest.raises(anthropic.APIStatusError) as overloaded:
                    await claude.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "one more"}])
                statuses.append(overloaded.value.status_code)
                assert overloaded.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
            return list(await asyncio.gather(*clients)), statuses

    tokens, statuses = asyncio.run(scenario())
    assert tokens == [48] * LIVE_MAX_QUEUE
    assert statuses == [503, 529]
    r = live_server.redis()
    assert r.zcard(keys.INFLIGHT) == 0  # every admitted request released its place
    r.close()


def test_n_choices_without_streaming_are_independent_and_reproducible(live_server: LiveServer) -> None:
    with openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as api:
        ask = {"model": "m", "messages": [{"role": "user", "content": "Name an animal."}], "n": 3, "seed": 11, "temperature": 1.0, "max_tokens": 12}
        first = api.chat.completions.create(**ask)  # type: ignore[call-overload]
        again = api.chat.completions.create(**ask)  # type: ignore[call-overload]
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1
    assert first.usage is not None
    single = [len(c.message.content or "") > 0 for c in first.choices]
    assert all(single) and first.usage.completion_tokens >= 3


def test_each_worker_writes_its_scheduler_figures_to_redis(live_server: LiveServer) -> None:
    httpx.post(f"{live_server.base_url}/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}, timeout=60)
    r = live_server.redis()
    [worker] = r.zrangebyscore(keys.WORKERS_ALIVE, time.time() - 10, "+inf")
    time.sleep(1.2)
    info = {k.decode(): v.decode() for k, v in r.hgetall(keys.worker_info(worker.decode())).items()}
    r.close()
    for field in ("running", "waiting", "kv_used_tokens", "kv_total_tokens", "prefill_tps", "decode_tps", "step_ms", "model", "pid"):
        assert field in info, field
    assert int(info["kv_total_tokens"]) > 0 and int(info["decode_tokens"]) > 0
    assert time.time() - float(info["heartbeat"]) < 3


def test_logprobs_in_chat_and_responses_formats(live_server: LiveServer) -> None:
    with openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as api:
        chat = api.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
        )
        with api.responses.stream(model="m", input="Hi", max_output_tokens=5, temperature=0, top_logprobs=2) as stream:
            deltas = [e for e in stream if e.type == "response.output_text.delta"]
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert content[0].top_logprobs[0].token == content[0].token  # greedy picks the most likely token
    entries = [lp for d in deltas for lp in d.logprobs]
    assert entries and all(len(lp.top_logprobs or []) == 2 for lp in entries)
