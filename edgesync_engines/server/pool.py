"""The worker processes as the server sees them: start, dispatch, cancel, restart, stop.

Each worker (:func:`~.worker.worker_main`) is a process started with ``spawn`` (a fresh
interpreter: no engine state or lock is inherited through ``fork``) and owns a request queue, a
response queue and a :class:`~.worker.CancelBoard`. Messages are plain dicts:

* to a worker: a job (``id``, ``prompt``, ``max_tokens``, ``temperature``, ``top_p``, ``seed``,
  ``stop``, ``stream``, ``reuse``), ``room`` (``tokens``: see below), ``prepare`` (``prompt``:
  chat messages ending with an answer, see below) or None (stop);
* from a worker: ``ready`` (``pid``), ``fatal`` (``message``: the engine did not load), and per
  job ``piece`` (``text``) when streamed, else ``started`` at its first token (for routing; not
  passed on), then one of ``done`` (``text``, ``finish_reason``,
  ``first_token_at``, ``result``), ``error`` (``status``, ``message``, ``err_type``, ``code``,
  ``param``) or ``cancelled``. ``done``'s ``result`` holds the request's figures,
  ``idle_pending`` (idle-time work is queued) and ``idle``:
  the worker's cumulative idle-time counters (``IdleStats``: ``jobs``, ``interrupted``,
  ``tokens_prefilled``, ``tokens_wasted``, ``fragments_written``, ``failed``, since its process
  started);
* from a worker between jobs: ``idle`` (``stats``: the same counters; ``pending``: idle-time
  work is still queued), sent when they changed while it waited for a job (its idle-time job
  runs between jobs).

The pool sums the counters' increases over its workers and their restarts
(:meth:`WorkerPool.idle_totals`).

Routing (:mod:`.routing`): a job goes to the worker whose live context (the last conversation
it answered, with the answer) begins the job's prompt over the most characters; when that worker
is busy and another is idle, to the idle one with the best score; when no context matches, to
the worker with the fewest outstanding jobs (on a tie, the one whose jobs that have not sent
their first token hold the fewest prompt characters: it is not held by a long prefill). A
worker's context is
replaced by each job it answers (``done``, not cancelled) and forgotten when a job is cancelled,
fails in the engine (a 500) or the process restarts. Each worker answers its queue in arrival
order. One thread per worker reads its responses and hands them to the asyncio queue of their
job. When a worker process dies, that thread fails its outstanding jobs with a 500
``worker_died`` error and starts a new process with new queues.

A conversation's next turn goes to another worker when its own is busy, which then injects the
conversation from the store. So when a worker answers, the others hear of the answered
conversation's length (``room``: prompt and answer tokens, plus :data:`ROOM_MARGIN_TOKENS`) when
it is the longest they have heard of, and make room to inject that much in idle time
(``EdgeSync.make_room``), rather than on that turn's path.

A job of another conversation can also take a worker while that worker is still storing the
history of the one it holds (its last report said idle-time work was pending): the history's
unstored part would then be prefilled on its next turn. So the pool hands that conversation to
another worker (``prepare``: the messages and the answer), which prepares it in its own idle time
(``EdgeSync.prepare_later``: what the store holds is injected, the rest prefilled) and is taken
to hold it from then on (:meth:`WorkerPool.handed_over` counts them).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from edgesync_engines.server.core_share import CoreShare
from edgesync_engines.server.routing import choose_worker, context_text, prefix_score, prompt_text
from edgesync_engines.server.worker import IDLE_FIELDS, CancelBoard, stop_signals_blocked, worker_main

log = logging.getLogger(__name__)

FINAL_TYPES = ("done", "error", "cancelled")
"""Message types that end a job."""
ROOM_MARGIN_TOKENS = 16
"""Tokens a ``room`` hint adds to a conversation's prompt and answer: the chat template's end of
the answer, which the next turn's prompt holds too (2 tokens in ChatML, a few in others)."""


