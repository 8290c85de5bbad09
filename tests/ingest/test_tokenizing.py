"""The tokenizing lanes (ingest/http/tokenizing.py): work runs off the event loop, a huge body's lane is
bounded and never holds up small requests."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from ingest.http.tokenizing import LARGE_BODY_BYTES, Tokenizing
from shared.errors import ApiError
from shared.settings import Settings


async def test_work_runs_on_another_thread_so_the_loop_keeps_turning() -> None:
    lanes = Tokenizing(Settings(), renderer=None)
    release = threading.Event()
    job = asyncio.ensure_future(lanes.run(10, lambda: (release.wait(30), threading.get_ident())[1]))
    ticks = 0
    while ticks < 5:  # the loop turns while the job blocks its thread
        await asyncio.sleep(0.01)
        ticks += 1
    release.set()
    assert await job != threading.get_ident()
    lanes.close()


async def test_a_large_body_past_the_queue_is_refused_while_small_ones_still_run() -> None:
    lanes = Tokenizing(Settings(tokenize_queue=1), renderer=None)
    release = threading.Event()
    big = asyncio.ensure_future(lanes.run(LARGE_BODY_BYTES + 1, lambda: release.wait(30)))
    await asyncio.sleep(0.05)
    with pytest.raises(ApiError) as refused:
        await lanes.run(LARGE_BODY_BYTES + 1, lambda: True)
    assert refused.value.status == 429 and refused.value.kind == "overloaded" and refused.value.code == "tokenizer_busy"
    assert await lanes.run(100, lambda: "small") == "small"  # not behind the big one
    release.set()
    assert await big is True
    assert await lanes.run(LARGE_BODY_BYTES + 1, lambda: "next") == "next"  # the lane is free again
    lanes.close()


async def test_a_large_count_is_counted_in_a_child_process_exactly_as_the_prompt_renders() -> None:
    import os

    from ingest.parsers.anthropic_messages import parse_count_tokens
    from models.files import local_folder
    from models.prompt import PromptRenderer

    settings = Settings.from_env(os.environ)
    name, folder = local_folder(settings.model, settings.model_cache)
    renderer = PromptRenderer.load(folder, name=name)
    body = {"model": "m", "system": "Be brief.", "messages": [{"role": "user", "content": "hello <|im_start|>system world " * 50}]}
    request = parse_count_tokens(body, request_id="c", created=1.0)
    lanes = Tokenizing(settings, renderer)
    assert await lanes.count(LARGE_BODY_BYTES + 1, request) == len(renderer.render(request)) == await lanes.count(100, request)
    assert lanes._counting is not None  # the large one went to the child process pool
    lanes.close()


class BulkRecorder:
    """Renders any request as one token, or two as its bulk copy (picklable)."""

    def __init__(self, bulk: bool = False) -> None:
        self.bulk = bulk

    def for_bulk(self) -> BulkRecorder:
        return BulkRecorder(bulk=True)

    def render(self, request: object) -> list[int]:
        return [0, 0] if self.bulk else [0]


async def test_a_large_count_encodes_in_bulk_in_the_child_and_a_small_one_as_prompts_render() -> None:
    """Bulk encoding sets the tokenizer's shared split flag: only the child, which owns its renderer, uses it."""
    from ingest.parsers.anthropic_messages import parse_count_tokens

    request = parse_count_tokens({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, request_id="n", created=1.0)
    lanes = Tokenizing(Settings(), BulkRecorder())
    assert await lanes.count(LARGE_BODY_BYTES + 1, request) == 2
    assert await lanes.count(100, request) == 1
    lanes.close()


class InterruptedRecorder:
    """Renders one token after a Ctrl-C reaches its process (picklable): SIGINT sent to itself, as a
    terminal sends it to the server's whole process group."""

    def for_bulk(self) -> InterruptedRecorder:
        return self

    def render(self, request: object) -> list[int]:
        os.kill(os.getpid(), signal.SIGINT)
        return [0]


async def test_ctrl_c_leaves_the_counting_child_quiet_for_the_server_to_stop() -> None:
    from ingest.parsers.anthropic_messages import parse_count_tokens

    request = parse_count_tokens({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, request_id="i", created=1.0)
    lanes = Tokenizing(Settings(), InterruptedRecorder())
    assert await lanes.count(LARGE_BODY_BYTES + 1, request) == 1  # not a KeyboardInterrupt (traceback) in the child
    lanes.close()
