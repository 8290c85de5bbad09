"""The lean forward's batch invariance through a live `met serve --model-impl lean`: a seeded request
sampled at temperature 1 gives the same text whatever ran before it. With SDPA's attention the first of
these n=3 requests diverged from the next two: the 32 prompts before it had put their shared
chat-template header into the prefix cache from chunks the step budget had cut elsewhere."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from shared import keys
from workers import llama

from ..conftest import LiveServer, start_server, stop_server

pytestmark = pytest.mark.e2e

ASK = {"model": "m", "messages": [{"role": "user", "content": "Name an animal."}], "n": 3, "seed": 11, "temperature": 1.0, "max_tokens": 12}


@pytest.fixture(scope="module")
def lean_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(Path(tmp_path_factory.mktemp("lean")), "--workers", "1", "--model-impl", "lean")
    yield server
    stop_server(server)


async def _stories(base: str) -> None:
    async with openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0, timeout=300) as api:

        async def one(i: int) -> None:
            stream = await api.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"Story number {i}:"}], max_tokens=48, temperature=0.7, seed=i, stream=True, extra_body={"ignore_eos": True}
            )
            async for _ in stream:
                pass

        await asyncio.gather(*(one(i) for i in range(32)))


def test_a_seeded_n3_request_samples_the_same_text_right_after_32_concurrent_prompts_and_again(lean_server: LiveServer) -> None:
    base = f"{lean_server.base_url}/v1"
    asyncio.run(_stories(base))  # > 512 prompt tokens at once: the step budget cuts prompts into chunks
    with openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=120) as api:
        runs = [[c.message.content for c in api.chat.completions.create(**ASK).choices] for _ in range(3)]  # type: ignore[call-overload]
    assert len(set(runs[0])) > 1 and all(runs[0])
    assert runs[1] == runs[0]  # the first one's prompt: its header from the stories' blocks, its rest computed
    assert runs[2] == runs[0]  # these two: all of it but the last partial block from the cache
    r = lean_server.redis()
    try:
        [worker] = [w.decode() for w in r.zrangebyscore(keys.WORKERS_ALIVE, time.time() - 10, "+inf")]
        expected = b"off" if llama.native_bf16() else b"auto"  # float32 projections where this CPU emulates bf16
        assert r.hget(keys.worker_info(worker), "projections") == expected
    finally:
        r.close()
