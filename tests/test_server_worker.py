"""A worker's :class:`~edgesync_engines.server.worker.CancelBoard` as pure logic (the real server
cancels through it in ``tests/test_server_chat.py`` and ``tests/test_server.py``): every job
marked stays cancelled while it is among the newest ``CANCELS_KEPT``, whatever was marked after;
a worker process waiting for a stream's first piece to be sent goes on once the server marks it,
or when its job is cancelled, or after the timeout."""

from __future__ import annotations

import multiprocessing
import sys

from edgesync_engines.server.worker import CANCELS_KEPT, CancelBoard


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
