"""The HTTP app (blacksheep): routes, admission, and the hand-off to Redis and the encoders.

Flow per request: auth (`guarded`, every route but /health and /ready) → read JSON within the size,
time and depth limits → protocol parser → IR → render the prompt (token ids into the IR; off the event
loop, ingest.http.tokenizing) → admission checks (what it would store, rate limits, queue depth) → XADD →
answer by tailing the request's delta stream (SSE or one JSON body), observed for /metrics. Every check
happens before any SSE header; nothing invalid is XADDed. The protocols' rows are ingest/http/surfaces.py;
resumed streams and the stored-response routes are ingest/http/resume_routes.py.

Size (~550 lines): the shared steps every route takes (limits, prepare, charge, publish, answer) in one
class, so that each check runs in the same order for every protocol; routes beyond generation live in
ingest/http/resume_routes.py and ingest/batches/batch_routes.py.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import orjson
from blacksheep import Application, Content, Response
from blacksheep import Request as HttpRequest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from bus.connect import connect
from bus.tails import Tails
from encoders.wire import ClientLink, Event, Numbered, Presence, Slotted, StreamEncoder, collect, fan_in, sse_events, sse_response, tail
from ingest.batches.batch_dispatch import BatchDispatcher
from ingest.batches.batch_routes import BatchLines, BatchRoutes
from ingest.http import file_refs, responses_store, resume, storage
from ingest.http.auth import CALLER, Authenticator, caller_of
from ingest.http.limits import Charged, RateLimiter, check_stored_size, parse_json, read_body
from ingest.http.loras import Loras
from ingest.http.metrics import CONTENT_TYPE, Metrics
from ingest.http.publish import LIFETIME_MARGIN_S, Admission, Origin, admit_and_submit, cancel
from ingest.http.readiness import readiness
from ingest.http.responses_compact import CompactionRoutes, open_compactions
from ingest.http.responses_store import Saver
from ingest.http.responses_ws import responses_socket
from ingest.http.resume_routes import Followers, ResponseRoutes, recording, resume_choices, resume_stream
from ingest.http.routing import Router
from ingest.http.surfaces import Surface, load_protocol_modules, surfaces
from ingest.http.tokenizing import Tokenizing
from ingest.parsers import anthropic_messages, tokenize
from ingest.parsers.cache_salt import cache_salt
from ingest.parsers.context import ContextPolicy, fit_max_tokens
from ingest.parsers.errors import error_body, failure, status_for
from ingest.parsers.models import ModelNames
from models.generation import sampling_defaults
from models.prompt import PromptRenderer
from shared import keys
from shared.codec import DELTA_FIELD
from shared.deltas import Batch, StreamDelta
from shared.errors import ApiError, invalid
from shared.ir import FALLBACK, ImagePart, Protocol, Request
from shared.protocols import spec
from shared.redact import redact
from shared.seal import Sealer, load_sealer, open_reasoning
from shared.settings import Settings
from shared.upstream_request import check_expressible

log = logging.getLogger("met.api")

Handler = Callable[[HttpRequest], Awaitable[Response]]


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    raw = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return Response(status, raw, Content(b"application/json", orjson.dumps(body)))


RELAXED_HEADER = "X-Metrale-Schema-Relaxed"  # what the output constraint left out of the request's schemas (models.grammar)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A body, ready to queue: its first request, every part, their records, and `relaxed` (Api.prepare_parts)."""

    request: Request
    parts: list[Request]
    encoded: list[bytes]
    relaxed: tuple[str, ...] = ()
    block_keys: list[bytes] | None = None  # the prompt's block keys for routing (ingest.http.routing), hashed here off the loop


@dataclass(frozen=True, slots=True)
class Queued:
    """A body queued (Api.submit): its first request, every part, the protocol session's saver (or None),
    what the rate limits took, and what the output constraint left out of its schemas."""

    request: Request
    parts: list[Request]
    store: Saver | None
    charged: Charged
    relaxed: tuple[str, ...] = ()


