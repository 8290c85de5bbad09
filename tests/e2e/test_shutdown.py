"""Ctrl-C as a terminal sends it: SIGINT to the server's whole process group, mid-stream. Redis and the
workers live in their own process groups, so only the supervisor gets it and drains in order: the
client's stream completes normally, the exit code is 0, no traceback lands in the log, and no
redis-server or worker is left behind. Once as `met serve --no-tui` in its own process group, once as
`./dev serve` under a pseudo-terminal whose Ctrl-C byte the terminal driver turns into the SIGINT."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import redis

from cli.embedded_redis import free_port
from shared import keys

from ..conftest import ROOT, wait_ready

pytestmark = pytest.mark.e2e

MAX_TOKENS = 60
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def serve_args(data_dir: Path, port: int) -> list[str]:
    return ["--no-tui", "--port", str(port), "--data-dir", str(data_dir), "--workers", "1", "--log-format", "json"]


def children_of(redis_url: str) -> list[int]:
    """The pids of the embedded redis-server and the live workers."""
    client = redis.Redis.from_url(redis_url)
    info: Any = client.info("server")
    pids = [int(info["process_id"])]
    workers: Any = client.zrange(keys.WORKERS_ALIVE, 0, -1)
    for worker in workers:
        pid: Any = client.hget(keys.worker_info(worker.decode()), "pid")
        pids.extend([int(pid)] if pid else [])
    client.close()
    return pids


def running(pids: list[int]) -> list[int]:
    """Those of `pids` still running (a zombie waiting for its reaper has stopped running)."""
    left = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            left.append(pid)
    return left


def stream_through_ctrl_c(base: str, ctrl_c: Callable[[], object]) -> tuple[str, str | None, int]:
    """Stream a completion, press Ctrl-C after a few chunks, read on to the end: (id, finish_reason, tokens)."""
    finish, tokens, chunk_id = None, 0, ""
    with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        stream = sdk.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Count from 1 to 100."}],
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for i, chunk in enumerate(stream):
            chunk_id = chunk.id
            if i == 3:
                ctrl_c()
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
    return chunk_id.removeprefix("chatcmpl-"), finish, tokens


def assert_clean(log: str, request_id: str, leftovers: list[int]) -> None:
    assert "Traceback" not in log and "ConnectionError" not in log, log[-4000:]
    assert "Metrale stopped." in log
    # a terminal may put its echoed ^C in front of a line: each JSON object starts at its brace
    access = [orjson.loads(line[line.index("{") :]) for line in log.splitlines() if '"met.requests"' in line and request_id in line]
    assert [(a["logger"], a["status"], a["output_tokens"]) for a in access] == [("met.requests", "length", MAX_TOKENS)]
    assert running(leftovers) == []


def test_ctrl_c_to_met_serves_process_group_lets_the_stream_finish(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "cli.main", "serve", *serve_args(tmp_path, port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(proc, base, log_path)
        children = children_of((tmp_path / "redis.url").read_text().strip())
        request_id, finish, tokens = stream_through_ctrl_c(base, lambda: os.killpg(proc.pid, signal.SIGINT))
        assert (finish, tokens) == ("length", MAX_TOKENS)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert_clean(log_path.read_text(errors="replace"), request_id, children)


def _controlling_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # the new session's terminal: its Ctrl-C signals our group


def test_ctrl_c_on_the_terminal_of_dev_serve_lets_the_stream_finish(tmp_path: Path) -> None:
    stamp = ROOT / ".venv" / ".metrale-installed"
    assert stamp.exists(), "./dev serve must find the venv already set up (run ./dev test once)"
    port = free_port()
    master, slave = os.openpty()
    proc = subprocess.Popen(
        ["./dev", "serve", *serve_args(tmp_path, port)],
        cwd=ROOT,
        env=ENV,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=_controlling_terminal,
    )
    os.close(slave)
    output = bytearray()

    def read_terminal() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the other side closed
                return
            if not data:
                return
            output.extend(data)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(proc, base, tmp_path / "serve.log")
        assert b"dev: installing packages" not in output  # the venv was already set up: no reinstall
        children = children_of((tmp_path / "redis.url").read_text().strip())
        request_id, finish, tokens = stream_through_ctrl_c(base, lambda: os.write(master, b"\x03"))
        assert (finish, tokens) == ("length", MAX_TOKENS)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(10)
        os.close(master)
    assert_clean(output.decode(errors="replace").replace("\r\n", "\n"), request_id, children)


def test_a_killed_supervisor_leaves_no_redis_server_or_worker_behind(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "cli.main", "serve", *serve_args(tmp_path, port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_ready(proc, f"http://127.0.0.1:{port}", log_path)
    children = children_of((tmp_path / "redis.url").read_text().strip())
    proc.kill()  # no finally, no drain: only the children's parent-death signal is left
    proc.wait()
    for _ in range(600):  # each child gets SIGTERM and stops on its own (the worker drains first)
        if not running(children):
            break
        time.sleep(0.1)
    left = running(children)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []
