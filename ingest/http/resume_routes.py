"""The routes and helpers around streams that outlive one HTTP response: resuming a stream
(`X-Request-Id` + `Last-Event-ID` on any generation route), the stored Responses routes (GET / DELETE
/v1/responses/{id}, `?stream=true&starting_after=N`, POST .../cancel), and background followers.

Every lookup is scoped to the caller's API key (ingest.http.auth.owns, applied in ingest.http.resume and
ingest.http.responses_store): another key's id is a 404. Split from ingest/http/app.py, which keeps the
generation flow; this module owns no storage (ingest.http.resume, ingest.http.responses_store do).
Must not: parse protocol bodies or encode frames (the app's `stream` does, through the Surface row).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import orjson
from blacksheep import Request as HttpRequest
from blacksheep import Response

from encoders.wire import tail
from ingest.http import responses_store, resume
from ingest.http.auth import caller_of
from ingest.http.responses_store import Saver
from ingest.http.surfaces import RESPONSES, Surface
from shared.deltas import Batch, StreamDelta, is_terminal
from shared.errors import ApiError, invalid
from shared.ir import Request

if TYPE_CHECKING:
    from ingest.http.app import Api


async def resume_stream(api: Api, http: HttpRequest, surface: Surface, request_id: str, after: int, *, background: bool = False) -> Response:
    """The rest of a stream after event `after`, re-encoded from its first delta (any API node)."""
    request = await resume.load(api.redis, request_id, surface.protocol, caller=caller_of(http))
    if not (request.stream or background):
        raise invalid(f"Request '{request_id}' was not streamed; nothing to resume.", "X-Request-Id", "not_a_stream")
    attached = await resume.attach(api.redis, request_id)
    presence = api.presence(http)
    deltas = tail(api.tails, request_id, deadline=api.deadline(request), presence=presence)
    detached = background or surface.background(orjson.loads(request.raw_body) if request.raw_body else {})
    return api.stream(request, surface, deltas=deltas, skip=after, presence=presence, attached=resume.Attached(attached, detached))


async def resume_choices(api: Api, http: HttpRequest, surface: Surface, request_id: str, part_ids: list[str], last_event_id: str) -> Response:
    """The rest of a stream of several choices (ingest.http.app.stream_choices): each choice re-encoded from
    its first delta, from the position its entry in `Last-Event-ID` names."""
    parts = [await resume.load(api.redis, part, surface.protocol, caller=caller_of(http)) for part in part_ids]
    skip = resume.event_positions(last_event_id, len(parts) + 1, "Last-Event-ID")
    attached = await resume.attach(api.redis, request_id)
    return api.stream_choices(http, request_id, surface, parts, skip=skip, attached=attached)


class ResponseRoutes:
    """GET / DELETE /v1/responses/{id} and POST /v1/responses/{id}/cancel, each for the caller's own responses."""

    def __init__(self, api: Api) -> None:
        self.api = api

    async def get_response(self, http: HttpRequest) -> Response:
        """The response (stored, or rebuilt while it runs); `?stream=true&starting_after=N` streams its
        events after sequence number N, live or finished, as a client connected from the start got them."""
        response_id = _route_value(http, "response_id")
        caller = caller_of(http)
        if http.query.get("stream", [""])[0] != "true":
            body, _ = await responses_store.load(self.api.redis, response_id, caller=caller)
            return self.api.json(body)
        recorded = await responses_store.live(self.api.redis, response_id, caller=caller)
        if recorded is None:
            raise ApiError(f"Response with id '{response_id}' has no stream to replay.", status=404, kind="not_found", code="response_not_found")
        after = resume.event_position(http.query.get("starting_after", ["-1"])[0], "starting_after")
        return await resume_stream(self.api, http, RESPONSES, recorded[0].id, after, background=True)

    async def cancel_response(self, http: HttpRequest) -> Response:
        return self.api.json(await responses_store.cancel_background(self.api.redis, _route_value(http, "response_id"), caller=caller_of(http)))

    async def delete_response(self, http: HttpRequest) -> Response:
        response_id = _route_value(http, "response_id")
        await responses_store.delete(self.api.redis, response_id, caller=caller_of(http), ttl=self.api.settings.response_ttl)
        return self.api.json({"id": response_id, "object": "response", "deleted": True})


class Followers:
    """Background responses' followers: each reads its deltas to the end and saves the response (no
    client waits); a reference to each task keeps it alive until it ends."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def follow(self, deltas: AsyncIterator[Batch | None], request: Request, store: Saver | None) -> None:
        async def run() -> None:
            seen = [d async for batch in deltas if batch is not None for d in batch]
            if store is not None:
                await store(request, seen)

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def recording(
    deltas: AsyncIterator[Batch | None], on_terminal: Callable[[list[StreamDelta]], Awaitable[None]]
) -> AsyncIterator[Batch | None]:
    """Pass batches of deltas through, and hand the whole list to `on_terminal` once the terminal one passed."""
    seen: list[StreamDelta] = []
    async for batch in deltas:
        if batch is not None:
            seen += batch
            if any(is_terminal(d) for d in batch):
                await on_terminal(seen)
        yield batch


def _route_value(http: HttpRequest, name: str) -> str:
    return str((http.route_values or {}).get(name) or "")


