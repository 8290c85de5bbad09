"""compose.yaml run for real (`./dev test-compose`, not part of `./dev test`): the Docker engine builds the
Metrale image on the stand-in base images (deploy/standin/build.sh), `up --build` starts Redis, the API
behind the nginx proxy and two CPU workers; streams on all three protocols go through the proxy; a worker
container is killed with SIGKILL mid-stream; the API is scaled to two replicas; `stop` drains the workers;
`down` removes everything; LoRA adapters from the mounted folder. Works with `docker compose` (v2) or Debian's `docker-compose` (1.29)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import redis

from cli.embedded_redis import free_port
from shared import keys

from ..conftest import ROOT
from ..topology import responses_stream_text

pytestmark = [pytest.mark.compose, pytest.mark.timeout(2400)]  # the first test includes the image build

PROMPT = "List the numbers from 1 to 40, separated by commas."
MAX_TOKENS = 110
PROJECT = "metrale-compose-test"


def compose_command() -> list[str]:
    if subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.fail("neither `docker compose` nor `docker-compose` is installed: run ./dev test-compose, which installs them")


class Compose:
    def __init__(self) -> None:
        self.base = [*compose_command(), "-p", PROJECT, "-f", str(ROOT / "compose.yaml"), "--profile", "cpu"]
        self.port = free_port()
        self.env = {
            **os.environ,
            "MET_PORT_PUBLISHED": str(self.port),
            "REDIS_PORT_PUBLISHED": str(free_port()),
            "REDIS_PASSWORD": secrets.token_hex(12),
        }
        self.url = f"http://127.0.0.1:{self.port}"

    def run(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*self.base, *args], env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
        if check and done.returncode != 0:
            pytest.fail(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
        return done

    def containers(self, service: str) -> list[str]:
        return self.run("ps", "-q", service).stdout.split()

    def redis(self) -> redis.Redis:
        """compose's Redis through its published loopback port (what `met top` on the host uses)."""
        return redis.Redis(port=int(self.env["REDIS_PORT_PUBLISHED"]), password=self.env["REDIS_PASSWORD"], decode_responses=True)

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--tail", "200", check=False).stdout


def docker(*args: str, timeout: float = 120) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def wait_for(what: str, check: Callable[[], object], timeout: float, on_fail: Callable[[], str] = lambda: "") -> object:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout}s waiting for {what}\n{on_fail()}")


def ready_workers(url: str) -> int:
    try:
        reply = httpx.get(f"{url}/ready", timeout=3)
        return int(reply.json().get("workers", 0)) if reply.status_code == 200 else 0
    except (httpx.HTTPError, ValueError):
        return 0


@pytest.fixture(scope="module")
def stack(default_adapters: dict[str, Path]) -> Iterator[Compose]:
    c = Compose()
    # the LoRA adapters' folder mounted at /adapters (compose.yaml), one of them served from the start
    c.env["MET_ADAPTERS_DIR"] = str(default_adapters["support-bot"].parent)
    c.env["MET_LORA"] = "support-bot=/adapters/support-bot"
    c.run("down", "-v", "--remove-orphans", check=False)
    try:
        # `--scale` and not `deploy.replicas` alone: docker-compose 1.29 reads replicas only with --compatibility.
        c.run("up", "-d", "--build", "--scale", "worker-cpu=2", timeout=1500)
        wait_for("two ready workers behind the proxy", lambda: ready_workers(c.url) >= 2, 900, c.logs)
        yield c
    finally:
        c.run("down", "-v", "--remove-orphans", check=False)


def chat_stream(url: str, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS, *, speculative: bool = True) -> str:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600) as api:
        text, finish = "", None
        for chunk in api.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"speculative": speculative},
        ):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    assert finish in ("length", "stop")
    return text


