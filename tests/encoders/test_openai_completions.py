"""Legacy Completions encoder: deltas → exact frames and bodies, checked with the official SDK's types."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from openai._models import construct_type
from openai.types import Completion

from encoders.frames import Frame
from encoders.openai_completions import CompletionAccumulator, CompletionStreamEncoder, completion_body
from encoders.reencode import encode_frames
from shared.deltas import Content, Error, ErrorKind, Finish, FinishReason, StreamDelta, TokenLogprob, Usage
from shared.ir import Protocol, Request, SamplingParams, TextCompletion

from .recorded import SCENARIOS, request

BASE = {"id": "cmpl-req01", "object": "text_completion", "created": 1700000000, "model": "tiny-chat", "system_fingerprint": None}
USAGE = {
    "prompt_tokens": 4,
    "completion_tokens": 3,
    "total_tokens": 7,
    "prompt_tokens_details": {"cached_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 0},
}


def completion_request(**spec: Any) -> Request:
    return request(Protocol.OPENAI_COMPLETIONS, completion=TextCompletion(text="Say:", **spec))


def run(deltas: list[StreamDelta], req: Request) -> list[Any]:
    encoder = CompletionStreamEncoder(replace(req, stream=True))
    frames: list[Frame] = [f for d in deltas for f in encoder.feed(d)] + encoder.finish()
    return [f.data if f.data == "[DONE]" else json.loads(f.data) for f in frames]


def chunk(text: str, finish_reason: str | None = None, logprobs: Any = None) -> dict[str, Any]:
    return {**BASE, "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def sdk_checked(payload: dict[str, Any]) -> Completion:
    """A chunk as the SDK's stream reads it (construct_type, no validation: text chunks carry finish_reason
    null, which the type's Literal leaves out); chunks with a finish reason and bodies validate strictly."""
    if any(c["finish_reason"] is None for c in payload["choices"]):
        parsed = construct_type(type_=Completion, value=payload)
        assert isinstance(parsed, Completion)
        return parsed
    return Completion.model_validate(payload)


