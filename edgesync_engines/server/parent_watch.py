"""A worker process's watch on the server that started it: the worker stops by itself once the
server is gone, at any stage.

* Serving, the worker's loop checks :attr:`ParentWatch.gone` between jobs and batches and
  closes engine and store as at a stop.
* A thread polls the parent pid every :data:`POLL_S`: while starting it ends the process at
  once; once serving, after :data:`ORPHAN_GRACE_S`.
* On Linux, while starting, ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (set first thing, then the
  recorded parent pid is compared); cleared by :meth:`ParentWatch.serving`, since the kernel
  sends it when the starting *thread* ends.

Ending a worker is safe for the store (LMDB is crash-safe).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
"""``prctl`` option (``<linux/prctl.h>``): the signal sent when the parent thread ends."""
POLL_S = 1.0
"""Seconds between two checks of the parent pid by the watch's thread."""
ORPHAN_GRACE_S = 30.0
"""Seconds a serving worker whose server is gone may take to close before the thread ends it."""


def _prctl():
    """libc's ``prctl``, or None where there is none (not Linux, or no libc to load)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def recorded_parent() -> int:
    """The pid ``multiprocessing`` recorded as this process's parent, else the current parent's."""
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None and parent.pid else os.getppid()


class ParentWatch:
    """The watch of one worker process (``label``: its name in the log) on its server
    (``parent_pid``, default :func:`recorded_parent`), polled every ``poll_s`` seconds; a serving
    worker may take ``grace_s`` seconds to stop once the server is gone."""

    def __init__(self, label: str, parent_pid: int | None = None, poll_s: float = POLL_S,
                 grace_s: float = ORPHAN_GRACE_S) -> None:
        self.label = label
        self.parent_pid = recorded_parent() if parent_pid is None else parent_pid
        self.poll_s = poll_s
        self.grace_s = grace_s
        self._serving = False
        self.kernel_armed = False
        """The kernel's SIGKILL at the parent's death is set (Linux, while starting)."""

    @property
    def gone(self) -> bool:
        """The server process has exited (this process was re-parented)."""
        return os.getppid() != self.parent_pid

    def start(self) -> "ParentWatch":
        """Arm the kernel's SIGKILL (Linux), end the process at once when its server is
        already gone, start the polling thread."""
        self.kernel_armed = self._parent_death_signal(signal.SIGKILL)
        if self.gone:
            log.info("%s: the server process %d is gone before the engine loaded; exiting", self.label,
                     self.parent_pid)
            os._exit(1)
        threading.Thread(target=self._watch, name="edgesync-parent-watch", daemon=True).start()
        return self

    def serving(self) -> None:
        """The engine is loaded and the worker's loop checks :attr:`gone` from now on: clear the
        kernel's signal (a clean exit beats a kill; see the module docstring)."""
        self._serving = True
        if self.kernel_armed:
            self.kernel_armed = not self._parent_death_signal(0)

    def _parent_death_signal(self, signum: int) -> bool:
        """``prctl(PR_SET_PDEATHSIG, signum)``; False where there is no prctl or it failed."""
        prctl = _prctl()
        if prctl is None:
            return False
        if prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            log.debug("%s: prctl(PR_SET_PDEATHSIG, %d) failed: %s", self.label, signum,
                      os.strerror(ctypes.get_errno()))
            return False
        return True

    def _watch(self) -> None:
        """The thread: wait until the parent is gone, then end the process (at once while
        starting, after :attr:`grace_s` once serving, if it has not ended by itself)."""
        while not self.gone:
            time.sleep(self.poll_s)
        if self._serving:
            log.info("%s: the server process %d is gone; stopping", self.label, self.parent_pid)
            time.sleep(self.grace_s)
            log.warning("%s: still running %.0f s after the server process %d went away; exiting", self.label,
                        self.grace_s, self.parent_pid)
        else:
            log.info("%s: the server process %d is gone while the engine loads; exiting", self.label,
                     self.parent_pid)
        os._exit(1)
