"""The gateway's Done-when list as plain functions, run against any upstream: our own `met serve`
(tests/e2e/test_gateway.py, main suite) and llama.cpp's server (tests/e2e/test_gateway_llamacpp.py,
`./dev test-gateway`). Each takes the gateway (a `met serve --upstream …`) and, where it kills the
upstream, an `UpstreamProcess` that can be killed and started again on the same port."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anthropic
import httpx
import openai
from typer.testing import CliRunner

from cli.main import app

from ..conftest import LiveServer, wait_for

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0.0}
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
STOP_PROMPT = "Say hello."  # both upstreams' greedy answers have a "." early
LONG = "Write a very long, detailed essay about the history of Paris, with many sections."


class UpstreamProcess(Protocol):
    url: str  # the base URL the gateway was given (…/v1)

    def kill(self) -> None: ...
    def restart(self) -> None: ...


def oai(gateway: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def claude(gateway: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=300)


# ---- the three protocols, streaming and not ---------------------------------------------------


def check_openai_chat(gateway: LiveServer) -> None:
    with oai(gateway) as client:
        cut = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris."}], max_tokens=8, **GREEDY)  # type: ignore[arg-type]
        assert cut.choices[0].finish_reason == "length" and cut.usage is not None and cut.usage.completion_tokens == 8
        assert cut.choices[0].message.content
        with client.chat.completions.stream(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=200, stream_options={"include_usage": True}, **GREEDY  # type: ignore[arg-type]
        ) as stream:
            final = stream.get_final_completion()
        assert final.choices[0].finish_reason == "stop" and final.choices[0].message.content
        assert final.usage is not None and final.usage.prompt_tokens > 0 and final.usage.completion_tokens > 0
        stopped = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": STOP_PROMPT}], max_tokens=60, stop=["."], **GREEDY)  # type: ignore[arg-type]
        text = stopped.choices[0].message.content or ""
        assert stopped.choices[0].finish_reason == "stop" and text and "." not in text, text


def check_openai_chat_forced_tool_call(gateway: LiveServer) -> None:
    with oai(gateway) as client:
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [{"type": "function", "function": WEATHER}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 60,
            **GREEDY,
        }
        answer = client.chat.completions.create(**kwargs)
        [call] = answer.choices[0].message.tool_calls or []
        assert answer.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"  # type: ignore[union-attr]
        assert isinstance(json.loads(call.function.arguments), dict)  # type: ignore[union-attr]
        with client.chat.completions.stream(**kwargs) as stream:
            final = stream.get_final_completion()
        [streamed] = final.choices[0].message.tool_calls or []
        assert final.choices[0].finish_reason == "tool_calls" and streamed.function.name == "get_weather"  # type: ignore[union-attr]
        assert isinstance(json.loads(streamed.function.arguments), dict)  # type: ignore[union-attr]


def check_anthropic_messages(gateway: LiveServer, *, upstream_names_the_stop: bool) -> None:
    with claude(gateway) as client:
        cut = client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Tell me about Paris."}], extra_body=GREEDY)
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 8 and cut.content[0].type == "text"
        with client.messages.stream(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "Say hello."}], extra_body=GREEDY) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == "end_turn" and final.content[0].type == "text" and final.content[0].text
        assert final.usage.output_tokens > 0
        with client.messages.stream(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": STOP_PROMPT}], stop_sequences=["."], extra_body=GREEDY) as stream:
            stopped = stream.get_final_message()
        text = stopped.content[0].text if stopped.content and stopped.content[0].type == "text" else ""
        assert text and "." not in text, text
        if upstream_names_the_stop:  # vLLM's `stop_reason` (Metrale sends it too): Anthropic's stop_sequence
            assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "."), stopped
        else:  # llama.cpp does not say which stop matched: end_turn, the text cut before it
            assert stopped.stop_reason == "end_turn", stopped
        tools: Any = [{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}]
        with client.messages.stream(
            model=MODEL,
            max_tokens=60,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=tools,
            tool_choice={"type": "tool", "name": "get_weather"},
            extra_body=GREEDY,
        ) as stream:
            called = stream.get_final_message()
        uses = [b for b in called.content if b.type == "tool_use"]
        assert called.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather" and isinstance(uses[0].input, dict)


def check_openai_responses(gateway: LiveServer) -> None:
    with oai(gateway) as client:
        cut = client.responses.create(model=MODEL, input="Tell me about Paris.", max_output_tokens=8, **GREEDY)  # type: ignore[arg-type]
        assert cut.status == "incomplete" and cut.usage is not None and cut.usage.output_tokens == 8 and cut.output_text
        with client.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=200, **GREEDY) as stream:  # type: ignore[arg-type]
            final = stream.get_final_response()
        assert final.status == "completed" and final.output_text and final.usage is not None and final.usage.output_tokens > 0
        tools: Any = [{"type": "function", **WEATHER}]
        with client.responses.stream(
            model=MODEL, input="What is the weather in Paris?", tools=tools, tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60, **GREEDY  # type: ignore[arg-type]
        ) as stream:
            called = stream.get_final_response()
        calls = [item for item in called.output if item.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments), dict)


# ---- raw streams: exactly one error event --------------------------------------------------------


@dataclass
class RawStream:
    """A streaming request read raw in a thread, so a test can act mid-stream."""

    gateway: LiveServer
    path: str
    body: dict[str, Any]
    events: list[tuple[str, str]] = field(default_factory=list)  # (event name, data)
    started: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    failure: BaseException | None = None

    def start(self) -> RawStream:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        try:
            with httpx.stream("POST", self.gateway.base_url + self.path, json=self.body, timeout=300) as response:
                assert response.status_code == 200, response.read()
                name = ""
                for line in response.iter_lines():
                    if line.startswith("event: "):
                        name = line.removeprefix("event: ")
                    elif line.startswith("data: "):
                        self.events.append((name, line.removeprefix("data: ")))
                        name = ""
                        if '"delta"' in line and ("text" in line or "content" in line):
                            self.started.set()
        except BaseException as exc:  # reported by join()
            self.failure = exc
        finally:
            self.started.set()

    def join(self, timeout: float = 120.0) -> list[tuple[str, str]]:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.failure is None, self.failure
        return self.events


def long_streams(gateway: LiveServer) -> dict[str, RawStream]:
    """One long streaming request per protocol."""
    user = [{"role": "user", "content": LONG}]
    return {
        "openai_chat": RawStream(gateway, "/v1/chat/completions", {"model": MODEL, "messages": user, "max_tokens": 1500, "stream": True, **GREEDY}),
        "anthropic_messages": RawStream(gateway, "/v1/messages", {"model": MODEL, "messages": user, "max_tokens": 1500, "stream": True, **GREEDY}),
        "openai_responses": RawStream(gateway, "/v1/responses", {"model": MODEL, "input": LONG, "max_output_tokens": 1500, "stream": True, **GREEDY}),
    }


def assert_one_error(protocol: str, events: list[tuple[str, str]]) -> None:
    """Exactly one error event, in the protocol's own shape, and it is the last one (then `[DONE]` for chat)."""
    if protocol == "openai_chat":
        assert events[-1][1] == "[DONE]", events[-3:]
        payloads = [json.loads(data) for _, data in events[:-1]]
        errors = [p for p in payloads if "error" in p]
        assert len(errors) == 1 and payloads[-1] is errors[0] and errors[0]["error"]["message"], payloads[-3:]
        assert not any(p.get("choices") and p["choices"][0].get("finish_reason") for p in payloads), "a finish besides the error"
    elif protocol == "anthropic_messages":
        names = [name for name, _ in events]
        assert names.count("error") == 1 and names[-1] == "error", names[-5:]
        error = json.loads(events[-1][1])
        assert error["type"] == "error" and error["error"]["type"] and error["error"]["message"]
        assert "message_stop" not in names
    else:
        types = [json.loads(data)["type"] for _, data in events]
        terminals = [t for t in types if t in ("response.completed", "response.incomplete", "response.failed")]
        # The encoder's failure: one `error` event, then the one terminal, `response.failed`.
        assert terminals == ["response.failed"] and types.count("error") == 1 and types[-2:] == ["error", "response.failed"], types[-5:]
        assert json.loads(events[-1][1])["response"]["error"]["message"]


