"""Legacy Completions parser: body → IR (prompt forms, echo, logprobs, best_of), one request per
prompt, and bad input → an error naming the parameter."""

from __future__ import annotations

from typing import Any

import pytest

from ingest.parsers.openai_completions import parse, per_prompt
from shared.errors import ApiError
from shared.ir import Protocol, Request, SamplingParams, TextCompletion


def parsed(**fields: Any) -> Request:
    return parse({"model": "m", "prompt": "Once", **fields}, request_id="r1", created=5.0)


def test_a_full_body_maps_onto_the_ir() -> None:
    req = parsed(
        max_tokens=32,
        temperature=0.5,
        top_p=0.9,
        n=2,
        best_of=3,
        stop=["\n", "END"],
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"50256": -100},
        logprobs=2,
        user="someone",
        top_k=40,
        unknown_field=True,
    )
    assert req.protocol is Protocol.OPENAI_COMPLETIONS and req.messages == () and req.endpoint == "/v1/completions"
    assert req.completion == TextCompletion(text="Once", n=2, logprobs=2)
    assert req.sampling == SamplingParams(
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        seed=7,
        max_tokens=32,
        stop=("\n", "END"),
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias=((50256, -100.0),),
        logprobs=True,
        top_logprobs=2,
        n=3,  # best_of candidates are generated; the completion keeps n
    )


def test_defaults_are_openais_16_tokens_one_choice_no_logprobs() -> None:
    req = parsed()
    assert req.sampling.max_tokens == 16 and req.sampling.n == 1 and not req.sampling.logprobs
    assert req.completion == TextCompletion(text="Once") and not req.stream and not req.include_usage


def test_best_of_alone_turns_logprobs_on_to_rank_but_does_not_show_them() -> None:
    req = parsed(best_of=4)
    assert req.sampling.logprobs and req.sampling.n == 4
    assert req.completion is not None and req.completion.logprobs is None and req.completion.n == 1


def test_legacy_logprobs_zero_asks_for_the_sampled_tokens_only() -> None:
    req = parsed(logprobs=0)
    assert req.sampling.logprobs and req.sampling.top_logprobs == 0
    assert req.completion is not None and req.completion.logprobs == 0


def test_echo_with_logprobs_asks_for_the_prompts_logprobs_too() -> None:
    assert parsed(echo=True, logprobs=3).sampling.prompt_logprobs == 3
    assert parsed(logprobs=3).sampling.prompt_logprobs is None and parsed(echo=True).sampling.prompt_logprobs is None


def test_stream_options_include_usage() -> None:
    assert parsed(stream=True, stream_options={"include_usage": True}).include_usage


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("a", [TextCompletion(text="a")]),
        (["a", "b"], [TextCompletion(text="a"), TextCompletion(text="b", prompt_index=1)]),
        ([5, 6, 7], [TextCompletion(token_ids=(5, 6, 7))]),
        ([[5], [6, 7]], [TextCompletion(token_ids=(5,)), TextCompletion(token_ids=(6, 7), prompt_index=1)]),
    ],
    ids=["text", "texts", "token ids", "lists of token ids"],
)
def test_every_prompt_form_becomes_one_request_per_prompt(prompt: Any, expected: list[TextCompletion]) -> None:
    body = {"model": "m", "prompt": prompt}
    parts = per_prompt(body, parse(body, request_id="r1", created=5.0), lambda ids: "never asked")
    assert [p.completion for p in parts] == expected
    assert [p.id for p in parts] == ["r1", "r1-p1"][: len(expected)]


def test_an_echoed_token_id_prompt_gets_its_decoded_text() -> None:
    body = {"model": "m", "prompt": [[5, 6], [7]], "echo": True}
    parts = per_prompt(body, parse(body, request_id="r1", created=5.0), lambda ids: "|".join(map(str, ids)))
    assert [(p.completion.text, p.completion.echo) for p in parts if p.completion] == [("5|6", True), ("7", True)]


def error_of(body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body, request_id="r1", created=5.0)
    assert caught.value.status == 400 and caught.value.kind == "invalid_request"
    return caught.value


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": None}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt[1]"),
        ({"prompt": [[1], []]}, "prompt[1]"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [True]}, "prompt"),
        ({"prompt": {"text": "a"}}, "prompt"),
        ({"prompt": ["a"] * 33}, "prompt"),
        ({"model": None}, "model"),
        ({"suffix": "tail"}, "suffix"),
        ({"suffix": 3}, "suffix"),
        ({"echo": "yes"}, "echo"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"best_of": 0}, "best_of"),
        ({"n": 17}, "n"),
        ({"prompt": ["a"] * 32, "best_of": 3}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": "warm"}, "temperature"),
        ({"stop": [""]}, "stop[0]"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_input_names_the_parameter(fields: dict[str, Any], param: str) -> None:
    body = {"model": "m", "prompt": "Once", **fields}
    assert error_of({k: v for k, v in body.items() if v is not None}).param == param


def test_a_body_that_is_not_an_object_is_refused() -> None:
    assert error_of([1, 2]).param is None  # type: ignore[arg-type]


def test_suffix_empty_is_no_suffix() -> None:
    assert parsed(suffix="").completion == TextCompletion(text="Once")
