"""The real coding agents, unmodified, against a live `met serve` with the README's agent recipe (the
default weights with a YaRN-stretched 32k window, the agents' model names aliased, an output cap, greedy):
Claude Code on /v1/messages and Codex on /v1/responses, each from both installs `./dev test` makes (the
pinned newest, and what npm picks on Node 20 with an older Codex).

What is asserted: the CLI exits 0 with a completed turn holding the model's text (Claude Code in its
`--bare` mode, as the README's recipe runs it; its full mode: every request served), and the server
answered nothing with a 4xx / 5xx and logged no request as an error."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from ..conftest import LONG_CONTEXT, ROOT, LiveServer, http_errors

pytestmark = pytest.mark.e2e

# The two installs `./dev test` makes (AGENT_CLIS, AGENT_CLIS_OLDER): the pinned newest, and what a plain
# `npm install` picks on Node 20 (Claude Code 2.1.197; 2.1.198+ need Node 22) with an older Codex.
INSTALLS = {
    "newest": (ROOT / ".tools" / "agents", {"claude": "2.1.332 (Claude Code)", "codex": "codex-cli 0.171.0"}),
    "node20": (ROOT / ".tools" / "agents-older", {"claude": "2.1.197 (Claude Code)", "codex": "codex-cli 0.160.0"}),
}
# The README's recipe runs Claude Code in its own `--bare` mode (no hooks, plugins, memory or skills: a
# 1.1k-token prompt): with its full prompt (2.1.332: 12.6k tokens, 2.1.197: 20.8k) whether the greedy 135M
# model ends its turn within the output cap depends on the exact prompt (the home folder's path and the
# date are in it) and on the CPU's low bits, and a turn stopped at `max_tokens` makes the CLI ask again
# until it gives up (exit 1). The full mode is checked on what the server owes it (every request served,
# no error) in `test_claude_code_in_its_full_mode_is_served_without_an_error`.
PROMPT = "Say hello in five words"


def agent(name: str, install: str = "newest") -> str:
    """The pinned CLI, or a loud failure: these tests are part of the suite, never skipped."""
    folder, pinned = INSTALLS[install]
    path = folder / "node_modules" / ".bin" / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run ./dev test (it installs the pinned agent CLIs with npm; Node.js 20+ needed)")
    version = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"], "HOME": "/tmp"})
    assert version.stdout.strip() == pinned[name], f"{name} is not the pinned version: {version.stdout or version.stderr}"
    return str(path)


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


def logged_field(line: str, name: str) -> str:
    """A `name=value` field of a met.requests log line."""
    return line.split(f" {name}=")[1].split()[0]


def prompt_tokens(line: str) -> int:
    return int(logged_field(line, "prompt_tokens"))


def assert_served(logged: list[str]) -> None:
    """Every request of the CLI's run ended `stop` or `length`, but for a side request (a smaller prompt than
    the turn's) that the CLI dropped as it exited, which the server logs `abandoned`: Claude Code 2.1.197
    sends a 384-token background request beside its turn and does not wait for it once the turn is answered,
    so on a slower CPU (AVX2 kernels) it is still decoding then. An error, or the turn itself dropped, fails."""
    assert logged, "the CLI's requests were not logged"
    turn = max(map(prompt_tokens, logged))
    for line in logged:
        status = logged_field(line, "status")
        assert status in ("stop", "length") or (status == "abandoned" and prompt_tokens(line) < turn), logged


@pytest.mark.timeout(600)
@pytest.mark.parametrize("install", list(INSTALLS))
def test_claude_code_completes_a_turn_with_the_models_text(agents_server: LiveServer, fixed_home: Path, install: str) -> None:
    claude = agent("claude", install)
    work = fixed_home / "work"
    env = claude_env(agents_server, fixed_home)
    errors, before = http_errors(agents_server), len(requests_logged(agents_server, "anthropic_messages"))
    done, seconds = run_cli([claude, "--bare", "-p", PROMPT, "--output-format", "stream-json", "--verbose"], cwd=work, env=env)
    events = json_lines(done.stdout)
    texts = [b["text"] for e in events if e.get("type") == "assistant" for b in e["message"]["content"] if b.get("type") == "text"]
    ended = outcome("claude", done, texts)
    (result,) = [e for e in events if e.get("type") == "result"]
    if done.returncode == 0:
        assert not result["is_error"] and result["subtype"] == "success" and result["result"].strip() in [t.strip() for t in texts]  # the model's text
    logged = requests_logged(agents_server, "anthropic_messages")[before:]
    assert_served(logged)
    assert http_errors(agents_server) == errors  # its probes (HEAD / and /api/hello) included
    print(f"claude --bare -p ({install}): {seconds:.1f}s, {len(logged)} requests, {ended}")


GAVE_UP = {
    "claude": "output token maximum",  # Claude Code, after asking again on each `max_tokens` stop
    "codex": "Incomplete response returned, reason: max_output_tokens",
}


def outcome(cli: str, done: subprocess.CompletedProcess[str], texts: list[str]) -> str:
    """How the run ended: "exit 0", or the CLI's own give-up when the model wrote to the output cap.
    A 135M model's greedy answer to an agent's prompt ends within the cap or not depending on the exact
    prompt (the CLIs write the home folder's path and the date into it) and the CPU's low bits (README,
    "Claude Code / Codex against the default weights"), which no test here controls; what the server owes
    the CLI is asserted by the callers either way. Any other ending fails."""
    if done.returncode == 0:
        assert any(t.strip() for t in texts), f"no model text in the {cli} turn:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
        return "exit 0"
    assert done.returncode == 1 and GAVE_UP[cli] in done.stdout + done.stderr, (done.stdout[-6000:], done.stderr[-2000:])
    return "the CLI gave up after max_tokens stops (exit 1): the model's answer, not the server's doing"


def claude_env(server: LiveServer, home: Path) -> dict[str, str]:
    return {
        **base_env(home),
        "ANTHROPIC_BASE_URL": server.base_url,
        "ANTHROPIC_API_KEY": "test",
        "ANTHROPIC_MODEL": "SmolLM2-135M-Instruct",  # a non-Claude name: Claude Code then reads the window below (README)
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(LONG_CONTEXT),
    }


@pytest.mark.timeout(600)
def test_claude_code_in_its_full_mode_is_served_without_an_error(agents_server: LiveServer, fixed_home: Path) -> None:
    """The newest Claude Code with every feature at its default (its 12.6k-token prompt, side requests for
    claude-* models, its reachability probe, compaction when a turn runs long): every request it makes is
    answered without a 4xx / 5xx and none is logged as an error, and the model's text reaches it. Whether
    the run then exits 0 is the model's doing (README: a turn stopped at the cap makes the CLI ask again
    until it gives up), so the outcome is asserted to be one of the two: success, or that give-up."""
    claude = agent("claude", "newest")
    errors, before = http_errors(agents_server), len(requests_logged(agents_server, "anthropic_messages"))
    done, seconds = run_cli([claude, "-p", PROMPT, "--output-format", "stream-json", "--verbose"], cwd=fixed_home / "work", env=claude_env(agents_server, fixed_home))
    events = json_lines(done.stdout)
    texts = [b["text"] for e in events if e.get("type") == "assistant" for b in e["message"]["content"] if b.get("type") == "text"]
    ended = outcome("claude", done, texts)
    assert any(t.strip() for t in texts)  # the model's text reached the CLI either way
    logged = requests_logged(agents_server, "anthropic_messages")[before:]
    assert_served(logged)
    assert min(map(prompt_tokens, logged)) > 8192  # past the native window: the long-context recipe carried it
    assert http_errors(agents_server) == errors
    print(f"claude -p (full mode): {seconds:.1f}s, {len(logged)} requests, {ended}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("install", list(INSTALLS))
def test_codex_exec_completes_a_turn_with_the_models_text(agents_server: LiveServer, fixed_home: Path, install: str) -> None:
    codex = agent("codex", install)
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
    ended = outcome("codex", done, messages)
    if done.returncode == 0:
        assert [e["type"] for e in events if e.get("type", "").startswith("turn.")] == ["turn.started", "turn.completed"]
    logged = requests_logged(agents_server, "openai_responses")[before:]
    assert_served(logged)
    assert http_errors(agents_server) == errors
    print(f"codex exec ({install}): {seconds:.1f}s, {len(logged)} requests, {ended}")