def lp(token: str, logprob: float, *alternatives: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(token=token, token_id=0, logprob=logprob, top=tuple((t, 0, v) for t, v in alternatives))


def test_plain_text_golden_frames() -> None:
    out = run(SCENARIOS["max_tokens"], completion_request())
    assert out == [chunk("This answer is cut"), chunk("", "length"), "[DONE]"]
    assert [sdk_checked(p).choices[0].text for p in out[:-1]] == ["This answer is cut", ""]


def test_echo_puts_the_prompt_before_the_first_text_once() -> None:
    out = run(SCENARIOS["plain_text"], completion_request(echo=True))
    assert [p["choices"][0]["text"] for p in out[:-1]] == ["Say:Hello", ", world", ""]


def test_echo_of_a_prompt_that_generated_nothing_rides_on_the_finish_chunk() -> None:
    out = run([Finish(reason=FinishReason.STOP, usage=Usage(prompt_tokens=4))], completion_request(echo=True))
    assert out == [chunk("Say:", "stop"), "[DONE]"]


def test_include_usage_adds_a_final_chunk_with_empty_choices() -> None:
    out = run(SCENARIOS["max_tokens"], replace(completion_request(), include_usage=True))
    assert all(p["usage"] is None for p in out[:-2])
    assert out[-2] == {**BASE, "choices": [], "usage": USAGE}
    assert sdk_checked(out[-2]).usage is not None
    assert out[-1] == "[DONE]"


def test_an_error_mid_stream_is_an_error_payload_then_done() -> None:
    out = run(SCENARIOS["error_mid_stream"], completion_request())
    assert out == [
        chunk("Partial"),
        {"error": {"message": "The worker ran out of memory.", "type": ErrorKind.OVERLOADED.value, "param": None, "code": None}},
        "[DONE]",
    ]


def test_streamed_logprobs_take_the_legacy_shape_with_offsets_running_on() -> None:
    deltas: list[StreamDelta] = [
        Content(text="Hi", token_ids=(1,), logprobs=(lp("Hi", -0.1, ("Hi", -0.1), ("Yo", -2.5)),)),
        Content(text=" there", token_ids=(2,), logprobs=(lp(" there", -0.7, (" you", -0.5), (" all", -1.5)),)),
        Finish(reason=FinishReason.STOP, usage=Usage(prompt_tokens=4, completion_tokens=2)),
    ]
    out = run(deltas, completion_request(logprobs=1))
    assert out[0]["choices"][0]["logprobs"] == {"tokens": ["Hi"], "token_logprobs": [-0.1], "top_logprobs": [{"Hi": -0.1}], "text_offset": [0]}
    # the sampled token is always in its dict, beside the top k (so up to k+1 entries)
    assert out[1]["choices"][0]["logprobs"] == {"tokens": [" there"], "token_logprobs": [-0.7], "top_logprobs": [{" you": -0.5, " there": -0.7}], "text_offset": [2]}
    assert out[2]["choices"][0]["logprobs"] is None


def test_a_ruled_out_token_is_floored_not_minus_infinity() -> None:
    deltas: list[StreamDelta] = [Content(text="x", logprobs=(lp("x", float("-inf")),)), Finish(reason=FinishReason.STOP, usage=Usage())]
    out = run(deltas, completion_request(logprobs=0))
    assert out[0]["choices"][0]["logprobs"]["token_logprobs"] == [-9999.0]


def test_return_token_ids_carries_prompt_ids_first_then_each_chunks_ids() -> None:
    out = run(SCENARIOS["plain_text"], replace(completion_request(), return_token_ids=True))
    choices = [p["choices"][0] for p in out[:-1]]
    assert choices[0]["prompt_token_ids"] == [101, 102, 103, 104] and "prompt_token_ids" not in choices[1]
    assert [c["token_ids"] for c in choices] == [[1], [2, 3], [4]]


def test_finish_is_idempotent_and_nothing_follows_done() -> None:
    encoder = CompletionStreamEncoder(completion_request())
    for delta in SCENARIOS["max_tokens"]:
        encoder.feed(delta)
    assert encoder.finish() == [] and encoder.feed(Content(text="late")) == []


def candidate(req: Request, text: str, logprobs: tuple[float, ...], *, prompt_index: int = 0) -> CompletionAccumulator:
    assert req.completion is not None
    acc = CompletionAccumulator(replace(req, completion=replace(req.completion, prompt_index=prompt_index)))
    entries = tuple(lp(c, v) for c, v in zip(text, logprobs, strict=True))
    for delta in (Content(text=text, token_ids=tuple(range(len(text))), logprobs=entries), Finish(reason=FinishReason.STOP, usage=Usage(prompt_tokens=4, completion_tokens=len(text)))):
        acc.feed(delta)
    return acc


def test_the_body_golden_with_echo_and_logprobs_offset_past_the_prompt() -> None:
    req = completion_request(echo=True, logprobs=0)
    body = completion_body(req, [candidate(req, "ab", (-0.5, -0.25))])
    assert body == {
        **BASE,
        "choices": [
            {
                "index": 0,
                "text": "Say:ab",
                "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -0.25], "top_logprobs": [{"a": -0.5}, {"b": -0.25}], "text_offset": [4, 5]},
                "finish_reason": "stop",
            }
        ],
        "usage": {**USAGE, "completion_tokens": 2, "total_tokens": 6},
    }
    Completion.model_validate(body)


def test_best_of_keeps_the_n_most_likely_per_prompt_indexed_prompt_major() -> None:
    req = replace(completion_request(n=2), sampling=SamplingParams(n=3, logprobs=True))  # best_of 3, no logprobs asked
    accs = [
        candidate(req, "aa", (-3.0, -3.0)),
        candidate(req, "bb", (-0.1, -0.1)),
        candidate(req, "cc", (-1.0, -1.0)),
        candidate(req, "dd", (-5.0, -5.0), prompt_index=1),
        candidate(req, "ee", (-0.2, -0.2), prompt_index=1),
        candidate(req, "ff", (-9.0, -9.0), prompt_index=1),
    ]
    body = Completion.model_validate(completion_body(req, accs))
    assert [(c.index, c.text, c.logprobs) for c in body.choices] == [(0, "bb", None), (1, "cc", None), (2, "ee", None), (3, "dd", None)]
    assert body.usage is not None and body.usage.prompt_tokens == 8 and body.usage.completion_tokens == 12  # each prompt once, every candidate


def test_without_best_of_choices_keep_their_order() -> None:
    req = completion_request(n=2)
    body = completion_body(req, [candidate(req, "zz", (-9.0, -9.0)), candidate(req, "yy", (-0.1, -0.1))])
    assert [c["text"] for c in body["choices"]] == ["zz", "yy"]


def test_an_error_is_kept_for_the_app_to_raise() -> None:
    acc = CompletionAccumulator(completion_request())
    acc.feed(Error(message="boom"))
    assert acc.error == Error(message="boom")


PROMPT_SCORED = (lp("Say", 0.0), lp(":", -1.5, (":", -1.5), ("!", -0.5)))  # the worker's first, text-less Content


def test_echo_with_logprobs_streams_the_prompts_tokens_first_the_first_one_null() -> None:
    deltas: list[StreamDelta] = [
        Content(text="", prompt_logprobs=PROMPT_SCORED),
        Content(text="Hi", token_ids=(1,), logprobs=(lp("Hi", -0.1),)),
        Content(text="", prompt_logprobs=PROMPT_SCORED),  # a resumed attempt that had emitted no token scores it again: ignored
        Content(text="!", token_ids=(2,), logprobs=(lp("!", -0.2),)),
        Finish(reason=FinishReason.STOP, usage=Usage(prompt_tokens=2, completion_tokens=2)),
    ]
    out = run(deltas, completion_request(echo=True, logprobs=1))
    assert out == [
        chunk("Say:", logprobs={"tokens": ["Say", ":"], "token_logprobs": [None, -1.5], "top_logprobs": [None, {":": -1.5}], "text_offset": [0, 3]}),
        chunk("Hi", logprobs={"tokens": ["Hi"], "token_logprobs": [-0.1], "top_logprobs": [{"Hi": -0.1}], "text_offset": [4]}),
        chunk("!", logprobs={"tokens": ["!"], "token_logprobs": [-0.2], "top_logprobs": [{"!": -0.2}], "text_offset": [6]}),
        chunk("", "stop"),
        "[DONE]",
    ]


def test_echo_with_logprobs_in_the_body_puts_the_prompts_tokens_first() -> None:
    req = completion_request(echo=True, logprobs=2)
    acc = CompletionAccumulator(req)
    for delta in (
        Content(text="", prompt_logprobs=PROMPT_SCORED),
        Content(text="ab", token_ids=(1, 2), logprobs=(lp("a", -0.5), lp("b", -0.25))),
        Finish(reason=FinishReason.STOP, usage=Usage(prompt_tokens=2, completion_tokens=2)),
    ):
        acc.feed(delta)
    # OpenAI (and vLLM) send null for the first prompt token, which the SDK's List[float] leaves out: the
    # SDK reads bodies without validating (construct_type), as here, and hands the nulls through
    parsed = construct_type(type_=Completion, value=completion_body(req, [acc]))
    assert isinstance(parsed, Completion)
    choice = parsed.choices[0]
    assert choice.text == "Say:ab" and choice.logprobs is not None
    assert choice.logprobs.model_dump() == {
        "tokens": ["Say", ":", "a", "b"],
        "token_logprobs": [None, -1.5, -0.5, -0.25],
        "top_logprobs": [None, {":": -1.5, "!": -0.5}, {"a": -0.5}, {"b": -0.25}],
        "text_offset": [0, 3, 4, 5],
    }


def test_a_recorded_stream_re_encodes_as_a_completion() -> None:
    frames = encode_frames(completion_request(echo=True), SCENARIOS["plain_text"], Protocol.OPENAI_COMPLETIONS)
    assert [json.loads(f.data)["choices"][0]["text"] for f in frames[:-1]] == ["Say:Hello", ", world", ""] and frames[-1].data == "[DONE]"