class Api:
    """Holds what the routes share: settings, the Redis client, the prompt renderer."""

    def __init__(self, settings: Settings, renderer: PromptRenderer) -> None:
        self.settings = settings
        self.renderer = renderer
        self.names = ModelNames.parse(renderer.info.name, settings.served_model_name, settings.model_alias, accept_any=settings.accept_any_model)
        self.model_name = self.names.main
        self.redis: Redis = connect(settings.redis_url or "redis://127.0.0.1:6379", max_connections=settings.redis_max_connections)
        self.node_id = f"{socket.gethostname()}-{os.getpid()}-{new_id()[:6]}"
        self.tails = Tails(self.redis, node=self.node_id, field=DELTA_FIELD)  # every stream this node answers is read through these readers
        self.started = int(time.time())
        self.draining = False  # set on shutdown: /ready turns 503 before anything stops
        self.open_streams = 0  # SSE responses in progress on this node
        self.open_requests = 0  # route calls in progress (a non-streamed answer is one until it is written)
        self.auth = Authenticator.from_settings(settings)
        self.limiter = RateLimiter(self.redis, settings)
        self.quota = storage.Quota.from_settings(settings, margin_s=LIFETIME_MARGIN_S)  # per-key storage (ingest.http.storage)
        self._making_room: dict[str, asyncio.Task[None]] = {}  # owner → its eviction in progress
        self.metrics = Metrics(self.redis, heartbeat_ttl=settings.heartbeat_ttl)
        self.router = Router(self.redis, settings)
        reserved = (*self.names.served, *(pattern for pattern, _ in self.names.aliases))
        self.loras = Loras(self.redis, settings, base_folder=renderer.info.folder, reserved=reserved, parent=self.model_name)  # ingest.http.loras
        self.followers = Followers()  # background responses being saved
        self._relaxations_logged: set[str] = set()
        self.tokenizing = Tokenizing(settings, renderer)  # prompt rendering off the event loop
        self.sealer: Sealer | None = None  # the deployment's reasoning seal (shared.seal), loaded on start
        self.context = ContextPolicy(
            context=renderer.info.max_model_len,
            strict=settings.strict_max_tokens,
            output_cap=settings.max_output_tokens,
            default_max_tokens=settings.default_max_tokens,
        )
        # What a model worker samples with where a request sets nothing (shared.ir `resolve`), as this node's flags
        # say: recorded with a request for the fields its protocol reports (`prepare`), never used to sample.
        self.sampling_defaults = {**FALLBACK, **sampling_defaults(settings, renderer.info.sampling_defaults)}

    json = staticmethod(json_response)

    # ---- shared steps -------------------------------------------------------------------------

    async def read_raw(self, http: HttpRequest) -> bytes:
        """The body, within the size (413) and time (408) limits."""
        return await read_body(http, self.settings.max_body_bytes, timeout_s=self.settings.body_timeout)

    async def parse_body(self, parse: Callable[..., Request], body: Any, *, size: int, caller: str) -> Request:
        """`parse(body)` once its `file_id` parts carry `caller`'s files (ingest.http.file_refs); a body with
        file parts is parsed on a tokenizing lane (PDF text extraction is CPU work), any other one here."""
        resolved = await file_refs.resolve(self.redis, body, owner=caller)
        work = partial(parse, resolved.body, request_id=new_id(), created=time.time())
        return await self.tokenizing.run(size + resolved.added, work) if resolved.files else work()

    async def read_json(self, http: HttpRequest) -> Any:
        """The parsed body, within the size (413), time (408) and nesting (400) limits, checked before any parser runs."""
        return parse_json(await self.read_raw(http), self.settings.max_json_depth)

    def prepare(self, request: Request, body: Any) -> Request:
        """Render the prompt, fit it and `max_tokens` into the context (ingest.parsers.context: clamp or refuse), and
        attach token ids and the raw body."""
        request = self.check_model(request)
        if not self.renderer.info.vision and any(isinstance(p, ImagePart) for m in request.messages for p in m.content):
            raise invalid(f"The model {self.model_name} does not accept images.", "messages", "image_not_supported")
        if self.settings.upstream:  # gateway workers: the upstream applies constraints; refuse what it cannot be told
            check_expressible(request, flavor=self.settings.upstream_flavor)
        else:
            self.renderer.check_constraint(request, tool_parser=self.settings.tool_parser)
        request = open_reasoning(open_compactions(request, self.sealer), self.sealer)  # sealed items the client sent back
        prompt = self.renderer.render(request)
        max_tokens = fit_max_tokens(request.protocol, len(prompt), request.sampling.max_tokens, self.context)
        reported = tuple((name, float(self.sampling_defaults[name])) for name in spec(request.protocol).reports_sampling)
        return replace(
            request,
            sampling=replace(request.sampling, max_tokens=max_tokens),
            reported_sampling=reported,
            prompt_token_ids=tuple(prompt),
            raw_body=orjson.dumps(redact(body)).decode(),
        )

    def check_model(self, request: Request) -> Request:
        """The request on the LoRA adapter its `model` names (ingest.http.loras), or on the base model when it
        names a served model or an alias; an unknown name is a 404 (ingest.parsers.models)."""
        request = self.loras.resolve(request)
        if not request.adapter:
            self.names.check(request.model)
        return request

    def prepare_parts(self, surface: Surface, body: Any, request: Request) -> Prepared:
        """The first request a body becomes, prepared, every part to queue (each `n` choice its own), each
        part's encoded record, and what the output constraint leaves out of the request's schemas; refused
        (413) when the parts would store more than `--max-stored-request-bytes`
        (ingest.http.limits.check_stored_size). No I/O: runs on a tokenizing thread."""
        requests = [self.prepare(r, body) for r in surface.expand(body, request, self.renderer)]
        parts = [part for r in requests for part in fan_out(r)]
        relaxed = () if self.settings.upstream else self.renderer.relaxed_schemas(requests[0])
        block_keys = self.router.block_keys(parts[0])  # (the parts of a body share their prompt)
        return Prepared(requests[0], parts, check_stored_size(parts, self.settings.max_stored_request_bytes), relaxed, block_keys)

    def relaxation_headers(self, request: Request, relaxed: tuple[str, ...]) -> dict[str, str]:
        """`X-Metrale-Schema-Relaxed` naming what the constraint left out of the request's schemas (and a
        log line the first time this node sees each), or nothing."""
        if not relaxed:
            return {}
        for note in relaxed:
            if note not in self._relaxations_logged and len(self._relaxations_logged) < 10_000:
                self._relaxations_logged.add(note)
                log.info("request %s: a schema is constrained without what llguidance cannot enforce (%s)", request.id, note)
        value = "; ".join(relaxed).encode("ascii", "backslashreplace").decode()
        return {RELAXED_HEADER: value[:4000]}

    async def charge(self, http: HttpRequest, parts: list[Request]) -> Charged:
        """Rate limits (ingest.http.limits): one request, and for each part its prompt plus the most it may generate."""
        limit = self.renderer.info.max_model_len
        tokens = sum(len(p.prompt_token_ids) + (p.sampling.max_tokens or limit - len(p.prompt_token_ids)) for p in parts)
        return await self.limiter.charge(caller_of(http), tokens=tokens)

    async def publish(self, parts: list[Request], encoded: list[bytes], *, owner: str, client: str = "", block_keys: list[bytes] | None = None) -> None:
        """Admit (queue depth) and XADD every part of a request (`encoded`: their records), or refuse before anything is queued."""
        try:
            admission = Admission(self.settings.max_queue, self.settings.request_timeout, self.quota)
            route = await self.router.route(parts[0], block_keys)  # every part alike: n choices share their prompt
            self.metrics.routing.labels(route.decision).inc()
            self.metrics.routed_cached_tokens.inc(route.cached_tokens)
            stored = await admit_and_submit(self.redis, parts, admission, origin=Origin(owner, client), encoded=encoded, stream=route.stream)
            if stored < 0:
                raise ApiError(
                    f"The server is at its queue limit ({self.settings.max_queue} requests); retry shortly.",
                    status=429,
                    kind="overloaded",
                    code="queue_full",
                    retry_after=1.0,
                )
        except RedisError as exc:
            log.error("redis unavailable: %s", type(exc).__name__)
            raise ApiError("The request queue is unavailable; try again shortly.", status=503, kind="unavailable", code="queue_unavailable") from None
        self.make_room(owner, stored)

    def make_room(self, owner: str, stored: int) -> None:
        """Past its storage cap, drop what of `owner`'s records expires first (ingest.http.storage), on a task of its
        own (one per owner at a time): the request that brought it past is not held up."""
        if not self.quota.cap or stored <= self.quota.cap or owner in self._making_room:
            return
        task = asyncio.create_task(storage.enforce(self.redis, owner, self.quota.cap, stored, evicted=self.metrics.stored_evicted))
        self._making_room[owner] = task
        task.add_done_callback(lambda _: self._making_room.pop(owner, None))

    def deadline(self, request: Request) -> float:
        """When a stream with no terminal event yet ends with a timeout error (a worker's own deadline is `request_timeout`)."""
        return request.created + self.settings.request_timeout + 30

    @staticmethod
    def presence(http: HttpRequest) -> Presence:
        """Whether this HTTP request's client is still connected (one watcher per request, shared by its parts)."""
        content: Any = http.content
        return Presence(getattr(content, "receive", None))

    def deltas(self, request: Request, http: HttpRequest, presence: Presence | None = None) -> AsyncIterator[Batch | None]:
        observer = self.metrics.observe(request, client=http.client_ip)
        return tail(self.tails, request.id, deadline=self.deadline(request), presence=presence, observer=observer)

    def client_link(self, presence: Presence, request: Request) -> ClientLink:
        async def abandon() -> None:
            await cancel(self.redis, request.id)

        return ClientLink(presence=presence, on_abandon=abandon)

    def stream(
        self,
        request: Request,
        surface: Surface,
        *,
        deltas: AsyncIterator[Batch | None],
        presence: Presence,
        skip: int = -1,
        attached: resume.Attached = resume.FIRST,
    ) -> Response:
        """SSE for a stream, resumable (ingest.http.resume): a client that leaves gets `--resume-grace-s` to
        come back before the generation is cancelled; a background one is never cancelled by leaving."""
        abandon = _nothing if attached.detached else resume.graceful_cancel(self.redis, request.id, self.settings.resume_grace_s, attached=attached.count)
        link = ClientLink(presence=presence, on_abandon=abandon)
        encoder: StreamEncoder = surface.stream_encoder(request)
        events = sse_events(
            deltas, encoder, ping=surface.ping(encoder), ping_interval=self.settings.ping_interval, client=link, numbering=Numbered(skip)
        )
        return self._sse(request.id, events)

    def stream_choices(
        self, http: HttpRequest, request_id: str, surface: Surface, parts: list[Request], *, skip: tuple[int, ...] | None = None, attached: int = 0
    ) -> Response:
        """SSE for a stream of several choices (chat n > 1, completions' prompts x n), each from its
        part's delta stream (encoders.fan_in), resumable as one stream under `request_id`."""
        assert surface.choices_encoder is not None  # the parsers let several choices through only where one exists
        abandon = resume.graceful_cancel(self.redis, request_id, self.settings.resume_grace_s, [p.id for p in parts], attached=attached)
        presence = self.presence(http)
        link = ClientLink(presence=presence, on_abandon=abandon)
        encoder = surface.choices_encoder(replace(parts[0], id=request_id), parts)
        observed = skip is None  # a resumed stream was observed (metrics) on its first connection
        tails = [
            self.deltas(part, http, presence) if observed else tail(self.tails, part.id, deadline=self.deadline(part), presence=presence) for part in parts
        ]
        deltas = fan_in(tails)
        numbering = Slotted(len(parts) + 1, skip)
        events = sse_events(
            deltas, encoder, ping=surface.ping(encoder), ping_interval=self.settings.ping_interval, client=link, numbering=numbering
        )
        return self._sse(request_id, events)

    def _sse(self, request_id: str, stream: AsyncIterator[list[Event]]) -> Response:
        headers = [(b"Cache-Control", b"no-cache"), (b"X-Accel-Buffering", b"no"), (b"X-Request-Id", request_id.encode())]
        return sse_response(stream, headers=headers, count=self._count_stream)

    def _count_stream(self, change: int) -> None:
        self.open_streams += change  # a draining node waits for these (cli.serve)

    async def collect(self, http: HttpRequest, request: Request, presence: Presence) -> list[StreamDelta]:
        return await collect(self.deltas(request, http, presence), client=self.client_link(presence, request))

    # ---- routes -------------------------------------------------------------------------------

    async def health(self, http: HttpRequest) -> Response:
        return json_response({"status": "ok"})

    async def ready(self, http: HttpRequest) -> Response:
        detail = self.auth.admits(http.get_first_header(b"authorization"), http.get_first_header(b"x-api-key"))
        body, status = await readiness(self.redis, heartbeat_ttl=self.settings.heartbeat_ttl, draining=self.draining, detail=detail)
        return json_response(body, status)

    async def metrics_text(self, http: HttpRequest) -> Response:
        return Response(200, [(b"Cache-Control", b"no-cache")], Content(CONTENT_TYPE.encode(), await self.metrics.render()))

    def cards(self) -> list[dict[str, Any]]:
        base = {"object": "model", "created": self.started, "owned_by": "metrale", "max_model_len": self.renderer.info.max_model_len}
        return self.names.cards(base) + self.loras.cards(base)

    async def models(self, http: HttpRequest) -> Response:
        return json_response({"object": "list", "data": self.cards()})

    async def model(self, http: HttpRequest) -> Response:
        """One model card (`GET /v1/models/{model}`): a served name or an alias (listed or matched); 404 in
        OpenAI's shape for any other name, also with `--accept-any-model` (which serves requests for any
        name but makes no more models exist: a client that looks a name up first learns what is here)."""
        name = _route_value(http, "tail")
        adapter = next((c for c in self.loras.cards(self.cards()[0]) if c["id"] == name), None)
        if adapter is not None:
            return json_response(adapter)
        target = self.names.check(name, listed=True)
        card = next((c for c in self.cards() if c["id"] == name), None)
        return json_response(card or {**self.cards()[0], "id": name, "parent": target})

    async def tokenize(self, http: HttpRequest) -> Response:
        """vLLM's /tokenize; like count_tokens, one request from the caller's rate limit, no tokens."""
        raw = await self.read_raw(http)
        body = parse_json(raw, self.settings.max_json_depth)
        await self.limiter.charge(caller_of(http), tokens=0)
        if isinstance(body, dict) and isinstance(body.get("model"), str) and not self.loras.serves(body["model"]):
            self.names.check(body["model"])  # a LoRA adapter's name tokenizes as its base does; an unknown model is a 404
        return json_response(await self.tokenizing.run(len(raw), partial(tokenize.tokenize, self.renderer, body)))

    async def detokenize(self, http: HttpRequest) -> Response:
        """vLLM's /detokenize; one request from the caller's rate limit, no tokens."""
        raw = await self.read_raw(http)
        body = parse_json(raw, self.settings.max_json_depth)
        await self.limiter.charge(caller_of(http), tokens=0)
        return json_response(await self.tokenizing.run(len(raw), partial(tokenize.detokenize, self.renderer, body)))

    async def count_tokens(self, http: HttpRequest) -> Response:
        """Anthropic's token count. Charged one request against the caller's rate limit (the same buckets
        as generations) before any tokenizing; counting generates nothing, so no tokens are charged."""
        raw = await self.read_raw(http)
        body = parse_json(raw, self.settings.max_json_depth)
        request = await self.parse_body(anthropic_messages.parse_count_tokens, body, size=len(raw), caller=caller_of(http))
        self.check_model(request)
        await self.limiter.charge(caller_of(http), tokens=0)
        return json_response({"input_tokens": await self.tokenizing.count(len(raw), request)})

    async def generate(self, http: HttpRequest, surface: Surface) -> Response:
        """The one flow every protocol shares: parse → session (the protocol's own state) → prepare → publish → answer."""
        point = resume.resume_point(http)
        if point is not None:
            request_id, last_event_id = point
            part_ids = await resume.choices_of(self.redis, request_id)
            if part_ids:
                return await resume_choices(self, http, surface, request_id, part_ids, last_event_id)
            return await resume_stream(self, http, surface, request_id, resume.event_position(last_event_id, "Last-Event-ID"))
        raw = await self.read_raw(http)
        body = parse_json(raw, self.settings.max_json_depth)
        queued = await self.submit(http, surface, body, size=len(raw))
        response = await self._answer(http, surface, body, queued.request, queued.parts, queued.store)
        for name, value in (self.relaxation_headers(queued.request, queued.relaxed) | self.limiter.headers(queued.charged)).items():
            response.add_header(name.encode(), value.encode())
        return response

    async def submit(self, http: HttpRequest, surface: Surface, body: Any, *, size: int) -> Queued:
        """Parse → session (the protocol's own state) → prepare → charge → publish: a parsed body queued, or an
        `ApiError` before anything is. `http` is the authenticated request (an HTTP one, or the WebSocket of
        ingest.http.responses_ws), `size` the body's bytes (ingest.http.tokenizing)."""
        caller = caller_of(http)
        parsed = await self.parse_body(surface.parse, body, size=size, caller=caller)
        parsed = replace(parsed, cache_salt=cache_salt(body, caller, self.settings.cache_salt))
        request, store = await surface.session(self.redis, self.settings, body, parsed, caller)
        prepared = await self.tokenizing.run(size, partial(self.prepare_parts, surface, body, request))
        charged = await self.charge(http, prepared.parts)
        try:
            await self.publish(prepared.parts, prepared.encoded, owner=caller, client=client_of(http), block_keys=prepared.block_keys)
        except ApiError:  # refused (the queue is full): it costs the key nothing
            await self.limiter.refund(caller, charged)
            raise
        return Queued(prepared.request, prepared.parts, store, charged, prepared.relaxed)

    async def _answer(self, http: HttpRequest, surface: Surface, body: Any, request: Request, parts: list[Request], store: Any) -> Response:
        """The answer to a queued request: a background stub, a stream (of one or several choices), or one JSON body."""
        background = surface.background(body)
        if background and not request.stream:
            self.followers.follow(self.deltas(request, http), request, store)
            return json_response(responses_store.body_of(request, []))
        if request.stream and len(parts) > 1:
            await resume.record_choices(
                self.redis, request.id, [p.id for p in parts], ttl=self.settings.dump_ttl + int(self.settings.request_timeout)
            )
            return self.stream_choices(http, request.id, surface, parts)
        presence = self.presence(http)
        if request.stream:
            deltas = self.deltas(request, http, presence)
            if store is not None:
                deltas = recording(deltas, partial(store, request))
            return self.stream(request, surface, deltas=deltas, presence=presence, attached=resume.Attached(detached=background))
        collected = await asyncio.gather(*(self.collect(http, part, presence) for part in parts))
        accs = []
        for part, deltas_of_part in zip(parts, collected, strict=True):
            acc = surface.accumulator(part)
            for delta in deltas_of_part:
                acc.feed(delta)
            if acc.error is not None:
                raise failure(acc.error)
            accs.append(acc)
        if store is not None:
            await store(request, collected[0])
        return json_response(surface.combine(request, accs))


