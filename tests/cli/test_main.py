"""cli/main.py generates the `serve`, `api` and `worker` flags from Settings' field metadata
(shared.settings.setting): each command has exactly the settings its roles name, with their help, and a
flag given reaches Settings while one left out keeps the environment's value."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import fields
from typing import Annotated, Any

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from cli.main import app, settings_command
from shared.settings import Settings, flag_of


@pytest.fixture(autouse=True)
def keep_root_logging() -> Iterator[None]:
    """`_settings` installs the process's log handler; put the root logger back after each test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_each_command_has_a_flag_for_exactly_the_settings_its_role_takes() -> None:
    group: Any = get_command(app)
    for role in ("serve", "api", "worker"):
        params = {p.name: p for p in group.commands[role].params}
        for f in fields(Settings):
            meta = flag_of(f.name)
            assert (f.name in params) == (role in meta.roles), (role, f.name)
            if f.name in params:
                assert params[f.name].help == meta.help
                assert params[f.name].default is None  # left out: the environment's value stands
    serve = {p.name for p in group.commands["serve"].params}
    assert serve >= {p.name for p in group.commands["api"].params} | {p.name for p in group.commands["worker"].params}
    assert "no_tui" in serve  # the command's own parameter, beside the generated ones


def probe_app(seen: dict[str, Any]) -> typer.Typer:
    probe = typer.Typer()

    @probe.command()
    @settings_command("serve")
    def run(settings: Settings, label: Annotated[str, typer.Option(help="the command's own flag")] = "none") -> None:
        seen["settings"], seen["label"] = settings, label

    return probe


def test_flags_given_reach_settings_and_those_left_out_keep_the_environment() -> None:
    seen: dict[str, Any] = {}
    env = {"MET_MAX_QUEUE": "7", "MET_PORT": "9000", "REDIS_URL": "redis://db:6379/0"}
    args = ["--port", "9001", "--api-key", "k1", "--api-key", "k2", "--no-prefix-cache", "--redis-cluster", "--lease", "2.5", "--label", "x"]
    done = CliRunner().invoke(probe_app(seen), args, env=env)
    assert done.exit_code == 0, done.output
    settings: Settings = seen["settings"]
    assert (settings.port, settings.max_queue, settings.api_keys, settings.lease_s) == (9001, 7, "k1,k2", 2.5)
    assert settings.prefix_cache is False and settings.redis_url == "redis+cluster://db:6379/0"  # --redis-cluster, a single flag
    assert seen["label"] == "x"
    assert settings.default_temperature is None  # a sampling default nobody set stays unset


def test_a_flag_value_is_checked_before_the_command_runs() -> None:
    seen: dict[str, Any] = {}
    done = CliRunner().invoke(probe_app(seen), ["--cache-salt", "everyone"])
    assert done.exit_code == 2 and "--cache-salt" in done.output
    assert not seen
    done = CliRunner().invoke(probe_app(seen), ["--max-running", "many"])
    assert done.exit_code == 2 and "--max-running" in done.output
    for bad, flag in ((["--speculative", "eagle"], "--speculative"), (["--spec-ngram-min", "5"], "--spec-ngram-min")):
        done = CliRunner().invoke(probe_app(seen), bad)
        assert done.exit_code == 2 and flag in done.output, done.output
        assert not seen


def test_serve_gives_each_of_several_workers_its_share_of_the_cores_unless_threads_is_set() -> None:
    import os

    from cli.serve import worker_settings

    cores = os.cpu_count() or 1
    assert worker_settings(Settings(workers=1)).threads == 0  # one worker: torch's default, every core
    assert worker_settings(Settings(workers=2)).threads == max(1, cores // 2)
    assert worker_settings(Settings(workers=cores * 4)).threads == 1
    assert worker_settings(Settings(workers=3, threads=5)).threads == 5
