"""`met api` and `met worker` against a real 3-master Redis Cluster (the shipped redis-server in
cluster mode), streaming all three protocols with the official SDKs: the per-request keys spread over
the masters while the global streams sit in their own slots (bus/connect.py)."""

from __future__ import annotations

import io
import json
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import redis
from redis.cluster import RedisCluster

from shared import keys

from ..topology import RedisProcs, Role, responses_stream_text, spawn_role, start_cluster, wait_serving

pytestmark = pytest.mark.e2e

PROMPT = "Name three colors."
LONG_PROMPT = "List the numbers from 1 to 40, separated by commas."
MAX_TOKENS = 24


@dataclass
class ClusterDeployment:
    cluster: RedisProcs
    api: Role
    workers: list[Role]

    clients: list[RedisCluster] = field(default_factory=list)

    def client(self) -> RedisCluster:
        """One cluster client for the module (closed with the deployment: no socket left to the GC)."""
        if not self.clients:
            self.clients.append(RedisCluster(host="127.0.0.1", port=self.cluster.ports[0]))
        return self.clients[0]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterDeployment]:
    base: Path = tmp_path_factory.mktemp("redis-cluster")
    cluster = start_cluster(base / "redis")
    first, second, _ = cluster.ports
    roles: list[Role] = []
    try:
        # Every spelling: a plain URL with --redis-cluster, a cluster URL with one seed, and with two.
        urls = [("--redis-url", f"redis://127.0.0.1:{second}/0", "--redis-cluster"), ("--redis-url", f"redis+cluster://127.0.0.1:{first}")]
        workers = [
            spawn_role(f"worker-{i}", "worker", base, *url, "--data-dir", str(base / f"w{i}"), "--default-temperature", "0", "--lease", "3")
            for i, url in enumerate(urls)
        ]
        roles += workers
        api = spawn_role("api", "api", base, "--redis-url", f"redis+cluster://127.0.0.1:{first},127.0.0.1:{second}", "--data-dir", str(base / "a"))
        roles.append(api)
        wait_serving(api, workers=2, others=tuple(workers))
        deployment = ClusterDeployment(cluster, api, workers)
        yield deployment
        for client in deployment.clients:
            client.close()
    finally:
        for role in roles:
            role.stop()
        cluster.stop()


def chat_text(base_url: str, max_tokens: int = MAX_TOKENS, prompt: str = PROMPT) -> tuple[str, str | None]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=180) as api:
        stream = api.chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}
        )
        text, finish, request_id = "", None, None
        for chunk in stream:
            request_id = stream.response.headers.get("x-request-id")
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    assert finish in ("stop", "length")
    return text, request_id


def responses_text(base_url: str) -> str:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=180) as api:
        text, terminal = responses_stream_text(api, PROMPT, MAX_TOKENS)
    assert terminal in ("response.completed", "response.incomplete")
    return text


def messages_text(base_url: str) -> str:
    claude = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0, timeout=180)
    with claude, claude.messages.stream(model="m", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": PROMPT}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens")
    return "".join(block.text for block in final.content if block.type == "text")


def test_all_three_protocols_stream_the_same_greedy_text_through_a_redis_cluster(deployment: ClusterDeployment) -> None:
    chat, request_id = chat_text(deployment.api.base_url)
    responses = responses_text(deployment.api.base_url)
    messages = messages_text(deployment.api.base_url)
    assert chat.strip()
    assert responses == chat
    assert messages == chat
    client = deployment.client()
    assert request_id, "the API names each request in x-request-id"
    assert client.hget(keys.request_meta(request_id), "status") == b"finished"
    assert client.xlen(keys.delta_stream(request_id)) > 1


def test_the_keys_really_spread_over_the_three_masters(deployment: ClusterDeployment) -> None:
    """Not three servers holding copies: each master owns its own share of the keys, the global streams
    included (so the test above went through MOVED routing, not one node)."""
    for _ in range(4):
        chat_text(deployment.api.base_url)
    per_node = []
    for port in deployment.cluster.ports:
        with redis.Redis(port=port) as node:
            per_node.append(node.dbsize())
    assert all(n > 0 for n in per_node), per_node
    client = deployment.client()
    slots = {client.keyslot(name) for name in (keys.REQUEST_STREAM, keys.INFLIGHT, keys.FINISHED, keys.WORKERS_ALIVE)}
    assert len(slots) > 1
    assert int(client.get(keys.INFLIGHT) or 0) == 0