def _bind(handler: Callable[[HttpRequest, Surface], Awaitable[Response]], surface: Surface) -> Handler:
    async def run(http: HttpRequest) -> Response:
        return await handler(http, surface)

    return run


def _route_value(http: HttpRequest, name: str) -> str:
    return str((http.route_values or {}).get(name) or "")


def fan_out(request: Request) -> list[Request]:
    """`n` > 1 becomes n independent requests, each its own durable stream; a
    given seed becomes seed, seed+1, ... so the choices differ yet replay exactly."""
    n = request.sampling.n
    if n == 1:
        return [request]
    seed = request.sampling.seed
    return [
        replace(request, id=f"{request.id}-{i}", sampling=replace(request.sampling, n=1, seed=None if seed is None else seed + i))
        for i in range(n)
    ]


async def _nothing() -> None:
    return None


def client_of(http: HttpRequest) -> str:
    """Who sent a request, for `met top` and dumps: the peer address and the user agent's first product
    token (`OpenAI/Python`, `claude-cli/2.1.332`), printable characters only, bounded."""
    agent = (http.get_first_header(b"user-agent") or b"").decode("latin-1").split(" ", 1)[0]
    agent = "".join(c for c in agent if c.isprintable())[:48]
    return f"{http.client_ip} {agent}".strip()


