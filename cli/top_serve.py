"""`met top` as the screen of `met serve` on a terminal.

How: the dashboard runs as a child process (`met top`, attached to the serve's Redis through the
environment, so no password sits in a process listing) that owns the terminal; `met serve` keeps its
own shutdown path untouched. While the dashboard is up, the serve process's stdout/stderr (and so
the workers it spawns afterwards, which inherit them) go to `<data_dir>/serve.log`, so no log line
draws over the screen.

Quitting the dashboard (q or Ctrl-C; Textual reads Ctrl-C as a key in raw mode, so no SIGINT
reaches anyone) gives the terminal back and sends SIGINT to the serve process: exactly what Ctrl-C
does without the dashboard (workers drain, the API stops, the embedded Redis stops, and the drain is
logged on the terminal). If the dashboard crashes instead, serve goes on with plain logs. When serve
stops for another reason (SIGTERM, a startup failure), `stop()` asks the dashboard to quit first.

Owns: the child process, the saved terminal file descriptors and the watcher thread. Must not:
read Redis (the child does) or decide how serve shuts down (it only raises the same SIGINT).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from shared.settings import Settings


class Dashboard:
    def __init__(self, settings: Settings, *, env: dict[str, str]) -> None:
        self.settings = settings
        self.env = env
        self.log_path = Path(settings.data_dir) / "serve.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._terminal: tuple[int, int] | None = None  # our saved stdout / stderr
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Hand the terminal to `met top` and send our own output (and later children's) to the log file."""
        title = f"serving http://{self.settings.host}:{self.settings.port}/v1 · logs {self.log_path}"
        sys.stdout.flush()
        sys.stderr.flush()
        self._terminal = (os.dup(1), os.dup(2))
        with open(self.log_path, "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "top", "--title", title],
            env=self.env,
            stdout=self._terminal[0],
            stderr=self._terminal[1],
        )
        threading.Thread(target=self._watch, name="met-top-watch", daemon=True).start()

    def _watch(self) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        self._give_back_terminal()
        if self._stopping.is_set():
            return
        if code == 0:
            print(f"Dashboard closed: stopping Metrale (logs in {self.log_path}).", flush=True)
            os.kill(os.getpid(), signal.SIGINT)  # the same path as Ctrl-C without the dashboard
        else:
            print(f"The dashboard exited with {code}; logging here instead. Ctrl-C stops Metrale.", flush=True)

    def _give_back_terminal(self) -> None:
        with self._lock:
            if self._terminal is None:
                return
            sys.stdout.flush()
            sys.stderr.flush()
            out, err = self._terminal
            os.dup2(out, 1)
            os.dup2(err, 2)
            os.close(out)
            os.close(err)
            self._terminal = None

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the dashboard to quit (SIGTERM: it exits cleanly and restores the terminal), then take the terminal back."""
        self._stopping.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._give_back_terminal()