def test_up_build_streams_all_three_protocols_through_the_proxy(stack: Compose) -> None:
    reference = chat_stream(stack.url)
    assert reference.strip()
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=600) as api:
        assert responses_stream_text(api, PROMPT, MAX_TOKENS, temperature=0) == (reference, "response.incomplete")
    claude = anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0, timeout=600)
    with claude, claude.messages.stream(model="SmolLM2-135M-Instruct", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": PROMPT}], extra_body={"temperature": 0}) as stream:
        message = stream.get_final_message()
    assert "".join(b.text for b in message.content if b.type == "text") == reference
    assert message.stop_reason == "max_tokens"


def test_adapters_in_the_mounted_folder_serve_from_the_start_and_load_at_runtime(stack: Compose) -> None:
    """compose.yaml mounts MET_ADAPTERS_DIR at /adapters in the API and the workers: MET_LORA registers one at start
    (the API checks the folder), POST /v1/load_lora_adapter another, and a worker loads each from the mount."""

    def chat(model: str) -> str:
        with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=600) as api:
            reply = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Write a short poem about the sea."}], max_tokens=24, temperature=0)
        assert reply.model == model
        return reply.choices[0].message.content or ""

    cards = {m["id"]: m for m in httpx.get(f"{stack.url}/v1/models", timeout=30).json()["data"]}
    assert cards["support-bot"]["root"] == "/adapters/support-bot" and cards["support-bot"]["parent"] == "SmolLM2-135M-Instruct"
    base, bot = chat("SmolLM2-135M-Instruct"), chat("support-bot")
    loaded = httpx.post(f"{stack.url}/v1/load_lora_adapter", json={"lora_name": "pirate", "lora_path": "/adapters/pirate"}, timeout=60)
    assert loaded.status_code == 200, loaded.text
    pirate = chat("pirate")
    assert len({base, bot, pirate}) == 3, (base, bot, pirate)
    assert chat("support-bot") == bot  # the same text from whichever worker took it
    outside = httpx.post(f"{stack.url}/v1/load_lora_adapter", json={"lora_name": "nowhere", "lora_path": "/adapters/nowhere"}, timeout=60)
    assert outside.status_code == 400 and "/adapters/nowhere" in outside.text
    # the image has a C++ compiler, so each worker built the gather-matmul kernel (workers/lora_kernel.py) into the
    # models volume rather than falling back to torch.bmm
    workers = stack.run("logs", "--no-color", "worker-cpu", check=False).stdout
    built = {line.split("|", 1)[0].strip() for line in workers.splitlines() if "LoRA adapters multiply through /root/.cache/metrale/build/lora-kernel/" in line}
    assert len(built) == 2, workers[-3000:]  # both containers ("<project>_worker-cpu_N |")


def newest_request(r: redis.Redis, since: float) -> str | None:
    ids: list[str] = r.zrangebyscore(keys.REQUEST_INDEX, since, "+inf")  # type: ignore[assignment]
    return ids[-1] if ids else None


def holder_container(r: redis.Redis, rid: str) -> str | None:
    """The container (its hostname is its id) of the worker streaming `rid`, once it wrote a few events."""
    worker = r.hget(keys.request_meta(rid), "worker")
    if not worker or r.xlen(keys.delta_stream(rid)) < 8:
        return None
    return str(worker).rsplit("-", 2)[0]


LONG_PROMPT = "Count from 1 to 300, separated by commas."
LONG_MAX_TOKENS = 400  # long enough that the kill lands mid-stream


