"""A worker's :class:`~edgesync_engines.server.worker.CancelBoard` as pure logic (the real server
cancels through it in ``tests/test_server_chat.py`` and ``tests/test_server.py``): every job
marked stays cancelled while it is among the newest ``CANCELS_KEPT``, whatever was marked after;
a worker process waiting for a stream's first piece to be sent goes on once the server marks it,
or when its job is cancelled, or after the timeout. A worker-like process whose parent is
SIGKILLed ends by itself (``server/parent_watch.py``), starting or serving."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from edgesync_engines.server import parent_watch
from edgesync_engines.server.parent_watch import ParentWatch
from edgesync_engines.server.worker import CANCELS_KEPT, CancelBoard
from tests.serve_process import ROOT, alive


def test_every_cancelled_job_stays_cancelled_until_the_ring_wraps():
    board = CancelBoard(multiprocessing.get_context("spawn"))
    assert not board.cancelled(1) and not board.drain_skipped
    board.cancel(7)
    board.cancel(3)  # a later cancel does not hide an earlier one
    assert board.cancelled(7) and board.cancelled(3) and not board.cancelled(4)
    for job_id in range(100, 100 + CANCELS_KEPT - 1):
        board.cancel(job_id)
    assert board.cancelled(3) and not board.cancelled(7)  # the oldest beyond the ring is forgotten
    assert board.cancelled(100) and board.cancelled(100 + CANCELS_KEPT - 2)
    board.skip_drain()
    assert board.drain_skipped and board.cancelled(3)


def _wait_in_a_worker(board: CancelBoard, job_id: int) -> None:
    sys.exit(0 if board.wait_first_piece(job_id, timeout_s=600) else 1)


def test_a_worker_waits_for_the_first_piece_until_the_server_marks_it_sent():
    ctx = multiprocessing.get_context("spawn")
    board = CancelBoard(ctx)
    worker = ctx.Process(target=_wait_in_a_worker, args=(board, 5))
    worker.start()
    board.first_piece_sent(4)  # another job's mark does not end the wait
    worker.join(0.5)
    assert worker.is_alive()
    board.first_piece_sent(5)
    worker.join(30)
    assert worker.exitcode == 0
    assert not board.wait_first_piece(6, timeout_s=0.01)  # never marked: the wait ends with the timeout
    cancelled = ctx.Process(target=_wait_in_a_worker, args=(board, 6))
    cancelled.start()
    board.cancel(6)  # the client went away: nothing will be sent
    cancelled.join(30)
    assert cancelled.exitcode == 1


INTERMEDIATE = """
import multiprocessing, sys, time
from tests.test_server_worker import _watched_sleep
ctx = multiprocessing.get_context("spawn")
ctx.Process(target=_watched_sleep, args=(sys.argv[1],), daemon=True).start()
time.sleep(600)
"""
"""A stand-in server (run with ``python -c``): starts one worker-like process and waits."""


def _watched_sleep(mode: str) -> None:
    """A worker-like process: its parent watch, then a wait as long as a model's load, or a loop
    that never checks its parent ("serving": only the watch's grace ends it)."""
    if mode == "thread":  # as where there is no prctl (macOS): the thread's poll is the only watch
        parent_watch._prctl = lambda: None
    # "kernel": a poll too slow to matter, so that only the kernel's signal can end it in time
    watch = ParentWatch("test worker", poll_s=600 if mode == "kernel" else 0.1, grace_s=0.5).start()
    if mode == "serving":
        watch.serving()
    print(json.dumps({"pid": os.getpid(), "kernel_armed": watch.kernel_armed}), flush=True)
    time.sleep(600)


@pytest.mark.parametrize("mode", ["kernel", "thread", "serving"])
def test_a_worker_whose_server_is_killed_stops_by_itself(mode):
    """Its server SIGKILLed, a worker ends whatever it is doing: while it starts, at once (the
    kernel's parent-death signal on Linux, the watch's thread elsewhere), and once serving after
    the watch's grace if its loop does not stop it first."""
    if mode == "kernel" and not sys.platform.startswith("linux"):
        pytest.skip("prctl(PR_SET_PDEATHSIG) is Linux's")
    server = subprocess.Popen([sys.executable, "-c", INTERMEDIATE, mode], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    worker = None
    try:
        report = json.loads(server.stdout.readline())
        worker = report["pid"]
        assert report["kernel_armed"] == (mode == "kernel" and sys.platform.startswith("linux"))
        assert alive(worker)
        server.kill()
        server.wait(30)
        deadline = time.monotonic() + 60  # generous: the assertion is that it ends, not how fast
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(worker)
    finally:
        server.kill()
        server.wait(30)
        if worker is not None and alive(worker):
            os.kill(worker, signal.SIGKILL)
