"""The real coding agents, unmodified, against a live `met serve`: Claude Code on /v1/messages and Codex on
/v1/responses (pinned; `./dev test` installs them into .tools/agents with npm). Every CLI feature is left
at its default; the server runs the YaRN-stretched 16k copy of the default model (Claude Code's prompt
alone is ~12.7k tokens, Codex's ~9k), greedy, so each turn is a short, poor, but ended answer.

What is asserted: the CLI exits 0 with a completed turn holding the model's text, and the server
answered nothing with a 4xx / 5xx and logged no request as an error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..conftest import LONG_CONTEXT, ROOT, LiveServer, http_errors

pytestmark = pytest.mark.e2e

BIN = ROOT / ".tools" / "agents" / "node_modules" / ".bin"
PINNED = {"claude": "2.1.332 (Claude Code)", "codex": "codex-cli 0.171.0"}
PROMPT = "Say hello in five words"


def agent(name: str) -> str:
    """The pinned CLI, or a loud failure: these tests are part of the suite, never skipped."""
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run ./dev test (it installs the pinned agent CLIs with npm; Node.js 20+ needed)")
    version = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"], "HOME": "/tmp"})
    assert version.stdout.strip() == PINNED[name], f"{name} is not the pinned version: {version.stdout or version.stderr}"
    return str(path)


@pytest.fixture
def fixed_home() -> Iterator[Path]:
    """The same HOME and working folder every run: both CLIs put their paths into the prompt, and a greedy
    135M model's answer to a 12k-token prompt changes with them; a fixed prompt (but for the date, which
    the CLIs also write and the recorded turns answer the same way with any date) gives a fixed turn."""
    root = Path(tempfile.gettempdir()) / "metrale-agent-clis"
    shutil.rmtree(root, ignore_errors=True)
    (root / "work").mkdir(parents=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def base_env(home: Path) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", "NO_COLOR": "1"}


def run_cli(cmd: list[str], *, cwd: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=540, stdin=subprocess.DEVNULL)
    return done, time.monotonic() - started


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def requests_logged(server: LiveServer, protocol: str) -> list[str]:
    return [line for line in server.log().splitlines() if "met.requests" in line and f" {protocol} " in line]


@pytest.mark.timeout(600)
def test_claude_code_completes_a_turn_with_the_models_text(agents_server: LiveServer, fixed_home: Path) -> None:
    claude = agent("claude")
    work = fixed_home / "work"
    env = {
        **base_env(fixed_home),
        "ANTHROPIC_BASE_URL": agents_server.base_url,
        "ANTHROPIC_API_KEY": "test",
        "ANTHROPIC_MODEL": "SmolLM2-135M-Instruct",  # a non-Claude name: Claude Code then reads the window below (README); its side requests ask for claude-* (an alias)
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(LONG_CONTEXT),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    errors, before = http_errors(agents_server), len(requests_logged(agents_server, "anthropic_messages"))
    done, seconds = run_cli([claude, "-p", PROMPT, "--output-format", "stream-json", "--verbose"], cwd=work, env=env)
    events = json_lines(done.stdout)
    texts = [b["text"] for e in events if e.get("type") == "assistant" for b in e["message"]["content"] if b.get("type") == "text"]
    assert any(t.strip() for t in texts), f"no model text in Claude Code's turn ({seconds:.0f}s):\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
    (result,) = [e for e in events if e.get("type") == "result"]
    assert done.returncode == 0 and not result["is_error"] and result["subtype"] == "success", (done.stdout[-6000:], done.stderr[-2000:])
    assert result["result"].strip() in [t.strip() for t in texts]  # what the CLI printed is the model's text
    logged = requests_logged(agents_server, "anthropic_messages")[before:]
    assert logged and not [line for line in logged if "status=error" in line]
    assert http_errors(agents_server) == errors
    print(f"claude -p: {seconds:.1f}s, {len(logged)} requests, exit {done.returncode}")


@pytest.mark.timeout(600)
def test_codex_exec_completes_a_turn_with_the_models_text(agents_server: LiveServer, fixed_home: Path) -> None:
    codex = agent("codex")
    home, work = fixed_home / ".codex", fixed_home / "work"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "SmolLM2-135M-Instruct"\nmodel_provider = "metrale"\n\n'
        f'[model_providers.metrale]\nname = "Metrale"\nbase_url = "{agents_server.base_url}/v1"\nwire_api = "responses"\nenv_key = "METRALE_API_KEY"\n'
    )
    env = {**base_env(fixed_home), "CODEX_HOME": str(home), "METRALE_API_KEY": "test"}
    errors, before = http_errors(agents_server), len(requests_logged(agents_server, "openai_responses"))
    done, seconds = run_cli([codex, "exec", "--json", "--skip-git-repo-check", "-C", str(work), PROMPT], cwd=work, env=env)
    events = json_lines(done.stdout)
    messages = [e["item"]["text"] for e in events if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]
    assert any(m.strip() for m in messages), f"no model text in Codex's turn ({seconds:.0f}s):\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
    assert done.returncode == 0, (events[-3:], done.stderr[-2000:])
    assert [e["type"] for e in events if e.get("type", "").startswith("turn.")] == ["turn.started", "turn.completed"]
    logged = requests_logged(agents_server, "openai_responses")[before:]
    assert logged and not [line for line in logged if "status=error" in line]
    assert http_errors(agents_server) == errors
    print(f"codex exec: {seconds:.1f}s, {len(logged)} requests, exit {done.returncode}")
