"""Resumable streams and background Responses, with real processes: one worker and two API nodes on one
Redis. An API node is SIGKILLed mid-stream and the client reconnects to the other with `Last-Event-ID`
(and the `X-Request-Id` it got): the text of both halves equals an uninterrupted greedy run, on all
three protocols. Background Responses through the official SDK: create → poll → a stream replayed from
`starting_after` equal, byte for byte, to the tail of the whole stream; and cancel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from cli.embedded_redis import free_port

from ..conftest import ROOT

pytestmark = pytest.mark.e2e

PROMPT = "List the numbers from 1 to 30, separated by commas."
MAX_TOKENS = 80
ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS}),
    "responses": ("/v1/responses", {"input": PROMPT, "max_output_tokens": MAX_TOKENS}),
}


class Node:
    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "cli.main", "api", "--port", str(self.port)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        wait_for(f"api node {self.port}", lambda: _ready(self.base), timeout=180)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, redis_server: str) -> Iterator[dict[str, str]]:
    data = tmp_path_factory.mktemp("resume")
    env = {**os.environ, "REDIS_URL": redis_server, "MET_DATA_DIR": str(data), "HF_HUB_OFFLINE": "1", "MET_DTYPE": "float32"}
    with open(data / "worker.log", "wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "cli.main", "worker"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    env["_LOGS"] = str(data)
    yield env
    worker.terminate()
    worker.wait(60)


@pytest.fixture(scope="module")
def steady(env: dict[str, str]) -> Iterator[Node]:
    """The API node that stays up (the one clients reconnect to)."""
    node = Node(env, Path(env["_LOGS"]) / "steady.log")
    yield node
    node.stop()


def wait_for(what: str, check: Callable[[], object], timeout: float = 60.0) -> object:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := check():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def sse(lines: Iterator[str]) -> Iterator[tuple[str | None, dict[str, Any] | str]]:
    """(id, data) per event of an SSE body; pings and comments skipped."""
    event_id, data = None, None
    for line in lines:
        if line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
        elif line == "" and data is not None:
            yield event_id, (data if data == "[DONE]" else orjson.loads(data))
            event_id, data = None, None


def text_of(route: str, payload: dict[str, Any] | str) -> str:
    if not isinstance(payload, dict):
        return ""
    if route == "chat":
        return "".join(c["delta"].get("content") or "" for c in payload.get("choices", []))
    if route == "messages":
        delta = payload.get("delta", {})
        return delta.get("text", "") if payload.get("type") == "content_block_delta" else ""
    return payload.get("delta", "") if payload.get("type") == "response.output_text.delta" else ""


def body_for(route: str) -> tuple[str, dict[str, Any]]:
    path, extra = ROUTES[route]
    return path, {"model": "m", "temperature": 0, "stream": True, **extra}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_stream_survives_its_api_node_being_killed_by_reconnecting_to_another_with_last_event_id(route: str, env: dict[str, str], steady: Node) -> None:
    path, body = body_for(route)
    with httpx.stream("POST", steady.base + path, json=body, timeout=120) as whole:
        reference = "".join(text_of(route, data) for _id, data in sse(whole.iter_lines()))
    assert len(reference) > 20

    doomed = Node(env, Path(env["_LOGS"]) / f"doomed-{route}.log")
    first, last_id = "", None
    try:
        with httpx.stream("POST", doomed.base + path, json=body, timeout=120) as cut:
            rid = cut.headers["x-request-id"]
            for event_id, data in sse(cut.iter_lines()):
                first += text_of(route, data)
                last_id = event_id
                if len(first) >= 8:
                    doomed.proc.send_signal(signal.SIGKILL)
                    break
    except httpx.HTTPError:
        pass
    doomed.proc.wait(10)
    assert last_id is not None and first and first != reference

    headers = {"X-Request-Id": rid, "Last-Event-ID": last_id}
    with httpx.stream("POST", steady.base + path, json=body, headers=headers, timeout=120) as rest:
        assert rest.status_code == 200
        events = list(sse(rest.iter_lines()))
    assert events and int(events[0][0] or -1) == int(last_id) + 1  # the very next event
    assert first + "".join(text_of(route, data) for _id, data in events) == reference


def test_a_client_that_reattached_before_its_first_connection_closed_keeps_its_stream_to_the_end(env: dict[str, str], steady: Node) -> None:
    """The resume race: the client is already reading the stream through node B (Last-Event-ID) when its
    connection to node A closes. A's grace (0.5 s here) ends with a client attached after A's connection
    did, so nothing is cancelled and B's stream runs to the full text (before: A compared the count at
    its loss, saw no change, and cancelled B's stream, which ended early as if finished)."""
    path = "/v1/chat/completions"
    story = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
    body = {"model": "m", "temperature": 0, "stream": True, "max_tokens": 300, "ignore_eos": True, "messages": story}  # ~10 s of generation
    with httpx.stream("POST", steady.base + path, json=body, timeout=180) as whole:
        reference = "".join(text_of("chat", data) for _id, data in sse(whole.iter_lines()))
    assert len(reference) > 200
    first_node = Node({**env, "MET_RESUME_GRACE_S": "0.5"}, Path(env["_LOGS"]) / "first-of-two.log")
    rest: list[str] = []
    try:
        with httpx.stream("POST", first_node.base + path, json=body, timeout=180) as first_connection:
            rid, first, last_id = first_connection.headers["x-request-id"], "", None
            lines = first_connection.iter_lines()
            for event_id, data in sse(lines):
                first += text_of("chat", data)
                last_id = event_id
                if len(first) >= 8:
                    break
            headers = {"X-Request-Id": rid, "Last-Event-ID": str(last_id)}
            resumed = httpx.stream("POST", steady.base + path, json=body, headers=headers, timeout=180)
            second = resumed.__enter__()
            events = sse(second.iter_lines())
            rest.append(text_of("chat", next(events)[1]))  # attached through node B ...
        # ... and only now the first connection closes: node A notices, waits its grace, cancels nothing.
        rest += [text_of("chat", data) for _id, data in events]
        resumed.__exit__(None, None, None)
    finally:
        first_node.stop()
    assert first + "".join(rest) == reference


