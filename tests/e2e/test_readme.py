"""The README's "Use it" examples, run verbatim against the live server (only the address changed): each
finishes, every request it makes sets its output limit, and none produces more than that limit."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest

from shared import keys
from shared.codec import decode_delta, decode_request
from shared.deltas import Finish

from ..conftest import ROOT, LiveServer

pytestmark = pytest.mark.e2e

README_ADDRESS = "http://127.0.0.1:8000"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def examples() -> list[tuple[str, str]]:
    """The fenced blocks a user runs against the server: every python block, and the curl block."""
    blocks = FENCE.findall((ROOT / "README.md").read_text())
    runnable = [(lang, code) for lang, code in blocks if lang == "python" or (lang == "bash" and code.startswith(f"curl -s {README_ADDRESS}"))]
    assert [lang for lang, _ in runnable] == ["bash", "python", "python", "python"], blocks
    return runnable


def recorded_ids(server: LiveServer) -> set[str]:
    members: Any = server.redis().zrange(keys.REQUEST_INDEX, 0, -1)
    return {m.decode() for m in members}


@pytest.mark.parametrize(("lang", "code"), examples(), ids=["curl", "openai", "anthropic", "completions"])
def test_a_readme_example_runs_as_written_within_its_max_tokens(live_server: LiveServer, lang: str, code: str) -> None:
    before = recorded_ids(live_server)
    code = code.replace(README_ADDRESS, live_server.base_url)
    command = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "the example printed nothing"
    new = recorded_ids(live_server) - before
    assert new, "the example sent no request"
    redis = live_server.redis()
    for request_id in new:
        request = decode_request(redis.get(keys.request_ir(request_id)))  # type: ignore[arg-type]
        limit = request.sampling.max_tokens
        assert limit is not None and limit <= 200, f"{request.protocol}: no small max_tokens"
        finishes = [d for d in _deltas(live_server, request_id) if isinstance(d, Finish)]
        assert len(finishes) == 1 and finishes[0].usage.completion_tokens <= limit


def _deltas(server: LiveServer, request_id: str) -> list[Any]:
    entries: Any = server.redis().xrange(keys.delta_stream(request_id))
    return [decode_delta(fields[b"d"]) for _id, fields in entries if b"d" in fields]
