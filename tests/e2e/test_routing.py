"""Prefix-aware routing with real processes: `met serve --workers 2`. A conversation's next turn goes to the
worker that served its first one (its long system prompt is in that worker's prefix cache, and the usage says
so), conversation after conversation; and a routed request whose worker is killed mid-stream is adopted from
that worker's routed stream by the other and ends with the text it would have had. A 3 s lease."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis

from shared import keys
from shared.codec import decode_delta
from shared.deltas import Finish, is_terminal

from ..conftest import LiveServer, start_server, stop_server, wait_for

pytestmark = pytest.mark.e2e

COLORS = ("red", "green", "blue", "amber", "violet", "grey", "silver", "golden")
ANIMALS = ("otter", "heron", "badger", "falcon", "lynx", "beaver", "crane", "marten")
CITIES = ("Lisbon", "Oslo", "Quito", "Hanoi", "Perth", "Tunis", "Riga", "Lima")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("routing"), "--workers", "2", "--lease", "3", workers_ready=2)
    yield server
    stop_server(server)


def system_prompt(conversation: int) -> str:
    """A long system prompt (~700 tokens) of the conversation's own from its first words, so that no two
    conversations share a block and each first turn goes to the shared stream."""
    facts = [
        f"Fact {k}: the {COLORS[(k + conversation) % 8]} {ANIMALS[(k * 3 + conversation) % 8]} of archive {conversation} lives in {CITIES[(k * 5) % 8]}."
        for k in range(40)
    ]
    return f"Archive {conversation} briefing. You are a terse assistant. Keep these facts in mind.\n" + "\n".join(facts)


def api(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=180)


def ask(server: LiveServer, messages: list[dict[str, str]], max_tokens: int) -> Any:
    with api(server) as client:
        return client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=max_tokens)  # type: ignore[arg-type]


def live_workers(r: redis.Redis) -> list[str]:
    return [w.decode() for w in r.zrangebyscore(keys.WORKERS_ALIVE, time.time() - 5, "+inf")]


def newest_request(r: redis.Redis, after: float) -> str | None:
    newest = r.zrangebyscore(keys.REQUEST_INDEX, after, "+inf")
    return newest[-1].decode() if newest else None


def served_by(r: redis.Redis, rid: str) -> str:
    worker = r.hget(keys.request_meta(rid), "worker")
    assert worker is not None, rid
    return worker.decode()


def idle_since(r: redis.Redis, since: float) -> bool:
    """Every live worker has sent a heartbeat after `since` that shows nothing running, waiting or routed to it
    (the router weighs queues by heartbeats: a turn that just ended must not count against its worker)."""
    workers = live_workers(r)
    if len(workers) < 2:
        return False
    for worker in workers:
        beat, running, waiting, routed = r.hmget(keys.worker_info(worker), ["heartbeat", "running", "waiting", "routed_queue"])
        if beat is None or float(beat) <= since or any(int(v or 0) for v in (running, waiting, routed)):
            return False
    return True


def settle(r: redis.Redis) -> None:
    since = time.time()
    wait_for("a heartbeat of each idle worker", lambda: idle_since(r, since), timeout=30)
    time.sleep(0.3)  # past the router's worker-table refresh (ingest.http.routing.REFRESH_S)


def decisions(server: LiveServer) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    found = re.findall(r'^met_routing_decisions_total\{decision="(\w+)"\} ([0-9.e+]+)$', text, re.MULTILINE)
    return {decision: float(count) for decision, count in found}


def first_turn(server: LiveServer, r: redis.Redis, conversation: int) -> tuple[list[dict[str, str]], str]:
    """Turn 1 of a conversation (its messages and answer appended) and the worker that served it."""
    messages = [{"role": "system", "content": system_prompt(conversation)}, {"role": "user", "content": "Which animal lives in Oslo?"}]
    started = time.time()
    reply = ask(server, messages, max_tokens=16)
    assert reply.usage is not None and reply.usage.prompt_tokens >= 600
    rid = str(wait_for("turn 1 in the index", lambda: newest_request(r, started)))
    messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    return messages, served_by(r, rid)


def test_a_conversations_next_turn_goes_to_the_worker_that_holds_its_prefix(cluster: LiveServer) -> None:
    r = cluster.redis()
    wait_for("two live workers", lambda: len(live_workers(r)) >= 2)
    before = decisions(cluster)
    first_workers: list[str] = []
    for conversation in range(4):
        settle(r)
        messages, worker = first_turn(cluster, r, conversation)
        first_workers.append(worker)
        settle(r)
        started = time.time()
        second = ask(cluster, [*messages, {"role": "user", "content": "And which one lives in Lima?"}], max_tokens=8)
        rid = str(wait_for("turn 2 in the index", lambda since=started: newest_request(r, since)))
        assert served_by(r, rid) == worker, (conversation, first_workers)
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        assert (second.usage.prompt_tokens_details.cached_tokens or 0) >= 600
    after = decisions(cluster)
    assert after.get("routed", 0) - before.get("routed", 0) == 4  # every second turn, and no first turn
    assert after.get("no_overlap", 0) - before.get("no_overlap", 0) == 4


def test_kill_9_of_the_worker_a_routed_request_went_to_gives_the_client_the_uninterrupted_text(cluster: LiveServer) -> None:
    r = cluster.redis()
    wait_for("two live workers", lambda: len(live_workers(r)) >= 2)
    settle(r)
    messages, worker = first_turn(cluster, r, 10)
    turn = [*messages, {"role": "user", "content": "List the numbers from 1 to 40, separated by commas."}]
    settle(r)
    reference = ask(cluster, turn, max_tokens=110)  # greedy: what the streamed turn must say too (and warms its whole prompt)
    expected = reference.choices[0].message.content or ""
    assert len(expected) > 40
    settle(r)
    started = time.time()
    result: dict[str, object] = {}

    def stream() -> None:
        try:
            with api(cluster) as client:
                # one token a step: speculative decoding writes this list fast enough to finish before the kill lands
                # (the text is the same: the reference above ran with it)
                chunks = client.chat.completions.create(model="m", messages=turn, temperature=0, max_tokens=110, stream=True, extra_body={"speculative": False})  # type: ignore[arg-type]
                result["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        except Exception as exc:  # reported below
            result["error"] = exc

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    rid = str(wait_for("the request", lambda: newest_request(r, started)))
    wait_for("a few deltas", lambda: r.xlen(keys.delta_stream(rid)) >= 8, timeout=120)
    assert served_by(r, rid) == worker
    on_its_stream = [f[b"id"].decode() for _, f in r.xrange(keys.routed_stream(worker))]
    assert rid in on_its_stream  # routed: pending on the worker's own stream, not the shared one
    assert rid not in [f[b"id"].decode() for _, f in r.xrange(keys.REQUEST_STREAM)]
    pid = r.hget(keys.worker_info(worker), "pid")
    assert pid is not None
    os.kill(int(pid), signal.SIGKILL)
    thread.join(150)
    assert not thread.is_alive() and "error" not in result, result
    assert result["text"] == expected
    recorded = [decode_delta(f[b"d"]) for _, f in r.xrange(keys.delta_stream(rid)) if b"d" in f]
    attempts = [getattr(e, "attempt", 0) for e in recorded]
    assert attempts == sorted(attempts) and attempts[0] == 1 and attempts[-1] == 2  # no interleaving, two attempts
    assert sum(is_terminal(e) for e in recorded) == 1 and isinstance(recorded[-1], Finish)
    meta = r.hgetall(keys.request_meta(rid))
    assert meta[b"attempt"] == b"2" and int(meta[b"deliveries"]) >= 2 and meta[b"worker"].decode() != worker
