"""The protocols' rows: one per protocol with paths the app can tell apart, each row's parser, encoders,
keep-alive, background flag, prompt expansion, session and several-choice stream belonging together.
Pure: no row is asked to reach Redis (where one must not, it is handed None)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import orjson
import pytest
from redis.asyncio import Redis

from encoders.fan_in import Tagged
from encoders.frames import Frame
from ingest.http.surfaces import CHAT, COMPLETIONS, MESSAGES, RESPONSES, SURFACES, Surface
from models.prompt import PromptRenderer
from shared.deltas import Content, Finish, FinishReason, Usage
from shared.errors import ApiError
from shared.ir import Protocol, Request
from shared.settings import Settings

from ..encoders.recorded import SCENARIOS

BODIES: dict[Protocol, dict[str, Any]] = {
    Protocol.OPENAI_CHAT: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    Protocol.ANTHROPIC_MESSAGES: {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    Protocol.OPENAI_RESPONSES: {"model": "m", "input": "hi"},
    Protocol.OPENAI_COMPLETIONS: {"model": "m", "prompt": "hi"},
}
NO_REDIS = cast(Redis, None)
NO_SETTINGS = cast(Settings, None)


class TokenNames:
    """Stands in for the renderer where a row only decodes token ids (a prompt given as ids, echoed)."""

    def decode(self, token_ids: tuple[int, ...]) -> str:
        return "".join(f"<{t}>" for t in token_ids)


RENDERER = cast(PromptRenderer, TokenNames())


def parsed(surface: Surface, **fields: Any) -> Request:
    return surface.parse({**BODIES[surface.protocol], **fields}, request_id="r1", created=1_700_000_000.5)


def stream_id(protocol: Protocol, first_frame: Frame) -> str:
    """The response id a stream announces in its first frame."""
    payload = orjson.loads(first_frame.data)
    return str({Protocol.ANTHROPIC_MESSAGES: payload.get("message", {}), Protocol.OPENAI_RESPONSES: payload.get("response", {})}.get(protocol, payload)["id"])


def row_id(surface: Surface) -> str:
    return surface.protocol.value


# ---- the table -------------------------------------------------------------------------------------------


def test_every_protocol_has_exactly_one_row() -> None:
    assert sorted(s.protocol for s in SURFACES) == sorted(Protocol)


def test_no_rows_path_is_a_prefix_of_anothers() -> None:
    # the app finds a path's protocol by prefix (its error shape before the body is parsed)
    for a in SURFACES:
        for b in SURFACES:
            assert a is b or not b.path.startswith(a.path), (a.path, b.path)


@pytest.mark.parametrize("surface", SURFACES, ids=row_id)
def test_each_rows_parser_gives_a_request_of_its_protocol_from_its_path(surface: Surface) -> None:
    request = parsed(surface)
    assert request.protocol is surface.protocol
    assert request.endpoint == surface.path
    assert (request.id, request.created, request.model) == ("r1", 1_700_000_000.5, "m")


@pytest.mark.parametrize("surface", SURFACES, ids=row_id)
@pytest.mark.parametrize("body", [[], "text", None, 3])
def test_each_rows_parser_refuses_a_body_that_is_not_an_object(surface: Surface, body: Any) -> None:
    with pytest.raises(ApiError) as caught:
        surface.parse(body, request_id="r1", created=0.0)
    assert caught.value.status == 400


# ---- encoders --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("surface", SURFACES, ids=row_id)
def test_a_rows_stream_and_its_body_answer_under_one_id(surface: Surface) -> None:
    request = parsed(surface)
    encoder = surface.stream_encoder(request)
    accumulator = surface.accumulator(request)
    frames: list[Frame] = []
    for delta in SCENARIOS["plain_text"]:
        frames += encoder.feed(delta)
        accumulator.feed(delta)
    frames += encoder.finish()
    body = surface.combine(request, [accumulator])
    assert accumulator.error is None
    assert stream_id(surface.protocol, frames[0]) == body["id"]
    assert "r1" in body["id"]


@pytest.mark.parametrize("surface", SURFACES, ids=row_id)
def test_a_rows_accumulator_reports_the_error_delta(surface: Surface) -> None:
    accumulator = surface.accumulator(parsed(surface))
    for delta in SCENARIOS["error_mid_stream"]:
        accumulator.feed(delta)
    assert accumulator.error == SCENARIOS["error_mid_stream"][-1]


def test_only_the_messages_row_pings_with_an_event() -> None:
    # Anthropic has a `ping` event; the OpenAI protocols have none (the wire sends `: ping` comments for them)
    for surface in SURFACES:
        frames = surface.ping(surface.stream_encoder(parsed(surface)))()
        if surface is MESSAGES:
            assert [(f.event, orjson.loads(f.data)["type"]) for f in frames] == [("ping", "ping")]
        else:
            assert frames == []


# ---- background, expansion, session ----------------------------------------------------------------------


def test_a_stored_responses_body_may_run_in_the_background() -> None:
    assert RESPONSES.background({**BODIES[Protocol.OPENAI_RESPONSES], "background": True})
    assert not RESPONSES.background(BODIES[Protocol.OPENAI_RESPONSES])
    assert not RESPONSES.background(["not", "an", "object"])


def test_a_background_response_that_is_not_stored_is_refused_naming_background() -> None:
    with pytest.raises(ApiError) as caught:
        RESPONSES.background({**BODIES[Protocol.OPENAI_RESPONSES], "background": True, "store": False})
    assert caught.value.param == "background"


@pytest.mark.parametrize("surface", [CHAT, MESSAGES, COMPLETIONS], ids=row_id)
def test_the_other_rows_never_answer_in_the_background(surface: Surface) -> None:
    assert not surface.background({**BODIES[surface.protocol], "background": True})


@pytest.mark.parametrize("surface", [CHAT, MESSAGES, RESPONSES], ids=row_id)
def test_the_chat_shaped_rows_queue_the_request_as_parsed(surface: Surface) -> None:
    request = parsed(surface)
    assert surface.expand(BODIES[surface.protocol], request, RENDERER) == [request]


def test_the_completions_row_queues_one_request_per_prompt() -> None:
    body = {**BODIES[Protocol.OPENAI_COMPLETIONS], "prompt": ["a", "b", "c"]}
    request = COMPLETIONS.parse(body, request_id="r1", created=0.0)
    parts = COMPLETIONS.expand(body, request, RENDERER)
    assert [p.id for p in parts] == ["r1", "r1-p1", "r1-p2"]
    assert [(p.completion.text, p.completion.prompt_index) for p in parts if p.completion] == [("a", 0), ("b", 1), ("c", 2)]


def test_the_completions_row_echoes_a_token_prompt_as_the_renderer_decodes_it() -> None:
    body = {**BODIES[Protocol.OPENAI_COMPLETIONS], "prompt": [5, 6], "echo": True}
    request = COMPLETIONS.parse(body, request_id="r1", created=0.0)
    [part] = COMPLETIONS.expand(body, request, RENDERER)
    assert part.completion is not None and part.completion.token_ids == (5, 6) and part.completion.text == "<5><6>"


@pytest.mark.parametrize("surface", [CHAT, MESSAGES, COMPLETIONS], ids=row_id)
async def test_a_row_with_no_state_of_its_own_passes_the_request_through_without_redis(surface: Surface) -> None:
    request = parsed(surface)
    assert await surface.session(NO_REDIS, NO_SETTINGS, BODIES[surface.protocol], request, "caller") == (request, None)


async def test_the_responses_row_keeps_a_saver_only_for_stored_responses() -> None:
    stored = {**BODIES[Protocol.OPENAI_RESPONSES], "store": True}
    unstored = {**BODIES[Protocol.OPENAI_RESPONSES], "store": False}
    request = parsed(RESPONSES)
    kept, saver = await RESPONSES.session(NO_REDIS, NO_SETTINGS, stored, request, "caller")
    assert kept == request and saver is not None
    assert await RESPONSES.session(NO_REDIS, NO_SETTINGS, unstored, request, "caller") == (request, None)


# ---- several choices -------------------------------------------------------------------------------------


SEVERAL = [(s, {"n": 2}) for s in SURFACES] + [(COMPLETIONS, {"prompt": ["a", "b"]})]


@pytest.mark.parametrize(("surface", "fields"), SEVERAL, ids=lambda v: row_id(v) if isinstance(v, Surface) else next(iter(v)))
def test_a_row_lets_several_choices_through_only_where_it_can_stream_them(surface: Surface, fields: dict[str, Any]) -> None:
    # ingest.http.app streams several choices through the row's choices_encoder, asserting there is one
    body = {**BODIES[surface.protocol], **fields}
    request = surface.parse(body, request_id="r1", created=0.0)
    several = request.sampling.n > 1 or len(surface.expand(body, request, RENDERER)) > 1
    assert not several or surface.choices_encoder is not None


@pytest.mark.parametrize("surface", [s for s in SURFACES if s.choices_encoder is not None], ids=row_id)
def test_a_rows_several_choices_stream_under_one_id_and_close_once(surface: Surface) -> None:
    assert surface.choices_encoder is not None
    request = parsed(surface)
    parts = [request, replace(request, id="r1-c1")]
    encoder = surface.choices_encoder(request, parts)
    tagged = [
        Tagged(0, Content(text="A")),
        Tagged(1, Content(text="B")),
        Tagged(1, Finish(reason=FinishReason.STOP, usage=Usage(prompt_tokens=1, completion_tokens=1))),
        Tagged(0, Finish(reason=FinishReason.STOP, usage=Usage(prompt_tokens=1, completion_tokens=1)), last=True),
    ]
    frames = [frame for t in tagged for _, frame in encoder.feed(t)] + [frame for _, frame in encoder.finish()]
    assert [f.data for f in frames].count("[DONE]") == 1 and frames[-1].data == "[DONE]"
    chunks = [orjson.loads(f.data) for f in frames if f.data != "[DONE]"]
    assert {c["id"] for c in chunks} == {stream_id(surface.protocol, frames[0])}
    assert "r1" in chunks[0]["id"] and "r1-c1" not in chunks[0]["id"]
    assert {choice["index"] for c in chunks for choice in c["choices"]} == {0, 1}
