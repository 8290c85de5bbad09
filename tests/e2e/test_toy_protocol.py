"""The protocol registry (issue 33): a protocol added by one module, tests/e2e/toy_protocol.py (its
parser, its encoder and one `register(Surface(...))` row), named by `--protocol-module`, is served by a
live server like the built-in four: through admission, the request stream and a worker, streamed and
whole, its bad input refused in its own error shape before anything is queued, and recorded under its
own name. Nothing outside that module knows it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from shared import keys

from ..conftest import LiveServer, start_server, stop_server

pytestmark = pytest.mark.e2e

SAY = "Count from one to ten in words."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(tmp_path_factory.mktemp("toy"), "--workers", "1", "--protocol-module", "tests.e2e.toy_protocol")
    yield live
    stop_server(live)


def toy(server: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/toy", json=body, timeout=120)


def test_the_toy_protocol_is_served_whole_and_streamed_with_the_models_own_greedy_answer(server: LiveServer) -> None:
    whole = toy(server, {"model": "m", "say": SAY, "max_tokens": 12})
    assert whole.status_code == 200, whole.text
    reply = whole.json()
    assert reply["object"] == "toy.reply" and reply["text"] and reply["finish"] in ("stop", "length") and 0 < reply["tokens"] <= 12
    # the same turn through the chat route: the toy went through the same template, model and sampling
    chat = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": SAY}], "max_tokens": 12, "temperature": 0},
        timeout=120,
    ).json()
    assert reply["text"] == chat["choices"][0]["message"]["content"]
    with httpx.stream("POST", f"{server.base_url}/v1/toy", json={"model": "m", "say": SAY, "max_tokens": 12, "stream": True}, timeout=120) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        events = [orjson.loads(line[5:]) for line in stream.iter_lines() if line.startswith("data:")]
    assert "".join(e.get("text", "") for e in events) == reply["text"]
    assert events[-1] == {"finish": reply["finish"], "tokens": reply["tokens"]}
    recorded = server.redis().hget(keys.request_meta(reply["id"]), "protocol")
    assert recorded == b"toy"  # recorded under its own name (dumps, replay)


def test_bad_toy_input_is_refused_in_its_error_shape_naming_the_parameter_before_anything_is_queued(server: LiveServer) -> None:
    r = server.redis()
    before = r.xlen(keys.REQUEST_STREAM)
    for body, param in (({"model": "m", "say": 5}, "say"), ({"model": "m", "say": "hi", "max_tokens": 0}, "max_tokens")):
        refused = toy(server, {**body, "stream": True})
        assert refused.status_code == 400 and refused.headers["content-type"].startswith("application/json")
        assert refused.json()["error"]["param"] == param and refused.json()["error"]["type"] == "invalid_request_error"
    too_long = toy(server, {"model": "m", "say": "word " * 20_000})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "say"  # the context error names its own field
    assert r.xlen(keys.REQUEST_STREAM) == before
