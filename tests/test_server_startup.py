"""``edgesync serve`` while its workers start (the real server, two workers loading the real
SmolLM2). It answers nothing, ``/health`` included, until every worker can serve, and a request
sent the moment ``/health`` says 200 is answered; the workers start before the server imports
its HTTP stack (which they never import), and a server that cannot make its HTTP server stops
them. A SIGTERM to the server, or a Ctrl-C to its process group, stops every worker it started
and exits with one line, no traceback, leaving the store free; a server SIGKILLed while its
workers load the engine leaves no worker behind either (each one's watch on its parent,
``server/parent_watch.py``). The waits are bounded and generous: what is asserted is what
happens, not how fast."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.serve_process import ROOT, ServeProcess, alive, children

pytestmark = [pytest.mark.model, pytest.mark.server]

WAIT_S = 120.0
"""Seconds any wait here may take before the test fails (the workers load in about a second)."""
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING) ")
"""A log line of the server's (a warning such as more workers than the CPUs the test's pytest
worker is pinned to is not an error)."""


def _wait_for(condition, what: str, timeout_s: float = WAIT_S):
    """Poll ``condition`` until it returns something true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    pytest.fail(f"not within {timeout_s:.0f} s: {what}")


def _store_free(store: Path) -> bool:
    """No process has the store open: its open lock (``edgesync.lock``, held shared by every
    process that opened the store) can be taken exclusively, or nobody ever opened it."""
    lock = store / "edgesync.lock"
    if not lock.exists():
        return True
    with open(lock, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
    return True


CONSOLE_SCRIPT = "import sys; from edgesync_engines.app.cli_entry import main; sys.exit(main())"
"""What the ``edgesync`` console script runs (``app/cli_entry.py``: for ``serve``, the first worker
is started before the command line is imported, ``server/early.py``)."""
ENTRIES = ["module", "console script"]


class ConsoleServe:
    """``edgesync serve --port 0 --store STORE ARGS...`` through the console script's entry point,
    with :class:`ServeProcess`'s ``proc``, ``spawn``, ``worker_pids``, ``stderr`` and ``stop``."""

    def __init__(self, store: Path, *args: str) -> None:
        self.cmd = [sys.executable, "-c", CONSOLE_SCRIPT, "serve", "--port", "0", "--store", str(store), *args]
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []

    def spawn(self, **popen) -> "ConsoleServe":
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, **popen)
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()
        return self

    def worker_pids(self) -> list[int]:
        return children(self.proc.pid, "spawn_main")

    def stderr(self) -> str:
        return "".join(self.lines)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _serve(entry: str, store: Path, *args: str):
    """The server of ``entry`` (not started): ``python -m edgesync_engines.app.cli``, or the console script's."""
    return ServeProcess(store, *args) if entry == "module" else ConsoleServe(store, *args)


def _spawned(tmp_path: Path, entry: str = "module") -> tuple[ServeProcess, list[int]]:
    """``edgesync serve --workers 2`` in a process group of its own, and its two workers' pids
    as soon as both processes exist."""
    serve = _serve(entry, tmp_path / "store", "--workers", "2").spawn(start_new_session=True)
    try:
        workers = _wait_for(lambda: (pids := serve.worker_pids()) and len(pids) == 2 and pids, "two workers started")
    except BaseException:
        serve.proc.kill()
        raise
    return serve, workers


def _reap(serve: ServeProcess, workers) -> None:
    """Kill whatever a failed test left running: the server and its workers."""
    if serve.proc.poll() is None:
        serve.proc.kill()
    for pid in workers:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["sigterm", "ctrl-c"])
def test_a_stop_while_the_workers_start_stops_them(tmp_path, sig, group, entry):
    serve, workers = _spawned(tmp_path, entry)
    try:
        (os.killpg if group else os.kill)(serve.proc.pid, sig)
        assert serve.proc.wait(WAIT_S) == 128 + sig
        _wait_for(lambda: not any(alive(pid) for pid in workers), f"workers {workers} gone")
    finally:
        _reap(serve, workers)
    time.sleep(0.2)  # the last lines of the stderr reader
    err = serve.stderr()
    assert "listening" not in err  # stopped during the start, as meant
    assert "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.strip() and not LOG_LINE.match(line)] == [
        f"error: stopped by {signal.Signals(sig).name} while the workers were starting; they are stopped"]
    assert _store_free(tmp_path / "store")


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_server_killed_while_its_workers_load_leaves_none_behind(tmp_path, entry):
    serve, workers = _spawned(tmp_path, entry)
    try:
        # the workers open the store as they load the engine: kill the server then
        _wait_for(lambda: (tmp_path / "store" / "edgesync.lock").exists(), "the store opened")
        serve.proc.kill()
        serve.proc.wait(WAIT_S)
        assert "listening" not in serve.stderr()  # killed during the start, as meant
        _wait_for(lambda: not any(alive(pid) for pid in workers), f"workers {workers} gone")
    finally:
        _reap(serve, workers)
    assert _store_free(tmp_path / "store")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("entry", ENTRIES)
