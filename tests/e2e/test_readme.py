"""The README's "Use it" examples, run verbatim against the live server (only the address changed): each
finishes, every request it makes sets its output limit, and none produces more than that limit. Also, with
no server: the agent recipe's flags, and every relative link in the README and `docs/` names a file (and,
with a `#fragment`, a heading) that exists."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shared import keys
from shared.codec import decode_delta, decode_request
from shared.deltas import Finish

from ..conftest import AGENT_ALIASES, AGENT_OUTPUT_CAP, LONG_CONTEXT, ROOT, LiveServer
from .test_agent_clis import INSTALLS, agent, outcome

pytestmark = pytest.mark.e2e

README_ADDRESS = "http://127.0.0.1:8000"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
ANY_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


def examples() -> list[tuple[str, str]]:
    """The fenced blocks a user runs against the server: every python block, and the curl block."""
    blocks = FENCE.findall((ROOT / "README.md").read_text())
    runnable = [(lang, code) for lang, code in blocks if lang == "python" or (lang == "bash" and code.startswith(f"curl -s {README_ADDRESS}"))]
    assert [lang for lang, _ in runnable] == ["bash", "python", "python", "python", "python"], blocks
    return runnable


def recorded_ids(server: LiveServer) -> set[str]:
    members: Any = server.redis().zrange(keys.REQUEST_INDEX, 0, -1)
    return {m.decode() for m in members}


@pytest.mark.parametrize(("lang", "code"), examples(), ids=["curl", "openai", "anthropic", "websocket", "completions"])
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


def agent_blocks() -> tuple[str, str, str, str]:
    """The README's agent recipe: the serve command, the Claude Code block, the Codex config and command."""
    blocks = FENCE.findall((ROOT / "README.md").read_text())
    serve = [code for lang, code in blocks if lang == "bash" and code.startswith("./dev serve --max-model-len")]
    claude = [code for lang, code in blocks if lang == "bash" and "claude " in code and "ANTHROPIC_BASE_URL" in code]
    toml = [code for lang, code in blocks if lang == "toml" and "model_provider" in code]
    codex = [code for lang, code in blocks if lang == "bash" and code.startswith("METRALE_API_KEY=unused codex exec")]
    assert len(serve) == len(claude) == len(toml) == len(codex) == 1, (serve, claude, toml, codex)
    return serve[0], claude[0], toml[0], codex[0]


def test_the_readme_agent_recipe_serves_with_the_flags_the_agent_tests_use() -> None:
    """The recipe's server is the `agents_server` fixture's (which the recipe's clients run against below),
    but for the suite's own --workers 1 and a KV budget that keeps the suite's memory in bounds."""
    serve, _, _, _ = agent_blocks()
    words = shlex.split(serve.replace("\\\n", " "))
    assert words[:2] == ["./dev", "serve"]
    flags = dict(zip(words[2::2], words[3::2], strict=True))
    assert len(words[2:]) == 12, words
    assert flags["--max-model-len"] == str(LONG_CONTEXT) and json.loads(flags["--rope-scaling"]) == {"rope_type": "yarn", "factor": 2}
    assert [words[i + 1] for i, w in enumerate(words) if w == "--model-alias"] == [AGENT_ALIASES[1], AGENT_ALIASES[3]]
    assert flags["--max-output-tokens"] == str(AGENT_OUTPUT_CAP) and flags["--default-temperature"] == "0"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("install", ["newest", "node20"])
def test_the_readme_agent_recipe_exits_0_with_each_install(agents_server: LiveServer, install: str, fixed_home: Path) -> None:
    """The README's Claude Code line for this install and its Codex command, run verbatim by bash (only the
    address changed) with that install's CLIs first on PATH: each exits 0 with the model's text, or the
    CLI gives up after the model wrote to the output cap (`test_agent_clis.outcome`: the model's answer,
    which the README says the recipe cannot promise). In the home and working folder the agent CLI tests
    use (`fixed_home`): the CLIs write both paths into their prompts, so Codex's ~9k-token prompt is then
    the one those tests sent but for its date and ids, and the server reads most of it from its prefix cache
    (a fresh folder cost a cold prefill: ~28 s of this test's 56 s on a 2-core AVX-512 machine)."""
    _, claude_block, toml, codex_line = agent_blocks()
    agent("claude", install), agent("codex", install)  # the pinned versions, or a loud failure
    home, work = fixed_home, fixed_home / "work"
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text(toml.replace(README_ADDRESS, agents_server.base_url))
    lines = [line for line in claude_block.splitlines() if not line.startswith("claude ") or f"# {install}: " in line]
    assert sum(line.startswith("claude ") for line in lines) == 1, lines
    env = {"PATH": f"{INSTALLS[install][0] / 'node_modules' / '.bin'}:{os.environ['PATH']}", "HOME": str(home), "LANG": "C.UTF-8", "NO_COLOR": "1", "CODEX_HOME": str(home / ".codex")}
    for script in ("\n".join(lines), codex_line):
        done = subprocess.run(["bash", "-e", "-c", script.replace(README_ADDRESS, agents_server.base_url)], cwd=work, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        ended = outcome("claude" if "claude " in script else "codex", done, [done.stdout])
        print(f"{install}: {script.splitlines()[-1]!r} → {ended}: {done.stdout.strip()[:120]!r}")


def _prose(path: Path) -> str:
    """The file's Markdown outside fenced blocks and inline code (where `#` and `[..](..)` are not Markdown)."""
    return re.sub(r"`[^`\n]*`", "", ANY_FENCE.sub("", path.read_text()))


def _anchors(path: Path) -> set[str]:
    """GitHub's anchor for each heading: lower case, punctuation dropped, spaces as hyphens (repeats get -1, -2…)."""
    anchors: set[str] = set()
    repeats: dict[str, int] = {}
    for title in HEADING.findall(ANY_FENCE.sub("", path.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        anchors.add(f"{slug}-{repeats[slug]}" if slug in repeats else slug)
        repeats[slug] = repeats.get(slug, 0) + 1
    return anchors


def test_every_relative_link_in_the_readme_and_docs_names_a_file_and_heading_that_exist() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 1, "docs/ holds no pages"
    broken = []
    for page in pages:
        for target in LINK.findall(_prose(page)):
            if re.match(r"[a-z][a-z+.-]*:", target):  # https:, mailto: …
                continue
            file, _, fragment = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and path.suffix == ".md" and fragment not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