def content_before_error(protocol: str, events: list[tuple[str, str]]) -> str:
    """The text the client got before the error (to check nothing came twice)."""
    out = []
    for name, data in events:
        if data == "[DONE]":
            continue
        payload = json.loads(data)
        if protocol == "openai_chat" and payload.get("choices"):
            out.append(payload["choices"][0]["delta"].get("content") or "")
        elif protocol == "anthropic_messages" and name == "content_block_delta":
            out.append(payload["delta"].get("text", ""))
        elif protocol == "openai_responses" and payload["type"] == "response.output_text.delta":
            out.append(payload["delta"])
    return "".join(out)




def ready(gateway: LiveServer) -> httpx.Response:
    return httpx.get(gateway.base_url + "/ready", timeout=5)


def check_upstream_killed_mid_stream(gateway: LiveServer, upstream: UpstreamProcess, *, all_at_once: bool = True) -> None:
    """Kill the upstream while a stream of each protocol runs: each client gets exactly one error event in its
    shape; /ready turns 503 (upstream unhealthy), /metrics shows it, a request meanwhile fails after
    --upstream-timeout; after the upstream restarts, requests succeed. `all_at_once` False: one protocol per kill,
    for an upstream that runs one request at a time (llama-cpp-python's server)."""
    streams = long_streams(gateway)
    rounds = [list(streams)] if all_at_once else [[protocol] for protocol in streams]
    for i, protocols in enumerate(rounds):
        for protocol in protocols:
            streams[protocol].start()
        for protocol in protocols:
            assert streams[protocol].started.wait(180), f"{protocol}: no content before the kill"
        upstream.kill()
        for protocol in protocols:
            assert_one_error(protocol, streams[protocol].join())
        if i == 0:
            check_upstream_down(gateway)
        upstream.restart()
        wait_for("/ready after the upstream restarted", lambda: ready(gateway).status_code == 200, timeout=60, interval=0.25)
        check_each_protocol_answers(gateway)