def test_health_answers_only_once_every_worker_can_serve(tmp_path, entry):
    port = _free_port()
    serve = _serve(entry, tmp_path / "store", "--workers", "2", "--port", str(port)).spawn()
    workers: list[int] = []
    answered_before: list[int] = []  # statuses answered while the workers loaded: none
    try:
        # the socket is bound before the workers start; nothing is answered until they are ready
        workers = _wait_for(lambda: (pids := serve.worker_pids()) and len(pids) == 2 and pids, "two workers started")
        deadline = time.monotonic() + WAIT_S
        health = None
        while health is None:
            assert serve.proc.poll() is None, serve.stderr()
            assert time.monotonic() < deadline, "no /health answer"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=0.2) as r:
                    health = json.loads(r.read())
            except urllib.error.HTTPError as exc:
                answered_before.append(exc.code)
            except OSError:  # not answered yet: the connection waits in the socket's queue
                time.sleep(0.01)
        assert answered_before == []
        assert health["status"] == "ok" and sorted(health["worker_pids"]) == sorted(workers)
        body = json.dumps({"model": "any", "prompt": "The capital of France is", "max_tokens": 1}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=WAIT_S) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] == 1
    finally:
        serve.stop()
        _reap(serve, workers)


def test_the_workers_and_the_pool_import_no_part_of_the_http_stack():
    """A worker imports its engine, not FastAPI or uvicorn (its start would pay for them), and the
    server imports them only once its workers are started (``cli_serve.http_server``)."""
    code = ("import sys\n"
            "import edgesync_engines.app.cli_serve, edgesync_engines.server.pool, edgesync_engines.server.security\n"
            "from edgesync_engines.request.router import EdgeSync\n"
            "from edgesync_engines.server import SERVER_MODULES\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in SERVER_MODULES + ('starlette',)))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=WAIT_S)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_server_that_cannot_make_its_http_server_stops_its_workers(tmp_path, monkeypatch):
    """The HTTP server is made while the workers load: when that fails (here: a module of the
    server extra that cannot be imported), the workers started are stopped, the port freed, and
    the command fails with the extra named in one line."""
    from edgesync_engines.app import cli, cli_serve
    from edgesync_engines.server import pool
    from edgesync_store.errors import MissingExtraError

    events = []

    class Pool:
        def __init__(self, settings, n_workers, **kwargs):
            self.n_workers = n_workers

        def spawn(self, early=None):
            events.append("spawn")
            return self

        def wait_ready(self, should_stop=None):
            events.append("wait_ready")
            return self

        def close(self):
            events.append("close")

    def no_http_server(*args, **kwargs):
        events.append("http_server")
        raise MissingExtraError("edgesync serve", "server", "fastapi")

    monkeypatch.setattr(pool, "WorkerPool", Pool)
    monkeypatch.setattr(cli_serve, "http_server", no_http_server)
    port = _free_port()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        status = cli.main(["serve", "--workers", "1", "--port", str(port), "--store", str(tmp_path / "store")])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert status != 0
    assert events == ["spawn", "http_server", "close"]
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", port))


def _marked(mark: str) -> list[int]:
    """Live processes whose environment holds ``mark`` (``/proc``: Linux)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark.encode() in (entry / "environ").read_bytes() and alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_serve_that_fails_before_its_workers_start_ends_its_early_worker(tmp_path):
    """The console script starts the first worker before it reads the options: a command that
    fails before the pool takes that worker kills it and exits with its one line (a worker left
    running would hold the exit: it ignores the SIGTERM ``multiprocessing`` sends at exit)."""
    mark = f"early-worker-{os.getpid()}-{time.monotonic_ns()}"
    missing = tmp_path / "none.gguf"
    proc = subprocess.run([sys.executable, "-c", CONSOLE_SCRIPT, "serve", "--port", "0", "--model", str(missing),
                           "--store", str(tmp_path / "store")], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "EDGESYNC_TEST_MARK": mark}, timeout=WAIT_S)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: model not found: {missing}"]
    assert _marked(mark) == []


INTERRUPT_AT_IMPORT = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, whatever the runner ignores
from edgesync_engines.app.cli_entry import main

class InterruptAt:  # a real SIGINT, sent as the named module starts to load
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1]:
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, InterruptAt())
sys.exit(main(["serve", "--port", "0", "--store", sys.argv[2]]))
"""


@pytest.mark.parametrize("module", ["edgesync_engines.app.cli", "edgesync_engines.app.cli_serve"])
def test_a_ctrl_c_while_serve_loads_its_command_ends_the_early_worker(tmp_path, module):
    """A Ctrl-C while ``edgesync serve`` imports its command, its first worker started already,
    exits 130 with one line, the worker killed."""
    mark = f"early-worker-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.run([sys.executable, "-c", INTERRUPT_AT_IMPORT, module, str(tmp_path / "store")], cwd=ROOT,
                          capture_output=True, text=True, timeout=WAIT_S,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "EDGESYNC_TEST_MARK": mark})
    assert (proc.returncode, proc.stderr, proc.stdout) == (130, "error: interrupted\n", "")
    assert _marked(mark) == []
