"""Crash recovery with real processes and a real Redis: kill -9 and SIGSTOP of a worker mid-stream,
a poison request, draining on SIGTERM, and an API node that dies. Two workers, a 3 s lease."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import redis

from cli.embedded_redis import free_port
from shared import keys
from shared.codec import decode_delta
from shared.deltas import Error, Finish, is_terminal
from workers.faults import FAULT_INJECTION_FILE

from ..conftest import ROOT, LiveServer, start_server, stop_server, wait_for

pytestmark = pytest.mark.e2e

POISON = "POISON-PILL-7f3a"
PROMPT = "List the numbers from 1 to 40, separated by commas."
MAX_TOKENS = 110
# the streams killed mid-way decode one token a step: speculative decoding can write this list before the kill
# lands (their text is the same: `reference_text` runs with it)
ONE_A_STEP = {"speculative": False}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("recovery")
    (data / FAULT_INJECTION_FILE).touch()  # test-only: the crash hook works only with this file in the data dir
    server = start_server(data, "--workers", "2", "--lease", "3", env={"MET_CRASH_ON": POISON}, workers_ready=2)
    yield server
    stop_server(server)



def live_workers(r: redis.Redis, n: int = 2) -> list[str]:
    ids = [w.decode() for w in r.zrangebyscore(keys.WORKERS_ALIVE, time.time() - 5, "+inf")]
    return ids if len(ids) >= n else []


def newest_request(r: redis.Redis, after: float) -> str | None:
    newest = r.zrangebyscore(keys.REQUEST_INDEX, after, "+inf")
    return newest[-1].decode() if newest else None


def holder_pid(r: redis.Redis, rid: str, min_deltas: int) -> int | None:
    """The pid of the worker generating `rid`, once it has written `min_deltas` events."""
    worker = r.hget(keys.request_meta(rid), "worker")
    if worker is None or r.xlen(keys.delta_stream(rid)) < min_deltas:
        return None
    pid = r.hget(keys.worker_info(worker.decode()), "pid")
    return int(pid) if pid else None


def events(r: redis.Redis, rid: str) -> list[object]:
    return [decode_delta(f[b"d"]) for _, f in r.xrange(keys.delta_stream(rid)) if b"d" in f]


def reference_text(server: LiveServer) -> str:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as api:
        reply = api.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=MAX_TOKENS)
    return reply.choices[0].message.content or ""


def stream_openai(server: LiveServer) -> str:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=180) as api:
        chunks = api.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=MAX_TOKENS, stream=True, extra_body=ONE_A_STEP)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def stream_anthropic(server: LiveServer) -> str:
    with anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=180) as claude:
        kwargs = {"model": "m", "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": PROMPT}], "extra_body": {"temperature": 0, **ONE_A_STEP}}
        with claude.messages.stream(**kwargs) as stream:  # type: ignore[arg-type]
            final = stream.get_final_message()
    return "".join(b.text for b in final.content if b.type == "text")


def stream_responses(server: LiveServer) -> str:
    with (
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=180) as api,
        api.responses.stream(model="m", input=PROMPT, temperature=0, max_output_tokens=MAX_TOKENS, extra_body=ONE_A_STEP) as stream,
    ):
        last = list(stream)[-1]
    return last.response.output_text  # type: ignore[union-attr]


def in_background(fn: Callable[[], str]) -> tuple[threading.Thread, dict[str, object]]:
    result: dict[str, object] = {}

    def target() -> None:
        try:
            result["text"] = fn()
        except Exception as exc:  # reported by the asserting test
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


@pytest.mark.parametrize("client", [stream_openai, stream_anthropic, stream_responses], ids=["openai", "anthropic", "responses"])
def test_kill_9_of_the_worker_mid_stream_gives_the_client_the_uninterrupted_text(cluster: LiveServer, client: Callable[[LiveServer], str]) -> None:
    r = cluster.redis()
    wait_for("two live workers", lambda: live_workers(r))
    expected = reference_text(cluster)
    started = time.time()
    thread, result = in_background(lambda: client(cluster))
    rid = str(wait_for("the request", lambda: newest_request(r, started)))
    pid = int(str(wait_for("a few deltas", lambda: holder_pid(r, rid, min_deltas=8))))
    os.kill(pid, signal.SIGKILL)
    thread.join(120)
    assert "error" not in result, result
    assert result["text"] == expected
    recorded = events(r, rid)
    attempts = [getattr(e, "attempt", 0) for e in recorded]
    assert attempts == sorted(attempts) and attempts[0] == 1 and attempts[-1] == 2  # no interleaving, two attempts
    assert sum(is_terminal(e) for e in recorded) == 1 and isinstance(recorded[-1], Finish)
    assert r.hget(keys.request_meta(rid), "attempt") == b"2"


def test_kill_9_of_the_worker_mid_stream_resumes_the_request_on_its_lora_adapter(cluster: LiveServer, default_adapters: dict[str, Path]) -> None:
    r = cluster.redis()
    wait_for("two live workers", lambda: live_workers(r))
    added = httpx.post(f"{cluster.base_url}/v1/load_lora_adapter", json={"lora_name": "pirate", "lora_path": str(default_adapters["pirate"])}, timeout=30)
    assert added.status_code == 200, added.text

    def ask(stream: bool, model: str = "pirate") -> str:
        with openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0, timeout=180) as api:
            kwargs = {"model": model, "messages": [{"role": "user", "content": "Write a long poem about the sea."}], "temperature": 0, "max_tokens": MAX_TOKENS}
            if not stream:
                return api.chat.completions.create(**kwargs).choices[0].message.content or ""  # type: ignore[call-overload]
            chunks = api.chat.completions.create(**kwargs, stream=True, extra_body=ONE_A_STEP)  # type: ignore[call-overload]
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    expected = ask(stream=False)
    assert expected != ask(stream=False, model="m")  # the adapter's own text
    started = time.time()
    thread, result = in_background(lambda: ask(stream=True))
    rid = str(wait_for("the request", lambda: newest_request(r, started)))
    pid = int(str(wait_for("a few deltas", lambda: holder_pid(r, rid, min_deltas=8))))
    os.kill(pid, signal.SIGKILL)
    thread.join(120)
    assert result.get("text") == expected, result
    assert r.hget(keys.request_meta(rid), "attempt") == b"2"


def test_a_paused_worker_that_wakes_up_after_losing_its_lease_cannot_write(cluster: LiveServer) -> None:
    r = cluster.redis()
    wait_for("two live workers", lambda: live_workers(r))
    expected = reference_text(cluster)
    started = time.time()
    thread, result = in_background(lambda: stream_openai(cluster))
    rid = str(wait_for("the request", lambda: newest_request(r, started)))
    pid = int(str(wait_for("a few deltas", lambda: holder_pid(r, rid, min_deltas=8))))
    stale_worker = r.hget(keys.request_meta(rid), "worker")
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for("the takeover", lambda: r.hget(keys.request_meta(rid), "attempt") == b"2", timeout=30)
    finally:
        os.kill(pid, signal.SIGCONT)
    thread.join(120)
    assert result.get("text") == expected, result
    assert stale_worker is not None
    wait_for("the stale write to be refused", lambda: int(r.hget(keys.worker_info(stale_worker.decode()), "stale_writes") or 0) >= 1, timeout=20)
    attempts = [getattr(e, "attempt", 0) for e in events(r, rid)]
    assert attempts == sorted(attempts) and set(attempts) == {1, 2}


def test_a_poison_request_goes_to_the_dead_letters_with_one_error_while_others_flow(cluster: LiveServer) -> None:
    r = cluster.redis()
    wait_for("two live workers", lambda: live_workers(r))
    started = time.time()
    poisoned, outcome = in_background(lambda: stream_openai_text(cluster, f"Say {POISON} please."))
    rid = str(wait_for("the poison request", lambda: newest_request(r, started)))
    healthy = stream_openai_text(cluster, "Say hello.")  # keeps flowing meanwhile
    assert healthy
    poisoned.join(180)
    assert isinstance(outcome.get("error"), openai.InternalServerError), outcome
    letters = [f for _, f in r.xrange(keys.DEAD_LETTER) if f[b"id"].decode() == rid]
    assert len(letters) == 1 and int(letters[0][b"deliveries"]) == 4
    recorded = events(r, rid)
    assert len(recorded) == 1 and isinstance(recorded[0], Error)


def stream_openai_text(server: LiveServer, prompt: str) -> str:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=180) as api:
        reply = api.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0)
    return reply.choices[0].message.content or ""


def test_sigterm_drains_in_flight_work_and_ready_turns_503_first(cluster: LiveServer) -> None:
    r = cluster.redis()
    wait_for("two live workers", lambda: live_workers(r))
    expected = reference_text(cluster)
    started = time.time()
    thread, result = in_background(lambda: stream_openai(cluster))
    rid = str(wait_for("the request", lambda: newest_request(r, started)))
    wait_for("a few deltas", lambda: holder_pid(r, rid, min_deltas=4))
    cluster.proc.send_signal(signal.SIGTERM)
    ready = wait_for("/ready to refuse", lambda: httpx.get(f"{cluster.base_url}/ready", timeout=5).status_code == 503, timeout=10)
    assert ready
    thread.join(120)
    assert result.get("text") == expected, result
    assert cluster.proc.wait(90) == 0


def test_an_api_node_that_dies_loses_only_its_connections(tmp_path: Path, redis_server: str) -> None:
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_server, "MET_DATA_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    worker = subprocess.Popen([sys.executable, "-m", "cli.main", "worker"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = subprocess.Popen([sys.executable, "-m", "cli.main", "api", "--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = redis.Redis.from_url(redis_server)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for("the api and a worker", lambda: _ready(base), timeout=180)
        body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, **ONE_A_STEP}
        started = time.time()
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as response:
            rid = response.headers["x-request-id"]
            next(response.iter_lines())
            api.kill()
            api.wait(10)
        assert r.zscore(keys.REQUEST_INDEX, rid) is not None and float(r.zscore(keys.REQUEST_INDEX, rid) or 0) >= started - 1
        wait_for("the request to finish without its api node", lambda: r.hget(keys.request_meta(rid), "status") == b"finished", timeout=120)
        recorded = events(r, rid)
        assert isinstance(recorded[-1], Finish) and recorded[-1].usage.completion_tokens > 0
        assert r.exists(keys.request_ir(rid))  # still in the dump
    finally:
        for proc in (api, worker):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)
        r.close()


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
