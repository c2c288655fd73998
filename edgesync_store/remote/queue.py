"""The write-behind queue: remote writes leave the request path and run in order on one daemon
thread. :meth:`WriteBehind.submit` never blocks: a full queue drops its oldest job (counted via
``on_drop``). A job's failures are its own; anything it raises is logged and the thread goes on."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

log = logging.getLogger(__name__)

__all__ = ["WriteBehind"]


class WriteBehind:
    """A bounded queue of jobs (zero-argument callables) and the thread that runs them.

    Args:
        maxlen: most jobs waiting (>= 1).
        on_drop: called once per dropped job (from the submitting thread).
        name: the thread's name.

    Raises:
        ValueError: ``maxlen`` < 1.
    """

    def __init__(self, maxlen: int, on_drop: Callable[[], None] = lambda: None, name: str = "edgesync-remote") -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen: must be >= 1, got {maxlen}")
        self.maxlen = maxlen
        self._on_drop = on_drop
        self._jobs: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        with self._cond:
            return len(self._jobs)

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue ``job``; False (not queued) once closed."""
        dropped = False
        with self._cond:
            if self._closed:
                return False
            if len(self._jobs) >= self.maxlen:
                self._jobs.popleft()
                dropped = True
            self._jobs.append(job)
            self._cond.notify_all()
        if dropped:
            self._on_drop()
        return True

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued job has run, at most ``timeout_s`` seconds; True when done."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float) -> int:
        """Run what is queued for at most ``timeout_s`` seconds, then stop the thread; returns the
        jobs left unrun (dropped). Idempotent."""
        self.drain(timeout_s)
        with self._cond:
            left = len(self._jobs)
            self._jobs.clear()
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=max(0.1, timeout_s))
        if left:
            log.warning("remote write-behind closed with %d jobs not run", left)
        return left

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed and not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                job()
            except Exception:  # a bug in a job must not stop the writer; the job logs its own faults
                log.exception("remote write-behind job failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
