"""How a server's workers share the CPUs (docs/architecture.md, serving): a **prefill** (lookup to
first token) runs alone, its batches of :data:`PREFILL_TURN_TOKENS` one at a time on every thread,
fewest tokens left first (one passed over :data:`MAX_PASSED` times next); a **step** (decode, idle
work) waits for prefills, then runs on ``threads // active workers`` threads. Thread count never
changes results (``tests/test_llamacpp.py``). The state is shared memory; the lock has a timeout,
so a worker killed holding it costs speed, never a wrong answer.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterator

log = logging.getLogger(__name__)

POLL_S = 0.001
"""Seconds between checks while a worker waits for its turn."""
PREFILL_TURN_TOKENS = 64
"""Most tokens in a prefill batch while the workers share the CPUs (docs/benchmarks.md)."""
MAX_PASSED = 2
"""Prefill batches that may pass a waiting one before it goes first (a long prompt is slowed at
most threefold, never starved)."""
LOCK_TIMEOUT_S = 2.0
"""Seconds a worker waits for the state's lock before it goes on without it."""


class CoreShare:
    """The CPU threads of ``n_workers`` worker processes.

    Args:
        ctx: the ``multiprocessing`` context the workers are started with.
        n_workers: worker processes (>= 1).
        n_threads: the threads all of them share (>= 1): a prefill's count.

    Raises ValueError when ``n_workers`` or ``n_threads`` is below 1.
    """

    def __init__(self, ctx, n_workers: int, n_threads: int) -> None:
        if n_workers < 1 or n_threads < 1:
            raise ValueError(f"CoreShare: n_workers and n_threads must be >= 1, got {n_workers}, {n_threads}")
        self.n_threads = n_threads
        self.n_workers = n_workers
        self._lock = ctx.Lock()
        self._next_ticket = ctx.Value("q", 0, lock=False)
        self._ticket = ctx.Array("q", n_workers, lock=False)  # 0: no prefill asked; else its place in line
        self._running = ctx.Array("b", n_workers, lock=False)  # 1 while worker i evaluates
        self._active = ctx.Array("b", n_workers, lock=False)  # 1 while worker i serves or runs idle work
        self._tokens_left = ctx.Array("q", n_workers, lock=False)  # >0 while worker i waits for or runs a batch
        self._passed = ctx.Array("q", n_workers, lock=False)  # other batches run while worker i's waited
        self._index = -1
        self._set_threads: Callable[[int], None] = lambda n: None
        self._threads_now = 0
        self._step_sharing = 1
        self._in_prefill = False
        self._lockless = False

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_set_threads"] = None  # attached again in each worker process
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._set_threads = lambda n: None

    def attach(self, index: int, set_threads: Callable[[int], None]) -> None:
        """Make this process worker ``index``; ``set_threads(n)`` sets its engine's thread count.
        Raises ValueError for ``index`` outside ``[0, n_workers)``."""
        if not 0 <= index < self.n_workers:
            raise ValueError(f"CoreShare.attach: index {index} outside [0, {self.n_workers})")
        self._index, self._set_threads, self._threads_now = index, set_threads, 0

    def release(self, index: int) -> None:
        """Clear worker ``index``'s marks (its process died; called by the pool before it starts another)."""
        with self._locked():
            self._ticket[index] = self._running[index] = self._active[index] = self._tokens_left[index] = 0
            self._passed[index] = 0

    @contextmanager
    def active(self) -> Iterator[None]:
        """For a request's whole service, or a run of idle-time work: this worker counts among
        those whose steps share the threads."""
        self._active[self._index] = 1
        try:
            yield
        finally:
            self._active[self._index] = 0

    @contextmanager
    def prefill(self) -> Iterator[None]:
        """A request's prefill up to its first token: no other worker starts a step meanwhile."""
        i = self._index
        try:
            with self._locked():
                self._next_ticket.value += 1
                self._ticket[i] = self._next_ticket.value
            self._in_prefill = True
            yield
        finally:
            self._in_prefill = False
            with self._locked():
                self._running[i] = self._ticket[i] = self._tokens_left[i] = self._passed[i] = 0

    @contextmanager
    def batch(self, tokens_left: int) -> Iterator[None]:
        """One prefill batch with ``tokens_left`` tokens still to evaluate (this one's included): inside
        :meth:`prefill` it waits its turn, then runs on every thread; outside (idle time), at once."""
        if not self._in_prefill:
            yield
            return
        i = self._index
        self._tokens_left[i] = max(1, tokens_left)
        try:
            while not self._mark_running(self._may_prefill):
                time.sleep(POLL_S)
            self._use_threads(self.n_threads)
            yield
        finally:
            with self._locked():
                self._running[i] = self._tokens_left[i] = 0

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Inside :meth:`prefill`, after its first token: no other worker starts anything until it ends."""
        if not self._in_prefill:
            yield
            return
        with self._locked():
            self._running[self._index] = 1
        try:
            yield
        finally:
            with self._locked():
                self._running[self._index] = 0

    @contextmanager
    def step(self) -> Iterator[None]:
        """A decode step or a run of idle-time batches: once no worker waits to prefill, at
        once with the other workers' steps, on ``n_threads // active workers`` threads."""
        while not self._mark_running(lambda: not self._prefill_asked()):
            time.sleep(POLL_S)
        self._step_sharing = max(1, self._active_workers())
        self._use_threads(max(1, self.n_threads // self._step_sharing))
        try:
            yield
        finally:
            with self._locked():
                self._running[self._index] = 0

    def should_yield(self) -> bool:
        """True when a run of idle-time batches should end now: another worker waits to prefill, or
        more workers are active than when the step began."""
        return self._prefill_asked() or self._active_workers() > self._step_sharing

    def _may_prefill(self) -> bool:
        """No other worker evaluates or waits with a lower rank; if so, the waiting ones count a pass."""
        mine = self._batch_rank(self._index)
        if any(self._running[j] or (self._tokens_left[j] and self._batch_rank(j) < mine) for j in self._others()):
            return False
        for j in self._others():
            self._passed[j] += bool(self._tokens_left[j])
        self._passed[self._index] = 0
        return True

    def _batch_rank(self, j: int) -> tuple[int, int, int]:
        """Worker ``j``'s place: passed :data:`MAX_PASSED` times first, then fewest left, then earliest."""

        return (self._passed[j] < MAX_PASSED, self._tokens_left[j], self._ticket[j])

    def _prefill_asked(self) -> bool:
        return any(self._ticket[j] for j in self._others())

    def _active_workers(self) -> int:
        return sum(self._active[j] for j in range(self.n_workers))

    def _others(self) -> Iterator[int]:
        return (j for j in range(self.n_workers) if j != self._index)

    def _mark_running(self, may_run: Callable[[], bool]) -> bool:
        """Under the lock: when ``may_run()``, mark this worker running (True)."""
        with self._locked():
            if may_run():
                self._running[self._index] = 1
                return True
        return False

    def _use_threads(self, n: int) -> None:
        if n != self._threads_now:
            self._set_threads(n)
            self._threads_now = n

    @contextmanager
    def _locked(self) -> Iterator[None]:
        acquired = not self._lockless and self._lock.acquire(timeout=LOCK_TIMEOUT_S)
        if not acquired and not self._lockless:
            self._lockless = True
            log.warning("worker %d: the workers' shared CPU state stayed locked for %.0f s (a worker died "
                        "holding it?); this worker goes on without the lock", self._index, LOCK_TIMEOUT_S)
        try:
            yield
        finally:
            if acquired:
                self._lock.release()
