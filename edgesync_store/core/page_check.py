"""The page check (``core.check``) of a store's ``data.mdb`` in a child process
(``python -m edgesync_store.commands.page_check``), so that whatever the file holds, the caller
survives. A child killed by a signal or past its timeout means damaged, except SIGINT, SIGTERM
and SIGHUP (checked again, once). A file that passed is not checked again while its device,
inode, size and mtime stay the same.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from edgesync_store.core.check import Report

CHECK_TIMEOUT_S = 120.0
"""Seconds a check child may take before the store is judged damaged (a healthy 1 GiB store
takes well under one: docs/measurements.md)."""

_ROOT = str(Path(__file__).resolve().parents[2])  # the child imports this copy of edgesync_store
_STOPPED = {-signal.SIGINT, -signal.SIGTERM, -signal.SIGHUP}
"""Return codes of a child stopped on request, not by what it read."""
_passed: set[tuple] = set()
_pending: dict[tuple, PendingCheck] = {}
_lock = threading.Lock()


def _state(data_file: Path) -> tuple | None:
    try:
        st = data_file.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class PendingCheck:
    """A check of ``store/data.mdb`` running in a child process with a session of its own (a
    terminal's Ctrl-C reaches the caller only); ``timeout_s``: seconds :meth:`result` waits."""

    def __init__(self, store: str | os.PathLike, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self.store = Path(store)
        self.timeout_s = timeout_s
        self._report: Report | None = None
        self._proc = self._start()

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "edgesync_store.commands.page_check", str(self.store), "--json"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))})

    @property
    def pid(self) -> int:
        """The child's process ID (the latest, after a check run again)."""
        return self._proc.pid

    def result(self) -> Report:
        """Wait for the child; its report, or a damaged one when it died or timed out."""
        if self._report is None:
            self._report = self._wait()
            if self._proc.returncode in _STOPPED:  # stopped on request: nothing learnt, check again
                self._proc = self._start()
                self._report = self._wait()
        return self._report

    def _wait(self) -> Report:
        try:
            out, err = self._proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.communicate()
            return Report(damage=f"the page check did not finish within {self.timeout_s:.0f} s")
        code = self._proc.returncode
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return Report(damage=f"the page check died of {name}")
        try:
            data = json.loads(out)
            return Report(damage=data["damage"], header=data["header"], databases=data["databases"],
                          pages=data["pages"], txnid=data["txnid"])
        except (ValueError, KeyError, TypeError):
            last = err.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
            return Report(damage=f"the page check failed (exit {code}): {last[0]}")


def begin(store: str | os.PathLike) -> None:
    """Start checking ``store`` in a child now (a no-op without ``data.mdb``, or when this process
    already checked the file as it is), for :func:`verify` to collect later."""
    data = Path(store).expanduser() / "data.mdb"
    state = _state(data)
    with _lock:
        if state is None or state in _passed or state in _pending:
            return
        _pending[state] = PendingCheck(data.parent)


def verify(store: str | os.PathLike) -> Report:
    """The check of ``store``'s data file as it is now: a passed one remembered, the one
    :func:`begin` started (waited for), or a new one (run and waited for). A healthy report
    without a data file (a new store)."""
    data = Path(store).expanduser() / "data.mdb"
    state = _state(data)
    if state is None:
        return Report()
    with _lock:
        if state in _passed:
            return Report()
        pending = _pending.pop(state, None)
    report = (pending or PendingCheck(data.parent)).result()
    if report.healthy:
        with _lock:
            _passed.add(state)
    return report
