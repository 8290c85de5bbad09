"""Fixtures for the `met dump` / `met replay` tests against the live server: recorded requests and the CLI in-process."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from cli.main import app

from ..conftest import LiveServer

PROTOCOLS = ("openai_chat", "anthropic_messages", "openai_responses")
ENDPOINTS = {"openai_chat": "/v1/chat/completions", "anthropic_messages": "/v1/messages", "openai_responses": "/v1/responses"}
ID_PREFIXES = ("chatcmpl-", "msg_", "resp_")
PROMPTS = ("Name a colour.", "What is 2 + 2?", "Say hello in French.", "Name a planet.", "Write one word about the sea.")


def body(protocol: str, prompt: str, *, stream: bool, seed: int | None) -> dict[str, Any]:
    """A small request; `seed` None means greedy (Anthropic has no seed: greedy via top_k=1 instead)."""
    sampled: dict[str, Any] = {"temperature": 0.9, "seed": seed} if seed is not None else {"temperature": 0}
    if protocol == "openai_chat":
        extra = {"stream_options": {"include_usage": True}} if stream else {}
        return {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "stream": stream, **sampled, **extra}
    if protocol == "anthropic_messages":
        greedy = {"top_k": 1} if seed is not None else {"temperature": 0}
        return {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "stream": stream, **greedy}
    return {"model": "m", "input": prompt, "max_output_tokens": 12, "stream": stream, **sampled}


def send(server: LiveServer, protocol: str, payload: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[str, bytes]:
    """POST and read the whole answer; returns (request id, the raw body bytes as received)."""
    with httpx.stream("POST", server.base_url + ENDPOINTS[protocol], json=payload, headers=headers, timeout=120) as response:
        raw = response.read()
        assert response.status_code == 200, raw
        request_id = response.headers.get("x-request-id")
    if request_id is None:
        full_id = httpx.Response(200, content=raw).json()["id"]
        request_id = next(full_id.removeprefix(p) for p in ID_PREFIXES if full_id.startswith(p))
    return request_id, raw


def met(*args: str) -> Result:
    """Run `met ...` in-process."""
    return CliRunner().invoke(app, list(args))


@dataclass
class Recorded:
    ids: list[str]
    protocols: dict[str, str]
    jsonl: Path


@pytest.fixture(scope="session")
def recorded(live_server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    """20 requests, one after another: every protocol, streaming and not, greedy and seeded; exported to JSONL."""
    ids: list[str] = []
    protocols: dict[str, str] = {}
    for i in range(20):
        protocol = PROTOCOLS[i % 3]
        payload = body(protocol, PROMPTS[i % len(PROMPTS)], stream=i % 2 == 0, seed=100 + i if i % 4 >= 2 else None)
        request_id, _ = send(live_server, protocol, payload)
        ids.append(request_id)
        protocols[request_id] = protocol
    jsonl = tmp_path_factory.mktemp("dumps") / "recorded.jsonl"
    result = met("dump", "export", *ids, "-o", str(jsonl), "--redis-url", live_server.redis_url)
    assert result.exit_code == 0, result.output
    yield Recorded(ids=ids, protocols=protocols, jsonl=jsonl)
