"""Int4 through the official SDKs: `met serve --quantization auto` runs the default model on
its own Q4_1 weights (workers.quant), answers a factual question right on every protocol with the same
greedy text, and its worker says what it runs and why; a quantization it does not know is refused by
name before anything starts."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from shared import keys

from ..conftest import ROOT, LiveServer, start_server, stop_server

pytestmark = pytest.mark.e2e

QUESTION = "What is the capital of France? Answer in one sentence."
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def int4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("int4"), "--workers", "1", "--quantization", "auto", "--kv-budget-mb", "256")
    yield server
    stop_server(server)


def test_auto_runs_the_default_model_on_its_own_4bit_weights_and_answers_the_same_on_every_protocol(int4: LiveServer) -> None:
    with openai.OpenAI(base_url=f"{int4.base_url}/v1", api_key="x", max_retries=0, timeout=300) as api:
        chunks = api.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS, temperature=0, stream=True)
        chat = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        responses = api.responses.create(model="m", input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0).output_text
    with anthropic.Anthropic(base_url=int4.base_url, api_key="x", max_retries=0, timeout=300) as claude:
        message = claude.messages.create(model="m", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": QUESTION}], extra_body={"temperature": 0})
    messages = "".join(b.text for b in message.content if b.type == "text")
    assert "Paris" in chat, chat  # 4-bit weights, still the model: the GGUF's own Q4_1 numbers
    assert responses == chat and messages == chat
    r = int4.redis()
    try:
        [worker] = [w.decode() for w in r.zrangebyscore(keys.WORKERS_ALIVE, time.time() - 10, "+inf")]
        assert r.hget(keys.worker_info(worker), "quantization") == b"int4"
        assert r.hget(keys.worker_info(worker), "projections") == b"off"  # int4 weights: float32 projections do not apply
    finally:
        r.close()
    assert "weights: int4" in int4.log() and "auto: the weights already are 4-bit" in int4.log()


def test_an_unknown_quantization_is_refused_by_name_before_anything_starts(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "cli.main", "serve", "--quantization", "int8", "--data-dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--quantization" in done.stderr and "'int8': choose one of none, int4, auto" in done.stderr
