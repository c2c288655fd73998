"""A worker's :class:`~edgesync_engines.server.worker.CancelBoard` as pure logic (the real server
cancels through it in ``tests/test_server_chat.py`` and ``tests/test_server.py``): every job
marked stays cancelled while it is among the newest ``CANCELS_KEPT``, whatever was marked after."""

from __future__ import annotations

import multiprocessing

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
