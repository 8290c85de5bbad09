"""LoRA adapters through a live `met serve` with the official SDKs: one registered with `--lora`, one loaded,
used, unloaded and loaded again through vLLM's endpoints; every protocol selects an adapter by its `model`
name, streamed and not; an unknown adapter is a 404 in the protocol's shape, a bad folder a 400 naming the
file; /v1/models lists adapters with their base as parent; /metrics counts requests per adapter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from ..conftest import LiveServer, start_server, stop_server

pytestmark = pytest.mark.e2e

BASE = "SmolLM2-135M-Instruct"
POEM = "Write a short poem about the sea."
TOKENS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_adapters: dict[str, Path]) -> Iterator[LiveServer]:
    flags = ("--lora", f"support-bot={default_adapters['support-bot']}", "--max-loras", "2")
    live = start_server(tmp_path_factory.mktemp("lora"), "--workers", "1", *flags, env={"MET_ACCEPT_ANY_MODEL": "0"})
    yield live
    stop_server(live)


def chat(server: LiveServer, model: str, *, stream: bool = False) -> str:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as api:
        messages = [{"role": "user", "content": POEM}]
        if stream:
            chunks = api.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=TOKENS, stream=True)  # type: ignore[arg-type]
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reply = api.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=TOKENS)  # type: ignore[arg-type]
        assert reply.model == model
        return reply.choices[0].message.content or ""


def messages(server: LiveServer, model: str, *, stream: bool = False) -> str:
    with anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as claude:
        kwargs = {"model": model, "max_tokens": TOKENS, "messages": [{"role": "user", "content": POEM}], "extra_body": {"temperature": 0}}
        if stream:
            with claude.messages.stream(**kwargs) as s:  # type: ignore[arg-type]
                final = s.get_final_message()
        else:
            final = claude.messages.create(**kwargs)  # type: ignore[arg-type]
    return "".join(b.text for b in final.content if b.type == "text")


def load(server: LiveServer, name: str, path: Path | str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=30)


def unload(server: LiveServer, name: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)


def test_an_adapter_named_by_lora_answers_every_protocol_with_its_own_text(server: LiveServer) -> None:
    base = chat(server, BASE)
    tuned = chat(server, "support-bot")
    assert tuned and tuned != base
    assert chat(server, "support-bot", stream=True) == tuned
    assert messages(server, "support-bot") == messages(server, "support-bot", stream=True) != messages(server, BASE)
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as api:
        done = api.completions.create(model="support-bot", prompt="The sea is", max_tokens=8, temperature=0)
        plain = api.completions.create(model=BASE, prompt="The sea is", max_tokens=8, temperature=0)
        assert done.model == "support-bot" and done.choices[0].text != plain.choices[0].text
        response = api.responses.create(model="support-bot", input=POEM, temperature=0, max_output_tokens=TOKENS)
        assert response.output_text == tuned
    counted = httpx.post(f"{server.base_url}/v1/messages/count_tokens", json={"model": "support-bot", "messages": [{"role": "user", "content": POEM}]}, timeout=30)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 5
    tokens = [httpx.post(f"{server.base_url}/tokenize", json={"model": m, "prompt": POEM}, timeout=30) for m in ("support-bot", BASE, "no-such-adapter")]
    assert tokens[0].status_code == tokens[1].status_code == 200 and tokens[0].json()["tokens"] == tokens[1].json()["tokens"]
    assert tokens[2].status_code == 404 and "no-such-adapter" in tokens[2].text


def test_models_lists_each_adapter_with_its_base_as_parent(server: LiveServer) -> None:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as api:
        cards = {m.id: m for m in api.models.list().data}
        assert cards["support-bot"].parent == BASE  # type: ignore[attr-defined]
        assert api.models.retrieve("support-bot").root.endswith("support-bot")  # type: ignore[attr-defined]


def test_load_use_unload_and_reload_through_the_endpoints(server: LiveServer, default_adapters: dict[str, Path]) -> None:
    with pytest.raises(openai.NotFoundError, match="pirate"):
        chat(server, "pirate")
    reply = load(server, "pirate", default_adapters["pirate"])
    assert reply.status_code == 200 and reply.text == "Success: LoRA adapter 'pirate' added successfully."
    pirate = chat(server, "pirate", stream=True)
    assert pirate and pirate != chat(server, "support-bot") and pirate != chat(server, BASE)
    again = load(server, "pirate", default_adapters["pirate"])
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert unload(server, "pirate").status_code == 200
    with pytest.raises(openai.NotFoundError):
        chat(server, "pirate")
    with pytest.raises(anthropic.NotFoundError) as missing:
        messages(server, "pirate", stream=True)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    gone = unload(server, "pirate")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    assert load(server, "pirate", default_adapters["pirate"]).status_code == 200
    assert chat(server, "pirate", stream=True) == pirate  # the same adapter again, the same text
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert 'met_lora_requests_total{adapter="pirate"} 2.0' in metrics
    assert unload(server, "pirate").status_code == 200


def test_a_bad_adapter_folder_is_refused_naming_the_file_and_nothing_is_registered(server: LiveServer, default_adapters: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text((default_adapters["pirate"] / "adapter_config.json").read_text())
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    for path, words in [(tmp_path, "adapter_model.safetensors"), (tmp_path / "missing", "adapter_config.json: no such file")]:
        reply = load(server, "broken", path)
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == "lora_path" and words in error["message"], error
    assert load(server, BASE, default_adapters["pirate"]).json()["error"]["param"] == "lora_name"  # a served name cannot be taken
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as api:
        assert "broken" not in {m.id for m in api.models.list().data}


def test_a_batch_line_on_an_adapter_gives_what_the_route_gives_it_alone(server: LiveServer) -> None:
    from .test_batches import file_lines, finished, line, submit

    body = {"model": "support-bot", "messages": [{"role": "user", "content": POEM}], "max_tokens": TOKENS, "temperature": 0}
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as api:
        batch = finished(api, submit(api, [line("tuned", body), line("base", {**body, "model": BASE})]).id)
        assert batch.status == "completed", batch
        results = {r["custom_id"]: r["response"]["body"] for r in file_lines(api, batch.output_file_id)}
    assert results["tuned"]["model"] == "support-bot"
    assert results["tuned"]["choices"][0]["message"]["content"] == chat(server, "support-bot") != results["base"]["choices"][0]["message"]["content"]


def test_met_top_shows_a_running_request_on_its_adapter(server: LiveServer) -> None:
    import asyncio
    import time

    from redis.asyncio import Redis

    from cli.top import queue_line
    from cli.top_snapshot import Snapshot, take_snapshot

    async def snapshot() -> Snapshot:
        async with Redis.from_url(server.redis_url) as redis:
            return await take_snapshot(redis, heartbeat_ttl=10)

    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as api:
        long = {"max_tokens": 2000, "extra_body": {"ignore_eos": True}}
        stream = api.chat.completions.create(model="support-bot", messages=[{"role": "user", "content": POEM}], stream=True, **long)  # type: ignore[call-overload]
        next(iter(stream))  # running on the worker now
        seen: tuple[tuple[str, int, int], ...] = ()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and seen != (("support-bot", 1, 0),):
            snap = asyncio.run(snapshot())
            seen = snap.adapters
            time.sleep(0.3)
        stream.close()
    assert seen == (("support-bot", 1, 0),)
    assert "adapters  support-bot 1 running" in queue_line(snap).plain


def test_met_replay_of_a_request_on_an_adapter_runs_it_on_the_adapter_again(server: LiveServer) -> None:
    """The adapter is part of the IR and so of the dump: `met replay` of a recorded request republishes it on its
    adapter (on the base model it would write the base's text and be reported diverged)."""
    from typer.testing import CliRunner

    from cli.main import app

    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as api:
        reply = api.chat.completions.create(model="support-bot", messages=[{"role": "user", "content": POEM}], temperature=0, max_tokens=TOKENS)
    request_id = reply.id.removeprefix("chatcmpl-")
    result = CliRunner().invoke(app, ["replay", request_id, "--redis-url", server.redis_url])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == "1 request(s): 1 matched, 0 diverged", result.output
