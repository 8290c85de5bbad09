"""Batch jobs through a live server with the official SDKs: OpenAI Files + Batches, Anthropic Message
Batches, up-front validation, cancel, and a key seeing only its own batches.

The server runs in float32 so that a line's greedy or seeded result can be compared token for token
with the same request sent alone (in bf16, batch composition may flip a near-tie).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests import openresponses

from ..conftest import ROOT, LiveServer, start_server, stop_server, wait_for

pytestmark = pytest.mark.e2e

KEY, OTHER_KEY = "batch-key-1", "batch-key-2"
MAX_LINES = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(
        tmp_path_factory.mktemp("batches"),
        *("--workers", "1", "--dtype", "float32", "--batch-max-inflight", "32", "--max-file-mb", "1"),
        *("--api-key", KEY, "--api-key", OTHER_KEY),
        env={"MET_BATCH_MAX_LINES": str(MAX_LINES)},
    )
    yield live
    stop_server(live)


@pytest.fixture
def oai(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture
def claude(server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120) as client:
        yield client


def chat_body(i: int, *, seeded: bool = False, max_tokens: int = 6) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": f"Count from {i} to {i + 5}."}], "max_tokens": max_tokens}
    body.update({"temperature": 0.8, "seed": 1000 + i} if seeded else {"temperature": 0})
    return body


def jsonl(rows: list[Any]) -> io.BytesIO:
    return io.BytesIO("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows).encode())


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def wait_until(what: str, check: Callable[[], Any]) -> Any:
    return wait_for(what, check, timeout=240.0, interval=0.3)


def submit(oai: openai.OpenAI, rows: list[Any], endpoint: str = "/v1/chat/completions") -> Any:
    uploaded = oai.files.create(file=("input.jsonl", jsonl(rows)), purpose="batch")
    return oai.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h", metadata={"run": "test"})  # type: ignore[arg-type]  # a str, not the SDK's Literal


def finished(oai: openai.OpenAI, batch_id: str) -> Any:
    return wait_until("the batch to end", lambda: (b := oai.batches.retrieve(batch_id)).status in ("completed", "failed", "cancelled") and b)


def file_lines(oai: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [json.loads(x) for x in oai.files.content(file_id).text.splitlines()] if file_id else []


def test_a_200_line_openai_batch_completes_with_one_result_per_line_equal_to_the_request_sent_alone(oai: openai.OpenAI) -> None:
    rows = [line(f"req-{i}", chat_body(i, seeded=i % 5 == 0)) for i in range(200)]
    batch = submit(oai, rows)
    assert batch.status == "validating" and batch.request_counts.total == 200 and batch.metadata == {"run": "test"}
    done = finished(oai, batch.id)
    assert done.status == "completed" and done.error_file_id is None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (200, 200, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out = file_lines(oai, done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(200))
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in out)
    by_id = {r["custom_id"]: r["response"]["body"] for r in out}
    for i in range(0, 200, 8):  # 25 lines, greedy and seeded, against the interactive route
        alone = oai.chat.completions.create(**chat_body(i, seeded=i % 5 == 0))
        batched = by_id[f"req-{i}"]["choices"][0]
        assert batched["message"]["content"] == alone.choices[0].message.content, i
        assert batched["finish_reason"] == alone.choices[0].finish_reason
    assert oai.batches.list(limit=1).data[0].id == batch.id


def test_a_legacy_completions_batch_gives_each_line_the_body_the_route_gives_it_alone(oai: openai.OpenAI) -> None:
    url = "/v1/completions"
    bodies = [{"model": "m", "prompt": f"{i}, {i + 1}, {i + 2},", "max_tokens": 6, "temperature": 0, "echo": i % 2 == 0, "logprobs": 1} for i in range(6)]
    bad = [line("two-prompts", {"model": "m", "prompt": ["a", "b"]}, url), line("n2", {"model": "m", "prompt": "a", "n": 2}, url)]
    refused = submit(oai, [line(f"p{i}", b, url) for i, b in enumerate(bodies)] + bad, endpoint=url)
    assert refused.status == "failed" and [(e.line, e.param) for e in refused.errors.data] == [(7, "body.prompt"), (8, "body.n")]  # type: ignore[union-attr]
    done = finished(oai, submit(oai, [line(f"p{i}", b, url) for i, b in enumerate(bodies)], endpoint=url).id)
    assert done.status == "completed" and done.request_counts.completed == len(bodies)
    by_id = {r["custom_id"]: r["response"]["body"] for r in file_lines(oai, done.output_file_id)}
    for i, body in enumerate(bodies):
        alone = oai.completions.create(**body)
        got = by_id[f"p{i}"]
        assert got["object"] == "text_completion" and got["choices"][0]["text"] == alone.choices[0].text, i
        assert got["choices"][0]["logprobs"]["tokens"] == alone.choices[0].logprobs.tokens  # type: ignore[union-attr]
        assert alone.usage is not None and (got["usage"]["prompt_tokens"], got["usage"]["completion_tokens"]) == (alone.usage.prompt_tokens, alone.usage.completion_tokens)


def test_a_responses_batch_gives_each_line_a_whole_response_object_equal_to_the_route_alone(oai: openai.OpenAI) -> None:
    """Batch output lines carry Response objects as complete as the route's (every field of the Open
    Responses `ResponseResource`, checked against the vendored schema), with the same output."""
    url = "/v1/responses"
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": False}
    weather: Any = {"type": "function", "name": "get_weather", "description": "Current weather in a city.", "parameters": city}
    bodies: list[dict[str, Any]] = [
        {"model": "m", "input": "Name a color.", "max_output_tokens": 8, "temperature": 0, "prompt_cache_key": "k1", "safety_identifier": "u1"},
        {"model": "m", "input": "Write an essay about rivers.", "max_output_tokens": 3, "temperature": 0},  # incomplete
        {"model": "m", "input": "Weather in Paris, Rome and Oslo?", "tools": [weather], "tool_choice": "required", "max_tool_calls": 1, "max_output_tokens": 300, "temperature": 0},
    ]
    done = finished(oai, submit(oai, [line(f"r{i}", b, url) for i, b in enumerate(bodies)], endpoint=url).id)
    assert done.status == "completed" and done.request_counts.completed == len(bodies)
    by_id = {r["custom_id"]: r["response"]["body"] for r in file_lines(oai, done.output_file_id)}
    for i, body in enumerate(bodies):
        got = by_id[f"r{i}"]
        openresponses.check("ResponseResource", got, f"batch line r{i}")
        alone = oai.responses.create(**body, store=False)
        assert [o["type"] for o in got["output"]] == [o.type for o in alone.output], i
        assert (got["status"], got["max_tool_calls"], got["temperature"]) == (alone.status, alone.max_tool_calls, alone.temperature), i
        assert "".join(c["text"] for o in got["output"] if o["type"] == "message" for c in o["content"]) == alone.output_text, i
    assert by_id["r0"]["prompt_cache_key"] == "k1" and by_id["r0"]["safety_identifier"] == "u1"
    assert by_id["r1"]["status"] == "incomplete" and by_id["r1"]["completed_at"] is None
    assert by_id["r2"]["status"] == "completed" and by_id["r2"]["completed_at"] >= by_id["r2"]["created_at"]
    assert [o["type"] for o in by_id["r2"]["output"]] == ["function_call"]


def test_a_50_request_anthropic_message_batch_ends_with_results_equal_to_the_requests_sent_alone(claude: anthropic.Anthropic) -> None:
    params = [{"model": "m", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": f"Name the number {i}."}]} for i in range(50)]
    bad = {"model": "m", "messages": [{"role": "user", "content": "no max_tokens"}]}
    created = claude.messages.batches.create(requests=[*({"custom_id": f"m{i}", "params": p} for i, p in enumerate(params)), {"custom_id": "bad", "params": bad}])  # type: ignore[misc]
    assert created.processing_status == "in_progress" and created.request_counts.processing == 51
    ended = wait_until("the message batch to end", lambda: (b := claude.messages.batches.retrieve(created.id)).processing_status == "ended" and b)
    assert (ended.request_counts.succeeded, ended.request_counts.errored, ended.request_counts.processing) == (50, 1, 0)
    assert ended.results_url and ended.ended_at is not None
    results = {r.custom_id: r.result for r in claude.messages.batches.results(created.id)}
    assert len(results) == 51
    assert results["bad"].type == "errored" and "max_tokens" in json.dumps(results["bad"].model_dump())
    for i in range(0, 50, 5):
        sent = {k: v for k, v in params[i].items() if k != "temperature"}
        alone = claude.messages.create(**sent, extra_body={"temperature": 0})  # type: ignore[call-overload]
        got = results[f"m{i}"]
        assert got.type == "succeeded"
        assert got.message.content[0].text == alone.content[0].text  # type: ignore[union-attr]
    assert claude.messages.batches.delete(created.id).type == "message_batch_deleted"


def test_cancel_mid_batch_keeps_finished_lines_and_cancels_the_rest_with_consistent_counts(oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    batch = submit(oai, [line(f"c{i}", chat_body(i, max_tokens=40)) for i in range(120)])
    wait_until("some lines to finish", lambda: oai.batches.retrieve(batch.id).request_counts.completed >= 3)
    assert oai.batches.cancel(batch.id).status == "cancelling"
    done = finished(oai, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    kept, cancelled = file_lines(oai, done.output_file_id), file_lines(oai, done.error_file_id)
    assert len(kept) == done.request_counts.completed >= 3 and done.request_counts.failed == 0
    assert len(kept) + len(cancelled) == 120 and len({r["custom_id"] for r in kept + cancelled}) == 120
    assert cancelled and all(r["error"]["code"] == "batch_cancelled" for r in cancelled)
    # Anthropic: the same through message batches.
    reqs = [{"custom_id": f"a{i}", "params": {"model": "m", "max_tokens": 40, "messages": [{"role": "user", "content": f"Count to {i}."}]}} for i in range(80)]
    mb = claude.messages.batches.create(requests=reqs)  # type: ignore[arg-type]
    wait_until("a message to finish", lambda: claude.messages.batches.retrieve(mb.id).request_counts.succeeded >= 2)
    assert claude.messages.batches.cancel(mb.id).processing_status in ("canceling", "ended")
    ended = wait_until("the cancel to end", lambda: (b := claude.messages.batches.retrieve(mb.id)).processing_status == "ended" and b)
    counts = ended.request_counts
    results = list(claude.messages.batches.results(mb.id))
    assert counts.canceled > 0 and counts.succeeded >= 2 and counts.succeeded + counts.canceled + counts.errored == 80 == len(results)
    assert sum(r.result.type == "canceled" for r in results) == counts.canceled


BAD_LINES = [
    ("not json", "invalid_json_line", None),
    (line("", chat_body(1)), "missing_required_parameter", "custom_id"),
    ({**line("dup", chat_body(1)), "method": "GET"}, "invalid_method", "method"),
    (line("url", chat_body(1), url="/v1/responses"), "mismatched_url", "url"),
    (line("body", {"model": "m"}), "invalid_request", "body.messages"),
    (line("temp", {**chat_body(1), "temperature": 9}), "invalid_request", "body.temperature"),
]


def test_every_bad_line_fails_the_batch_with_an_error_naming_its_line_and_parameter(oai: openai.OpenAI, server: LiveServer) -> None:
    r = server.redis()
    queued_before = r.xlen("met:requests")
    rows: list[Any] = [line("ok", chat_body(1)), line("ok", chat_body(2))]  # line 2: duplicate custom_id
    rows += [bad for bad, _code, _param in BAD_LINES]
    batch = submit(oai, rows)
    assert batch.status == "failed" and batch.failed_at
    errors = [(e.line, e.code, e.param) for e in batch.errors.data]  # type: ignore[union-attr]
    expected = [(2, "duplicate_custom_id", "custom_id")] + [(n, code, param) for n, (_bad, code, param) in enumerate(BAD_LINES, start=3)]
    assert errors == expected
    assert r.xlen("met:requests") == queued_before  # nothing reached a worker


def test_bad_batch_parameters_get_openai_errors_naming_them(oai: openai.OpenAI, server: LiveServer) -> None:
    uploaded = oai.files.create(file=("in.jsonl", jsonl([line("a", chat_body(1))])), purpose="batch")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input_file_id": uploaded.id, "endpoint": "/v1/embeddings", "completion_window": "24h"}, "endpoint"),
        ({"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions", "completion_window": "1h"}, "completion_window"),
        ({"input_file_id": "file-missing", "endpoint": "/v1/chat/completions", "completion_window": "24h"}, "input_file_id"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            oai.batches.create(**body)
        assert err.value.body["param"] == param  # type: ignore[index]
    too_many = [line(f"x{i}", chat_body(i)) for i in range(MAX_LINES + 1)]
    refused = submit(oai, too_many)
    assert refused.status == "failed" and refused.errors.data[0].code == "too_many_lines"  # type: ignore[union-attr]
    with pytest.raises(openai.APIStatusError) as big:
        oai.files.create(file=("big.jsonl", io.BytesIO(b"x" * (2 * 2**20))), purpose="batch")
    assert big.value.status_code == 413 and big.value.body["param"] == "file"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as purpose:
        oai.files.create(file=("in.jsonl", jsonl([])), purpose="nonsense")  # type: ignore[arg-type]
    assert purpose.value.body["param"] == "purpose"  # type: ignore[index]


def test_bad_message_batches_get_anthropic_errors_naming_the_request(server: LiveServer) -> None:
    cases = [
        ({"requests": []}, "requests"),
        ({"requests": [{"custom_id": "a", "params": {}}, {"custom_id": "a", "params": {}}]}, "requests[1].custom_id"),
        ({"requests": [{"custom_id": "has space", "params": {}}]}, "requests[0].custom_id"),
        ({"requests": [{"custom_id": "a"}]}, "requests[0].params"),
    ]
    for body, param in cases:
        reply = httpx.post(f"{server.base_url}/v1/messages/batches", json=body, headers={"x-api-key": KEY}, timeout=30)
        assert reply.status_code == 400
        assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == "invalid_request_error"
        assert param in reply.json()["error"]["message"]


def test_a_key_sees_only_its_own_files_and_batches(oai: openai.OpenAI, server: LiveServer) -> None:
    batch = submit(oai, [line("own", chat_body(3))])
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=OTHER_KEY, max_retries=0) as other:
        with pytest.raises(openai.NotFoundError):
            other.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            other.files.retrieve(batch.input_file_id)
        assert batch.id not in [b.id for b in other.batches.list().data]
        assert batch.input_file_id not in [f.id for f in other.files.list().data]
    with anthropic.Anthropic(base_url=server.base_url, api_key=OTHER_KEY, max_retries=0) as other_claude, pytest.raises(anthropic.NotFoundError):
        other_claude.messages.batches.retrieve(batch.id)
    assert finished(oai, batch.id).status == "completed"
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0) as wrong, pytest.raises(openai.AuthenticationError):
        wrong.files.list()


def met_batch(server: LiveServer, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "cli.main", "batch", *args, "--url", server.base_url, "--api-key", KEY]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "160"})


def test_met_batch_submits_follows_and_fetches_both_kinds_of_batch_file(server: LiveServer, tmp_path: Path) -> None:
    openai_file, anthropic_file = tmp_path / "openai.jsonl", tmp_path / "anthropic.jsonl"
    openai_file.write_text("\n".join(json.dumps(line(f"cli-{i}", chat_body(i))) for i in range(6)))
    anthropic_file.write_text("\n".join(json.dumps({"custom_id": f"a-{i}", "params": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}}) for i in range(4)))
    for path, count in ((openai_file, 6), (anthropic_file, 4)):
        out = tmp_path / f"{path.stem}.results.jsonl"
        run = met_batch(server, "submit", str(path), "--wait", "-o", str(out))
        assert run.returncode == 0, run.stdout + run.stderr
        batch_id = run.stdout.split()[0]
        assert f"{count} result lines" in run.stdout
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(rows) == count and len({r["custom_id"] for r in rows}) == count
        shown = met_batch(server, "show", batch_id)
        assert shown.returncode == 0 and batch_id in shown.stdout
        again = tmp_path / "again.jsonl"
        assert met_batch(server, "results", batch_id, "-o", str(again)).returncode == 0
        assert sorted(again.read_text().splitlines()) == sorted(out.read_text().splitlines())
        piped = met_batch(server, "results", batch_id, "-o", "-")  # stdout: the lines; stderr: the count
        assert piped.returncode == 0 and sorted(piped.stdout.splitlines()) == sorted(out.read_text().splitlines()) and f"{count} result lines" in piped.stderr
        assert not (ROOT / "-").exists()
        assert batch_id in met_batch(server, "list").stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(line("x", {"model": "m"})))
    refused = met_batch(server, "submit", str(bad))
    assert refused.returncode == 1 and "line 1" in refused.stdout and "messages" in refused.stdout


def test_a_batch_past_its_window_expires_keeping_what_finished(oai: openai.OpenAI, server: LiveServer) -> None:
    batch = submit(oai, [line(f"e{i}", chat_body(i, max_tokens=40)) for i in range(80)])
    wait_until("a line to finish", lambda: oai.batches.retrieve(batch.id).request_counts.completed >= 1)
    r = server.redis()
    key = f"met:batch:{{{batch.id}}}:doc"
    doc = json.loads(r.get(key) or b"{}")
    r.set(key, json.dumps({**doc, "expires_at": int(time.time()) - 1}), keepttl=True)  # the 24 h window has passed
    done = wait_until("the batch to expire", lambda: (b := oai.batches.retrieve(batch.id)).status == "expired" and b)
    kept, expired = file_lines(oai, done.output_file_id), file_lines(oai, done.error_file_id)
    assert len(kept) == done.request_counts.completed >= 1 and len(kept) + len(expired) == 80
    assert {r["error"]["code"] for r in expired} == {"batch_expired"} and done.expired_at


def test_one_keys_forty_batches_never_take_another_keys_place_and_stay_within_the_batch_pool(oai: openai.OpenAI, server: LiveServer) -> None:
    """Batch lines have a pool of their own (--batch-max-queue 64, 32 a key): key A's 40 batches of 8 lines
    (320 lines, past the interactive queue limit of 256) hold at most 32 places of it, none of the
    interactive queue, and key B's chat request is admitted at once and answered while they run."""
    from shared import keys

    r = server.redis()
    batches = [submit(oai, [line(f"s{b}-{i}", chat_body(i, max_tokens=40)) for i in range(8)]).id for b in range(40)]
    wait_until("every batch to start", lambda: all(oai.batches.retrieve(b).status == "in_progress" for b in batches))
    wait_until("the dispatcher to have queued what it may", lambda: r.zcard(keys.INFLIGHT) + r.zcard(keys.INFLIGHT_BATCH) >= 32)
    queued = r.zcard(keys.INFLIGHT_BATCH)
    assert 0 < queued <= 32 and r.zcard(keys.INFLIGHT) == 0  # one key's share of the pool; no interactive place taken
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=OTHER_KEY, max_retries=0, timeout=120) as other:
        reply = other.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0)  # admitted: no 429
    assert reply.choices[0].message.content and reply.choices[0].finish_reason in ("stop", "length")
    assert sum(oai.batches.retrieve(b).request_counts.completed for b in batches) < 320  # the batches were still running beside it
    assert r.zcard(keys.INFLIGHT_BATCH) <= 32
    for b in batches:
        oai.batches.cancel(b)
    wait_until("every batch to end", lambda: all(oai.batches.retrieve(b).status == "cancelled" for b in batches))