def test_a_stream_of_several_choices_resumes_on_another_node_each_choice_from_where_it_was(env: dict[str, str], steady: Node) -> None:
    """Chat n=3: the API node dies mid-stream; the client resumes on the other with the last event id
    (a position per choice): each choice's text, both halves joined, equals an uninterrupted run."""
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40, "n": 3, "temperature": 0.8, "seed": 3, "stream": True}

    def texts(events: list[tuple[str | None, Any]], into: dict[int, str]) -> dict[int, str]:
        for _id, data in events:
            for choice in data.get("choices", []) if isinstance(data, dict) else []:
                into[choice["index"]] = into.get(choice["index"], "") + (choice["delta"].get("content") or "")
        return into

    with httpx.stream("POST", steady.base + "/v1/chat/completions", json=body, timeout=120) as whole:
        reference = texts(list(sse(whole.iter_lines())), {})
    assert sorted(reference) == [0, 1, 2] and all(len(t) > 10 for t in reference.values())

    doomed = Node(env, Path(env["_LOGS"]) / "doomed-choices.log")
    seen: list[tuple[str | None, Any]] = []
    try:
        with httpx.stream("POST", doomed.base + "/v1/chat/completions", json=body, timeout=120) as cut:
            rid = cut.headers["x-request-id"]
            for event in sse(cut.iter_lines()):
                seen.append(event)
                if len(seen) >= 12:
                    doomed.proc.send_signal(signal.SIGKILL)
                    break
    except httpx.HTTPError:
        pass
    doomed.proc.wait(10)
    last_id = seen[-1][0]
    assert last_id is not None and len(last_id.split(".")) == 4  # three choices and the close
    first = texts(seen, {})
    assert first != reference

    headers = {"X-Request-Id": rid, "Last-Event-ID": last_id}
    with httpx.stream("POST", steady.base + "/v1/chat/completions", json=body, headers=headers, timeout=120) as rest:
        assert rest.status_code == 200
        events = list(sse(rest.iter_lines()))
    assert events[-1][1] == "[DONE]"
    assert texts(events, first) == reference