def test_a_batch_runs_to_the_end_on_a_redis_cluster(deployment: ClusterDeployment) -> None:
    """The batch path's cluster steps: the batch's keys before the active set, each line's keys before
    the count and the XADD, then its IR (ingest.batches.batch_jobs, ingest.http.publish)."""
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "m", "messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 4}} for i in range(3)]  # fmt: skip
    with openai.OpenAI(base_url=f"{deployment.api.base_url}/v1", api_key="x", max_retries=0, timeout=60) as api:
        uploaded = api.files.create(file=("in.jsonl", io.BytesIO(b"\n".join(json.dumps(r).encode() for r in rows))), purpose="batch")
        batch = api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        end = time.monotonic() + 240
        while (batch := api.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < end, f"the batch did not end: {batch}"
            time.sleep(0.5)
        assert batch.status == "completed" and batch.request_counts is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 0)
        results = [json.loads(x) for x in api.files.content(batch.output_file_id or "").text.splitlines()]
    assert sorted(r["custom_id"] for r in results) == ["c0", "c1", "c2"]
    assert all(r["response"]["status_code"] == 200 for r in results)
    assert int(deployment.client().get(keys.INFLIGHT) or 0) == 0


def test_each_conversation_is_routed_to_the_worker_holding_its_prefix_through_the_cluster(deployment: ClusterDeployment) -> None:
    """Prefix routing on a cluster: the routing index sets and the routed streams (in the request stream's slot,
    read with it in one XREADGROUP) work across masters; every second turn finds its first turn's worker."""
    r = deployment.client()
    with openai.OpenAI(base_url=f"{deployment.api.base_url}/v1", api_key="x", max_retries=0, timeout=180) as api:
        for n in range(3):
            system = f"Conversation {n}. " + " ".join(f"Rule {i}: answer plainly and keep item {i * (n + 3)} in mind." for i in range(60))
            messages: list[Any] = [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]
            first = api.chat.completions.create(model="m", messages=messages, max_tokens=8)
            messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "And goodbye?"}]
            second = api.chat.completions.create(model="m", messages=messages, max_tokens=8)
            workers = [r.hget(keys.request_meta(c.id.removeprefix("chatcmpl-")), "worker") for c in (first, second)]
            assert workers[0] is not None and workers[0] == workers[1], (n, workers)
            assert second.usage is not None and second.usage.prompt_tokens_details is not None
            assert (second.usage.prompt_tokens_details.cached_tokens or 0) >= 256
    routed = 0
    end = time.monotonic() + 10
    while routed < 3 and time.monotonic() < end:  # the claims by source reach the heartbeat within a second
        routed = sum(int(r.hget(keys.worker_info(w.decode()), "routed_claims") or 0) for w in r.zrange(keys.WORKERS_ALIVE, 0, -1))
        time.sleep(0.2)
    assert routed >= 3


def test_a_worker_killed_mid_stream_is_resumed_by_the_other_through_the_cluster(deployment: ClusterDeployment) -> None:
    """XAUTOCLAIM, the attempt fence and the resume, with the request stream and the delta streams on
    different masters."""
    reference, _ = chat_text(deployment.api.base_url, max_tokens=80, prompt=LONG_PROMPT)
    got: list[str | BaseException] = []

    def client() -> None:
        try:
            got.append(chat_text(deployment.api.base_url, max_tokens=80, prompt=LONG_PROMPT)[0])
        except BaseException as exc:  # asserted below
            got.append(exc)

    r = deployment.client()
    since = time.time()
    thread = threading.Thread(target=client)
    thread.start()
    victim = None
    end = time.monotonic() + 120
    while victim is None and time.monotonic() < end:
        for rid in r.zrangebyscore(keys.REQUEST_INDEX, since, "+inf"):
            worker = r.hget(keys.request_meta(rid.decode()), "worker")
            if worker and r.xlen(keys.delta_stream(rid.decode())) >= 8:
                pid = int(r.hget(keys.worker_info(worker.decode()), "pid") or 0)
                victim = next((w for w in deployment.workers if w.proc.pid == pid), None)
        time.sleep(0.05)
    assert victim is not None, "no worker was seen streaming the request"
    victim.signal(signal.SIGKILL)
    thread.join(300)
    assert got == [reference]
    rids = r.zrangebyscore(keys.REQUEST_INDEX, since, "+inf")
    assert max(int(r.hget(keys.request_meta(rid.decode()), "attempt") or 0) for rid in rids) >= 2
