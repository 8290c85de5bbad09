"""Gateway workers (workers/gateway.py) in front of a real OpenAI-compatible upstream that is always here:
our own `met serve` on the default model. A `met serve --upstream …` in front of it is driven with the
official SDKs; the upstream is killed mid-stream and restarted; the gateway worker is killed mid-stream
and, with `--upstream-continue` (our upstream takes `continue_final_message`), the request goes on.
The same checks run against llama.cpp's server in tests/e2e/test_gateway_llamacpp.py (`./dev test-gateway`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from typer.testing import CliRunner

from cli.embedded_redis import free_port
from cli.main import app
from shared import keys

from ..conftest import LiveServer, start_server, stop_server
from . import gateway_checks as checks

pytestmark = pytest.mark.e2e
UPSTREAM_KEY = "sk-upstream-7f3a9c"  # the upstream requires it: every test here shows the gateway sends it


class MetUpstream:
    """Our own `met serve`, on a fixed port so it can be killed and started again where the gateway points."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.runs = 0
        self.server: LiveServer | None = None

    def start(self) -> None:
        self.runs += 1
        self.server = start_server(self.root / f"run{self.runs}", "--workers", "1", "--drain-timeout", "2", "--api-key", UPSTREAM_KEY, port=self.port)

    def kill(self) -> None:
        assert self.server is not None
        self.server.proc.kill()  # the API goes at once; its worker and Redis follow (parent-death signal)
        self.server.proc.wait()

    def restart(self) -> None:
        self.start()

    def stop(self) -> None:
        if self.server is not None:
            stop_server(self.server)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetUpstream]:
    proc = MetUpstream(tmp_path_factory.mktemp("upstream"))
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def gateway(upstream: MetUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    key_file = tmp_path_factory.mktemp("secrets") / "upstream.key"
    key_file.write_text(UPSTREAM_KEY + "\n")
    args = ["--upstream", upstream.url, "--upstream-api-key-file", str(key_file), "--upstream-timeout", "5", "--lease", "3", "--drain-timeout", "2", "--upstream-continue"]
    server = start_server(tmp_path_factory.mktemp("gateway"), *args)
    yield server
    stop_server(server)


def test_ready_metrics_and_met_top_show_the_gateway_worker_with_its_healthy_upstream(gateway: LiveServer, upstream: MetUpstream) -> None:
    checks.check_health_is_shown(gateway, upstream)


def test_the_gateways_processes_run_sched_batch_and_a_model_servers_do_not(gateway: LiveServer, upstream: MetUpstream) -> None:
    """`met serve --upstream` yields to an upstream on the same host (cli/main.py: yield_to_upstream): its
    API node, Redis and gateway worker are SCHED_BATCH; the upstream here, a `met serve` with a model
    worker, keeps normal scheduling."""
    import os

    import psutil

    assert upstream.server is not None

    def policies(pid: int) -> dict[str, int]:
        top = psutil.Process(pid)
        return {" ".join(p.cmdline()[1:4]): os.sched_getscheduler(p.pid) for p in [top, *top.children(recursive=True)]}

    gateway_side, model_side = policies(gateway.proc.pid), policies(upstream.server.proc.pid)
    assert len(gateway_side) >= 3 and set(gateway_side.values()) == {os.SCHED_BATCH}, gateway_side  # API, Redis, worker
    assert any("worker" in name for name in gateway_side), gateway_side
    assert len(model_side) >= 3 and set(model_side.values()) == {os.SCHED_OTHER}, model_side


def test_openai_chat_through_the_gateway_text_max_tokens_stop_and_usage(gateway: LiveServer) -> None:
    checks.check_openai_chat(gateway)


def test_openai_chat_forced_tool_call_through_the_gateway(gateway: LiveServer) -> None:
    checks.check_openai_chat_forced_tool_call(gateway)


def test_anthropic_messages_through_the_gateway(gateway: LiveServer) -> None:
    checks.check_anthropic_messages(gateway, upstream_names_the_stop=True)


def test_openai_responses_through_the_gateway(gateway: LiveServer) -> None:
    checks.check_openai_responses(gateway)


def test_what_the_upstream_cannot_express_is_refused_in_each_protocols_shape(gateway: LiveServer) -> None:
    checks.check_refused_before_any_sse_header(gateway)


def test_with_two_gateway_workers_each_conversation_follows_the_upstream_that_served_its_first_turn(
    upstream: MetUpstream, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """llama.cpp and the like publish no KV events: a gateway worker's routing index is the block keys of the prompts it
    sent (workers.routed.PromptKeys), so a second turn goes to the worker, and so the upstream, that served the first."""
    key_file = tmp_path_factory.mktemp("secrets2") / "upstream.key"
    key_file.write_text(UPSTREAM_KEY + "\n")
    args = ["--upstream", upstream.url, "--upstream-api-key-file", str(key_file), "--workers", "2"]
    server = start_server(tmp_path_factory.mktemp("two-gateways"), *args, workers_ready=2)
    try:
        r = redis.Redis.from_url(server.redis_url)
        served = []
        with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as api:
            model = api.models.list().data[0].id
            for n in range(4):
                system = f"Conversation {n}. " + " ".join(f"Rule {i}: answer plainly and keep item {i * (n + 3)} in mind." for i in range(60))
                messages: list[Any] = [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]
                first = api.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
                messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "And goodbye?"}]
                second = api.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
                served.append([r.hget(keys.request_meta(c.id.removeprefix("chatcmpl-")), "worker") for c in (first, second)])
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        r.close()
    finally:
        stop_server(server)
    assert all(first is not None and first == second for first, second in served), served
    assert 'met_routing_decisions_total{decision="routed"} 4.0' in metrics


def test_a_gateway_requests_dump_re_encodes_to_the_bytes_its_client_received(gateway: LiveServer, tmp_path: Path) -> None:
    checks.check_dump_and_encode_only(gateway, tmp_path)


def test_a_client_that_leaves_mid_stream_gets_its_upstream_request_closed(gateway: LiveServer, upstream: MetUpstream) -> None:
    assert upstream.server is not None
    checks.check_client_disconnect_closes_the_upstream_request(gateway, upstream.server)


def test_the_upstream_key_is_sent_but_never_logged_dumped_or_in_the_heartbeat(gateway: LiveServer, tmp_path: Path) -> None:
    checks.check_each_protocol_answers(gateway)  # the upstream refuses requests without the key
    exported = tmp_path / "all.jsonl"
    ids = [m.decode() for m in gateway.redis().zrange(keys.REQUEST_INDEX, 0, -1)]
    assert CliRunner().invoke(app, ["dump", "export", *ids, "-o", str(exported), "--redis-url", gateway.redis_url]).exit_code == 0
    worker_hashes = [gateway.redis().hgetall(keys.worker_info(w.decode())) for w in gateway.redis().zrange(keys.WORKERS_ALIVE, 0, -1)]
    for where, text in [("log", gateway.log()), ("dump", exported.read_text()), ("heartbeat", repr(worker_hashes))]:
        assert UPSTREAM_KEY not in text, where


def test_a_gateway_worker_killed_mid_stream_is_continued_by_the_upstream_where_it_stopped(gateway: LiveServer, upstream: MetUpstream) -> None:
    checks.check_gateway_worker_killed_mid_stream_continues(gateway, upstream.url, UPSTREAM_KEY)


def test_the_upstream_killed_mid_stream_gives_each_protocol_one_error_and_a_restart_serves_again(gateway: LiveServer, upstream: MetUpstream) -> None:
    checks.check_upstream_killed_mid_stream(gateway, upstream)
