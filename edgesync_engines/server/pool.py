"""The worker processes as the server sees them: start, dispatch, cancel, restart, stop.

Each worker (:func:`~.worker.worker_main`, started with ``spawn``) owns a request queue, a
response queue and a :class:`~.worker.CancelBoard`; messages are plain dicts keyed by ``type``:
to a worker a job, ``room``, ``prepare`` or None (stop); from it ``ready``, ``fatal``, per job
``piece`` or ``started``, then one of :data:`FINAL_TYPES`, and ``idle`` between jobs. Routing,
room hints and hand-over: docs/serving.md, Concurrency.
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
from typing import TYPE_CHECKING, AsyncIterator, Callable

from edgesync_engines.server.core_share import CoreShare
from edgesync_engines.server.routing import choose_worker, context_text, prefix_score, prompt_text
from edgesync_engines.server.worker import IDLE_FIELDS, CancelBoard, stop_signals_blocked, worker_main

if TYPE_CHECKING:
    from edgesync_engines.server.early import EarlyWorker

log = logging.getLogger(__name__)

FINAL_TYPES = ("done", "error", "cancelled")
"""Message types that end a job."""
ROOM_MARGIN_TOKENS = 16
"""Tokens a ``room`` hint adds to prompt and answer: the chat template's end of the answer."""


class PoolStartError(RuntimeError):
    """A worker could not load its engine (the message says why), did not start in time, or the
    start was stopped (:meth:`WorkerPool.start`'s ``should_stop``)."""


@dataclass
class _Worker:
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
    """Ids of its outstanding jobs that have sent a message (prefill over)."""
    last_used: int = 0  # the pool's job count when this worker was last given a job
    context: str | None = None
    """Canonical text the worker holds live (``routing.context_text``), or None."""
    slots: int = 1
    """Conversations its engine answers at once (its ``ready`` message says)."""
    contexts: list = field(default_factory=list)
    """With several slots: the canonical texts of the conversations it answered last, newest last
    (as many as its slots; its engine places each request in the slot holding it)."""
    history: list | None = None
    """Chat messages of that conversation with the answer (None: a text prompt, or none)."""
    storing: bool = False
    """The worker last said its idle-time work was pending."""
    idle: dict = field(default_factory=dict)
    """Idle-time counters its current process last reported."""
    room: int = 0
    """Largest ``room`` hint sent to its current process (tokens)."""