def check_upstream_down(gateway: LiveServer) -> None:
    wait_for("/ready to report the upstream down", lambda: ready(gateway).status_code == 503, timeout=60, interval=0.25)
    body = ready(gateway).json()
    assert body["status"] == "upstream_unhealthy" and body["gateways"] and not body["gateways"][0]["healthy"]
    assert re.search(r"^met_upstream_healthy\{.*\} 0\.0$", httpx.get(gateway.base_url + "/metrics", timeout=10).text, re.MULTILINE)
    # A request while the upstream is down waits --upstream-timeout for it, then fails with one error.
    try:
        with oai(gateway) as client:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        raise AssertionError("a request succeeded with the upstream down")
    except openai.APIStatusError as exc:
        assert "upstream is unavailable" in str(exc), exc


def check_each_protocol_answers(gateway: LiveServer) -> None:
    with oai(gateway) as client:
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5, **GREEDY)  # type: ignore[arg-type]
        assert chat.choices[0].message.content
        with claude(gateway) as messages:
            message = messages.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Say hi."}], extra_body=GREEDY)
        assert message.content[0].type == "text" and message.content[0].text
        assert client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=5, **GREEDY).output_text  # type: ignore[arg-type]


def check_health_is_shown(gateway: LiveServer, upstream: UpstreamProcess) -> None:
    """/ready and /metrics list the gateway worker with its upstream, healthy; so does `met top`'s snapshot."""
    import asyncio

    from redis.asyncio import Redis

    from cli.top_snapshot import take_snapshot

    body = ready(gateway).json()
    assert body["status"] == "ready" and [g["upstream"] for g in body["gateways"]] == [upstream.url] and body["gateways"][0]["healthy"]
    metrics = httpx.get(gateway.base_url + "/metrics", timeout=10).text
    assert re.search(rf'^met_upstream_healthy\{{upstream="{re.escape(upstream.url)}",worker="[^"]+"\}} 1\.0$', metrics, re.MULTILINE), metrics

    async def snapshot() -> Any:
        redis = Redis.from_url(gateway.redis_url)
        try:
            return await take_snapshot(redis, heartbeat_ttl=10)
        finally:
            await redis.aclose()

    [worker] = asyncio.run(snapshot()).workers
    assert worker.upstream == upstream.url and worker.upstream_healthy and worker.device == "upstream"