class PoolStartError(RuntimeError):
    """A worker could not load its engine (the message says why), did not start in time, or the
    start was stopped (:meth:`WorkerPool.start`'s ``should_stop``)."""


@dataclass
class _Slot:
    """One worker position: its current process and queues, and its outstanding job ids."""

    index: int
    process: multiprocessing.Process | None = None
    requests: object = None
    responses: object = None
    cancel: object = None
    pid: int | None = None
    restarts: int = 0
    jobs: set = field(default_factory=set)
    started: set = field(default_factory=set)
    """The ids of its outstanding jobs that have sent a message (their prefill is over)."""
    last_used: int = 0  # the pool's job count when this slot was last given a job
    context: str | None = None
    """The canonical text of what the worker holds live (``routing.context_text``), or None."""
    history: list | None = None
    """The chat messages of that conversation, with the answer (None: a text prompt, or none)."""
    storing: bool = False
    """The worker last said its idle-time work was not done (it may be storing that history)."""
    idle: dict = field(default_factory=dict)
    """The idle-time counters its current process last reported."""
    room: int = 0
    """The largest ``room`` hint sent to its current process (tokens)."""


class WorkerPool:
    """``n_workers`` engine processes serving jobs (see the module docstring).

    Args:
        settings: ``EdgeSyncConfig.to_dict()`` values every worker loads its engine from.
        n_workers: processes (>= 1).
        log_level: the workers' logging level name.
        start_timeout_s: seconds a worker may take to load its engine.
        shared_threads: CPU threads the workers share (:class:`~.core_share.CoreShare`: a
            request's prefill runs alone on all of them); None, or one worker: each engine
            keeps the threads of ``settings``.
    """

    def __init__(self, settings: dict, n_workers: int, log_level: str = "WARNING",
                 start_timeout_s: float = 300.0, shared_threads: int | None = None) -> None:
        if n_workers < 1:
            raise ValueError(f"n_workers: must be >= 1, got {n_workers}")
        self.settings = dict(settings)
        self.log_level = log_level
        self.start_timeout_s = start_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self.cores = CoreShare(self._ctx, n_workers, shared_threads) if shared_threads and n_workers > 1 else None
        self._slots = [_Slot(i) for i in range(n_workers)]
        self._listeners: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closing = False
        self._cancelled = 0
        self._routed_by_prefix = 0
        self._handed_over = 0
        self._assigned = 0
        self._prompts: dict[int, object] = {}  # job id -> prompt, until its final message
        self._idle_totals = dict.fromkeys(IDLE_FIELDS, 0)
        self._threads: list[threading.Thread] = []

    @property
    def n_workers(self) -> int:
        """Worker processes."""
        return len(self._slots)

    def start(self, should_stop: Callable[[], bool] | None = None) -> "WorkerPool":
        """Start every worker and wait until each has loaded its engine. Whatever ends the wait
        early (a worker that cannot load, ``should_stop`` returning True, an exception such as
        KeyboardInterrupt) first stops the workers started (:meth:`close`: one still loading is
        killed at once), so that none is left behind.

        Args:
            should_stop: polled while the workers load (every 0.5 s at most); True stops the
                start (``edgesync serve`` passes whether a SIGTERM or Ctrl-C arrived).

        Raises:
            PoolStartError: a worker reported that its engine cannot load, or timed out, or
                ``should_stop`` returned True.
        """
        try:
            for slot in self._slots:
                self._spawn(slot)
            for slot in self._slots:
                self._await_ready(slot, should_stop)
        except BaseException:
            self.close()
            raise
        for slot in self._slots:
            thread = threading.Thread(target=self._read, args=(slot,), name=f"edgesync-worker-{slot.index}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _spawn(self, slot: _Slot) -> None:
        """A new process for ``slot``, with new queues (a dead process may have left its old
        queues half-written). It starts with SIGINT and SIGTERM blocked
        (:func:`~.worker.stop_signals_blocked`) until it ignores them."""
        slot.requests, slot.responses = self._ctx.Queue(), self._ctx.Queue()
        slot.cancel = CancelBoard(self._ctx)
        if self.cores is not None:  # a dead process's marks would stop the others
            self.cores.release(slot.index)
        process = self._ctx.Process(
            target=worker_main, name=f"edgesync-worker-{slot.index}", daemon=True,
            args=(slot.index, self.settings, slot.requests, slot.responses, slot.cancel, self.log_level,
                  self.cores))
        with stop_signals_blocked():
            process.start()
        slot.process = process  # started: close() joins only started processes

    def _await_ready(self, slot: _Slot, should_stop: Callable[[], bool] | None = None) -> None:
        """Block until ``slot``'s worker says ready (PoolStartError on fatal, death, timeout, or
        once ``should_stop`` returns True)."""
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if should_stop is not None and should_stop():
                raise PoolStartError("the start was stopped before every worker had loaded its engine")
            try:
                msg = slot.responses.get(timeout=0.5)
            except queue.Empty:
                if not slot.process.is_alive():
                    raise PoolStartError(f"worker {slot.index} exited with status {slot.process.exitcode} "
                                         "before its engine was loaded") from None
                continue
            if msg.get("type") == "fatal":
                raise PoolStartError(f"worker {slot.index} cannot load the engine: {msg['message']}")
            if msg.get("type") == "ready":
                slot.pid = msg["pid"]
                log.info("worker %d ready (pid %d)", slot.index, slot.pid)
                return
        raise PoolStartError(f"worker {slot.index} did not load its engine within {self.start_timeout_s:.0f} s")

    def pids(self) -> list[int | None]:
        """The current process id of each worker (None while one is starting)."""
        return [slot.pid for slot in self._slots]

    def restarts(self) -> int:
        """Worker processes restarted since :meth:`start`."""
        return sum(slot.restarts for slot in self._slots)

    def cancelled(self) -> int:
        """Jobs a worker stopped early because their client went away (or on shutdown)."""
        return self._cancelled

    def routed_by_prefix(self) -> int:
        """Jobs the prefix rule placed (``routing.choose_worker``'s by_prefix)."""
        return self._routed_by_prefix

    def handed_over(self) -> int:
        """Conversations handed to another worker when a new one took their worker
        (:meth:`_hand_over`)."""
        return self._handed_over

    def idle_totals(self) -> dict[str, int]:
        """The workers' idle-time counters (``IdleStats`` fields), summed over workers and
        their restarts, as far as reported."""
        with self._lock:
            return dict(self._idle_totals)

    def queued(self) -> int:
        """Jobs submitted and not yet answered, over all workers."""
        with self._lock:
            return sum(len(slot.jobs) for slot in self._slots)

    async def submit(self, job: dict) -> AsyncIterator[dict]:
        """Send ``job`` (a dict without ``id``) to a worker; yields its messages, ending with
        the final one (``done``, ``error`` or ``cancelled``). Closing the iterator early
        cancels the job (the worker stops at its next token)."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._closing:
                raise RuntimeError("the server is shutting down")
            job_id = next(self._ids)
            slot = self._route(job["prompt"])
            slot.jobs.add(job_id)
            self._prompts[job_id] = job["prompt"]
            self._listeners[job_id] = (loop, inbox)
            slot.requests.put({**job, "id": job_id})
        finished = False
        try:
            while True:
                msg = await inbox.get()
                finished = msg["type"] in FINAL_TYPES
                yield msg
                if finished:
                    return
        finally:
            with self._lock:
                self._listeners.pop(job_id, None)
                if not finished and job_id in slot.jobs:
                    slot.cancel.cancel(job_id)

    def first_piece_sent(self, job_id: int) -> None:
        """Tell the worker of ``job_id`` that its first streamed piece went to the client (it
        waits for this before it computes the next token, see ``worker.serve_one``)."""
        with self._lock:
            for slot in self._slots:
                if job_id in slot.jobs:
                    slot.cancel.first_piece_sent(job_id)
                    return

    def _route(self, prompt) -> _Slot:
        """The slot for a job of ``prompt`` (lock held; see :mod:`.routing`)."""
        slots = self._slots
        text = prompt_text(prompt) if len(slots) > 1 else ""
        scores = [prefix_score(text, s.context) if text else 0 for s in slots]
        unstarted = [sum(len(prompt_text(self._prompts[j])) for j in s.jobs - s.started if j in self._prompts)
                     if text else 0 for s in slots]
        index, by_prefix = choose_worker([len(s.jobs) for s in slots], scores, [s.last_used for s in slots],
                                         unstarted)
        self._routed_by_prefix += by_prefix
        self._assigned += 1
        chosen = slots[index]
        chosen.last_used = self._assigned
        if text and chosen.context is not None and not text.startswith(chosen.context):
            self._hand_over(chosen)  # the job does not continue the conversation the worker holds
        return chosen

    def _hand_over(self, left: _Slot) -> None:
        """``left`` got a job of another conversation than the one it holds live (lock held):
        when it may still be storing that conversation's history, another worker is asked to
        prepare it in its idle time (a ``prepare`` message) and is taken to hold it from now on,
        so that its next turn continues a live sequence there rather than prefilling what
        ``left`` did not store. The worker with the fewest outstanding jobs takes it (then one
        whose own idle-time work is done, then the one given a job longest ago)."""
        history, context = left.history, left.context
        left.context, left.history = None, None
        others = [s for s in self._slots if s is not left and s.requests is not None]
        if not (left.storing and history and others) or any(s.context == context for s in others):
            return
        taker = min(others, key=lambda s: (len(s.jobs), s.storing, s.last_used, s.index))
        taker.requests.put({"type": "prepare", "prompt": history})
        taker.context, taker.history, taker.storing = context, history, True
        self._handed_over += 1
        log.debug("worker %d took over the conversation worker %d was storing", taker.index, left.index)

    def _ended(self, slot: _Slot, msg: dict) -> None:
        """Bookkeeping of a job's final message (lock held): its slot's live context and the
        idle-time counters the worker reported with it."""
        kind, prompt = msg.get("type"), self._prompts.pop(msg.get("id"), None)
        result = msg.get("result") or {}
        if kind == "done":
            if msg.get("finish_reason") != "cancelled" and prompt is not None:
                slot.context = context_text(prompt, msg.get("text", ""))
                slot.history = None if isinstance(prompt, str) else [
                    *prompt, {"role": "assistant", "content": msg.get("text", "")}]
                self._hint_room(slot, int(result.get("prompt_tokens", 0)) + int(result.get("completion_tokens", 0)))
            else:
                slot.context, slot.history = None, None
            slot.storing = bool(result.get("idle_pending"))
            self._count_idle(slot, result.get("idle"))
        elif kind == "cancelled" or msg.get("status", 500) >= 500:
            slot.context, slot.history = None, None  # the live sequence now holds another prompt, or is unknown

    def _hint_room(self, answered: _Slot, n_tokens: int) -> None:
        """Tell every other worker of a conversation of ``n_tokens`` that ``answered`` holds,
        when it is longer than any they heard of (lock held; see the module docstring)."""
        tokens = n_tokens + ROOM_MARGIN_TOKENS
        for slot in self._slots:
            if slot is not answered and slot.room < tokens and slot.requests is not None:
                slot.requests.put({"type": "room", "tokens": tokens})
                slot.room = tokens

    def _count_idle(self, slot: _Slot, stats: dict | None) -> None:
        """Add what a worker's cumulative idle-time counters grew by since its last report
        (lock held)."""
        if not stats:
            return
        for name in IDLE_FIELDS:
            value = int(stats.get(name, 0))
            self._idle_totals[name] += max(0, value - slot.idle.get(name, 0))
        slot.idle = {name: int(stats.get(name, 0)) for name in IDLE_FIELDS}

    def _deliver(self, slot: _Slot, msg: dict) -> None:
        """Hand a worker's message to its job's queue (dropped when nobody listens); an
        ``idle`` report updates the pool's counters and ``slot.storing``."""
        with self._lock:
            if msg.get("type") == "idle":
                self._count_idle(slot, msg.get("stats"))
                slot.storing = bool(msg.get("pending"))
                return
            if msg.get("type") in FINAL_TYPES:
                slot.jobs.discard(msg.get("id"))
                slot.started.discard(msg.get("id"))
                self._ended(slot, msg)
            elif msg.get("id") in slot.jobs:
                slot.started.add(msg.get("id"))
            if msg.get("type") == "started":  # the pool's own bookkeeping: nobody listens for it
                return
            if msg.get("type") == "cancelled":
                self._cancelled += 1
            target = self._listeners.get(msg.get("id"))
        if target is not None:
            loop, inbox = target
            loop.call_soon_threadsafe(inbox.put_nowait, msg)

    def _read(self, slot: _Slot) -> None:
        """The reader thread of one slot: deliver messages, restart the worker when it dies."""
        while True:
            try:
                msg = slot.responses.get(timeout=0.2)
            except (queue.Empty, EOFError, OSError):
                if self._closing:
                    return
                if not slot.process.is_alive():
                    self._restart(slot)
                continue
            if msg.get("type") in ("ready", "fatal"):
                continue
            self._deliver(slot, msg)

    def _restart(self, slot: _Slot) -> None:
        """Fail ``slot``'s outstanding jobs and start a new process in its place."""
        code = slot.process.exitcode
        with self._lock:
            # one critical section: a job submitted now goes to the new queue, never the dead one's
            lost = sorted(slot.jobs)
            slot.jobs.clear()
            slot.started.clear()
            slot.pid = None
            # a new process: nothing live, counters from 0
            slot.context, slot.history, slot.storing, slot.idle, slot.room = None, None, False, {}, 0
            slot.restarts += 1
            self._spawn(slot)
        log.error("worker %d (exit status %s) died with %d jobs outstanding; restarted it", slot.index, code,
                  len(lost))
        for job_id in lost:
            self._deliver(slot, {"id": job_id, "type": "error", "status": 500, "err_type": "server_error",
                                 "code": "worker_died", "param": None,
                                 "message": f"the worker serving this request died (exit status {code}); "
                                            "it was restarted, retry the request"})
        try:
            self._await_ready(slot, should_stop=lambda: self._closing)
        except PoolStartError as exc:
            if not self._closing:  # else close() stopped it
                log.error("%s", exc)

    def cancel_all(self) -> None:
        """Cancel every outstanding job: each worker stops its running one at the next token
        and answers the queued ones ``cancelled`` without starting them."""
        with self._lock:
            for slot in self._slots:
                if slot.cancel is not None:
                    for job_id in slot.jobs:
                        slot.cancel.cancel(job_id)

    def skip_drain(self) -> None:
        """Tell every worker that is stopping to leave its queued idle-time work
        (:func:`~.worker.drain`)."""
        for slot in self._slots:
            if slot.cancel is not None:
                slot.cancel.skip_drain()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop every worker. One that said ready is asked to stop after its current job, and
        given up to ``timeout_s`` to close its engine and store before it is killed (workers
        ignore SIGTERM). One still loading its engine (a start or a restart under way) is
        killed at once: it has stored nothing yet and would read the request to stop only once
        loaded, which can take minutes; the store is crash-safe (LMDB)."""
        with self._lock:
            self._closing = True
        for slot in self._slots:
            if slot.process is None or not slot.process.is_alive():
                continue
            if slot.pid is None:
                log.info("worker %d is still loading its engine; killing it", slot.index)
                slot.process.kill()
            else:
                slot.requests.put(None)
        deadline = time.monotonic() + timeout_s
        for slot in self._slots:
            if slot.process is None:
                continue
            slot.process.join(max(0.0, deadline - time.monotonic()))
            if slot.process.is_alive():
                log.warning("worker %d did not stop in %.0f s; killing it", slot.index, timeout_s)
                slot.process.kill()
                slot.process.join(5)
        for thread in self._threads:
            thread.join(1)