def test_kill_9_of_a_worker_container_mid_stream_leaves_no_gap_and_no_repeat(stack: Compose) -> None:
    reference = chat_stream(stack.url, LONG_PROMPT, LONG_MAX_TOKENS)
    got: list[str | BaseException] = []

    def client() -> None:
        try:
            # one token a step, so the kill lands mid-stream (speculative decoding writes a count fast; same text)
            got.append(chat_stream(stack.url, LONG_PROMPT, LONG_MAX_TOKENS, speculative=False))
        except BaseException as exc:  # asserted below
            got.append(exc)

    r = stack.redis()
    since = time.time()
    thread = threading.Thread(target=client)
    thread.start()
    rid = str(wait_for("the request in the index", lambda: newest_request(r, since), 60))
    container = wait_for("a worker streaming it", lambda: holder_container(r, rid), 300)
    # SIGKILL from the host to the container's process, as a crash would (`docker kill` counts as a
    # manual stop, after which Docker does not apply the restart policy).
    os.kill(int(docker("inspect", "-f", "{{.State.Pid}}", str(container)).strip()), signal.SIGKILL)
    thread.join(600)
    assert got and not isinstance(got[0], BaseException), got
    assert got[0] == reference
    assert int(r.hget(keys.request_meta(rid), "attempt") or 0) >= 2  # another worker resumed it
    wait_for("two ready workers again (restart: unless-stopped)", lambda: ready_workers(stack.url) >= 2, 600, stack.logs)


def test_scale_api_to_two_and_the_proxy_uses_both(stack: Compose) -> None:
    stack.run("up", "-d", "--no-recreate", "--scale", "api=2", "--scale", "worker-cpu=2", timeout=600)
    apis = stack.containers("api")
    assert len(apis) == 2

    def both_serve() -> bool:
        with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=120) as api:
            api.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        return all(" status=" in container_logs(cid) for cid in apis)  # each replica logged a finished request

    wait_for("both API replicas to answer through the proxy", both_serve, 300, stack.logs)


def test_each_conversation_follows_its_prefix_to_one_worker_whichever_api_replica_takes_a_turn(stack: Compose) -> None:
    """Prefix routing across API replicas (their routing reads the workers' indexes in Redis, so it does not matter which
    replica the proxy picks for a turn) and worker containers (`--scale worker-cpu=2`)."""
    r = stack.redis()
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=300) as api:
        for n in range(3):
            system = f"Conversation {n}. " + " ".join(f"Rule {i}: answer plainly and keep item {i * (n + 3)} in mind." for i in range(60))
            messages: list[Any] = [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]
            first = api.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8)
            messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "And goodbye?"}]
            second = api.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8)
            workers = [r.hget(keys.request_meta(c.id.removeprefix("chatcmpl-")), "worker") for c in (first, second)]
            assert workers[0] and workers[0] == workers[1], (n, workers)
            assert second.usage is not None and second.usage.prompt_tokens_details is not None
            assert (second.usage.prompt_tokens_details.cached_tokens or 0) >= 256


def container_logs(cid: str) -> str:
    done = subprocess.run(["docker", "logs", cid], capture_output=True, text=True, timeout=60, check=False)
    return done.stdout + done.stderr


def test_stop_drains_the_workers_and_down_removes_everything(stack: Compose) -> None:
    reference = chat_stream(stack.url, LONG_PROMPT, 200)  # finishes well within the workers' 30 s drain
    got: list[str | BaseException] = []

    def client() -> None:
        try:
            got.append(chat_stream(stack.url, LONG_PROMPT, 200))
        except BaseException as exc:
            got.append(exc)

    r = stack.redis()
    since = time.time()
    thread = threading.Thread(target=client)
    thread.start()
    rid = str(wait_for("the request in the index", lambda: newest_request(r, since), 60))
    wait_for("a worker streaming it", lambda: holder_container(r, rid), 300)
    workers = stack.containers("worker-cpu")
    stack.run("stop", "-t", "60", "worker-cpu", timeout=300)  # SIGTERM: each worker finishes what it holds, then exits
    thread.join(300)
    assert got and got[0] == reference, got
    for cid in workers:
        state = json.loads(docker("inspect", cid))[0]["State"]
        assert state["ExitCode"] == 0, (cid, state)  # exited by itself within the grace period: drained, not killed
    stack.run("stop", "-t", "30", timeout=300)
    stack.run("down", "-v", "--remove-orphans", timeout=300)
    assert not stack.run("ps", "-q").stdout.strip()
    assert PROJECT not in docker("volume", "ls", "-q")
