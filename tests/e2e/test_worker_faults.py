"""Worker faults with real processes: `met serve` on a standalone redis-server (AOF, fsync always) and the
real default model, driven by the official SDKs.

- Redis is killed (-9) mid-stream and restarted on the same port: per protocol the client gets the full
  greedy text of an undisturbed run, the worker process is the same one (pid unchanged, model not
  reloaded), and the in-flight set returns to empty.
- One request that makes every step fail (test-only fault injection) fails alone with one error: its
  batch mates finish whole, and it is delivered once (no redelivery, no dead letter)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

import anthropic
import openai
import pytest
import redis

from cli.embedded_redis import EmbeddedRedis
from shared import keys
from workers.faults import FAULT_INJECTION_FILE

from ..conftest import LiveServer, start_server, stop_server, wait_for
from .test_recovery import in_background, newest_request

pytestmark = pytest.mark.e2e

FAULT = "FAULTY-9c1e"
PROMPT = "Count from 1 to 20, separated by commas."
MAX_TOKENS = 40  # enough to restart Redis mid-stream, few enough for a loaded 2-core machine
SLOW = 600.0  # client timeouts: the machine is shared


def stream_openai(server: LiveServer) -> str:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=SLOW) as api:
        chunks = api.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=MAX_TOKENS, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def stream_anthropic(server: LiveServer) -> str:
    with anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=SLOW) as claude:
        kwargs = {"model": "m", "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": PROMPT}], "extra_body": {"temperature": 0}}
        with claude.messages.stream(**kwargs) as stream:  # type: ignore[arg-type]
            final = stream.get_final_message()
    return "".join(b.text for b in final.content if b.type == "text")


def stream_responses(server: LiveServer) -> str:
    with (
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=SLOW) as api,
        api.responses.stream(model="m", input=PROMPT, temperature=0, max_output_tokens=MAX_TOKENS) as stream,
    ):
        last = list(stream)[-1]
    return last.response.output_text  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedRedis, LiveServer]]:
    base = tmp_path_factory.mktemp("faults")
    store = EmbeddedRedis(str(base / "store"), appendfsync="always")
    url = store.start()
    data = base / "serve"
    data.mkdir()
    (data / FAULT_INJECTION_FILE).touch()  # test-only: fault injection works only with this file in the data dir
    (data / "redis.url").write_text(url)  # where start_server looks (met serve writes it only for its embedded Redis)
    try:
        server = start_server(data, "--redis-url", url, "--workers", "1", ready_timeout=600, env={"MET_FAIL_ON": FAULT})
        try:
            yield store, server
        finally:
            stop_server(server)
    finally:
        store.stop()


def worker_pids(r: redis.Redis) -> list[int]:
    ids = [w.decode() for w in r.zrangebyscore(keys.WORKERS_ALIVE, time.time() - 5, "+inf")]
    return sorted(int(r.hget(keys.worker_info(w), "pid") or 0) for w in ids)


def kill_and_restart(store: EmbeddedRedis, outage_s: float) -> None:
    assert store.proc is not None
    store.proc.kill()  # kill -9
    store.proc.wait()
    time.sleep(outage_s)
    store.start()  # same port, same AOF


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("client", [stream_openai, stream_anthropic, stream_responses], ids=["openai", "anthropic", "responses"])
def test_a_kill_9_and_restart_of_redis_mid_stream_gives_the_full_text_from_the_same_worker(
    standalone: tuple[EmbeddedRedis, LiveServer], client: Callable[[LiveServer], str]
) -> None:
    store, server = standalone
    r = server.redis()
    [pid] = wait_for("one live worker", lambda: worker_pids(r), timeout=SLOW)  # type: ignore[misc]
    expected = client(server)  # undisturbed
    started = time.time()
    thread, result = in_background(lambda: client(server))
    rid = str(wait_for("the request", lambda: newest_request(r, started)))
    wait_for("a few deltas", lambda: r.xlen(keys.delta_stream(rid)) >= 8, timeout=SLOW)
    r.close()
    kill_and_restart(store, outage_s=2.0)
    thread.join(SLOW)
    assert "error" not in result, result
    assert result["text"] == expected
    r = server.redis()
    assert r.hget(keys.request_meta(rid), "attempt") == b"1"  # the same attempt carried on: nothing was reclaimed
    wait_for("the in-flight set to empty", lambda: r.zcard(keys.INFLIGHT) == 0, timeout=30)
    assert worker_pids(r) == [pid]  # the same process: it neither died nor reloaded the model
    worker = next(iter(r.zrange(keys.WORKERS_ALIVE, 0, -1))).decode()
    wait_for("the worker's next heartbeat to count the outage", lambda: int(r.hget(keys.worker_info(worker), "redis_outages") or 0) >= 1, timeout=30)
    r.close()


def chat(server: LiveServer, prompt: str) -> tuple[str, str, int]:
    """(text, finish reason, completion tokens) of a non-streamed chat completion."""
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=SLOW) as api:
        reply = api.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], max_tokens=CHAT_TOKENS, temperature=0)
    assert reply.usage is not None
    return reply.choices[0].message.content or "", reply.choices[0].finish_reason, reply.usage.completion_tokens


CHAT_TOKENS = 32


@pytest.mark.timeout(1800)
def test_a_request_that_fails_every_step_fails_alone_while_its_batch_mates_finish(standalone: tuple[EmbeddedRedis, LiveServer]) -> None:
    """The mates' text is not compared with a solo run: on the default (hf) path a batch's bf16 numerics
    depend on its composition, which the isolating re-runs change too. They must finish whole: no error,
    every token they may generate (a short max_tokens they all reach)."""
    _, server = standalone
    prompts = [f"Write a long story about {n} dragons." for n in ("two", "three", "four")]
    r = server.redis()
    started = time.time()
    runs = [in_background(lambda p=p: chat(server, p)) for p in prompts]  # type: ignore[misc]
    wait_for("the mates to be decoding", lambda: len(mates := r.zrangebyscore(keys.REQUEST_INDEX, started, "+inf")) == 3 and all(r.xlen(keys.delta_stream(m.decode())) >= 2 for m in mates), timeout=SLOW)
    poisoned, outcome = in_background(lambda: chat(server, f"Say {FAULT}:step please."))  # type: ignore[arg-type, return-value]
    for thread, _ in [*runs, (poisoned, outcome)]:
        thread.join(SLOW)
    for _, res in runs:
        assert "error" not in res, res
        text, reason, tokens = res["text"]  # type: ignore[misc]
        assert text and reason == "length" and tokens == CHAT_TOKENS
    assert isinstance(outcome.get("error"), openai.InternalServerError), outcome
    assert re.search(r"isolating the failing request\(s\) among [2-9]", server.log())  # it shared a step with mates
    ids = [m.decode() for m in r.zrangebyscore(keys.REQUEST_INDEX, started, "+inf")]
    [poison] = [rid for rid in ids if FAULT.encode() in (r.get(keys.request_ir(rid)) or b"")]
    assert r.hget(keys.request_meta(poison), "deliveries") == b"1"  # delivered once: no redelivery, no dead letter
    assert not [f for _, f in r.xrange(keys.DEAD_LETTER) if f.get(b"id", b"").decode() == poison]
    wait_for("the in-flight set to empty", lambda: r.zcard(keys.INFLIGHT) == 0, timeout=30)
    r.close()
