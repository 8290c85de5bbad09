"""`met replay` against the live server: recorded requests replay exactly, an edited record diverges, and
`--encode-only` gives back the bytes a streaming client received."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from cli.replay import divergence_cause
from shared.dumps import generated_token_ids, read_records

from ..conftest import LiveServer
from .conftest import PROTOCOLS, Recorded, body, met, send

pytestmark = pytest.mark.e2e

ENCODE_NAMES = {"openai_chat": "openai", "anthropic_messages": "anthropic", "openai_responses": "responses"}


def test_all_twenty_recorded_requests_replay_through_redis_with_the_same_output(recorded: Recorded, live_server: LiveServer) -> None:
    result = met("replay", str(recorded.jsonl), "--redis-url", live_server.redis_url)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == "20 request(s): 20 matched, 0 diverged"
    for request_id in recorded.ids:
        assert re.search(rf"^{request_id}\s+\S+\s+match\s", result.output, re.MULTILINE), result.output


def test_a_request_id_replays_straight_from_redis_and_an_unknown_one_says_how_to_export(recorded: Recorded, live_server: LiveServer) -> None:
    request_id = recorded.ids[1]
    result = met("replay", request_id[:12], "--redis-url", live_server.redis_url)  # a unique prefix, as `met dump show` takes
    assert result.exit_code == 0, result.output
    assert re.search(rf"^{request_id}\s+\S+\s+match\s", result.output, re.MULTILINE), result.output
    assert result.output.splitlines()[-1] == "1 request(s): 1 matched, 0 diverged"
    unknown = met("replay", "0123456789abcdef01234567", "--redis-url", live_server.redis_url)
    assert unknown.exit_code == 2
    assert "neither a file nor a recorded request" in unboxed(unknown.output) and "met dump export" in unboxed(unknown.output), unknown.output
    missing = met("replay", "no/such/file.jsonl", "--redis-url", live_server.redis_url)
    assert missing.exit_code == 2 and "cannot read dump records from no/such/file.jsonl" in unboxed(missing.output), missing.output


def unboxed(output: str) -> str:
    """A click error as one line of words (rich draws it in a wrapped box)."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", output).split())


def test_the_greedy_requests_replay_over_http_too(recorded: Recorded, live_server: LiveServer, tmp_path: Path) -> None:
    lines = recorded.jsonl.read_bytes().splitlines()
    subset = tmp_path / "some.jsonl"
    subset.write_bytes(b"\n".join(lines[:3]) + b"\n")  # one request per protocol
    result = met("replay", str(subset), "--against", live_server.base_url)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == "3 request(s): 3 matched, 0 diverged"


def test_an_edited_record_is_reported_with_its_first_divergent_token(recorded: Recorded, live_server: LiveServer, tmp_path: Path) -> None:
    doc = orjson.loads(recorded.jsonl.read_bytes().splitlines()[0])
    record = read_records([orjson.dumps(doc)])[0]
    content_indices = [i for i, d in enumerate(doc["deltas"]) if d["t"] == "content" and d["token_ids"]]
    target = content_indices[1]  # the second delta with tokens: the divergence is past the first
    expected_index = len(generated_token_ids(record.deltas[:target]))
    original_token = doc["deltas"][target]["token_ids"][0]
    doc["deltas"][target]["token_ids"][0] = 7  # another token
    doc["deltas"][target]["text"] = " EDITED"
    edited = tmp_path / "edited.jsonl"
    edited.write_bytes(orjson.dumps(doc) + b"\n" + recorded.jsonl.read_bytes().splitlines()[1] + b"\n")
    result = met("replay", str(edited), "--redis-url", live_server.redis_url)
    assert result.exit_code == 1, result.output
    assert re.search(rf"^{doc['id']}\s+\S+\s+DIVERGED", result.output, re.MULTILINE), result.output
    assert f"first divergent token: #{expected_index} (token 7 recorded, token {original_token} now)" in result.output
    recorded_line, now_line = (line.strip() for line in result.output.splitlines() if line.strip().startswith(("recorded:", "now:")))
    assert "EDITED" in recorded_line and "EDITED" not in now_line
    assert result.output.splitlines()[-1] == "2 request(s): 1 matched, 1 diverged"
    assert "note: " + divergence_cause(record) in result.output


@pytest.mark.parametrize(
    ("sampling", "cause"),
    [
        ({"temperature": 0.0}, "greedy, so the same tokens are expected: a divergence comes from the kernels"),
        ({"temperature": 0.8, "seed": 7}, "seeded (7), so the same tokens are expected"),
        ({"temperature": 0.8}, "sampled without a seed, so a different output is expected"),
        ({}, "set no temperature and no seed: the server's default decided"),
    ],
)
def test_a_divergence_is_put_down_to_the_kernels_or_to_sampling_by_what_the_request_asked(recorded: Recorded, sampling: dict[str, Any], cause: str) -> None:
    record = read_records([recorded.jsonl.read_bytes().splitlines()[0]])[0]
    request = replace(record.request, sampling=replace(record.request.sampling, **({"temperature": None, "top_k": None, "seed": None} | sampling)))
    assert cause in divergence_cause(replace(record, request=request))


def strip_pings(raw: bytes) -> bytes:
    """Drop keep-alives (`event: ping` frames, `: ping` comments): they are timing, not content."""
    blocks = [b for b in raw.split(b"\n\n") if b]
    kept = [b for b in blocks if not b.startswith(b"event: ping\n") and b != b": ping"]
    return b"".join(b + b"\n\n" for b in kept)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_encode_only_reproduces_the_bytes_a_streaming_client_received(protocol: str, live_server: LiveServer, tmp_path: Path) -> None:
    payload = body(protocol, "Tell me about Paris.", stream=True, seed=5 if protocol != "anthropic_messages" else None)
    request_id, received = send(live_server, protocol, payload)
    exported, encoded = tmp_path / "one.jsonl", tmp_path / "one.sse"
    assert met("dump", "export", request_id, "-o", str(exported), "--redis-url", live_server.redis_url).exit_code == 0
    result = met("replay", "--encode-only", "--protocol", ENCODE_NAMES[protocol], str(exported), "-o", str(encoded))
    assert result.exit_code == 0, result.output
    assert encoded.read_bytes() == strip_pings(received)


def test_encode_only_re_encodes_into_another_protocol(recorded: Recorded, tmp_path: Path) -> None:
    out = tmp_path / "as_anthropic.sse"
    assert met("replay", "--encode-only", "--protocol", "anthropic", str(recorded.jsonl), "-o", str(out)).exit_code == 0
    events = re.findall(rb"^event: (\S+)$", out.read_bytes(), re.MULTILINE)
    assert events.count(b"message_start") == events.count(b"message_stop") == len(recorded.ids)
