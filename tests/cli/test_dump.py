"""`met dump` against the live server: list shows statuses, show shows timings and placement, export redacts secrets."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from shared import keys
from shared.dumps import read_records

from ..conftest import LiveServer
from .conftest import Recorded, met, send

pytestmark = pytest.mark.e2e


def test_export_writes_one_record_per_request_in_order(recorded: Recorded) -> None:
    records = read_records(recorded.jsonl.read_bytes().splitlines())
    assert [r.id for r in records] == recorded.ids
    assert [r.request.protocol.value for r in records] == [recorded.protocols[i] for i in recorded.ids]
    assert all(r.outcome in ("stop", "length") and r.deltas and r.request.prompt_token_ids for r in records)


def test_list_shows_every_recorded_request_as_finished(recorded: Recorded, live_server: LiveServer) -> None:
    result = met("dump", "list", "--since", "1h", "--limit", "500", "--redis-url", live_server.redis_url)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:3] == ["ID", "RECEIVED", "(UTC)"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    for request_id in recorded.ids:
        assert rows[request_id][3] == "finished" and rows[request_id][5] == recorded.protocols[request_id]


def test_list_filters_by_status(recorded: Recorded, live_server: LiveServer) -> None:
    result = met("dump", "list", "--status", "queued", "--status", "error", "--redis-url", live_server.redis_url)
    assert result.exit_code == 0, result.output
    assert not any(request_id in result.output for request_id in recorded.ids)
    assert met("dump", "list", "--status", "nonsense", "--redis-url", live_server.redis_url).exit_code == 2


def test_show_gives_timings_worker_attempt_and_outcome(recorded: Recorded, live_server: LiveServer) -> None:
    result = met("dump", "show", recorded.ids[0], "--redis-url", live_server.redis_url)
    assert result.exit_code == 0, result.output
    fields = {line.split()[0]: line.split(None, 1)[1] for line in result.output.split("\n\n")[0].splitlines()[1:] if len(line.split()) > 1}
    assert fields["status"].strip() == "finished" and fields["attempt"].strip() == "1"
    assert fields["outcome"].strip() in ("stop", "length") and fields["worker"].strip() not in ("", "-")
    for timing in ("claimed", "first", "finished"):
        assert fields[timing].lstrip("token ").startswith("+") and fields[timing].rstrip().endswith(("ms", " s"))


def test_show_json_and_an_unknown_id(recorded: Recorded, live_server: LiveServer) -> None:
    shown = met("dump", "show", recorded.ids[1], "--json", "--redis-url", live_server.redis_url)
    assert orjson.loads(shown.output)["id"] == recorded.ids[1]
    missing = met("dump", "show", "no-such-request", "--redis-url", live_server.redis_url)
    assert missing.exit_code == 1 and "No request no-such-request" in missing.output


def test_no_secret_from_the_body_or_the_headers_lands_in_a_dump(live_server: LiveServer, tmp_path: Path) -> None:
    payload = {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "api_key": "sk-e2e-body-secret",
        "metadata": {"access_token": "sk-e2e-metadata-secret"},
    }
    headers = {"Authorization": "Bearer sk-e2e-header-secret", "x-api-key": "sk-e2e-xkey-secret"}
    request_id, _ = send(live_server, "openai_chat", payload, headers)
    out = tmp_path / "secret.jsonl"
    assert met("dump", "export", request_id, "-o", str(out), "--redis-url", live_server.redis_url).exit_code == 0
    dumped = out.read_bytes()
    shown = met("dump", "show", request_id, "--json", "--redis-url", live_server.redis_url).output.encode()
    for secret in (b"sk-e2e-body-secret", b"sk-e2e-metadata-secret", b"sk-e2e-header-secret", b"sk-e2e-xkey-secret"):
        assert secret not in dumped and secret not in shown
    assert b"[redacted]" in dumped


def test_export_of_an_unknown_id_fails_but_writes_the_rest(recorded: Recorded, live_server: LiveServer, tmp_path: Path) -> None:
    out = tmp_path / "partial.jsonl"
    result = met("dump", "export", recorded.ids[0], "no-such-request", "-o", str(out), "--redis-url", live_server.redis_url)
    assert result.exit_code == 1 and "no-such-request" in result.output
    assert [r.id for r in read_records(out.read_bytes().splitlines())] == [recorded.ids[0]]


def test_show_accepts_a_unique_prefix_of_an_id(live_server: LiveServer) -> None:
    request_id, _ = send(live_server, "openai_chat", {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    shown = met("dump", "show", request_id[:10], "--json", "--redis-url", live_server.redis_url)
    assert shown.exit_code == 0, shown.output
    assert orjson.loads(shown.output)["id"] == request_id


def test_show_of_an_ambiguous_prefix_lists_the_candidates_and_fails(redis_server: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_server)
    client.zadd(keys.REQUEST_INDEX, {"feed01aa": 1.0, "feed02bb": 2.0, "f*x": 3.0, "other": 4.0})
    client.close()
    ambiguous = met("dump", "show", "feed0", "--redis-url", redis_server)
    assert ambiguous.exit_code == 2
    assert "ambiguous" in ambiguous.output and "feed01aa" in ambiguous.output and "feed02bb" in ambiguous.output
    assert "other" not in ambiguous.output
    literal = met("dump", "show", "f*", "--redis-url", redis_server)  # a glob character in a prefix matches only itself
    assert literal.exit_code == 1 and "feed01aa" not in literal.output
