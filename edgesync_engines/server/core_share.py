"""How a server's workers share the CPUs: a request's prefill runs alone on all of them.

Each worker process owns one llama.cpp engine, and llama.cpp's threads spin at their barriers,
so two engines computing at once on shared cores slow each other far more than twice. A fixed
split (``CPUs // workers`` threads each) avoids that but prefills every request on a fraction
of the cores, although a request's prefill is the part a client waits for (its TTFT).

So the workers take the cores by the kind of work, as llama.cpp's own server does when it puts
a new prompt into the batch its other slots decode in:

* **prefill** (a request's lookup, injection, prefill and first token): no other worker starts
  a step meanwhile, and each prefill batch waits until no other worker evaluates (at most one
  decode step, one idle-time batch or one other prefill batch), then runs on every thread.
  Prefill batches are cut to :data:`PREFILL_TURN_TOKENS` (``kv_layout.turn_batches``,
  bit-identical; not with flash attention, where cuts are not exact), and among prefills
  waiting for a batch the one with the fewest tokens left goes first: a short prompt that
  arrives during a long one's prefill waits one batch. A batch passed over
  :data:`MAX_PASSED` times goes next, so that short prompts never starve a long one. Once the
  first token is out, :meth:`CoreShare.hold` keeps every other worker waiting until the server
  has sent it, so that the server's and the client's processes have the cores for it.
* **step** (one decode step, or a run of idle-time batches): waits while any worker waits to
  prefill, then runs at once with the other workers' steps, on ``threads // active workers``
  threads (a worker is active while it serves a request or runs idle-time work).

A decode step that waits for another worker's prefill delays that answer's next token, never
its first. A worker's thread count never changes its results: llama.cpp's CPU kernels give
bit-identical logits on 1 and 2 threads (``tests/test_llamacpp.py`` checks it on the real
model, and that the cut batches change no bit).

The state lives in shared memory made by the pool (``spawn`` context) and is passed to each
worker process; each process then calls :meth:`CoreShare.attach` once. A worker that dies
leaves its marks behind: the pool clears them with :meth:`CoreShare.release` before it starts
the new process. The short critical sections take a lock with a timeout: a worker killed while
holding it makes the others go on without it (one warning each; a race then costs speed, never
a wrong answer) instead of stopping them.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterator

log = logging.getLogger(__name__)

POLL_S = 0.001
"""Seconds between checks while a worker waits for its turn: small beside a decode step, and
rare enough that the waiting costs the running worker next to no CPU."""
PREFILL_TURN_TOKENS = 64
"""A prefill batch's most tokens while the workers share the CPUs (the engine's ``turn_tokens``):
what a short prompt waits for at most behind a long one, at no cost in prefill speed
(docs/benchmarks.md)."""
MAX_PASSED = 2
"""Other prefill batches that may run while one waits before it goes first, whatever its size:
a stream of short prompts slows a long one's prefill at most threefold, never stops it."""
LOCK_TIMEOUT_S = 2.0
"""Seconds a worker waits for the state's lock before it goes on without it (see the module
docstring); the lock is held only to read and mark a few flags."""


class CoreShare:
    """The CPU threads of ``n_workers`` worker processes (see the module docstring).

    Args:
        ctx: the ``multiprocessing`` context the workers are started with.
        n_workers: worker processes (>= 1).
        n_threads: the threads all of them share (>= 1): a prefill's count.

    Raises:
        ValueError: ``n_workers`` or ``n_threads`` below 1.
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
        """Make this process worker ``index``, whose engine's thread count ``set_threads(n)``
        sets (e.g. ``EngineAdapter.set_threads``).

        Raises:
            ValueError: ``index`` outside ``[0, n_workers)``.
        """
        if not 0 <= index < self.n_workers:
            raise ValueError(f"CoreShare.attach: index {index} outside [0, {self.n_workers})")
        self._index, self._set_threads, self._threads_now = index, set_threads, 0

    def release(self, index: int) -> None:
        """Clear worker ``index``'s marks (its process died; called by the pool before it
        starts another)."""
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
        """A request's prefill, up to its first token: while it lasts no other worker starts a
        step, and its batches (:meth:`batch`, the engine's ``batch_turn``) run on every thread,
        one worker's batch at a time."""
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
        """One prefill batch, with ``tokens_left`` prompt tokens still to evaluate (this
        batch's included). Inside :meth:`prefill`: it waits until no other worker evaluates
        and no other prefill waiting for a batch ranks before it (passed over
        :data:`MAX_PASSED` times, else fewer tokens left, else asked earlier), so that a short
        prompt is not kept behind a long one nor a long one starved; then it runs on every
        thread. Outside (an idle-time batch, already inside a :meth:`step`): at once."""
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
        """Inside :meth:`prefill`, once its first token is out: no other worker starts a
        batch or a step until it ends (the first token's way to the client, which needs the
        cores too). Outside: nothing."""
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
        """True when a run of idle-time batches should end now (the batch running stops midway
        where the engine can, ``EngineAdapter.abortable``): another worker waits to prefill, or
        more workers are active than when the step began (its thread count is now too high)."""
        return self._prefill_asked() or self._active_workers() > self._step_sharing

    def _may_prefill(self) -> bool:
        """No other worker evaluates, and none waits for a batch with a lower
        :meth:`_batch_rank`; when so, the batches of the others waiting count one more pass."""
        mine = self._batch_rank(self._index)
        if any(self._running[j] or (self._tokens_left[j] and self._batch_rank(j) < mine) for j in self._others()):
            return False
        for j in self._others():
            self._passed[j] += bool(self._tokens_left[j])
        self._passed[self._index] = 0
        return True

    def _batch_rank(self, j: int) -> tuple[int, int, int]:
        """Worker ``j``'s place among waiting prefill batches: one passed over
        :data:`MAX_PASSED` times first, then the fewest tokens left, then the earliest asked."""
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
