"""Legacy Completions, /tokenize, /detokenize and the model card, through a live `met serve` with the
official `openai` SDK (real Redis, real SmolLM2-135M-Instruct). Bad input is refused in OpenAI's
error shape naming the parameter, and nothing reaches the request stream."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from shared import keys

from ..conftest import LiveServer

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


@pytest.fixture
def api(live_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def tokens_of(live_server: LiveServer, prompt: str) -> list[int]:
    ids: list[int] = httpx.post(f"{live_server.base_url}/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=30).json()["tokens"]
    return ids


def test_a_raw_prompt_is_continued_without_the_chat_template(live_server: LiveServer, api: openai.OpenAI) -> None:
    reply = api.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=8)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert "Paris" in reply.choices[0].text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens == len(tokens_of(live_server, PROMPT))  # raw: no template tokens around it


def test_max_tokens_defaults_to_16_as_openai(api: openai.OpenAI) -> None:
    reply = api.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, stop=None)
    assert reply.usage is not None and reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"


def test_a_token_id_prompt_equals_its_text_and_echo_prepends_the_prompt(live_server: LiveServer, api: openai.OpenAI) -> None:
    ids = tokens_of(live_server, PROMPT)
    by_text = api.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=6)
    by_ids = api.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=6, echo=True)
    assert by_ids.choices[0].text == PROMPT + by_text.choices[0].text


def test_a_stream_of_several_prompts_with_n_choices_each_equals_the_non_streaming_choices(api: openai.OpenAI) -> None:
    """Several prompts x n streamed in one response: choice `prompt_index * n + i` carries its text (with
    its own prompt echoed) as the non-streaming request gives it; one usage chunk counts every prompt once."""
    common = {"model": MODEL, "prompt": [PROMPT, "1, 2, 3, 4,"], "n": 2, "temperature": 0.8, "seed": 5, "max_tokens": 6, "echo": True}
    whole = api.completions.create(**common)  # type: ignore[call-overload]
    chunks = list(api.completions.create(**common, stream=True, stream_options={"include_usage": True}))  # type: ignore[call-overload]
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in whole.choices} and sorted(texts) == [0, 1, 2, 3]
    assert texts[2].startswith("1, 2, 3, 4,") and texts[0].startswith(PROMPT)
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_stream_with_echo_and_usage_concatenates_to_the_non_streaming_text(api: openai.OpenAI) -> None:
    whole = api.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=8, echo=True)
    chunks = list(api.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=8, echo=True, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "text_completion" for c in chunks)
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_a_list_of_prompts_with_n_gets_prompt_major_choice_indexes(api: openai.OpenAI) -> None:
    reply = api.completions.create(model=MODEL, prompt=[PROMPT, "1, 2, 3, 4,"], n=2, temperature=0, max_tokens=5)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert "Paris" in reply.choices[0].text and "Paris" in reply.choices[1].text
    assert "5" in reply.choices[2].text and "5" in reply.choices[3].text
    assert reply.usage is not None and reply.usage.completion_tokens == 20


def test_a_list_of_token_id_prompts(live_server: LiveServer, api: openai.OpenAI) -> None:
    first, second = tokens_of(live_server, PROMPT), tokens_of(live_server, "1, 2, 3, 4,")
    reply = api.completions.create(model=MODEL, prompt=[first, second], temperature=0, max_tokens=4)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage is not None and reply.usage.prompt_tokens == len(first) + len(second)


def test_logprobs_take_the_legacy_shape_with_the_sampled_token_in_each_top_dict(api: openai.OpenAI) -> None:
    reply = api.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=5, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs and logprobs.text_offset is not None
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.text_offset) == 5
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and top[token] == logprob and logprob == max(top.values())  # greedy: the best one


def test_streamed_logprobs_have_offsets_that_run_on_across_chunks(api: openai.OpenAI) -> None:
    chunks = list(api.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=5, logprobs=1, stream=True))
    offsets = [o for c in chunks for o in ((c.choices[0].logprobs.text_offset or []) if c.choices[0].logprobs else [])]
    tokens = [t for c in chunks for t in ((c.choices[0].logprobs.tokens or []) if c.choices[0].logprobs else [])]
    assert len(tokens) == 5 and offsets == [sum(len(t) for t in tokens[:i]) for i in range(5)]


def test_echo_with_logprobs_scores_the_prompt_tokens_first_null(live_server: LiveServer, api: openai.OpenAI) -> None:
    ids = tokens_of(live_server, PROMPT)
    whole = api.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=3, echo=True, logprobs=1)
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs and logprobs.text_offset
    assert len(logprobs.tokens) == len(ids) + 3 and "".join(logprobs.tokens) == whole.choices[0].text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # type: ignore[comparison-overlap]
    assert all(lp < 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    generated = api.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=3, logprobs=1)
    assert generated.choices[0].logprobs is not None and generated.choices[0].logprobs.token_logprobs == logprobs.token_logprobs[len(ids) :]
    streamed = list(api.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=3, echo=True, logprobs=1, stream=True))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []]
    assert tokens == logprobs.tokens and "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


def test_best_of_returns_the_n_candidates_with_the_highest_cumulative_logprob(api: openai.OpenAI) -> None:
    reply = api.completions.create(model=MODEL, prompt="My favourite colour is", best_of=4, n=2, temperature=1.0, seed=7, max_tokens=6)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.logprobs is None for c in reply.choices)  # ranked with logprobs the client did not ask for
    assert reply.usage is not None and reply.usage.completion_tokens == 4 * 6  # every candidate was generated
    scored = api.completions.create(model=MODEL, prompt="My favourite colour is", best_of=4, n=2, temperature=1.0, seed=7, max_tokens=6, logprobs=0)
    sums = [sum(c.logprobs.token_logprobs or []) for c in scored.choices if c.logprobs]
    assert len(sums) == 2 and sums[0] >= sums[1]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "suffix": " is the answer."}, "suffix"),
        ({"prompt": PROMPT, "n": 3, "best_of": 2}, "best_of"),
        ({"prompt": PROMPT, "best_of": 2, "stream": True}, "best_of"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [PROMPT, ""]}, "prompt[1]"),
        ({"prompt": [1, "two"]}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": PROMPT, "logprobs": 6}, "logprobs"),
        ({"prompt": "word " * 9000}, "prompt"),
        ({}, "prompt"),
    ],
    ids=lambda v: str(v) if isinstance(v, str) else None,
)
def test_bad_completions_are_refused_naming_the_parameter_before_anything_is_queued(live_server: LiveServer, body: dict[str, Any], param: str) -> None:
    r = live_server.redis()
    before = r.xlen(keys.REQUEST_STREAM)
    response = httpx.post(f"{live_server.base_url}/v1/completions", json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and set(error) == {"message", "type", "param", "code"}
    assert r.xlen(keys.REQUEST_STREAM) == before
    r.close()


def test_the_sdk_sees_the_suffix_refusal_as_a_bad_request(api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=MODEL, prompt=PROMPT, suffix="!")
    assert caught.value.param == "suffix"


def test_tokenize_a_prompt_and_detokenize_it_back(live_server: LiveServer) -> None:
    base = live_server.base_url
    out = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True}, timeout=30).json()
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["count"] == len(out["tokens"]) == 2 and out["token_strs"] == ["Hello", "Ġworld"] and out["max_model_len"] == 8192
    assert httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": out["tokens"]}, timeout=30).json() == {"prompt": "Hello world"}
    plain = httpx.post(f"{base}/tokenize", json={"prompt": "Hello world"}, timeout=30).json()
    assert plain["tokens"] == out["tokens"] and plain["token_strs"] is None


def test_tokenize_messages_counts_what_chat_completions_prefills(live_server: LiveServer, api: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    for extra in ({}, {"tools": tools}):
        out = httpx.post(f"{live_server.base_url}/tokenize", json={"model": MODEL, "messages": messages, **extra}, timeout=30).json()
        reply = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, **extra)  # type: ignore[call-overload]
        assert reply.usage is not None and out["count"] == reply.usage.prompt_tokens
    bare = httpx.post(f"{live_server.base_url}/tokenize", json={"messages": messages, "add_generation_prompt": False}, timeout=30).json()
    assert bare["count"] < out["count"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"model": MODEL}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/detokenize", {"model": MODEL}, "tokens"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens"),
        ("/detokenize", {"tokens": [49152]}, "tokens"),
    ],
)
def test_bad_tokenize_input_names_the_parameter(live_server: LiveServer, path: str, body: dict[str, Any], param: str) -> None:
    response = httpx.post(f"{live_server.base_url}{path}", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_the_model_card_is_retrieved_and_an_unknown_model_is_a_404(api: openai.OpenAI) -> None:
    card = api.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card == api.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as caught:
        api.models.retrieve("gpt-5")
    assert caught.value.body == {"message": "The model 'gpt-5' does not exist. This server serves 'SmolLM2-135M-Instruct'.", "type": "not_found_error", "param": "model", "code": "model_not_found"}
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("org/gpt-5")