def new_id() -> str:
    return secrets.token_hex(12)


def guarded(api: Api, protocol: Protocol | None, handler: Handler, *, public: bool = False) -> Handler:
    """The one gate of every route and of the fallback: authenticate (unless `public`), run the handler,
    and render an `ApiError` (or an unexpected failure) in the protocol's error shape; count HTTP errors.

    Auth is decided by the handler the router matched, not by re-reading the path, so no spelling of a
    path (case, slashes, absolute-form targets, Host) reaches a protected handler unauthenticated; an
    unmatched path lands on the fallback, which is guarded too. `protocol` None: by path (the fallback)."""

    async def run(http: HttpRequest) -> Response:
        shape = protocol or _protocol_of_path(http)
        api.open_requests += 1  # a draining node waits for these too (cli.serve)
        try:
            return await answer(http, shape)
        finally:
            api.open_requests -= 1

    async def answer(http: HttpRequest, shape: Protocol) -> Response:
        try:
            if not public:
                caller = api.auth.authenticate(http.get_first_header(b"authorization"), http.get_first_header(b"x-api-key"))
                _scope(http)[CALLER] = caller
            response = await handler(http)
        except ApiError as err:
            headers = {"Retry-After": str(max(1, math.ceil(err.retry_after)))} if err.retry_after else {}
            if err.status == 401:
                headers["WWW-Authenticate"] = "Bearer"
            if err.status == 408:  # the body never fully arrived: the connection cannot carry another request
                headers["Connection"] = "close"
            response = json_response(error_body(shape, err), status_for(shape, err), headers)
            log.info("%s %s answered %d (%s): %.200s", http.method, http.url.path.decode(errors="replace"), response.status, err.code or err.kind, err)
        except Exception:
            log.exception("unhandled error on %s", http.url.path)
            internal = ApiError("The server had an error while processing your request.", status=500, kind="internal")
            response = json_response(error_body(shape, internal), 500)
        if response.status >= 400:
            api.metrics.http_error(response.status)
        return response

    return run


