"""`met`: the command line (typer). Flags default to the environment (`Settings.from_env`); `command()`
shows those defaults in --help."""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any, get_args, get_type_hints

import typer
from rich.markup import escape as rich_escape
from typer.core import TyperOption

from cli import logs
from cli.batch import app as batch_app
from cli.dump import DataDirOption as DumpDataDir
from cli.dump import app as dump_app
from cli.replay import HELP as REPLAY_HELP
from shared.redact import is_secret, redact_url
from shared.settings import CACHE_SALT_POLICIES, QUANTIZATIONS, ROUTINGS, SPECULATIVE, Flag, Settings, flag_of

app = typer.Typer(
    help="Metrale: an LLM inference server speaking OpenAI Chat Completions, OpenAI Responses, legacy OpenAI Completions and Anthropic Messages.",
    no_args_is_help=True,
    add_completion=False,
)

DataDir = Annotated[str | None, typer.Option(help=flag_of("data_dir").help)]


def settings_command(role: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command one flag per Settings field whose metadata names `role` (shared.settings.setting):
    the flags are generated, never copied, so a new setting is one line in Settings. The wrapped function
    takes the resolved `settings` (environment, then flags; validated by `_settings`) and its own
    parameters, which come after the generated flags in --help. Each flag defaults to None, so a flag left
    out falls through to the environment; `command()` shows that value as the flag's default."""

    def wrap(func: Callable[..., None]) -> Callable[..., None]:
        hints = get_type_hints(func, include_extras=True)
        own = [p.replace(annotation=hints[p.name], kind=inspect.Parameter.KEYWORD_ONLY) for p in inspect.signature(func).parameters.values() if p.name != "settings"]
        types = get_type_hints(Settings)
        flags = [
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=_option(f.metadata["flag"], types[f.name]))
            for f in fields(Settings)
            if role in f.metadata["flag"].roles
        ]

        def command(**given: Any) -> None:
            mine = {p.name: given.pop(p.name) for p in own}
            func(_settings(**given), **mine)

        command.__name__, command.__qualname__, command.__doc__ = func.__name__, func.__qualname__, func.__doc__
        command.__signature__ = inspect.Signature([*flags, *own])  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in [*flags, *own]}
        return command

    return wrap


def _option(meta: Flag, kind: Any) -> Any:
    """The typer annotation of one setting's flag: its type made optional (None: not given), a repeated
    flag as a list. A bool is typer's --x/--no-x pair, or only the flag the setting names."""
    base = next((t for t in get_args(kind) if t is not type(None)), kind)
    decls = [meta.flag] if meta.flag else []
    if meta.repeat:
        return Annotated[list[base] | None, typer.Option(*decls, help=meta.help)]  # type: ignore[valid-type]
    return Annotated[base | None, typer.Option(*decls, help=meta.help)]


def _settings(**overrides: object) -> Settings:
    for name in (f.name for f in fields(Settings) if f.metadata["flag"].repeat):  # repeated flags: Settings holds them comma-separated
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
    if settings.routing not in ROUTINGS:
        raise typer.BadParameter(f"{settings.routing!r}: choose one of {', '.join(ROUTINGS)}", param_hint="--routing")
    if settings.speculative not in SPECULATIVE:
        raise typer.BadParameter(f"{settings.speculative!r}: choose one of {', '.join(SPECULATIVE)}", param_hint="--speculative")
    if not 1 <= settings.spec_ngram_min <= settings.spec_ngram_max:
        raise typer.BadParameter(f"{settings.spec_ngram_min}: between 1 and --spec-ngram-max ({settings.spec_ngram_max})", param_hint="--spec-ngram-min")
    if settings.upstream_flavor not in ("vllm", "openai"):
        raise typer.BadParameter(f"{settings.upstream_flavor!r}: use vllm or openai", param_hint="--upstream-flavor")
    if settings.upstream and not settings.upstream.startswith(("http://", "https://")):
        raise typer.BadParameter(f"{settings.upstream!r}: an http(s) URL, e.g. http://127.0.0.1:8080/v1", param_hint="--upstream")
    logs.configure(settings.log_format)
    return settings


def _check_model(settings: Settings) -> None:
    """Refuse, before anything starts, a context window the flags cannot give (models.window) and model
    aliases that name no served model (ingest.parsers.models), and `--lora` adapters it cannot serve (models.adapters);
    on the default model this also converts its GGUF once."""
    from ingest.http.loras import parse_specs
    from ingest.parsers.models import ModelNames
    from models.adapters import AdapterError, Base, check
    from models.window import WindowError, model_folder

    try:
        name, folder = model_folder(settings)
    except WindowError as exc:
        raise typer.BadParameter(str(exc), param_hint="--max-model-len / --rope-scaling / --hf-overrides") from None
    try:
        ModelNames.parse(name, settings.served_model_name, settings.model_alias, accept_any=settings.accept_any_model)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model-alias") from None
    try:
        base = Base.from_folder(folder)
        for _name, path in parse_specs(settings.lora):
            check(Path(path).expanduser(), base=base, max_rank=settings.max_lora_rank)
    except (ValueError, AdapterError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--lora") from None


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
@settings_command("serve")
def serve(
    settings: Settings,
    no_tui: Annotated[bool, typer.Option("--no-tui", help="On a terminal, log lines instead of the `met top` dashboard.")] = False,
) -> None:
    """Run everything: embedded Redis (unless --redis-url), the API and N workers. Ctrl-C stops all."""
    tui = not no_tui and sys.stdin.isatty() and sys.stdout.isatty()
    _check_tool_parser(settings)
    _check_model(settings)
    yield_to_upstream(settings)  # before Redis and the workers start: they inherit it
    from cli.serve import serve as run

    run(settings, tui=tui)


@app.command()
@settings_command("api")
def api(settings: Settings) -> None:
    """Run only the API role against --redis-url (what compose and multi-node setups use)."""
    from cli.serve import run_api
    from shared.event_loop import run_loop

    if not settings.redis_url:
        raise typer.BadParameter("`met api` needs --redis-url (or REDIS_URL)", param_hint="--redis-url")
    _check_model(settings)
    run_loop(run_api(settings))


@app.command()
@settings_command("worker")
def worker(settings: Settings) -> None:
    """Run one worker: claim requests from --redis-url, generate (or, with --upstream, stream from the upstream), append deltas."""
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
def replay(  # noqa: PLR0913 (one parameter per flag of replay's own, none a setting)
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
