"""One API node at scale: 1,100 streams open at once and 200 background responses, through a live
`met serve` whose worker runs the simulated engine (`--model-impl sim`: the worker, scheduler and
engine as they are, the forward replaced by a 20 ms wait), so what is loaded is the pipeline.

Before the delta streams were read by a node's shared readers (bus.tails), every waiting stream held
a pooled Redis connection in its own blocking XREAD: past ~100 open streams the pool (redis-py's
default of 100) raised, so admission, `/ready` and cancels failed with 503 (measured: 156 of 256 and 856
of 1,024 streams refused). Here every stream completes with exactly its tokens, `/ready` answers 200
throughout, and Redis sees a handful of connections from the API node, not one per stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from tests.conftest import LiveServer, start_server, stop_server

pytestmark = pytest.mark.e2e

STREAMS = 1100
TOKENS = 16


@pytest.fixture(scope="module")
def sim_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    args = ["--model-impl", "sim", "--sim-step-ms", "20", "--max-running", "2048", "--max-queue", "4096", "--max-connections", "4096"]
    server = start_server(tmp_path_factory.mktemp("scale"), "--workers", "1", *args)
    yield server
    stop_server(server)


def client_of(server: LiveServer, connections: int) -> openai.AsyncOpenAI:
    pool = httpx.AsyncClient(limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections), timeout=300)
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, http_client=pool)


async def watch_ready(server: LiveServer, stop: asyncio.Event, seen: list[int]) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        while not stop.is_set():
            # a fresh connection each time: a kept-alive one can be closed by the server's keep-alive timeout just as
            # a poll reuses it (the client's loop, busy with 1,100 streams, may sleep far past 0.2 s)
            seen.append((await http.get(f"{server.base_url}/ready", headers={"Connection": "close"})).status_code)
            await asyncio.sleep(0.2)


def api_connections(server: LiveServer) -> int:
    """Redis connections open now from the API node (`met serve`'s own process: its pid's client name
    is not set, so count by what is not the worker's or this test's)."""
    with redis.Redis.from_url(server.redis_url) as r:
        clients: Any = r.client_list()
    return len(clients)


def test_eleven_hundred_streams_at_once_all_complete_while_ready_stays_200_and_redis_sees_few_connections(sim_server: LiveServer) -> None:
    async def scenario() -> tuple[list[tuple[str, int, str]], list[int], int]:
        client = client_of(sim_server, STREAMS + 50)
        stop, ready = asyncio.Event(), []
        watcher = asyncio.create_task(watch_ready(sim_server, stop, ready))
        most_connections = 0
        opened = asyncio.Event()
        open_count = 0

        async def one(i: int) -> tuple[str, int, str]:
            nonlocal open_count
            stream = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": f"Tell me story number {i}."}],
                max_tokens=TOKENS,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            open_count += 1
            if open_count == STREAMS:
                opened.set()
            text, usage, reason = "", 0, ""
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    reason = chunk.choices[0].finish_reason or reason
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            return text, usage, reason

        async def count_connections() -> None:
            nonlocal most_connections
            await opened.wait()  # every stream has its response headers: all are open at once
            most_connections = await asyncio.to_thread(api_connections, sim_server)

        results, _ = await asyncio.gather(asyncio.gather(*(one(i) for i in range(STREAMS))), count_connections())
        stop.set()
        await watcher
        await client.close()
        return list(results), ready, most_connections

    results, ready, connections = asyncio.run(scenario())
    assert [(usage, reason) for _, usage, reason in results] == [(TOKENS, "length")] * STREAMS
    assert all(text for text, _, _ in results)
    assert ready and set(ready) == {200}, f"/ready answered {sorted(set(ready))}"
    assert connections < 150, f"{connections} Redis connections with {STREAMS} streams open (one per stream before)"


def test_two_hundred_background_responses_at_once_all_complete(sim_server: LiveServer) -> None:
    async def scenario() -> list[tuple[str, int]]:
        client = client_of(sim_server, 250)
        made = await asyncio.gather(
            *(client.responses.create(model="m", input=f"Story {i}.", max_output_tokens=TOKENS, background=True, extra_body={"ignore_eos": True}) for i in range(200))
        )
        assert {r.status for r in made} <= {"queued", "in_progress"}
        done: dict[str, Any] = {}
        for _ in range(600):
            pending = [r.id for r in made if r.id not in done]
            if not pending:
                break
            for response in await asyncio.gather(*(client.responses.retrieve(rid) for rid in pending)):
                if response.status in ("completed", "incomplete", "failed", "cancelled"):
                    done[response.id] = response
            await asyncio.sleep(0.5)
        await client.close()
        return [(done[r.id].status, done[r.id].usage.output_tokens) if r.id in done else ("unfinished", 0) for r in made]

    outcomes = asyncio.run(scenario())
    assert outcomes == [("incomplete", TOKENS)] * 200  # max_output_tokens reached: Responses says "incomplete"


def test_the_simulated_worker_reports_its_engine_and_its_cpu_per_phase_in_its_heartbeat(sim_server: LiveServer, tmp_path: Path) -> None:
    """The load above ran on the simulated engine, not a model: its worker says so (`model_impl: sim`), and
    its heartbeat carries the CPU it spent per loop phase (what bench/pipeline.py reports per 1k tokens)."""
    with redis.Redis.from_url(sim_server.redis_url) as r:
        infos = [r.hgetall(k) for k in r.scan_iter("met:worker:*")]
    assert [i.get(b"model_impl") for i in infos] == [b"sim"]
    phases = {k.decode(): float(v) for k, v in infos[0].items() if k.startswith(b"cpu_")}
    assert set(phases) == {"cpu_step_ms", "cpu_claim_ms", "cpu_cancels_ms", "cpu_write_ms", "cpu_periodic_ms"}
    assert phases["cpu_step_ms"] > 0 and phases["cpu_write_ms"] > 0
