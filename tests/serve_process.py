"""The real ``edgesync serve`` in a subprocess on a free loopback port, for the server tests and
``benchmarks/serve.py``: start it, wait until it answers ``/health``, stop it with SIGTERM; and
the processes it started (``/proc``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"listening on http://([0-9.]+):(\d+)/v1")


class ServeProcess:
    """``python -m edgesync_engines.app.cli serve --port 0 --store STORE ARGS...`` (context
    manager). ``port``, ``base_url`` (``.../v1``) once started; ``stderr()`` what it printed;
    ``stop()`` returns its exit status; ``spawn()`` starts it without waiting for it to listen.
    Raises RuntimeError when it does not come up."""

    def __init__(self, store: Path, *args: str, env: dict | None = None, timeout_s: float = 180.0) -> None:
        self.store = Path(store)
        self.args = list(args)
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._err: list[str] = []

    def spawn(self, **popen) -> "ServeProcess":
        """Start the process and return at once (``popen``: more ``subprocess.Popen`` arguments)."""
        cmd = [sys.executable, "-m", "edgesync_engines.app.cli", "serve", "--port", "0", "--store", str(self.store),
               *self.args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)
        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def start(self) -> "ServeProcess":
        self.spawn()
        deadline = time.monotonic() + self.timeout_s
        while self.port is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"edgesync serve did not start: {self.stderr()}")
            time.sleep(0.1)
        return self

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self._err.append(line)
            m = LISTENING.search(line)
            if m:
                self.port = int(m.group(2))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def health(self) -> dict:
        """``GET /health`` as a dict."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=10) as r:
            return json.loads(r.read())

    def stderr(self) -> str:
        return "".join(self._err)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, wait; SIGKILL after ``timeout_s``. Returns the exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def worker_pids(self) -> list[int]:
        """The pids of the worker processes the server has started so far (its children that
        ``multiprocessing`` spawned, read from ``/proc``: Linux)."""
        return children(self.proc.pid, "spawn_main")

    def __enter__(self) -> "ServeProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def children(pid: int, marker: str = "") -> list[int]:
    """The live child processes of ``pid`` whose command line holds ``marker`` (``/proc``: Linux)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]  # after "pid (comm) "
        if int(ppid) == pid and state != "Z" and marker in cmdline:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """``pid`` is a running process: one of its threads has not exited (a killed process's
    leader shows as a zombie while its other threads still exit, and its files, the store's
    locks among them, are released only when the last one has)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:  # that thread is gone
            continue
        if stat[stat.rindex(")") + 2] not in "ZX":
            return True
    return False
