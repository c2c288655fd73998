"""Idle-time storing (``EdgeSync.prepare``, ``prepare_later``, ``config.idle_store``): a prompt's
KV prefilled in small exact batches between requests and stored as its chunks fill.

After an answer in a chat, the job covers the conversation as the next turn begins
(:func:`history_tokens`): the answer's decoded KV is not a prefill's, so the live sequence is
cut back to its exact part and the rest evaluated in batches of about ``idle_batch_tokens``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from edgesync_engines.adapters.protocol import ContextOverflowError, EvaluationAborted
from edgesync_engines.request import storeback
from edgesync_engines.request.checks import check_chat_messages
from edgesync_engines.request.reuse import ExactReuse, exact_context
from edgesync_store.schema import chunk_spans, common_prefix_len

if TYPE_CHECKING:
    from edgesync_engines.adapters.protocol import EngineAdapter
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_engines.request.fragment_cache import FragmentCache
    from edgesync_engines.request.lanes import Lane
    from edgesync_store.core.backend import FragmentBackend

log = logging.getLogger(__name__)

MAX_PENDING = 4
"""Idle-time jobs kept waiting per engine (conversations answered, their history not stored
yet); the oldest beyond it is dropped, its next turn then prefills the answer again."""
NEXT_TURN_PROBES = ("A", "B")
"""Two contents of a user turn that differ in their first letter, so that the tokens of two
renderings part where the content begins (:func:`history_tokens`)."""


def history_tokens(engine, messages) -> list[int]:
    """Token IDs the next prompt of a conversation that ends with ``messages`` begins with:
    the chat template over them and, after an answer or a system prompt, the beginning of the
    next user turn (the tokens two renderings with the :data:`NEXT_TURN_PROBES` share); a
    string is tokenized as is. Raises as ``EdgeSync.prompt_tokens``."""
    if not isinstance(messages, str):
        check_chat_messages(messages)
        if messages[-1]["role"] in ("assistant", "system"):
            try:
                a, b = (engine.prompt_tokens([*messages, {"role": "user", "content": probe}],
                                             add_generation_prompt=False) for probe in NEXT_TURN_PROBES)
            except Exception as e:  # a template may raise on any turn order (jinja's raise_exception)
                log.debug("history_tokens: the template refused a user turn after the history (%s)", e)
            else:
                if common := common_prefix_len(a, b):
                    return a[:common]
    return engine.prompt_tokens(messages, add_generation_prompt=False)


@dataclass
class PrepareResult:
    """What :meth:`EdgeSync.prepare` (or one idle-time job) did.

    Attributes:
        prompt_tokens: tokens of the prompt prepared.
        tokens_reused: tokens whose KV was already there (live, or injected from the store).
        tokens_prefilled: tokens evaluated (with the few live ones a batch may reach back to).
        tokens_ready: leading tokens whose exact KV the engine's live sequence then holds.
        interrupted: a request paused the job before its end.
        elapsed_ms: wall time of the job in ms (with the pauses between batches).
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

    The caller holds the adapter's lock around each :meth:`step`; the engine's live sequence
    holds the prompt's exact first ``start`` tokens.

    Args:
        store: the store the chunks go to (None: only the live sequence is filled).
        config: ``idle_batch_tokens``, ``chunk_tokens``, ``ttl_seconds``, the fragment grouping.
        start: leading tokens whose exact KV the live sequence holds (reused).
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
        return not self.batches

    def step(self, should_stop: Callable[[], bool] | None = None) -> int:
        """Evaluate the next batch and store the chunks it completes; returns the tokens
        evaluated (0: none left). Once ``should_stop`` returns True the batch stops midway
        and stays the next one.

        Raises ValueError or ContextOverflowError when ``extend`` refuses the batch, and
        EvaluationAborted when ``should_stop`` stopped it (the live sequence as before it).
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
        interrupted: jobs a request paused before their end.
        tokens_wasted: tokens prepared that the next request of that conversation did not
            begin with.
        failed: jobs that failed (logged; the next request prefills as usual).
    """

    jobs: int = 0
    interrupted: int = 0
    tokens_prefilled: int = 0
    tokens_wasted: int = 0
    fragments_written: int = 0
    failed: int = 0