def check_dump_and_encode_only(gateway: LiveServer, tmp_path: Path) -> None:
    """A gateway request's dump re-encodes (`met replay --encode-only`) into the bytes its client received."""
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12, "stream": True, **GREEDY}
    with httpx.stream("POST", gateway.base_url + "/v1/chat/completions", json=payload, timeout=120) as response:
        received = response.read()
        request_id = response.headers["x-request-id"]
    runner = CliRunner()
    exported, encoded = tmp_path / "gateway.jsonl", tmp_path / "gateway.sse"
    result = runner.invoke(app, ["dump", "export", request_id, "-o", str(exported), "--redis-url", gateway.redis_url])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["replay", "--encode-only", "--protocol", "openai", str(exported), "-o", str(encoded)])
    assert result.exit_code == 0, result.output
    blocks = [b for b in received.split(b"\n\n") if b and not b.startswith(b"event: ping\n") and b != b": ping"]
    assert encoded.read_bytes() == b"".join(b + b"\n\n" for b in blocks)
    result = runner.invoke(app, ["replay", "--encode-only", "--protocol", "anthropic", str(exported), "-o", str(tmp_path / "as_anthropic.sse")])
    assert result.exit_code == 0 and b"event: message_stop" in (tmp_path / "as_anthropic.sse").read_bytes()


