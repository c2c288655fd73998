"""Idle-time storing: a prompt's KV prefilled in small exact batches and stored as its chunks
fill, between requests.

In a chat, the prompt of turn k+1 is the prompt of turn k, the model's answer and a new
message. The answer's KV in the live sequence came from decoding, which is not bit-identical
to a prefill's, so the exact mode never stores it. After an answer, :class:`IdleRunner` (one
background thread per :class:`~edgesync_engines.request.router.EdgeSync`) runs a
:class:`PrefillJob` over the conversation rendered as the next turn begins (the chat template
over the messages and the answer, and the beginning of the next user turn:
``EdgeSync.history_tokens``): it cuts the live sequence back
to its exact part and evaluates the rest in batches of about ``idle_batch_tokens`` tokens
(``EngineAdapter.prefill_batches``: batches whose KV equals an uncached prefill's), storing each
chunk of the prompt's grid once its tokens are evaluated.

A request pauses the runner (:meth:`IdleRunner.paused`) before it takes the engine's lock: the
runner holds that lock for one batch at a time and checks between batches, and the batch running
stops midway where the engine can (``EngineAdapter.abortable``: llama.cpp checks between the
nodes of the batch's graph; elsewhere the request waits for that one batch). What was stored
before the pause is kept, and the live sequence keeps what was evaluated, so a request that
extends it injects nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from edgesync_engines.adapters.protocol import EvaluationAborted
from edgesync_engines.request import storeback
from edgesync_store.schema import chunk_spans

if TYPE_CHECKING:
    from edgesync_engines.adapters.protocol import EngineAdapter
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_engines.request.fragment_cache import FragmentCache
    from edgesync_store.core.backend import FragmentBackend

log = logging.getLogger(__name__)

MAX_PENDING = 4
"""Idle-time jobs kept waiting per engine (conversations answered, their history not stored
yet); the oldest beyond it is dropped, its next turn then prefills the answer again."""


@dataclass
class PrepareResult:
    """What :meth:`EdgeSync.prepare` (or one idle-time job) did.

    Attributes:
        prompt_tokens: tokens of the prompt prepared.
        tokens_reused: tokens whose KV was already there (live, or injected from the store).
        tokens_prefilled: tokens evaluated (a batch may reach back a few live tokens, which
            count here too).
        tokens_ready: leading tokens whose exact KV the engine's live sequence then holds: a
            request that extends them prefills only what follows (up to 7 tokens before the
            prompt's end are left to the request: batches end on the row group).
        fragments_written: fragments stored.
        interrupted: a request paused the job before its end.
        elapsed_ms: wall time of the job, milliseconds (for an idle-time job, with the pauses
            between batches).
    """

    prompt_tokens: int
    tokens_reused: int = 0
    tokens_prefilled: int = 0
    tokens_ready: int = 0
    fragments_written: int = 0
    interrupted: bool = False
    elapsed_ms: float = 0.0


class PrefillJob:
    """One prompt's KV prefilled batch by batch on one engine, its chunks stored as they fill.

    The caller holds the adapter's lock around each :meth:`step` and :meth:`finish`, and the
    engine's live sequence must hold the prompt's exact first ``start`` tokens.

    Args:
        adapter: the engine.
        store: the store the chunks go to (None: only the live sequence is filled).
        config: ``idle_batch_tokens``, ``chunk_tokens``, ``ttl_seconds`` and the fragment
            grouping.
        tokens: the prompt's token IDs.
        start: leading tokens whose exact KV the live sequence holds (reused).
        ram: the RAM tier that keeps what is stored (``storeback.store_new``).
        on_ready: called with the new count of exact live tokens after each batch.
    """

    def __init__(self, adapter: "EngineAdapter", store: "FragmentBackend | None", config: "EdgeSyncConfig",
                 tokens: Sequence[int], start: int, ram: "FragmentCache | None" = None,
                 on_ready: Callable[[int], None] | None = None) -> None:
        self.adapter, self.store, self.config, self.ram = adapter, store, config, ram
        self.tokens = [int(t) for t in tokens]
        self.on_ready = on_ready
        self.batches = deque(adapter.prefill_batches(start, len(self.tokens), config.idle_batch_tokens))
        end = self.batches[-1][1] if self.batches else start
        # the chunk grid of what will be evaluated: stored span by span as the batches reach it
        self.spans = deque(chunk_spans(end, config.chunk_tokens)) if store is not None and not store.readonly \
            else deque()
        self.result = PrepareResult(len(self.tokens), tokens_reused=start, tokens_ready=start)
        self._t0 = time.perf_counter()

    @property
    def done(self) -> bool:
        """No batch is left."""
        return not self.batches

    def step(self, should_stop: Callable[[], bool] | None = None) -> int:
        """Evaluate the next batch and store the chunks it completes; returns the tokens
        evaluated (0: nothing was left). With ``should_stop``, the batch stops midway once it
        returns True (``EngineAdapter.abortable``) and stays the next one.

        Raises:
            ValueError, ContextOverflowError: the adapter's ``extend`` refused the batch (the
                live sequence no longer holds the prompt's start).
            EvaluationAborted: ``should_stop`` stopped the batch; the live sequence is as
                before it.
        """
        if not self.batches:
            return 0
        start, end = self.batches[0]
        try:
            with self.adapter.abortable(should_stop) if should_stop is not None else nullcontext():
                self.adapter.extend(self.tokens, start, end)
        except EvaluationAborted:
            if self.on_ready is not None:  # the live sequence holds the exact tokens[:start]
                self.on_ready(start)
            raise
        self.batches.popleft()
        self.result.tokens_prefilled += end - start
        self.result.tokens_ready = end
        if self.on_ready is not None:
            self.on_ready(end)
        self._store_upto(end)
        self.result.elapsed_ms = (time.perf_counter() - self._t0) * 1000
        return end - start

    def _store_upto(self, end: int) -> None:
        """Store the spans of the grid that end at or before ``end``."""
        ready = []
        while self.spans and self.spans[0][1] <= end:
            ready.append(self.spans.popleft())
        if ready:
            self.result.fragments_written += storeback.store_new(
                self.store, self.adapter, self.tokens[:end], self.config, ram=self.ram, spans=ready)

    def run(self) -> PrepareResult:
        """Every batch at once (the caller holds the lock); returns :attr:`result`."""
        while self.step():
            pass
        return self.result


@dataclass
class IdleStats:
    """Counters of one engine's idle-time work (all since start).

    Attributes:
        jobs: jobs started.
        interrupted: jobs a request paused before their end.
        tokens_prefilled: tokens evaluated in idle time.
        tokens_wasted: tokens prepared that the next request did not begin with (its rendered
            history was not a prefix of that request, or another conversation came next).
        fragments_written: fragments stored in idle time.
        failed: jobs that failed (logged; the next request prefills as usual).
    """

    jobs: int = 0
    interrupted: int = 0
    tokens_prefilled: int = 0
    tokens_wasted: int = 0
    fragments_written: int = 0
    failed: int = 0


class IdleRunner:
    """The background thread that runs idle-time jobs for one engine, one at a time.

    Jobs wait in a short queue (:data:`MAX_PENDING`, newest first). A request pauses the job in
    progress during its current batch (midway where the engine can); that job keeps its place
    at the head of the queue, behind the jobs of answers given after it, and starts again from
    what the store and the live sequence then hold. So the newest answer's history goes first:
    its conversation's KV is the live sequence's (continued, not read back from the store), and
    a job paused only because the engine was wanted elsewhere (a server's other worker) resumes
    where it stopped instead of an older conversation's job replacing the live sequence. When an
    older conversation's job did run after it (the newest finished first), the newest job runs
    once more at the end: what the store holds of its history is injected and the rest
    prefilled, so that the engine again holds, live, the conversation most likely to go on. And
    before another conversation's job replaces the live sequence, the engine makes room to
    inject the history just prepared (``EngineAdapter.make_room``), in case its next turn comes
    before it is live again.

    With ``threaded`` False no thread is started: the owner runs the queued jobs on its own
    thread with :meth:`run_pending` between requests. A server worker does so, because
    llama.cpp's OpenMP build keeps a team of threads per calling thread: once a second thread
    has evaluated, the two teams outnumber the cores, and OpenMP then stops spinning at its
    barriers, which slowed every later evaluation (measured in docs/benchmarks.md).

    Args:
        lock: the engine's lock (``EngineAdapter.lock``), held for one batch at a time.
        name: the thread's name.
        busy: returns True while requests wait for the engine elsewhere (e.g. in a server
            worker's queue): no batch starts meanwhile, and the one running stops midway where
            the engine can, so that they are not delayed by one. Checked often during a batch:
            keep it cheap.
        threaded: run the jobs on a thread of the runner's own (False: :meth:`run_pending`).
    """

    def __init__(self, lock, name: str = "edgesync-idle", busy: Callable[[], bool] | None = None,
                 threaded: bool = True) -> None:
        self._lock = lock
        self._name = name
        self.busy = busy or (lambda: False)
        self.threaded = threaded
        self._cond = threading.Condition()
        self._pending: deque[tuple[tuple, Callable[[], PrefillJob | None]]] = deque()
        self._epoch = 0
        self._waiting = 0  # requests inside paused()
        self._running = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._job: PrefillJob | None = None
        self._newest: tuple[tuple, Callable[[], PrefillJob | None]] | None = None  # the last job queued
        self.stats = IdleStats()
        self.work_ended_at = 0.0
        """Wall-clock time (``time.time()``, seconds) at which the last step of idle-time work
        (a job's start, which reads the store, or a batch) ended."""

    def submit(self, start: Callable[[], "PrefillJob | None"], key: tuple = ()) -> None:
        """Queue a job: ``start()`` is called with the lock held and returns the job (None:
        nothing to do); its batches then run on the runner's thread while no request needs the
        engine. ``key`` names the prompt (e.g. its messages): a waiting job whose key is a prefix
        of this one's is dropped (the conversation went on), and so is the oldest job beyond
        :data:`MAX_PENDING`."""
        with self._cond:
            if self._closed:
                return
            self._queue_first(key, start)
            if self._pending and self._pending[0][1] is start:
                self._newest = self._pending[0]
            if self._thread is None and self.threaded:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def _queue_first(self, key: tuple, start: Callable[[], "PrefillJob | None"]) -> None:
        """Put a job at the head of the queue (the caller holds ``_cond``), dropping the
        waiting jobs whose key it extends and the oldest beyond :data:`MAX_PENDING`; a job
        whose key a waiting one extends is not queued (its conversation went on)."""
        if key:
            if any(len(p[0]) > len(key) and p[0][:len(key)] == key for p in self._pending):
                return
            self._pending = deque(p for p in self._pending if not p[0] or key[:len(p[0])] != p[0])
        self._pending.appendleft((key, start))
        while len(self._pending) > MAX_PENDING:
            self._pending.pop()

    @contextmanager
    def paused(self) -> Iterator[bool]:
        """For a request's whole ``with`` block (enter it before taking the engine's lock): the
        job in progress stops during its current batch (midway where the engine can; it is
        queued again) and none starts.
        Yields True when a job was running (the caller may then wait one batch for the lock)."""
        with self._cond:
            self._epoch += 1
            self._waiting += 1
            running = self._running
        try:
            yield running
        finally:
            with self._cond:
                self._waiting -= 1
                self._cond.notify_all()

    @property
    def has_work(self) -> bool:
        """True while a job is queued (or paused and queued again)."""
        with self._cond:
            return bool(self._pending)

    def progress(self) -> int:
        """Tokens the current (or last) job has evaluated so far."""
        job = self._job
        return 0 if job is None else job.result.tokens_prefilled

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._pending or self._waiting or self.busy()):
                    self._cond.wait(0.05 if self._pending else None)
                if self._closed:
                    return
            self._run_next()

    def run_pending(self) -> bool:
        """Run the queued jobs on the calling thread while :attr:`busy` says no request waits
        (checked before each batch); True when none is left. For a runner made with
        ``threaded`` False."""
        while True:
            with self._cond:
                if self._closed or not self._pending:
                    return not self._pending
            if self.busy():
                return False
            self._run_next()

    def _run_next(self) -> None:
        """Run the first queued job, which keeps its place at the head of the queue when paused."""
        with self._cond:
            if not self._pending:
                return
            key, start = self._pending.popleft()
            epoch, self._running = self._epoch, True
        try:
            if not self._run_job(epoch, start):
                with self._cond:  # it keeps its place: the newest answer's history goes first
                    self._queue_first(key, start)
            else:
                with self._cond:
                    newest = self._newest
                    if not self._pending and newest is not None and newest[1] is not start:
                        self._pending.append(newest)  # an older history replaced the newest's: take it back
        except Exception:  # the job is lost, the engine serves on: the next request prefills as usual
            self.stats.failed += 1
            log.warning("idle-time prefill failed", exc_info=True)
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()

    def _run_job(self, epoch: int, start: Callable[[], "PrefillJob | None"]) -> bool:
        """Start the job and run its batches while no request paused it; False when paused."""
        with self._lock:
            if epoch != self._epoch or self._waiting:
                return False
            job = start()
            self.work_ended_at = time.time()
        if job is None:
            return True
        self._job = job
        self.stats.jobs += 1
        done = True
        def wanted() -> bool:  # a request needs the engine: no batch starts, and one running stops
            return epoch != self._epoch or bool(self._waiting) or self.busy()

        while not job.done:
            with self._lock:
                if wanted():
                    done = False
                    break
                try:
                    job.step(wanted)
                except EvaluationAborted:
                    done = False
                    break
                finally:
                    self.work_ended_at = time.time()
        job.result.interrupted = not done
        self.stats.interrupted += not done
        self.stats.tokens_prefilled += job.result.tokens_prefilled
        self.stats.fragments_written += job.result.fragments_written
        log.debug("idle-time prefill: %s", job.result)
        if done and self.has_work:
            # another conversation's job replaces the live sequence next: should this one's next
            # turn come first, it injects its history, into a buffer made now rather than then
            with self._lock:
                if not wanted():
                    job.adapter.make_room(len(job.tokens), wanted)
                self.work_ended_at = time.time()
        return done

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no job runs or waits (True), or ``timeout_s`` seconds pass (False). With
        ``threaded`` False the jobs run only in :meth:`run_pending`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._running or self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 0.1)
            return True

    def close(self) -> None:
        """Pause the job in progress and stop the thread (it ends during its current batch)."""
        with self._cond:
            self._closed = True
            self._epoch += 1
            self._pending.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(30)
