"""Responses compaction, input items and input token counts through the official `openai` SDK against a
live `met serve` (ingest/http/responses_compact.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ingest.http.responses_compact import SUMMARY_PREFIX
from shared import keys
from shared.codec import decode_request, deltas_of
from shared.deltas import Content

from ..conftest import LiveServer, http_errors
from .test_agent_clis import PROMPT, agent, base_env, requests_logged, run_cli

pytestmark = pytest.mark.e2e

# A 3-turn conversation whose assistant turns and tool output are marked, so the prompt can be searched for them.
HISTORY: list[Any] = [
    {"role": "user", "content": "My cat is called Tom."},
    {"role": "assistant", "content": "ASSISTANT-TURN-ONE"},
    {"role": "user", "content": "He likes fish."},
    {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"q": "TOOL-CALL-ARGS"}'},
    {"type": "function_call_output", "call_id": "c1", "output": "TOOL-OUTPUT"},
    {"role": "assistant", "content": "ASSISTANT-TURN-TWO"},
    {"role": "user", "content": "And he sleeps a lot."},
    {"role": "assistant", "content": "ASSISTANT-TURN-THREE"},
]


@pytest.fixture
def api(live_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=300) as sdk:
        yield sdk


def prompt_text(live_server: LiveServer, token_ids: list[int]) -> str:
    answer = httpx.post(f"{live_server.base_url}/detokenize", json={"tokens": token_ids}, timeout=60)
    answer.raise_for_status()
    text: str = answer.json()["prompt"]
    return text


def test_a_compacted_conversation_sent_back_carries_the_models_summary_and_no_assistant_turn(api: openai.OpenAI, live_server: LiveServer) -> None:
    raw = api.responses.with_raw_response.compact(model="m", input=HISTORY, instructions="Be brief.")
    compacted = raw.parse()
    assert compacted.object == "response.compaction" and compacted.usage.input_tokens > 0 and compacted.usage.output_tokens > 0
    *kept, compaction = raw.http_response.json()["output"]  # as sent: the SDK types `output` as output items (user messages too)
    assert [k["content"] for k in kept] == [[{"type": "input_text", "text": t}] for t in ("My cat is called Tom.", "He likes fish.", "And he sleeps a lot.")]
    assert compaction["type"] == "compaction" and compaction["id"].startswith("cmp_") and compaction["encrypted_content"]
    # the summary is what the model wrote: the compaction call's own recorded deltas
    rid = compacted.id.removeprefix("resp_")
    entries: Any = live_server.redis().xrange(keys.delta_stream(rid))
    summary = "".join(d.text for d in deltas_of(entries) if isinstance(d, Content)).strip()
    assert len(summary) > 0

    follow_up = [*kept, compaction, {"role": "user", "content": "What is my cat's name?"}]
    body: Any = {"model": "m", "input": follow_up, "max_output_tokens": 4, "temperature": 0, "extra_body": {"return_token_ids": True}}
    answer = api.responses.create(**body)
    prompt = prompt_text(live_server, (answer.model_extra or {})["prompt_token_ids"])
    assert SUMMARY_PREFIX + summary in prompt
    assert "My cat is called Tom." in prompt and "What is my cat's name?" in prompt
    assert not any(marker in prompt for marker in ("ASSISTANT-TURN", "TOOL-CALL-ARGS", "TOOL-OUTPUT"))
    counted = api.responses.input_tokens.count(model="m", input=follow_up)
    assert answer.usage is not None and counted.input_tokens == answer.usage.input_tokens

    tampered = {**compaction, "encrypted_content": compaction["encrypted_content"][:-8] + "AAAAAAA="}
    dropped = api.responses.create(**{**body, "input": [*kept, tampered, follow_up[-1]]})
    assert SUMMARY_PREFIX not in prompt_text(live_server, (dropped.model_extra or {})["prompt_token_ids"])
    assert dropped.usage is not None and dropped.usage.input_tokens < answer.usage.input_tokens


def test_input_items_list_a_stored_responses_input_in_pages(api: openai.OpenAI) -> None:
    created = api.responses.create(model="m", input=HISTORY, max_output_tokens=2, temperature=0)
    newest_first = list(api.responses.input_items.list(created.id, limit=3))  # the SDK follows `after` / `has_more`
    assert len(newest_first) == len(HISTORY) and all(item.id for item in newest_first)
    first = api.responses.input_items.list(created.id, limit=3, order="asc")
    assert [item.type for item in first.data] == ["message", "message", "message"] and first.has_more
    ends = first.model_extra or {}  # OpenAI's list fields beyond the SDK's cursor page
    assert ends["first_id"] == first.data[0].id and ends["last_id"] == first.data[-1].id
    rest = api.responses.input_items.list(created.id, order="asc", after=ends["last_id"], include=["message.input_image.image_url"])
    assert [i.id for i in [*first.data, *rest.data]] == [i.id for i in reversed(newest_first)] and not rest.has_more
    assert [i.type for i in rest.data] == ["function_call", "function_call_output", "message", "message", "message"]
    with pytest.raises(openai.NotFoundError):
        api.responses.input_items.list("resp_" + "0" * 24)
    alone = api.responses.create(model="m", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        api.responses.input_items.list(alone.id)  # store=false keeps nothing


def test_input_tokens_counts_what_the_same_create_uses(api: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "name": "lookup", "description": "Look a word up.", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]
    first = api.responses.create(model="m", input="My cat is called Tom.", instructions="Be kind.", max_output_tokens=3, temperature=0)
    body: Any = {"model": "m", "input": "What is his name?", "instructions": "Be brief.", "tools": tools, "previous_response_id": first.id}
    created = api.responses.create(**body, max_output_tokens=3, temperature=0)
    counted = api.responses.input_tokens.count(**body)
    assert counted.object == "response.input_tokens"
    assert created.usage is not None and counted.input_tokens == created.usage.input_tokens
    assert api.responses.input_tokens.count(input="What is his name?").input_tokens < counted.input_tokens  # `model` may be left out


CODEX_COMPACT_PROMPT = "You are performing a CONTEXT CHECKPOINT COMPACTION."  # how Codex 0.171.0's summarizing request ends


@pytest.mark.timeout(900)
def test_codex_compacts_its_session_through_the_server_and_resumes_from_the_summary(agents_server: LiveServer, fixed_home: Path) -> None:
    """Codex with a custom provider (the README's config) compacts locally: a summarizing turn sent to
    /v1/responses (its own prompt last, no tools), whose answer it installs as a user message of the next
    window; it never calls /v1/responses/compact (0.171.0 and 0.160.0 alike: that remote path is only for a
    provider named "OpenAI", and there it is a `compaction_trigger` input item). A token limit far below its
    first prompt makes it compact after the first turn; `exec resume` then sends the summary back."""
    codex = agent("codex", "newest")
    home, work = fixed_home / ".codex", fixed_home / "work"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "SmolLM2-135M-Instruct"\nmodel_provider = "metrale"\n'
        "model_auto_compact_token_limit = 1000\nmodel_post_turn_compact_threshold_percent = 1\n\n"
        f'[model_providers.metrale]\nname = "Metrale"\nbase_url = "{agents_server.base_url}/v1"\nwire_api = "responses"\nenv_key = "METRALE_API_KEY"\n'
        "stream_idle_timeout_ms = 600000\n"  # a slow CPU prefill of its 9k-token prompt is not a dropped stream (no re-sent requests)
    )
    env = {**base_env(fixed_home), "CODEX_HOME": str(home), "METRALE_API_KEY": "test"}
    errors, before = http_errors(agents_server), len(requests_logged(agents_server, "openai_responses"))
    first, _ = run_cli([codex, "exec", "--json", "--skip-git-repo-check", "-C", str(work), PROMPT], cwd=work, env=env)
    # The resumed turn with the limit lifted: at 1000 tokens Codex would compact again before sampling, and
    # its own ~9k-token instructions can never fit under that, so it gives up ("Failed to run pre-sampling compact").
    lifted = ["-c", "model_auto_compact_token_limit=1000000"]
    resumed, _ = run_cli([codex, "exec", "--json", "--skip-git-repo-check", *lifted, "-C", str(work), "resume", "--last", "Go on"], cwd=work, env=env)
    bodies = [recorded_body(agents_server, line) for line in requests_logged(agents_server, "openai_responses")[before:]]
    at = next(i for i, (_, body) in enumerate(bodies) if CODEX_COMPACT_PROMPT in (input_texts(body) or [""])[-1])
    rid, compacting = bodies[at]
    assert not compacting.get("tools")
    entries: Any = agents_server.redis().xrange(keys.delta_stream(rid))
    summary = "".join(d.text for d in deltas_of(entries) if isinstance(d, Content)).strip()
    assert summary and any(summary in text for _, body in bodies[at + 1 :] for text in input_texts(body))  # the round trip
    assert http_errors(agents_server) == errors
    assert first.returncode == 0 and resumed.returncode == 0, (first.stdout[-3000:], resumed.stdout[-3000:], resumed.stderr[-2000:])


def recorded_body(server: LiveServer, line: str) -> tuple[str, dict[str, Any]]:
    """A logged request's id and its body as recorded with it (the request IR's `raw_body`)."""
    rid = line.split(" openai_responses ")[0].split()[-1]  # ingest.http.request_log: "<id> <protocol> model=..."
    raw: Any = server.redis().get(keys.request_ir(rid))
    body: dict[str, Any] = json.loads(decode_request(raw).raw_body or "{}")
    return rid, body


def input_texts(body: dict[str, Any]) -> list[str]:
    items = body.get("input") if isinstance(body.get("input"), list) else []
    return ["".join(p.get("text", "") for p in item["content"]) if isinstance(item.get("content"), list) else str(item.get("content", "")) for item in items or [] if item.get("type", "message") == "message"]
