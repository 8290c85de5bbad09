"""The compose topology without containers: a standalone redis-server with AOF, two `met api` and two
`met worker` processes, and nginx (Debian's package) running deploy/nginx.conf in front of the API
nodes. Streams go through nginx; a worker is killed with SIGKILL and an API node gets SIGTERM while
they run; no client loses a token or sees one twice, and nothing is left queued or counted."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import pytest
import redis

from shared import keys

from ..conftest import wait_for
from ..topology import Nginx, RedisProcs, Role, responses_stream_text, spawn_role, start_nginx, start_standalone, wait_serving

pytestmark = pytest.mark.e2e

PROMPT = "List the numbers from 1 to 40, separated by commas."
MAX_TOKENS = 110
LEASE_S = 3


@dataclass
class Topology:
    redis: RedisProcs
    workers: list[Role]
    apis: list[Role]
    nginx: Nginx
    reference: str = ""

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.redis.ports[0])


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    base: Path = tmp_path_factory.mktemp("topology")
    store = start_standalone(base / "redis")
    url = f"redis://127.0.0.1:{store.ports[0]}/0"
    roles: list[Role] = []
    nginx: Nginx | None = None
    try:
        workers = [
            spawn_role(f"worker-{i}", "worker", base, "--redis-url", url, "--lease", str(LEASE_S), "--default-temperature", "0", "--data-dir", str(base / f"w{i}"))
            for i in range(2)
        ]
        roles += workers
        apis = [spawn_role(f"api-{i}", "api", base, "--redis-url", url, "--data-dir", str(base / f"a{i}"), env={"MET_DRAIN_TIMEOUT": "120"}) for i in range(2)]
        roles += apis
        for api in apis:
            wait_serving(api, workers=2, others=tuple(roles))
        nginx = start_nginx(base / "nginx", [api.port for api in apis])
        wait_serving(apis[0], workers=2, others=tuple(roles), base_url=nginx.base_url)
        yield Topology(store, workers, apis, nginx)
    finally:
        if nginx is not None:
            nginx.stop()
        for role in roles:
            role.stop()
        store.stop()


def chat_stream(base_url: str) -> tuple[str, str | None]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=300) as api:
        text, finish = "", None
        for chunk in api.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_all_three_protocols_stream_through_nginx(topology: Topology) -> None:
    base = topology.nginx.base_url
    with openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300) as api:
        reference = api.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS).choices[0].message.content or ""
        assert reference.strip()
        topology.reference = reference
        assert chat_stream(base)[0] == reference
        assert responses_stream_text(api, PROMPT, MAX_TOKENS) == (reference, "response.incomplete")
    claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=300)
    with claude, claude.messages.stream(model="m", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": PROMPT}]) as stream:
        message = stream.get_final_message()
    assert "".join(b.text for b in message.content if b.type == "text") == reference
    # they went through the proxy (nginx writes a request's line once it has sent the whole response, which
    # can be just after the client read its last event: CI once read 3 lines of 4)
    log = topology.nginx.directory.joinpath("access.log")
    wait_for("nginx's access log to hold the four requests", lambda: log.read_text().count('"POST /v1/') >= 4, timeout=10)



def busy_worker(topology: Topology, since: float) -> Role | None:
    """A worker that holds a request which has already streamed a few events."""
    r = topology.client()
    for rid in r.zrangebyscore(keys.REQUEST_INDEX, since, "+inf"):
        meta = r.hgetall(keys.request_meta(rid.decode()))
        if meta.get(b"status") == b"running" and r.xlen(keys.delta_stream(rid.decode())) >= 8:
            pid = r.hget(keys.worker_info(meta[b"worker"].decode()), "pid")
            return next((w for w in topology.workers if pid and w.proc.pid == int(pid)), None)
    return None


@pytest.mark.timeout(900)
def test_a_killed_worker_and_a_terminated_api_node_lose_no_stream(topology: Topology) -> None:
    if not topology.reference:
        pytest.fail("test_all_three_protocols_stream_through_nginx must run first: it records the greedy text")
    results: list[tuple[str, str | None] | BaseException] = []

    def client() -> None:
        try:
            results.append(chat_stream(topology.nginx.base_url))
        except BaseException as exc:  # recorded, asserted below
            results.append(exc)

    started = time.time()
    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    victim = wait_for("a worker streaming a request", lambda: busy_worker(topology, started), timeout=120.0)
    assert isinstance(victim, Role)
    victim.signal(signal.SIGKILL)
    leaving = topology.apis[0]
    logged_before = len(leaving.log())
    leaving.signal(signal.SIGTERM)
    late = [threading.Thread(target=client) for _ in range(2)]  # traffic while the node drains
    for t in late:
        t.start()
    for t in threads + late:
        t.join(600)
    assert victim.proc.wait(10) == -signal.SIGKILL
    assert len(results) == 6
    for result in results:
        assert not isinstance(result, BaseException), repr(result)
        text, finish = result
        assert text == topology.reference  # no gap, no repeat
        assert finish in ("length", "stop")
    assert leaving.proc.wait(150) == 0, leaving.log()[-3000:]
    finished_while_draining = [line for line in leaving.log()[logged_before:].splitlines() if " status=length " in line]
    assert finished_while_draining, "no stream was open on the terminated API node: the test proved nothing"
    r = topology.client()
    attempts = [int(r.hget(keys.request_meta(rid.decode()), "attempt") or 0) for rid in r.zrangebyscore(keys.REQUEST_INDEX, started, "+inf")]
    assert max(attempts) >= 2, "no request was resumed by the other worker"
    wait_for("the in-flight counter back at 0", lambda: int(r.get(keys.INFLIGHT) or 0) == 0, timeout=30)
    assert r.xpending(keys.REQUEST_STREAM, keys.WORKER_GROUP)["pending"] == 0
