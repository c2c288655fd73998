"""The first worker's process, started by the ``edgesync`` console script before it imports the
command line (``app/cli_entry.py``): it imports the engine (Python, NumPy, llama.cpp's bindings)
while the server imports its own modules, reads its settings and checks them; then
:meth:`~.pool.WorkerPool.spawn` adopts it as worker 0 and sends it its settings (a ``load``
message), and it loads the engine as any worker does. The console script kills it unless a pool
adopted it (:func:`discard`). Only this module's standard-library imports and :mod:`.worker`'s
are paid before it starts.
"""

from __future__ import annotations

import atexit
import multiprocessing
from dataclasses import dataclass

from edgesync_engines.server.worker import CancelBoard, stop_signals_blocked, worker_main, worker_malloc_settings


@dataclass
class EarlyWorker:
    """A worker process started without its settings, and its queues and cancel board."""

    process: multiprocessing.Process
    requests: object
    responses: object
    cancel: CancelBoard


_started: EarlyWorker | None = None  # the early worker not adopted yet


def begin() -> None:
    """Start the early worker (``spawn``, as the pool's), with the workers' allocator settings and
    SIGINT and SIGTERM blocked; once per process."""
    global _started
    if _started is not None:
        return
    ctx = multiprocessing.get_context("spawn")
    worker_malloc_settings()  # glibc reads them at the process's start
    requests, responses, cancel = ctx.Queue(), ctx.Queue(), CancelBoard(ctx)
    process = ctx.Process(target=worker_main, name="edgesync-worker-0", daemon=True,
                          args=(0, None, requests, responses, cancel))
    # run before multiprocessing's exit handler, which would wait forever for a process that
    # ignores its SIGTERM; a Ctrl-C comes once _started is set
    atexit.register(discard)
    with stop_signals_blocked():
        process.start()
        _started = EarlyWorker(process, requests, responses, cancel)


def take() -> EarlyWorker | None:
    """The early worker, still running, for a pool to adopt (then no longer :func:`discard`\\ ed), or None."""
    global _started
    early, _started = _started, None
    if early is not None and not early.process.is_alive():
        early.process.join()
        return None
    return early


def discard() -> None:
    """Kill the early worker unless a pool took it (it ignores SIGTERM and holds nothing yet)."""
    early = take()
    if early is not None:
        early.process.kill()
        early.process.join()