class WorkerPool:
    """``n_workers`` engine processes serving jobs.

    Args:
        settings: ``EdgeSyncConfig.to_dict()`` values every worker loads its engine from.
        n_workers: processes (>= 1).

        start_timeout_s: seconds a worker may take to load its engine.
        shared_threads: CPU threads the workers share (:class:`~.core_share.CoreShare`); None, or
            one worker: each engine keeps the threads of ``settings``.
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
        self._workers = [_Worker(i) for i in range(n_workers)]
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
        self._spawned_at = 0.0  # time.monotonic() at spawn()

    @property
    def n_workers(self) -> int:
        """Worker processes."""
        return len(self._workers)

    def n_slots(self) -> int:
        """Conversations the workers answer at once, in all."""
        return sum(worker.slots for worker in self._workers)

    def start(self, should_stop: Callable[[], bool] | None = None) -> "WorkerPool":
        """Start every worker and wait until each has loaded its engine (:meth:`spawn`, then
        :meth:`wait_ready`); on any early end (including KeyboardInterrupt) the workers started
        are stopped first (:meth:`close`). ``should_stop``: polled at least every 0.5 s while the
        workers load; True stops the start. Raises PoolStartError when a worker cannot load its
        engine, times out, or on ``should_stop``.
        """
        return self.spawn().wait_ready(should_stop)

    def spawn(self, early: "EarlyWorker | None" = None) -> "WorkerPool":
        """Start every worker's process and return at once (they load their engines meanwhile);
        :meth:`wait_ready` waits for them, :meth:`close` stops them. ``early``: a process started
        before the settings were known (:mod:`.early`), adopted as worker 0 and sent them, unless
        the workers share the CPUs (their shared counters are given at the start: it is killed).
        On any error the workers started are stopped first."""
        self._spawned_at = time.monotonic()
        try:
            for worker in self._workers:
                if early is not None and worker.index == 0 and self.cores is None:
                    self._adopt(worker, early)
                else:
                    self._spawn(worker)
        except BaseException:
            self.close()
            raise
        finally:
            if early is not None and self._workers[0].process is not early.process:
                early.process.kill()
                early.process.join()
        return self

    def _adopt(self, worker: _Worker, early: "EarlyWorker") -> None:
        """Make the early process ``worker``'s and send it the settings to load."""
        worker.requests, worker.responses, worker.cancel = early.requests, early.responses, early.cancel
        worker.process = early.process
        worker.requests.put({"type": "load", "settings": self.settings, "log_level": self.log_level})
        log.debug("worker %d: the process started early (pid %d) loads the engine", worker.index, early.process.pid)

    def wait_ready(self, should_stop: Callable[[], bool] | None = None) -> "WorkerPool":
        """Wait until every worker :meth:`spawn` started has loaded its engine, then start reading
        their answers; the rest as :meth:`start`."""
        try:
            for worker in self._workers:
                self._await_ready(worker, should_stop)
        except BaseException:
            self.close()
            raise
        log.info("%d worker%s ready %.2f s after the pool started them", len(self._workers),
                 "s" if len(self._workers) > 1 else "", time.monotonic() - self._spawned_at)
        for worker in self._workers:
            thread = threading.Thread(target=self._read, args=(worker,), name=f"edgesync-worker-{worker.index}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _spawn(self, worker: _Worker) -> None:
        """A new process for ``worker``, with new queues, started with SIGINT and SIGTERM blocked."""
        worker.requests, worker.responses = self._ctx.Queue(), self._ctx.Queue()
        worker.cancel = CancelBoard(self._ctx)
        if self.cores is not None:  # a dead process's marks would stop the others
            self.cores.release(worker.index)
        process = self._ctx.Process(
            target=worker_main, name=f"edgesync-worker-{worker.index}", daemon=True,
            args=(worker.index, self.settings, worker.requests, worker.responses, worker.cancel, self.log_level,
                  self.cores))
        with stop_signals_blocked():
            process.start()
        worker.process = process  # started: close() joins only started processes

    def _await_ready(self, worker: _Worker, should_stop: Callable[[], bool] | None = None) -> None:
        """Block until ``worker``'s worker says ready (PoolStartError on fatal, death, timeout, or ``should_stop``)."""
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if should_stop is not None and should_stop():
                raise PoolStartError("the start was stopped before every worker had loaded its engine")
            try:
                msg = worker.responses.get(timeout=0.5)
            except queue.Empty:
                if not worker.process.is_alive():
                    raise PoolStartError(f"worker {worker.index} exited with status {worker.process.exitcode} "
                                         "before its engine was loaded") from None
                continue
            if msg.get("type") == "fatal":
                raise PoolStartError(f"worker {worker.index} cannot load the engine: {msg['message']}")
            if msg.get("type") == "ready":
                worker.pid, worker.slots = msg["pid"], int(msg.get("slots", 1))
                log.info("worker %d ready (pid %d)", worker.index, worker.pid)
                return
        raise PoolStartError(f"worker {worker.index} did not load its engine within {self.start_timeout_s:.0f} s")

    def pids(self) -> list[int | None]:
        """The current process id of each worker (None while one is starting)."""
        return [worker.pid for worker in self._workers]

    def restarts(self) -> int:
        """Worker processes restarted since :meth:`start`."""
        return sum(worker.restarts for worker in self._workers)

    def cancelled(self) -> int:
        """Jobs a worker stopped early because their client went away (or on shutdown)."""
        return self._cancelled

    def routed_by_prefix(self) -> int:
        """Jobs the prefix rule placed (``routing.choose_worker``'s by_prefix)."""
        return self._routed_by_prefix

    def handed_over(self) -> int:
        """Conversations handed to another worker (:meth:`_hand_over`)."""
        return self._handed_over

    def idle_totals(self) -> dict[str, int]:
        """The workers' idle-time counters (``IdleStats`` fields), summed over workers and restarts."""
        with self._lock:
            return dict(self._idle_totals)

    def queued(self) -> int:
        """Jobs submitted and not yet answered, over all workers."""
        with self._lock:
            return sum(len(worker.jobs) for worker in self._workers)

    async def submit(self, job: dict) -> AsyncIterator[dict]:
        """Send ``job`` (a dict without ``id``) to a worker; yields its messages up to the final one.
        Closing the iterator early cancels the job."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._closing:
                raise RuntimeError("the server is shutting down")
            job_id = next(self._ids)
            worker = self._route(job["prompt"])
            worker.jobs.add(job_id)
            self._prompts[job_id] = job["prompt"]
            self._listeners[job_id] = (loop, inbox)
            worker.requests.put({**job, "id": job_id})
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
                if not finished and job_id in worker.jobs:
                    worker.cancel.cancel(job_id)

    def first_piece_sent(self, job_id: int) -> None:
        """Tell the worker of ``job_id`` that its first streamed piece reached the client."""
        with self._lock:
            for worker in self._workers:
                if job_id in worker.jobs:
                    worker.cancel.first_piece_sent(job_id)
                    return

    def _route(self, prompt) -> _Worker:
        """The worker for a job of ``prompt`` (lock held; see :mod:`.routing`)."""
        workers = self._workers
        text = prompt_text(prompt) if len(workers) > 1 else ""
        scores = [max((prefix_score(text, c) for c in (s.contexts if s.slots > 1 else [s.context])), default=0)
                  if text else 0 for s in workers]
        unstarted = [sum(len(prompt_text(self._prompts[j])) for j in s.jobs - s.started if j in self._prompts)
                     if text else 0 for s in workers]
        # a worker with a free slot counts as idle
        index, by_prefix = choose_worker([len(s.jobs) // s.slots for s in workers], scores,
                                         [s.last_used for s in workers], unstarted)
        self._routed_by_prefix += by_prefix
        self._assigned += 1
        chosen = workers[index]
        chosen.last_used = self._assigned
        if chosen.slots == 1 and text and chosen.context is not None and not text.startswith(chosen.context):
            self._hand_over(chosen)  # the job does not continue the conversation the worker holds
        return chosen

    def _hand_over(self, left: _Worker) -> None:
        """``left`` got another conversation's job (lock held): another worker ``prepare``s its old one."""
        history, context = left.history, left.context
        left.context, left.history = None, None
        others = [s for s in self._workers if s is not left and s.requests is not None]
        if not (left.storing and history and others) or any(s.context == context for s in others):
            return
        taker = min(others, key=lambda s: (len(s.jobs), s.storing, s.last_used, s.index))
        taker.requests.put({"type": "prepare", "prompt": history})
        taker.context, taker.history, taker.storing = context, history, True
        self._handed_over += 1
        log.debug("worker %d took over the conversation worker %d was storing", taker.index, left.index)

    def _ended(self, worker: _Worker, msg: dict) -> None:
        """Bookkeeping of a job's final message (lock held): live context and idle counters."""
        kind, prompt = msg.get("type"), self._prompts.pop(msg.get("id"), None)
        result = msg.get("result") or {}
        if kind == "done":
            if msg.get("finish_reason") != "cancelled" and prompt is not None:
                worker.context = context_text(prompt, msg.get("text", ""))
                if worker.slots > 1:  # the conversation it continues is no longer held apart
                    kept = [c for c in worker.contexts if not worker.context.startswith(c)]
                    worker.contexts = (kept + [worker.context])[-worker.slots:]
                worker.history = None if isinstance(prompt, str) else [
                    *prompt, {"role": "assistant", "content": msg.get("text", "")}]
                self._hint_room(worker, int(result.get("prompt_tokens", 0)) + int(result.get("completion_tokens", 0)))
            else:
                worker.context, worker.history = None, None
            worker.storing = bool(result.get("idle_pending"))
            self._count_idle(worker, result.get("idle"))
        elif kind == "cancelled" or msg.get("status", 500) >= 500:
            worker.context, worker.history = None, None  # the live sequence now holds another prompt, or is unknown

    def _hint_room(self, answered: _Worker, n_tokens: int) -> None:
        """Send a ``room`` hint of ``n_tokens`` + margin to every other worker that heard of less (lock held)."""
        tokens = n_tokens + ROOM_MARGIN_TOKENS
        for worker in self._workers:
            if worker is not answered and worker.room < tokens and worker.requests is not None:
                worker.requests.put({"type": "room", "tokens": tokens})
                worker.room = tokens

    def _count_idle(self, worker: _Worker, stats: dict | None) -> None:
        """Add what a worker's cumulative idle-time counters grew by since its last report (lock held)."""
        if not stats:
            return
        for name in IDLE_FIELDS:
            value = int(stats.get(name, 0))
            self._idle_totals[name] += max(0, value - worker.idle.get(name, 0))
        worker.idle = {name: int(stats.get(name, 0)) for name in IDLE_FIELDS}

    def _deliver(self, worker: _Worker, msg: dict) -> None:
        """Hand a worker's message to its job's queue (dropped when nobody listens)."""
        with self._lock:
            if msg.get("type") == "idle":
                self._count_idle(worker, msg.get("stats"))
                worker.storing = bool(msg.get("pending"))
                return
            if msg.get("type") == "done":
                msg["result"]["worker"] = worker.index  # for the metrics per slot
            if msg.get("type") in FINAL_TYPES:
                worker.jobs.discard(msg.get("id"))
                worker.started.discard(msg.get("id"))
                self._ended(worker, msg)
            elif msg.get("id") in worker.jobs:
                worker.started.add(msg.get("id"))
            if msg.get("type") == "started":  # the pool's own bookkeeping: nobody listens for it
                return
            if msg.get("type") == "cancelled":
                self._cancelled += 1
            target = self._listeners.get(msg.get("id"))
        if target is not None:
            loop, inbox = target
            loop.call_soon_threadsafe(inbox.put_nowait, msg)

    def _read(self, worker: _Worker) -> None:
        """The reader thread of one worker: deliver messages, restart the worker when it dies."""
        while True:
            try:
                msg = worker.responses.get(timeout=0.2)
            except (queue.Empty, EOFError, OSError):
                if self._closing:
                    return
                if not worker.process.is_alive():
                    self._restart(worker)
                continue
            if msg.get("type") in ("ready", "fatal"):
                continue
            self._deliver(worker, msg)

    def _restart(self, worker: _Worker) -> None:
        """Fail ``worker``'s outstanding jobs and start a new process in its place."""
        code = worker.process.exitcode
        with self._lock:
            # one critical section: a job submitted now goes to the new queue, never the dead one's
            lost = sorted(worker.jobs)
            worker.jobs.clear()
            worker.started.clear()
            worker.pid = None
            # a new process: nothing live, counters from 0
            worker.context, worker.history, worker.storing, worker.idle, worker.room = None, None, False, {}, 0
            worker.restarts += 1
            self._spawn(worker)
        log.error("worker %d (exit status %s) died with %d jobs outstanding; restarted it", worker.index, code,
                  len(lost))
        for job_id in lost:
            self._deliver(worker, {"id": job_id, "type": "error", "status": 500, "err_type": "server_error",
                                 "code": "worker_died", "param": None,
                                 "message": f"the worker serving this request died (exit status {code}); "
                                            "it was restarted, retry the request"})
        try:
            self._await_ready(worker, should_stop=lambda: self._closing)
        except PoolStartError as exc:
            if not self._closing:  # else close() stopped it
                log.error("%s", exc)

    def cancel_all(self) -> None:
        """Cancel every outstanding job (the running one stops at its next token)."""
        with self._lock:
            for worker in self._workers:
                if worker.cancel is not None:
                    for job_id in worker.jobs:
                        worker.cancel.cancel(job_id)

    def skip_drain(self) -> None:
        """Tell every stopping worker to leave its queued idle-time work."""
        for worker in self._workers:
            if worker.cancel is not None:
                worker.cancel.skip_drain()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop every worker: a ready one gets a stop message and ``timeout_s`` seconds before it is
        killed; one still loading its engine is killed at once (it has stored nothing)."""
        with self._lock:
            self._closing = True
        for worker in self._workers:
            if worker.process is None or not worker.process.is_alive():
                continue
            if worker.pid is None:
                log.info("worker %d is still loading its engine; killing it", worker.index)
                worker.process.kill()
            else:
                worker.requests.put(None)
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            if worker.process is None:
                continue
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                log.warning("worker %d did not stop in %.0f s; killing it", worker.index, timeout_s)
                worker.process.kill()
                worker.process.join(5)
        for thread in self._threads:
            thread.join(1)
