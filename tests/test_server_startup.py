"""``edgesync serve`` stopped while its workers start (the real server, two workers loading the
real SmolLM2): a SIGTERM to the server, or a Ctrl-C to its process group, stops every worker it
started and exits with one line, no traceback, leaving the store free; a server SIGKILLed while
its workers load the engine leaves no worker behind either (each one's watch on its parent,
``server/parent_watch.py``). The waits are bounded and generous: what is asserted is that the
workers are gone, not how fast."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.serve_process import ServeProcess, alive

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


def _spawned(tmp_path: Path) -> tuple[ServeProcess, list[int]]:
    """``edgesync serve --workers 2`` in a process group of its own, and its two workers' pids
    as soon as both processes exist."""
    serve = ServeProcess(tmp_path / "store", "--workers", "2").spawn(start_new_session=True)
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


@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["sigterm", "ctrl-c"])
def test_a_stop_while_the_workers_start_stops_them(tmp_path, sig, group):
    serve, workers = _spawned(tmp_path)
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


def test_a_server_killed_while_its_workers_load_leaves_none_behind(tmp_path):
    serve, workers = _spawned(tmp_path)
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
