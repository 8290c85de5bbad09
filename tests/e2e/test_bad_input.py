"""Bad input through a live server: 400 in OpenAI's error shape naming the parameter, before any SSE
header, and nothing reaches the request stream. Redis down: 503 in the same shape."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from cli.embedded_redis import free_port
from shared import keys

from ..conftest import ROOT, LiveServer

pytestmark = pytest.mark.e2e

GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

CASES: list[tuple[str, Any, str | None]] = [
    ("malformed json", b'{"model": "m", "messages": [', None),
    ("body is an array", b"[1, 2]", None),
    ("missing messages", {"model": "m"}, "messages"),
    ("missing model", {"messages": GOOD["messages"]}, "model"),
    ("wrong type", {**GOOD, "temperature": "warm"}, "temperature"),
    ("unknown role", {**GOOD, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("n above the cap", {**GOOD, "n": 17}, "n"),
    ("negative max_tokens", {**GOOD, "max_tokens": -5}, "max_tokens"),
    ("absurd max_tokens", {**GOOD, "max_tokens": 10**9}, "max_tokens"),
    ("prompt longer than the context", {**GOOD, "messages": [{"role": "user", "content": "word " * 9000}]}, "messages"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(("name", "body", "param"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_400_naming_the_parameter_and_nothing_is_queued(live_server: LiveServer, name: str, body: Any, param: str | None, stream: bool) -> None:
    if stream and isinstance(body, dict):
        body = {**body, "stream": True}
    r = live_server.redis()
    before = r.xlen(keys.REQUEST_STREAM)
    content = body if isinstance(body, bytes) else None
    response = httpx.post(
        f"{live_server.base_url}/v1/chat/completions",
        content=content,
        json=None if content is not None else body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}
    assert r.xlen(keys.REQUEST_STREAM) == before
    r.close()


def test_the_sdk_sees_a_bad_request_error_with_the_param(live_server: LiveServer) -> None:
    with openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="x", max_retries=0) as api, pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=17)
    assert caught.value.param == "n"


def test_unknown_fields_are_ignored(live_server: LiveServer) -> None:
    response = httpx.post(f"{live_server.base_url}/v1/chat/completions", json={**GOOD, "frobnicate": [1, 2], "user": "u1"}, timeout=60)
    assert response.status_code == 200 and response.json()["object"] == "chat.completion"


@pytest.fixture
def api_without_redis(tmp_path: Any) -> Iterator[str]:
    port, dead_redis = free_port(), free_port()
    cmd = [sys.executable, "-m", "cli.main", "api", "--port", str(port), "--redis-url", f"redis://127.0.0.1:{dead_redis}/0", "--data-dir", str(tmp_path)]
    with open(tmp_path / "api.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail((tmp_path / "api.log").read_text())
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def test_redis_down_is_a_503_in_the_openai_shape_not_a_traceback(api_without_redis: str) -> None:
    response = httpx.post(f"{api_without_redis}/v1/chat/completions", json={**GOOD, "stream": True}, timeout=30)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "queue_unavailable" and "Traceback" not in response.text
    ready = httpx.get(f"{api_without_redis}/ready", timeout=30)
    assert ready.status_code == 503 and ready.json()["redis"] is False
