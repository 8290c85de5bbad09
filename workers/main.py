"""`met worker`: load the model, build the engine, run the loop until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import secrets
import signal
import socket
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.exceptions import RedisError

from bus.connect import DEFAULT_MAX_CONNECTIONS, connect
from models.files import local_folder
from models.generation import sampling_defaults
from models.prompt import PromptRenderer
from models.window import describe, model_folder
from shared import keys
from shared.event_loop import settle_heap
from shared.seal import load_sealer
from shared.settings import Settings
from workers.engine import Engine
from workers.loop import WorkerLoop, torch_thread

log = logging.getLogger("met.worker")
T = TypeVar("T")


def build_engine(settings: Settings) -> tuple[Engine, dict[str, str]]:
    name, folder = model_folder(settings)
    renderer = PromptRenderer.load(folder, name=name, max_model_len=settings.max_model_len)
    renderer.info = replace(renderer.info, sampling_defaults=sampling_defaults(settings, renderer.info.sampling_defaults))
    log.info("sampling defaults (a request's own values win): %s", renderer.info.sampling_defaults or "none (fallback)")
    log.info("%s", describe(folder))
    if settings.model_impl == "sim":
        return _simulated_engine(settings, renderer, name)
    import torch

    from workers import kernels, llama
    from workers.runner import TorchRunner, load, pick_device, pick_dtype

    device, dtype = pick_device(settings.device), pick_dtype(settings.dtype)
    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    log.info("torch threads: %d%s", torch.get_num_threads(), "" if settings.threads > 0 else " (torch's default; --threads)")
    model, lean, config = load(folder, device=device, dtype=dtype, model_impl=settings.model_impl, max_len=renderer.info.max_model_len)
    runner = TorchRunner(
        model,
        lean=lean,
        config=config,
        max_len=renderer.info.max_model_len,
        kv_budget_mb=kv_budget_mb(settings, device),
        device=device,
        dtype=dtype,
        model_impl=settings.model_impl,
    ).quantize(settings.quantization)
    runner.enable_adapters(max_loras=settings.max_loras, max_rank=settings.max_lora_rank)  # after quantize: the hf path hooks the modules that run
    runner.batch_invariant = settings.batch_invariant
    kernels.ENABLED = settings.row_invariant
    if runner.lean is not None and device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and runner.quantization == "none":
        found = kernels.probe_all(llama.weight_shapes(runner.lean), kernels.BF16 if dtype == torch.bfloat16 else kernels.F32)
        log.info("kernels: %s CPU, MKL_CBWR=%s, rows per GEMM call %s (workers.kernels)", kernels.cpu_kind(), os.environ.get("MKL_CBWR"), found)
    runner.eos_ids = renderer.info.eos_token_ids  # min_tokens bans these until reached
    runner.tokenizer = renderer.tokenizer  # DRY sequence breakers are tokenized with it
    engine = Engine(
        runner,
        renderer.tokenizer,
        renderer.info,
        settings=settings,
    )
    engine.score_prompt = runner.score_prompt  # echo + logprobs on legacy completions
    info = {
        "model": settings.served_model_name or name,
        "device": str(device),
        "dtype": settings.dtype,
        "model_impl": "lean" if runner.lean is not None else "hf",
        "quantization": runner.quantization,
        "cpu": kernels.cpu_kind() if device.type == "cpu" else device.type,
        "bf16_rows_per_call": kernels.rows_per_call(),  # where a CPU's GEMM picks kernels by row count (AMX): calls cut to this (--row-invariant)
        "projections": runner.wide_mode,  # which rows multiply in float32 where bf16 is emulated: off | auto | prompt (--batch-invariant)
        "kv_blocks": str(runner.num_blocks),
        "kv_block_size": str(runner.block_size),
        "kv_bytes": str(runner.kv_bytes),
        "max_model_len": str(renderer.info.max_model_len),
    }
    return engine, info


def kv_budget_mb(settings: Settings, device: Any) -> int:
    """The KV pool's MiB: `--kv-budget-mb`, else 0 (the runner takes the default share of free memory),
    except for the workers of `met serve --workers N` on a CPU, which split that share (each would otherwise
    take all of it: 3 x 8.7 GB on a 24 GB machine, session 21). After the weights are loaded."""
    if settings.kv_budget_mb or settings.workers < 2 or device.type != "cpu":
        return settings.kv_budget_mb
    from workers.kv_cache import default_budget_mb

    share = max(1, default_budget_mb(device, sharers=settings.workers))
    log.info("KV cache: the default share of free memory split among %d workers: %d MiB each", settings.workers, share)
    return share


def _simulated_engine(settings: Settings, renderer: PromptRenderer, name: str) -> tuple[Engine, dict[str, str]]:
    """`--model-impl sim` (workers/sim.py): the engine on a runner that waits instead of computing."""
    from workers.sim import SimRunner

    runner = SimRunner(renderer.tokenizer, max_len=renderer.info.max_model_len, step_s=settings.sim_step_ms / 1000)
    engine = Engine(runner, renderer.tokenizer, renderer.info, settings=settings)
    log.warning("simulated engine: no model runs; every step waits %.1f ms and emits text from a fixed passage", settings.sim_step_ms)
    info = {
        "model": settings.served_model_name or name,
        "device": "sim",
        "dtype": "",
        "model_impl": "sim",
        "kv_blocks": str(runner.num_blocks),
        "kv_block_size": str(runner.block_size),
        "kv_bytes": "0",
        "max_model_len": str(renderer.info.max_model_len),
    }
    return engine, info


async def load_engine(settings: Settings) -> tuple[Engine, dict[str, str], ThreadPoolExecutor]:
    """`build_engine` on a new torch thread, the one that will step it (`WorkerLoop` says why only one)."""
    stepper = torch_thread()
    engine, info = await asyncio.get_running_loop().run_in_executor(stepper, build_engine, settings)
    return engine, info, stepper


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: blocks up to this size come from the heap, not mmap
TRIM_THRESHOLD = 2**30  # free memory the heap keeps before it gives any back


def keep_freed_memory() -> bool:
    """After the load, tell glibc's malloc to keep freed memory for the next allocation (where glibc is
    the C library; elsewhere nothing changes). A step allocates and frees tens of MB of temporaries
    (gathered keys and values, their transposed copies), and by default glibc hands large freed blocks
    back to the kernel: the next step then page-faults and zeroes the same memory again. On 2 cores
    that doubled the decode attention of 32 sequences over 1,024 keys (a layer: 14-19 ms, 9-10 ms with
    this; bench/RESULTS.md, session 8). The price: the worker's RSS stays at its busiest step's
    high-water mark. There is no torch or Python setting for it, and jemalloc/tcmalloc would have to be
    preloaded before the process starts, which `met worker` run by hand cannot do for itself."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    log.info("malloc: freed memory %s (mallopt)", "kept for reuse" if done else "handled as glibc's default")
    return done