class IdleRunner:
    """One engine's idle-time work: :meth:`prepare` now, or jobs queued (:meth:`prepare_later`)
    and run one at a time on a thread of its own or, with ``threaded`` False, by the owner's
    :meth:`run_pending` (a server worker).

    Jobs wait newest first (:data:`MAX_PENDING`); a paused job keeps its place at the head and
    restarts from what the store and the live sequence then hold.

    Args:
        engine: the ``EdgeSync`` it works for; a job runs in the lane (``request/lanes.py``) whose
            live sequence holds most of its prompt, holding its adapter's lock one batch at a time.
        busy: True while requests wait for the engine elsewhere (a server worker's queue): no
            batch starts, and the one running stops midway. Checked often: keep it cheap.
        threaded: run the jobs on a thread of the runner's own (False: :meth:`run_pending`).
    """

    def __init__(self, engine, name: str = "edgesync-idle", busy: Callable[[], bool] | None = None,
                 threaded: bool = True) -> None:
        self.engine = engine
        self.prepared: tuple[list[int], int] | None = None  # the last job's (tokens ready, start), until a request
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

    def prepare(self, prompt) -> PrepareResult:
        """``EdgeSync.prepare``: store ``prompt``'s KV at once.

        Raises ValueError (empty prompt, bad messages, no store), PermissionError (read-only
        store), ContextOverflowError (longer than the context)."""
        es = self.engine
        if es.store is None or es.adapter.namespace is None:
            raise ValueError("prepare: needs a store and an engine whose KV can be cached "
                             f"({es.uncached_reason or 'store=False or EDGESYNC_CACHE=0'})")
        if es.store.readonly:
            raise PermissionError("prepare: the store is open read-only")
        tokens = history_tokens(es, prompt)
        if len(tokens) > es.adapter.n_ctx:
            raise ContextOverflowError(len(tokens), 0, es.adapter.n_ctx)
        with self.paused(), es.lanes.taken(tokens) as lane:
            return self.prefill_job(lane, prompt, tokens).run()

    def prepare_later(self, history) -> None:
        """Queue the preparation of chat messages (``EdgeSync.prepare_later`` checked them and
        that the engine has a writable store)."""
        es, history = self.engine, list(history)

        def start() -> tuple[list, list[int]] | None:
            tokens = history_tokens(es, history)
            return (history, tokens) if len(tokens) < es.adapter.n_ctx else None

        self.submit(start, key=tuple((m.get("role"), m.get("content")) for m in history))

    def prefill_job(self, lane: "Lane", prompt, tokens: list[int]) -> PrefillJob:
        """The :class:`PrefillJob` of ``tokens`` in ``lane`` (its lock held), starting from what
        its live sequence or the store holds exactly; it keeps the lane's live count up to date."""
        es = self.engine
        live_exact = lane.take_live()
        _, injected = ExactReuse(es).reuse(lane, prompt, tokens, 1, live_exact)
        start = injected.reused if exact_context(injected) else 0
        lane.set_live(start)

        def ready(end: int) -> None:
            lane.set_live(end)
            self.prepared = (tokens[:end], start)

        return PrefillJob(lane.adapter, es.store, es.config, tokens, start, es.fragment_cache, ready)

    def count_wasted(self, tokens: list[int]) -> None:
        """A request of ``tokens`` takes the engine: the tokens the last job prepared that it
        does not begin with, in the same conversation, count as wasted."""
        if self.prepared is not None:
            (prepared, start), self.prepared = self.prepared, None
            common = common_prefix_len(prepared, tokens)
            if common >= start:  # the same conversation, departing inside the prepared tokens
                self.stats.tokens_wasted += len(prepared) - common

    def submit(self, start: Callable[[], "tuple[object, list[int]] | None"], key: tuple = ()) -> None:
        """Queue a job: ``start()`` returns its prompt and tokens (None: nothing to do). ``key``
        names the prompt (e.g. its messages): a waiting job whose key is
        a prefix of this one's is dropped, and so is the oldest beyond :data:`MAX_PENDING`."""
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
        """Put a job at the head of the queue (the caller holds ``_cond``), as :meth:`submit` says."""
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
        running job stops (queued again) and none starts. Yields True when a job was running.
        (With several lanes a request only takes its lane: a job on it stops, the others go on.)"""
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
            if not self._run_next():
                with self._cond:  # paused, or every lane busy: look again shortly
                    self._cond.wait(0.05)

    def run_pending(self) -> bool:
        """Run the queued jobs on the calling thread while :attr:`busy` says no request waits;
        True when none is left, False when busy or a job was paused (the caller comes back).
        For a runner made with ``threaded`` False."""
        while True:
            with self._cond:
                if self._closed or not self._pending:
                    return not self._pending
            if self.busy() or not self._run_next():
                return False

    def _run_next(self) -> bool:
        """Run the next job; False when it was paused (queued again) or none waits."""
        with self._cond:
            if not self._pending:
                return False
            key, start = self._pending.popleft()
            epoch, self._running = self._epoch, True
        try:
            if not self._run_job(epoch, start):
                with self._cond:  # it keeps its place: the newest answer's history goes first
                    self._queue_first(key, start)
                return False
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
        return True

    def _run_job(self, epoch: int, start: Callable[[], "tuple[object, list[int]] | None"]) -> bool:
        """Run the job's batches while no request paused it; False when paused."""
        if epoch != self._epoch or self._waiting:
            return False
        what = start()
        if what is None:
            return True
        prompt, tokens = what
        lanes = self.engine.lanes
        lane = lanes.idle_lane(tokens)
        if lane is None:
            return False

        def wanted() -> bool:  # a request needs the engine or this lane: no batch starts, one running stops
            return epoch != self._epoch or bool(self._waiting) or self.busy() or lanes.is_taken(lane)

        with lane.adapter.lock:  # the job's start (it reads the store) runs even if a request just came
            if epoch != self._epoch or self._waiting or lanes.is_taken(lane):
                return False
            job = self.prefill_job(lane, prompt, tokens)
            self.work_ended_at = time.time()
        self._job = job
        self.stats.jobs += 1
        done = True

        while not job.done:
            with lane.adapter.lock:
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
            with lane.adapter.lock:
                if not wanted():
                    job.adapter.make_room(len(job.tokens), wanted)
                self.work_ended_at = time.time()
        return done

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no job runs or waits (True), or ``timeout_s`` seconds pass (False)."""
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