def test_one_keys_cached_prompt_is_not_a_cache_hit_for_another_key(oai: openai.OpenAI, server: LiveServer) -> None:
    """With API keys, the prefix cache is salted per key (--cache-salt auto): a key's repeated prompt hits
    the cache, the same prompt from another key does not (so cached_tokens tells nothing of others)."""
    prompt = [{"role": "user", "content": "Describe the water cycle in detail, step by step, for a school report. " * 3}]
    first = oai.chat.completions.create(model="m", messages=prompt, max_tokens=2, temperature=0)  # type: ignore[arg-type]
    again = oai.chat.completions.create(model="m", messages=prompt, max_tokens=2, temperature=0)  # type: ignore[arg-type]
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=OTHER_KEY, max_retries=0, timeout=120) as other:
        theirs = other.chat.completions.create(model="m", messages=prompt, max_tokens=2, temperature=0)  # type: ignore[arg-type]
        salted = other.chat.completions.create(model="m", messages=prompt, max_tokens=2, temperature=0, extra_body={"cache_salt": "tenant-9"})  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError) as refused:
            other.chat.completions.create(model="m", messages=prompt, max_tokens=2, extra_body={"cache_salt": 7})  # type: ignore[arg-type]
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, again, theirs, salted)]  # type: ignore[union-attr]
    # The other key may hit its own cached template head (its earlier requests in this module), never this
    # key's blocks of the prompt; a fresh salt hits nothing.
    assert cached[1] >= 32 and cached[2] < 32 and cached[2] < cached[1] and cached[3] == 0, cached
    assert refused.value.body["param"] == "cache_salt"  # type: ignore[index]