def redis_client(url: str, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> Redis:
    """The worker's client: one quick retry per command (bus.connect.quick_retry) and a short connect
    timeout. The loop rides out a longer outage itself (workers.claims), stepping on while it waits."""
    return connect(url, max_connections=max_connections, socket_connect_timeout=2.0)


async def run_worker(settings: Settings) -> None:
    assert settings.redis_url, "a worker needs --redis-url"
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    worker_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
    if settings.upstream:  # a gateway worker (workers/gateway.py): the model runs on the upstream
        await _run_gateway(settings, worker_id=worker_id, stop=stop)
        return
    engine, info, stepper = await load_engine(settings)
    keep_freed_memory()
    settle_heap()  # the model and tokenizer are loaded: out of the garbage collector's way (shared.event_loop)
    redis = redis_client(settings.redis_url, settings.redis_max_connections)
    engine.sealer = await _until_redis_answers(lambda: load_sealer(redis, keys.SEAL_KEY))
    loop = WorkerLoop(redis, engine, settings=settings, worker_id=worker_id, info=info, stepper=stepper)
    log.info("worker %s ready: %s", worker_id, info)
    try:
        await loop.run(stop)
    finally:
        await redis.aclose()


async def _until_redis_answers(call: Callable[[], Awaitable[T]]) -> T:
    """`call()`, retried while Redis does not answer (it may be starting or restarting): the model is loaded."""
    wait = 0.1
    while True:
        try:
            return await call()
        except RedisError as exc:
            log.warning("redis unavailable (%s); retrying in %.1f s", type(exc).__name__, wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, 2.0)


async def _run_gateway(settings: Settings, *, worker_id: str, stop: asyncio.Event) -> None:
    from models.tokenizer import load_tokenizer
    from workers.gateway import run_gateway

    assert settings.redis_url
    name, folder = await asyncio.to_thread(local_folder, settings.model, settings.model_cache)
    tokenizer = await asyncio.to_thread(load_tokenizer, folder)  # usage an upstream does not send; specials to escape

    redis = redis_client(settings.redis_url, settings.redis_max_connections)
    try:
        await run_gateway(redis, settings, worker_id=worker_id, model=settings.served_model_name or name, stop=stop, tokenizer=tokenizer)
    finally:
        await redis.aclose()

