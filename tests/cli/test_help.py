"""`met <command> --help` names itself `met` and shows, for every flag backed by a setting, the value it
takes when not given: the environment's, else the built-in default; never a secret."""

from __future__ import annotations

import os
import subprocess
import sys

from shared.settings import Settings

from ..conftest import ROOT


def help_text(*args: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MET_") and k != "REDIS_URL"} | {"COLUMNS": "250"} | env
    done = subprocess.run([sys.executable, "-m", "cli.main", *args, "--help"], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def flag_line(text: str, flag: str) -> str:
    """The help row of `flag`, with its wrapped continuation rows joined."""
    rows = text.splitlines()
    start = next(i for i, row in enumerate(rows) if row.startswith(f"│ {flag} "))
    end = next((i for i in range(start + 1, len(rows)) if not rows[i].startswith("│    ")), len(rows))
    return " ".join(" ".join(rows[start:end]).replace("│", " ").split())


def test_serve_help_says_met_and_shows_each_default() -> None:
    text = help_text("serve")
    assert "Usage: met serve" in text
    defaults = Settings()
    assert flag_line(text, "--port").endswith(f"[default: {defaults.port}]")
    assert flag_line(text, "--max-running").endswith(f"[default: {defaults.max_running}]")
    assert flag_line(text, "--request-timeout").endswith(f"[default: {defaults.request_timeout}]")
    assert flag_line(text, "--prefix-cache").endswith("[default: --prefix-cache]")  # the flag that is on
    assert flag_line(text, "--redis-cluster").endswith("[default: off]")


def test_the_environment_is_the_default_shown_and_secrets_never_are() -> None:
    text = help_text("api", MET_PORT="9123", MET_API_KEYS="sk-never-shown", REDIS_URL="redis://:hunter2@db:6379/0")
    assert flag_line(text, "--port").endswith("[default: 9123]")
    assert flag_line(text, "--redis-url").endswith("[default: redis://:[redacted]@db:6379/0]")
    assert "sk-never-shown" not in text and "hunter2" not in text
    assert "[default" not in flag_line(text, "--api-key")
