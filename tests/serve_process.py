"""The real ``edgesync serve`` in a subprocess on a free loopback port, for the server tests and
``benchmarks/serve.py``: start it, wait until it answers ``/health``, stop it with SIGTERM."""

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
    ``stop()`` returns its exit status. Raises RuntimeError when it does not come up."""

    def __init__(self, store: Path, *args: str, env: dict | None = None, timeout_s: float = 180.0) -> None:
        self.store = Path(store)
        self.args = list(args)
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._err: list[str] = []

    def start(self) -> "ServeProcess":
        cmd = [sys.executable, "-m", "edgesync_engines.app.cli", "serve", "--port", "0", "--store", str(self.store),
               *self.args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._drain, daemon=True).start()
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

    def __enter__(self) -> "ServeProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
