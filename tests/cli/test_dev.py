"""`./dev met <subcommand> …` runs any `met` subcommand from this checkout, as the README's examples do."""

from __future__ import annotations

import hashlib
import subprocess

import pytest

from ..conftest import ROOT, LiveServer

pytestmark = pytest.mark.e2e


def dev(*args: str) -> subprocess.CompletedProcess[str]:
    stamp = ROOT / ".venv" / ".metrale-installed"
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    assert stamp.exists() and stamp.read_text().strip() == wanted, "set up the venv first (./dev test): this test must not install"
    return subprocess.run(["./dev", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_dev_met_runs_any_met_subcommand(live_server: LiveServer) -> None:
    helped = dev("met", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "Usage: met " in helped.stdout  # not `python -m cli.main`
    for command in ("serve", "top", "dump", "replay", "api", "worker"):
        assert command in helped.stdout
    listed = dev("met", "dump", "list", "--since", "1h", "--redis-url", live_server.redis_url)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split()[:2] == ["ID", "RECEIVED"] or listed.stdout.startswith("No requests recorded")
    wrong = dev("met", "dump", "show", "no-such-request", "--redis-url", live_server.redis_url)
    assert wrong.returncode == 1 and "No request no-such-request" in wrong.stderr


def test_dev_without_a_known_command_says_how_to_use_it() -> None:
    done = dev("nonsense")
    assert done.returncode == 2 and "./dev met <subcommand>" in done.stderr


def test_a_second_serve_on_a_used_port_refuses_before_touching_the_running_one(live_server: LiveServer) -> None:
    """Before: it asked the first server whether it was ready (a false "Metrale ready"), failed to bind,
    and deleted the running server's `redis.url` on its way out (its `met top` / `met dump` then broke)."""
    marker = live_server.data_dir / "redis.url"
    before = marker.read_text()
    port = live_server.base_url.rsplit(":", 1)[1]
    second = dev("met", "serve", "--no-tui", "--port", port, "--data-dir", str(live_server.data_dir))
    assert second.returncode == 3, second.stdout + second.stderr
    assert f"127.0.0.1:{port} is in use" in second.stderr and "Metrale ready" not in second.stdout
    assert marker.read_text() == before
    assert live_server.redis().ping() and live_server.proc.poll() is None