def check_refused_before_any_sse_header(gateway: LiveServer) -> None:
    """What the upstream's chat API cannot express gets the protocol's own 400 naming the parameter."""
    chat = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "regex": "[0-9]+"},
        timeout=30,
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "regex", chat.text
    msg = httpx.post(
        gateway.base_url + "/v1/messages",
        json={"model": MODEL, "max_tokens": 2048, "stream": True, "thinking": {"type": "enabled", "budget_tokens": 1024}, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert msg.status_code == 400 and msg.json()["type"] == "error" and "thinking.budget_tokens" in msg.text, msg.text
    completions = httpx.post(gateway.base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
    assert completions.status_code == 400 and completions.json()["error"]["param"] == "prompt", completions.text


def check_gateway_worker_killed_mid_stream(gateway: LiveServer) -> None:
    """kill -9 of the gateway worker mid-stream, without `--upstream-continue`: the reclaimed
    request ends with exactly one Error after the text already sent (nothing twice); the next request works."""
    import os
    import signal

    import redis as redis_sync

    from shared import keys

    stream = RawStream(gateway, "/v1/chat/completions", long_streams(gateway)["openai_chat"].body).start()
    assert stream.started.wait(180), "no content before the kill"
    with redis_sync.Redis.from_url(gateway.redis_url) as client:
        [worker] = [w.decode() for w in client.zrange(keys.WORKERS_ALIVE, 0, -1)]
        pid = int(client.hget(keys.worker_info(worker), "pid") or 0)
        sent_before = content_before_error("openai_chat", list(stream.events))
        os.kill(pid, signal.SIGKILL)
        events = stream.join(timeout=180)
        assert_one_error("openai_chat", events)
        assert content_before_error("openai_chat", events).startswith(sent_before)
        request_ids = {json.loads(d)["id"] for _, d in events if d != "[DONE]" and "id" in json.loads(d)}
        assert len(request_ids) == 1
        wait_for("a new gateway worker", lambda: ready(gateway).status_code == 200, timeout=120, interval=0.25)
        check_each_protocol_answers(gateway)


def check_gateway_worker_killed_mid_stream_continues(gateway: LiveServer, upstream_url: str, upstream_key: str) -> None:
    """kill -9 of the gateway worker mid-stream, with `--upstream-continue`: the reclaimed request goes on
    where it stopped. The client's one stream ends normally (no error, one finish, one id); its text is
    what the dead worker wrote, then exactly what the upstream answers when that text is sent back as an
    open assistant message (`continue_final_message`, greedy); usage counts both parts."""
    import os
    import signal

    import redis as redis_sync

    from shared import keys
    from shared.codec import decode_delta
    from shared.deltas import Content, Finish

    user = [{"role": "user", "content": LONG}]
    body = {"model": MODEL, "messages": user, "max_tokens": 160, "stream": True, "stream_options": {"include_usage": True}, **GREEDY}
    stream = RawStream(gateway, "/v1/chat/completions", body).start()
    assert stream.started.wait(180), "no content before the kill"
    with redis_sync.Redis.from_url(gateway.redis_url) as client:
        [worker] = [w.decode() for w in client.zrange(keys.WORKERS_ALIVE, 0, -1)]
        os.kill(int(client.hget(keys.worker_info(worker), "pid") or 0), signal.SIGKILL)
        events = stream.join(timeout=240)
        assert events[-1][1] == "[DONE]"
        payloads = [json.loads(data) for _, data in events[:-1]]
        assert not [p for p in payloads if "error" in p], payloads[-3:]
        finishes = [c["finish_reason"] for p in payloads for c in p.get("choices", []) if c.get("finish_reason")]
        assert finishes == ["length"] and len({p["id"] for p in payloads}) == 1
        text = content_before_error("openai_chat", events)
        rid = payloads[0]["id"].removeprefix("chatcmpl-")
        deltas = [decode_delta(fields[b"d"]) for _, fields in client.xrange(keys.delta_stream(rid))]
        written = {attempt: "".join(d.text for d in deltas if isinstance(d, Content) and d.attempt == attempt) for attempt in (1, 2)}
        assert written[1] and written[2] and text == written[1] + written[2], written
        assert max(d.attempt for d in deltas) == 2
        extend = {"continue_final_message": True, "add_generation_prompt": False}
        opened = [*user, {"role": "assistant", "content": written[1]}]
        with openai.OpenAI(base_url=upstream_url, api_key=upstream_key, max_retries=0, timeout=120) as direct:
            rest = direct.chat.completions.create(model=MODEL, messages=opened, max_tokens=160, extra_body=extend, **GREEDY)  # type: ignore[arg-type, call-overload]
        assert (rest.choices[0].message.content or "").startswith(written[2])
        usage = payloads[-1]["usage"]
        [finish] = [d for d in deltas if isinstance(d, Finish)]
        assert usage["completion_tokens"] == finish.usage.completion_tokens == 160 and usage["prompt_tokens"] == len(_prompt_ids(gateway, user))
        wait_for("a new gateway worker", lambda: ready(gateway).status_code == 200, timeout=120, interval=0.25)


def _prompt_ids(gateway: LiveServer, messages: list[dict[str, str]]) -> list[int]:
    tokens: list[int] = httpx.post(gateway.base_url + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    return tokens


def check_client_disconnect_closes_the_upstream_request(gateway: LiveServer, upstream_server: LiveServer) -> None:
    """A streaming client that goes away cancels its request; the gateway worker closes the upstream request,
    which the upstream (our own met serve here) records as cancelled."""
    from shared import keys

    payload = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 1500, "stream": True, **GREEDY}
    before = set(upstream_server.redis().zrange(keys.REQUEST_INDEX, 0, -1))
    with httpx.stream("POST", gateway.base_url + "/v1/chat/completions", json=payload, timeout=120) as response:
        for line in response.iter_lines():
            if '"content"' in line:
                break  # leave mid-stream
    upstream_ids: list[bytes] = []

    def upstream_cancelled() -> bool:
        upstream_ids[:] = [rid for rid in upstream_server.redis().zrange(keys.REQUEST_INDEX, 0, -1) if rid not in before]
        outcomes = [upstream_server.redis().hget(keys.request_meta(rid.decode()), "outcome") for rid in upstream_ids]
        return outcomes == [b"cancelled"]

    wait_for("the upstream to record its request as cancelled", upstream_cancelled, timeout=120, interval=0.25)