def test_a_resume_of_an_unknown_stream_is_a_404_in_the_protocol_shape(steady: Node) -> None:
    path, body = body_for("messages")
    reply = httpx.post(steady.base + path, json=body, headers={"X-Request-Id": "nope", "Last-Event-ID": "3"}, timeout=30)
    assert reply.status_code == 404 and reply.json()["type"] == "error"
    bad = httpx.post(steady.base + path, json=body, headers={"X-Request-Id": "nope", "Last-Event-ID": "x"}, timeout=30)
    assert bad.status_code == 400 and "Last-Event-ID" in bad.json()["error"]["message"]


def test_background_responses_poll_replay_from_starting_after_byte_for_byte_and_cancel(steady: Node) -> None:
    with openai.OpenAI(base_url=f"{steady.base}/v1", api_key="x", max_retries=0, timeout=120) as client:
        made = client.responses.create(model="m", input=PROMPT, max_output_tokens=MAX_TOKENS, temperature=0, background=True)
        assert made.status in ("queued", "in_progress") and made.background
        done = wait_for("the background response", lambda: (r := client.responses.retrieve(made.id)).status not in ("queued", "in_progress") and r, timeout=120)
        assert done.status in ("completed", "incomplete") and done.output_text  # type: ignore[attr-defined]

        def raw(after: int) -> bytes:
            with httpx.stream("GET", f"{steady.base}/v1/responses/{made.id}", params={"stream": "true", "starting_after": after}, timeout=60) as reply:
                return reply.read()

        whole = raw(-1)
        cut = whole.split(b"\n\n")
        tail = raw(4)
        assert tail == b"\n\n".join(cut[5:]) and tail.startswith(b"id: 5\n")
        with client.responses.retrieve(made.id, stream=True, starting_after=2) as stream:
            numbers = [event.sequence_number for event in stream]
        assert numbers[0] == 3 and numbers == list(range(3, 3 + len(numbers)))

        long = client.responses.create(model="m", input="Write a very long story.", max_output_tokens=3000, background=True, extra_body={"ignore_eos": True})
        wait_for("the long response to start", lambda: client.responses.retrieve(long.id).status == "in_progress", timeout=60)
        cancelled = client.responses.cancel(long.id)
        assert cancelled.status == "cancelled"
        assert client.responses.retrieve(long.id).status == "cancelled"
        foreground = client.responses.create(model="m", input=PROMPT, max_output_tokens=4)
        with pytest.raises(openai.BadRequestError):
            client.responses.cancel(foreground.id)  # only background responses can be cancelled


def test_met_api_alone_drains_on_sigterm_unready_first_while_its_open_streams_finish(env: dict[str, str]) -> None:
    """Streams and non-streamed requests alike: a non-streamed request still generating well past
    uvicorn's 5 s shutdown grace gets its whole answer (before: only SSE streams were waited for)."""
    node = Node({**env, "MET_DRAIN_TIMEOUT": "300"}, Path(env["_LOGS"]) / "draining.log")  # no ceiling on a slow machine
    path, body = body_for("chat")
    long_body = {**body, "stream": False, "max_tokens": 300, "ignore_eos": True}  # ends >5 s after the stream on a CPU
    answered: dict[str, httpx.Response] = {}
    waiting = threading.Thread(target=lambda: answered.setdefault("r", httpx.post(node.base + path, json=long_body, timeout=180)))
    waiting.start()
    time.sleep(1.0)  # it is in flight (admitted, generating) before the SIGTERM below
    with httpx.stream("POST", node.base + path, json=body, timeout=120) as stream:
        events = sse(stream.iter_lines())
        next(events)
        node.proc.send_signal(signal.SIGTERM)
        wait_for("/ready to turn 503", lambda: httpx.get(f"{node.base}/ready", timeout=2).status_code == 503, timeout=10)
        rest = list(events)
    assert rest and rest[-1][1] == "[DONE]"
    finish = [d for _id, d in rest if isinstance(d, dict) and d.get("choices") and d["choices"][0].get("finish_reason")]
    assert finish and finish[-1]["choices"][0]["finish_reason"] in ("stop", "length")  # finished, not cut or cancelled
    waiting.join(180)
    assert answered["r"].status_code == 200 and answered["r"].json()["choices"][0]["finish_reason"] == "length"
    assert node.proc.wait(60) == 0
