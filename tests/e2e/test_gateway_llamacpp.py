"""The gateway in front of a real third-party upstream: llama.cpp's server (llama-cpp-python 0.3.36, built from
its source distribution by `./dev test-gateway` into .tools/llama-cpp/venv) on the default model's GGUF, with a
`met serve --upstream …` in front, driven with the official SDKs through all three protocols; the upstream is
killed mid-stream and restarted. Marked `gateway_llamacpp`: deselected from the main suite (pyproject addopts),
selected by `./dev test-gateway`; selected without the build, it fails saying how to build it."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cli.embedded_redis import free_port

from ..conftest import LiveServer, start_server, stop_server
from . import gateway_checks as checks
from .llamacpp import llamacpp_command, missing_message

pytestmark = [pytest.mark.e2e, pytest.mark.gateway_llamacpp]


class LlamaCppUpstream:
    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log_dir = log_dir
        self.runs = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.runs += 1
        log_path = self.log_dir / f"llamacpp-{self.runs}.log"
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(llamacpp_command(self.port), stdout=log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 180
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                pytest.fail(f"llama.cpp's server exited with {self.proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        pytest.fail(f"llama.cpp's server was not up in 180 s:\n{log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def restart(self) -> None:
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppUpstream]:
    problem = missing_message()
    if problem:
        pytest.fail(problem)
    proc = LlamaCppUpstream(tmp_path_factory.mktemp("llamacpp"))
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def gateway(upstream: LlamaCppUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    args = ["--upstream", upstream.url, "--upstream-timeout", "5", "--lease", "3", "--drain-timeout", "2"]
    server = start_server(tmp_path_factory.mktemp("gateway"), *args)
    yield server
    stop_server(server)


def test_ready_metrics_and_met_top_show_the_gateway_worker_with_llamacpp_healthy(gateway: LiveServer, upstream: LlamaCppUpstream) -> None:
    checks.check_health_is_shown(gateway, upstream)


def test_openai_chat_through_llamacpp_text_max_tokens_stop_and_usage(gateway: LiveServer) -> None:
    checks.check_openai_chat(gateway)


def test_openai_chat_forced_tool_call_through_llamacpp(gateway: LiveServer) -> None:
    checks.check_openai_chat_forced_tool_call(gateway)


def test_anthropic_messages_through_llamacpp(gateway: LiveServer) -> None:
    checks.check_anthropic_messages(gateway, upstream_names_the_stop=False)


def test_openai_responses_through_llamacpp(gateway: LiveServer) -> None:
    checks.check_openai_responses(gateway)


def test_a_llamacpp_gateway_requests_dump_re_encodes_to_the_bytes_its_client_received(gateway: LiveServer, tmp_path: Path) -> None:
    checks.check_dump_and_encode_only(gateway, tmp_path)


def test_llamacpp_killed_mid_stream_gives_each_protocol_one_error_and_a_restart_serves_again(gateway: LiveServer, upstream: LlamaCppUpstream) -> None:
    checks.check_upstream_killed_mid_stream(gateway, upstream, all_at_once=False)  # it runs one request at a time


def test_a_gateway_worker_killed_mid_stream_in_front_of_llamacpp_ends_with_one_error_and_no_duplicate(gateway: LiveServer) -> None:
    checks.check_gateway_worker_killed_mid_stream(gateway)  # no --upstream-continue: llama-cpp-python cannot continue a message