def _scope(http: HttpRequest) -> dict[str, Any]:
    scope: Any = http.scope
    return scope if scope is not None else {}


def _protocol_of_path(http: HttpRequest) -> Protocol:
    """The error shape for an unmatched path: the protocol whose routes it falls under (OpenAI's otherwise)."""
    path = http.url.path.decode(errors="replace").lower()
    return next((s.protocol for s in surfaces() if path.startswith(s.path)), Protocol.OPENAI_CHAT)


def _add_batch_routes(app: Application, api: Api, lines: BatchLines) -> None:
    """Files, Batches and Message Batches (ingest/batches/batch_routes.py); the dispatcher runs beside the app."""
    routes = BatchRoutes(api, lines, caller=caller_of)
    openai, anthropic = Protocol.OPENAI_CHAT, Protocol.ANTHROPIC_MESSAGES
    table: list[tuple[str, str, Protocol, Handler]] = [
        ("POST", "/v1/files", openai, routes.upload_file),
        ("GET", "/v1/files", openai, routes.list_files),
        ("GET", "/v1/files/:file_id", openai, routes.get_file),
        ("GET", "/v1/files/:file_id/content", openai, routes.file_content),
        ("DELETE", "/v1/files/:file_id", openai, routes.delete_file),
        ("POST", "/v1/batches", openai, routes.create_batch),
        ("GET", "/v1/batches", openai, routes.list_batches),
        ("GET", "/v1/batches/:batch_id", openai, routes.get_batch),
        ("POST", "/v1/batches/:batch_id/cancel", openai, routes.cancel_batch),
        ("POST", "/v1/messages/batches", anthropic, routes.create_message_batch),
        ("GET", "/v1/messages/batches", anthropic, routes.list_message_batches),
        ("GET", "/v1/messages/batches/:batch_id", anthropic, routes.get_message_batch),
        ("POST", "/v1/messages/batches/:batch_id/cancel", anthropic, routes.cancel_message_batch),
        ("GET", "/v1/messages/batches/:batch_id/results", anthropic, routes.message_batch_results),
        ("DELETE", "/v1/messages/batches/:batch_id", anthropic, routes.delete_message_batch),
    ]
    for method, path, protocol, handler in table:
        app.router.add(method, path, guarded(api, protocol, metered(api, handler)))


