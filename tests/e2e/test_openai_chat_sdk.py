"""The official `openai` SDK against a live `met serve` (real Redis, real SmolLM2-135M-Instruct)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from shared import keys
from shared.codec import decode_delta, decode_request
from shared.deltas import Content, Finish, FinishReason

from ..conftest import LiveServer

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Asked so, the float32 model's greedy answer names Paris by a margin of 1.45 logits at its closest token;
# "What is the capital of France?" does by 0.098 ("The" 25.36 over "L" 25.26): which one a bf16 model
# picks there is a matter of its GEMMs' summation order (session 12), not of the server.
NAME_IT = [{"role": "user", "content": "Name the capital of France."}]


@pytest.fixture
def api(live_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def test_non_streaming_greedy_answer_mentions_paris(live_server: LiveServer, api: openai.OpenAI) -> None:
    reply = api.chat.completions.create(model="SmolLM2-135M-Instruct", messages=NAME_IT, temperature=0, max_tokens=30)  # type: ignore[arg-type]
    assert reply.object == "chat.completion"
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.prompt_tokens > 10
    assert reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_stream_concatenates_to_the_non_streaming_text_for_the_same_seed(live_server: LiveServer, api: openai.OpenAI) -> None:
    prompt = [{"role": "user", "content": "Tell me a short story about a cat."}]
    common = {"model": "m", "messages": prompt, "temperature": 0.9, "seed": 1234, "max_tokens": 40}
    whole = api.chat.completions.create(**common)  # type: ignore[call-overload]
    chunks = list(api.chat.completions.create(**common, stream=True, stream_options={"include_usage": True}))  # type: ignore[call-overload]
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])


def test_continue_final_message_extends_the_assistant_text_where_it_stopped(live_server: LiveServer, api: openai.OpenAI) -> None:
    """vLLM's `continue_final_message`: the first 6 greedy tokens sent back as an open assistant message
    continue into exactly the 12-token greedy answer (the prompt ends inside the message, not after it)."""
    prompt = [{"role": "user", "content": "Tell me a short story about a cat."}]
    whole = api.chat.completions.create(model="m", messages=prompt, temperature=0, max_tokens=12)  # type: ignore[arg-type]
    head = api.chat.completions.create(model="m", messages=prompt, temperature=0, max_tokens=6)  # type: ignore[arg-type]
    head_text = head.choices[0].message.content or ""
    assert head.choices[0].finish_reason == "length" and head_text
    opened = [*prompt, {"role": "assistant", "content": head_text}]
    extend = {"continue_final_message": True, "add_generation_prompt": False}
    rest = api.chat.completions.create(model="m", messages=opened, temperature=0, max_tokens=6, extra_body=extend)  # type: ignore[arg-type]
    assert head_text + (rest.choices[0].message.content or "") == whole.choices[0].message.content
    assert rest.usage is not None and head.usage is not None and rest.usage.prompt_tokens == head.usage.prompt_tokens + 6
    streamed = api.chat.completions.create(model="m", messages=opened, temperature=0, max_tokens=6, extra_body=extend, stream=True)  # type: ignore[call-overload]
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == rest.choices[0].message.content
    # Without it the same messages open a new assistant turn: a different continuation.
    fresh = api.chat.completions.create(model="m", messages=opened, temperature=0, max_tokens=6)  # type: ignore[arg-type]
    assert fresh.usage is not None and fresh.usage.prompt_tokens > rest.usage.prompt_tokens
    for bad, param in (({"continue_final_message": True}, "continue_final_message"), ({"add_generation_prompt": "no"}, "add_generation_prompt")):
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(model="m", messages=opened, max_tokens=6, extra_body=bad)  # type: ignore[arg-type]
        assert refused.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="m", messages=prompt, max_tokens=6, extra_body=extend)  # type: ignore[arg-type]
    assert "last message" in refused.value.message


def test_a_stream_of_n_choices_carries_each_choice_as_the_non_streaming_request_does(live_server: LiveServer, api: openai.OpenAI) -> None:
    """n > 1 streamed: every choice under its index in one stream, the SDK's accumulator rebuilds them,
    and each equals the same choice of the same request without streaming (choice i samples with seed+i)."""
    common = {"model": "m", "messages": [{"role": "user", "content": "Tell me a short story about a cat."}], "temperature": 0.9, "seed": 77, "max_tokens": 24, "n": 3}
    whole = api.chat.completions.create(**common)  # type: ignore[call-overload]
    with api.chat.completions.stream(**common, stream_options={"include_usage": True}) as stream:  # type: ignore[call-overload]
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        snapshot = stream.current_completion_snapshot
    assert [c.choices[0].index for c in chunks[:3]] == [0, 1, 2]  # every choice's role chunk first
    assert len({c.id for c in chunks}) == 1 and chunks[-1].choices == [] and chunks[-1].usage is not None
    assert [(c.index, c.message.content, c.finish_reason) for c in snapshot.choices] == [
        (c.index, c.message.content, c.finish_reason) for c in whole.choices
    ]
    assert len({c.message.content for c in whole.choices}) > 1  # the choices are sampled apart
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore[union-attr]


def test_a_different_seed_changes_the_sampled_text(live_server: LiveServer, api: openai.OpenAI) -> None:
    prompt = [{"role": "user", "content": "Tell me a short story about a cat."}]
    texts = {
        api.chat.completions.create(model="m", messages=prompt, temperature=1.0, seed=s, max_tokens=30).choices[0].message.content  # type: ignore[arg-type]
        for s in (1, 2, 3)
    }
    assert len(texts) > 1


def test_eight_concurrent_streams_complete_and_the_worker_batched_them(live_server: LiveServer) -> None:
    async def one(api: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        stream = await api.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": f"Count from {i} to {i + 20}."}],
            max_tokens=48,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, rid = "", ""
        async for chunk in stream:
            rid = chunk.id.removeprefix("chatcmpl-")
            text += "".join(c.delta.content or "" for c in chunk.choices)
        return rid, text

    async def all_of_them() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as api:
            return await asyncio.gather(*(one(api, i) for i in range(8)))

    results = asyncio.run(all_of_them())
    assert len(results) == 8 and all(text for _rid, text in results)
    r = live_server.redis()
    batch = [int(r.hget(keys.request_meta(rid), "batch_max") or 0) for rid, _ in results]
    assert max(batch) >= 4, batch  # requests decoded together, not one after another


def test_disconnecting_mid_stream_cancels_generation(live_server: LiveServer) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Write a very long story about dragons."}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{live_server.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        rid = response.headers["x-request-id"]
        lines = response.iter_lines()
        for _ in range(10):
            next(lines)
    r = live_server.redis()
    deadline = time.monotonic() + 30
    while r.hget(keys.request_meta(rid), "outcome") is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.hget(keys.request_meta(rid), "outcome") == b"cancelled"
    events = [decode_delta(fields[b"d"]) for _id, fields in r.xrange(keys.delta_stream(rid))]
    final = events[-1]
    assert isinstance(final, Finish) and final.reason is FinishReason.CANCELLED
    assert final.usage.completion_tokens < 500  # stopped well before max_tokens


def test_the_request_and_its_deltas_are_in_redis_under_the_documented_keys(live_server: LiveServer, api: openai.OpenAI) -> None:
    reply = api.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=20)  # type: ignore[arg-type]
    rid = reply.id.removeprefix("chatcmpl-")
    r = live_server.redis()
    entries = [fields for _id, fields in r.xrange(keys.REQUEST_STREAM) if fields[b"id"].decode() == rid]
    assert len(entries) == 1
    request = decode_request(entries[0][b"req"])
    assert request.messages[0].text == QUESTION[0]["content"] and request.prompt_token_ids
    events = [decode_delta(fields[b"d"]) for _id, fields in r.xrange(keys.delta_stream(rid))]
    assert isinstance(events[-1], Finish) and sum(isinstance(e, Finish) for e in events) == 1
    assert "".join(e.text for e in events if isinstance(e, Content)) == reply.choices[0].message.content
    assert all(e.attempt == 1 for e in events)
    generated = [t for e in events for t in e.token_ids]  # type: ignore[union-attr]
    assert len(generated) == reply.usage.completion_tokens  # type: ignore[union-attr]
    assert r.hget(keys.request_meta(rid), "status") == b"finished"
    # The client `met top` shows: the peer address and the SDK's own product token from its User-Agent.
    assert r.hget(keys.request_meta(rid), "client") == b"127.0.0.1 OpenAI/Python"
    assert events[0].cached_tokens is not None  # type: ignore[union-attr]  # the first delta carries the prefix-cache count
    for key in (keys.delta_stream(rid), keys.request_meta(rid)):
        assert 0 < r.ttl(key) <= 86400
    pending = r.xpending(keys.REQUEST_STREAM, keys.WORKER_GROUP)
    assert pending["pending"] == 0 or rid not in str(pending)


def test_models_health_and_ready(live_server: LiveServer, api: openai.OpenAI) -> None:
    models = api.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    assert httpx.get(f"{live_server.base_url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{live_server.base_url}/ready").json()
    assert ready["status"] == "ready" and ready["workers"] == 1


def test_the_worker_prints_its_kv_pool_sized_by_default_from_free_memory_and_reports_the_same_size(live_server: LiveServer) -> None:
    printed = re.search(r"KV cache: (\d+) blocks x 16 tokens = (\d+) tokens \((\d+) MiB, default: a share of free memory\)", live_server.log())
    assert printed is not None, "no KV pool line in the server's log"
    blocks, tokens = int(printed[1]), int(printed[2])
    assert tokens == blocks * 16 and tokens > 8192  # the default budget holds more than one full context
    with live_server.redis() as r:
        infos = [r.hgetall(k) for k in r.scan_iter(keys.worker_info("*"))]
    assert [int(i[b"kv_blocks"]) for i in infos] == [blocks]
