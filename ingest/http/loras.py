"""The LoRA adapters a deployment serves, by model name: registered in Redis, resolved on every API node.

An adapter is registered with `--lora NAME=PATH` (at an API node's start) or vLLM's
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}`, and removed with `POST /v1/unload_lora_adapter
{"lora_name"}`. Registering checks the folder (`models.adapters.check`: peft's format, the base model's
shapes, `--max-lora-rank`) and refuses a bad one naming the file, so nothing unservable is ever named;
the entry (absolute path, rank, modules) goes into the hash `keys.LORAS`, which every API node reads
(`refresh`, each second, and at once after its own change). A request whose `model` is a registered
name gets `adapter` and `adapter_path` in its IR (`resolve`), so a worker loads the adapter from that
path on first use (workers.lora: the folder must be reachable there too, e.g. one volume mounted at the
same path in compose) and a resume, replay or batch line keeps it. `/v1/models` lists each adapter with
the base model as `parent` (vLLM's cards). With API keys set, only an `--admin-key` may load or unload.

Must not: import torch or load the adapter's tensors (the worker does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
from blacksheep import Content, Response
from blacksheep import Request as HttpRequest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from ingest.http.auth import ANONYMOUS, caller_id, caller_of
from ingest.http.limits import parse_json, read_body
from models.adapters import AdapterError, Base, check
from shared import keys
from shared.errors import ApiError, invalid
from shared.ir import Request
from shared.settings import Settings

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # how stale another node's registration may be here


def parse_specs(specs: str) -> list[tuple[str, str]]:
    """`--lora` values "NAME=PATH,..." → [(name, path)]; ValueError naming a malformed one."""
    pairs = []
    for spec in (s.strip() for s in specs.split(",") if s.strip()):
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora {spec!r}: expected NAME=PATH (a folder with adapter_config.json and adapter_model.safetensors)")
        pairs.append((name.strip(), path.strip()))
    return pairs


class Loras:
    def __init__(self, redis: Redis, settings: Settings, *, base_folder: str, reserved: tuple[str, ...], parent: str) -> None:
        self.redis = redis
        self.settings = settings
        self.base = Base.from_folder(base_folder) if base_folder else None
        self.reserved = frozenset(reserved)  # the served names and alias patterns: no adapter may take one
        self.parent = parent
        self.known: dict[str, dict[str, Any]] = {}  # name → {"path", "rank", "modules", "created"}
        self.admins = frozenset(caller_id(k.strip()) for k in settings.admin_keys.split(",") if k.strip())

    def entry(self, name: str, path: str) -> dict[str, Any]:
        """The registry entry of a folder this server can serve, or a 400 naming `lora_path` and the file."""
        if not name or name in self.reserved:
            raise invalid(f"'lora_name' must be a new model name, not {name!r} (a served model name or alias).", "lora_name", "invalid_value")
        folder = Path(path).expanduser().resolve()
        try:
            summary = check(folder, base=self.base, max_rank=self.settings.max_lora_rank)
        except AdapterError as exc:
            raise invalid(f"The LoRA adapter '{name}' cannot be loaded: {exc}", "lora_path", "invalid_lora_adapter") from exc
        return {"path": str(folder), "rank": summary.rank, "modules": list(summary.modules), "created": int(time.time())}

    async def register_flags(self) -> None:
        """Register the `--lora` adapters (the CLI checked them before the app was built)."""
        for name, path in parse_specs(self.settings.lora):
            await self.redis.hset(keys.LORAS, name, orjson.dumps(self.entry(name, path)))

    async def run(self, stop: asyncio.Event) -> None:
        """`--lora` registered (retried while Redis is down), then `known` refreshed each REFRESH_S."""
        registered = False
        while not stop.is_set():
            try:
                if not registered:
                    await self.register_flags()
                    registered = True
                await self.refresh()
            except RedisError:
                pass  # the next second tries again; requests resolve with what was last read
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), REFRESH_S)

    async def refresh(self) -> None:
        raw = await self.redis.hgetall(keys.LORAS)
        self.known = {(k.decode() if isinstance(k, bytes) else k): orjson.loads(v) for k, v in raw.items()}

    def serves(self, name: str) -> bool:
        """Whether `name` is a registered adapter's (a served model's name or alias never is)."""
        return name in self.known and name not in self.reserved

    def resolve(self, request: Request) -> Request:
        """The request on the adapter its `model` names (unchanged when it names none)."""
        if not self.serves(request.model):
            return request
        return replace(request, adapter=request.model, adapter_path=self.known[request.model]["path"])

    def cards(self, base: dict[str, Any]) -> list[dict[str, Any]]:
        return [{**base, "id": name, "root": e["path"], "parent": self.parent, "created": e["created"], "lora_rank": e["rank"]} for name, e in sorted(self.known.items())]

    def _admin(self, http: HttpRequest) -> None:
        if self.admins and caller_of(http) in self.admins:
            return
        if caller_of(http) == ANONYMOUS:  # no key configured: every route is open, these too
            return
        raise ApiError("Loading and unloading LoRA adapters needs an admin key (--admin-key).", status=403, kind="permission", code="admin_key_required")

    async def _body(self, http: HttpRequest, *names: str) -> dict[str, str]:
        body = parse_json(await read_body(http, self.settings.max_body_bytes, timeout_s=self.settings.body_timeout), self.settings.max_json_depth)
        if not isinstance(body, dict):
            raise invalid("The body must be a JSON object.", None)
        for name in names:
            if not isinstance(body.get(name), str) or not body[name].strip():
                raise invalid(f"'{name}' is required: a non-empty string.", name, "missing_required_parameter")
        return {name: body[name].strip() for name in names}

    async def load(self, http: HttpRequest) -> Response:
        """vLLM's `POST /v1/load_lora_adapter`: 200 once registered; 400 when the name is taken or the folder bad."""
        self._admin(http)
        body = await self._body(http, "lora_name", "lora_path")
        name = body["lora_name"]
        entry = self.entry(name, body["lora_path"])
        if not await self.redis.hsetnx(keys.LORAS, name, orjson.dumps(entry)):
            raise invalid(f"The lora adapter '{name}' has already been loaded.", "lora_name", "lora_already_loaded")
        self.known[name] = entry
        log.info("LoRA adapter %r registered from %s (rank %d: %s)", name, entry["path"], entry["rank"], ", ".join(entry["modules"]))
        return _text(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, http: HttpRequest) -> Response:
        """vLLM's `POST /v1/unload_lora_adapter`: 200 once removed (requests already queued keep it); 404 when unknown."""
        self._admin(http)
        name = (await self._body(http, "lora_name"))["lora_name"]
        if not await self.redis.hdel(keys.LORAS, name):
            raise ApiError(f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name", kind="not_found", code="lora_not_found")
        self.known.pop(name, None)
        log.info("LoRA adapter %r unregistered", name)
        return _text(f"Success: LoRA adapter '{name}' removed successfully.")


def _text(message: str) -> Response:
    """vLLM answers these endpoints with a plain-text line."""
    return Response(200, [(b"Cache-Control", b"no-cache")], Content(b"text/plain; charset=utf-8", message.encode()))