def metered(api: Api, handler: Handler) -> Handler:
    """`handler` after one request from the caller's rate limit (no tokens), as /tokenize: the files,
    batches and stored-response routes do work and storage a key's limit must bound too."""

    async def run(http: HttpRequest) -> Response:
        await api.limiter.charge(caller_of(http), tokens=0)
        return await handler(http)

    return run


def build_app(settings: Settings, renderer: PromptRenderer) -> Application:
    load_protocol_modules(m.strip() for m in settings.protocol_modules.split(",") if m.strip())  # they register their rows
    api = Api(settings, renderer)
    app = Application()
    app.router.add_get("/health", guarded(api, Protocol.OPENAI_CHAT, api.health, public=True))
    app.router.add_get("/ready", guarded(api, Protocol.OPENAI_CHAT, api.ready, public=True))
    for add in (app.router.add_get, app.router.add_head):  # Claude Code's reachability probes (HEAD /api/hello, and HEAD / in 2.1.197)
        add("/api/hello", guarded(api, Protocol.ANTHROPIC_MESSAGES, api.health, public=True))
        add("/", guarded(api, Protocol.ANTHROPIC_MESSAGES, api.health, public=True))
    app.router.add_get("/metrics", guarded(api, Protocol.OPENAI_CHAT, api.metrics_text))
    app.router.add_get("/v1/models", guarded(api, Protocol.OPENAI_CHAT, api.models))
    app.router.add_get("/v1/models/*", guarded(api, Protocol.OPENAI_CHAT, api.model))
    app.router.add_post("/tokenize", guarded(api, Protocol.OPENAI_CHAT, api.tokenize))
    app.router.add_post("/detokenize", guarded(api, Protocol.OPENAI_CHAT, api.detokenize))
    app.router.add_post("/v1/load_lora_adapter", guarded(api, Protocol.OPENAI_CHAT, api.loras.load))  # vLLM's runtime LoRA endpoints
    app.router.add_post("/v1/unload_lora_adapter", guarded(api, Protocol.OPENAI_CHAT, api.loras.unload))
    for surface in surfaces():
        app.router.add_post(surface.path, guarded(api, surface.protocol, _bind(api.generate, surface)))
    app.router.add_post("/v1/messages/count_tokens", guarded(api, Protocol.ANTHROPIC_MESSAGES, api.count_tokens))
    stored = ResponseRoutes(api)
    app.router.add_ws("/v1/responses", responses_socket(api))  # the Responses WebSocket mode (ingest.http.responses_ws)
    app.router.add_get("/v1/responses/:response_id", guarded(api, Protocol.OPENAI_RESPONSES, metered(api, stored.get_response)))
    app.router.add_delete("/v1/responses/:response_id", guarded(api, Protocol.OPENAI_RESPONSES, metered(api, stored.delete_response)))
    app.router.add_post("/v1/responses/:response_id/cancel", guarded(api, Protocol.OPENAI_RESPONSES, metered(api, stored.cancel_response)))
    compaction = CompactionRoutes(api)  # ingest.http.responses_compact
    app.router.add_post("/v1/responses/compact", guarded(api, Protocol.OPENAI_RESPONSES, compaction.compact))
    app.router.add_post("/v1/responses/input_tokens", guarded(api, Protocol.OPENAI_RESPONSES, compaction.input_tokens))
    app.router.add_get("/v1/responses/:response_id/input_items", guarded(api, Protocol.OPENAI_RESPONSES, metered(api, compaction.input_items)))

    lines = BatchLines(api, {s.protocol: s for s in surfaces()})
    _add_batch_routes(app, api, lines)

    async def not_found(http: HttpRequest) -> Response:
        raise ApiError(f"Unknown route: {http.method} {http.url.path.decode(errors='replace')}", status=404, kind="not_found", code="unknown_route")

    app.router.fallback = guarded(api, None, not_found)

    stop_dispatch = asyncio.Event()
    dispatcher = BatchDispatcher(api.redis, settings, lines, node_id=api.node_id)
    tasks: list[asyncio.Task[None]] = []

    async def load_seal() -> None:
        """The deployment's reasoning seal; retried while Redis is down (sealed reasoning sent back before
        then is dropped from prompts, as any that does not open)."""
        while api.sealer is None:
            try:
                api.sealer = await load_sealer(api.redis, keys.SEAL_KEY)
            except RedisError:
                await asyncio.sleep(1.0)

    async def start(_: Application) -> None:
        tasks.append(asyncio.create_task(load_seal()))
        tasks.append(asyncio.create_task(dispatcher.run(stop_dispatch)))
        tasks.append(asyncio.create_task(api.loras.run(stop_dispatch)))

    async def close(_: Application) -> None:
        stop_dispatch.set()
        tasks[0].cancel()  # the seal loader, if Redis never came up
        await asyncio.gather(*tasks, return_exceptions=True)
        await api.tails.close()
        await api.redis.aclose()
        api.tokenizing.close()

    app.on_start += start
    app.on_stop += close
    app.met_api = api  # type: ignore[attr-defined]  # cli.serve flips `draining` on shutdown
    return app
