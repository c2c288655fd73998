"""The workers' share of the CPUs (``server/core_share.py``), as pure logic: several
:class:`CoreShare` views on one shared state stand for the workers, each on a thread of this
test (the state is the same ``multiprocessing`` shared memory the worker processes use), and a
recorder stands for the engine's ``set_threads``. Orders are asserted through events, never
times. That answers do not depend on the thread count is checked on the real model in
``tests/test_llamacpp.py``; the server runs it in ``tests/test_server_load.py``."""

from __future__ import annotations

import copy
import multiprocessing
import threading

import pytest

from edgesync_engines.server.core_share import CoreShare

WAIT_S = 10.0  # generous bound for an event that must happen; a failure, never a timing


def workers(n_workers: int, n_threads: int) -> tuple[list[CoreShare], list[list[int]]]:
    """``n_workers`` attached views of one state, and each one's ``set_threads`` calls."""
    share = CoreShare(multiprocessing.get_context("spawn"), n_workers, n_threads)
    views, calls = [], []
    for i in range(n_workers):
        view, record = copy.copy(share), []
        view.attach(i, record.append)
        views.append(view)
        calls.append(record)
    return views, calls


def in_thread(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_a_prefill_batch_waits_for_the_step_running_then_has_every_thread():
    (a, b), (_, b_threads) = workers(2, 4)
    order: list[str] = []
    prefill_asked, step_may_end = threading.Event(), threading.Event()
    with a.active(), a.step():
        order.append("a step begins")

        def prefill():
            prefill_asked.set()
            with b.active(), b.prefill(), b.batch(100):
                order.append("b prefills")

        thread = in_thread(prefill)
        assert prefill_asked.wait(WAIT_S)
        assert a.should_yield()  # a run of idle-time batches ends at its next batch
        step_may_end.set()
        order.append("a step ends")
    thread.join(WAIT_S)
    assert order == ["a step begins", "a step ends", "b prefills"]
    assert b_threads == [4]


def test_steps_wait_for_a_prefill_and_then_split_the_threads():
    (a, b), (a_threads, b_threads) = workers(2, 4)
    order: list[str] = []
    with b.active(), b.prefill(), b.batch(30):
        with a.active():
            thread = in_thread(lambda: (a.step().__enter__(), order.append("a steps")))
            thread.join(0.2)  # the step must not have begun while b prefills
            order.append("b prefill ends")
    thread.join(WAIT_S)
    assert order == ["b prefill ends", "a steps"]
    # a was active alone when its step began: every thread
    assert a_threads == [4] and b_threads == [4]


def test_a_hold_after_the_first_token_keeps_other_batches_waiting_until_it_ends():
    (a, b), _ = workers(2, 4)
    order: list[str] = []
    asked = threading.Event()
    with a.active(), a.prefill():
        with a.batch(20):
            order.append("a's last batch")

        def prefill():
            asked.set()
            with b.active(), b.prefill(), b.batch(100):
                order.append("b prefills")

        with a.hold():
            thread = in_thread(prefill)
            assert asked.wait(WAIT_S)
            thread.join(0.2)  # b's batch must not begin while a holds
            order.append("a's first token sent")
    thread.join(WAIT_S)
    assert order == ["a's last batch", "a's first token sent", "b prefills"]


def test_a_hold_outside_a_prefill_holds_nothing():
    (a, b), _ = workers(2, 4)
    done = threading.Event()

    def prefill():
        with b.active(), b.prefill(), b.batch(10):
            done.set()

    with a.hold():
        thread = in_thread(prefill)
        assert done.wait(WAIT_S)  # b's batch ran while a held outside a prefill
    thread.join(WAIT_S)


def test_the_threads_of_a_step_are_the_total_over_the_active_workers():
    (a, b, c), (a_threads, _, _) = workers(3, 6)
    with a.active():
        with a.step():
            pass
        with b.active():
            with a.step():
                assert not a.should_yield()
            with c.active():
                with a.step():
                    pass
    assert a_threads == [6, 3, 2]


def test_a_run_of_batches_yields_when_more_workers_become_active():
    (a, b), _ = workers(2, 2)
    with a.active(), a.step():
        assert not a.should_yield()
        with b.active():
            assert a.should_yield()


def test_waiting_prefill_batches_go_shortest_first_then_in_the_order_asked():
    (a, b, c, d), _ = workers(4, 2)
    order: list[str] = []
    waiting = threading.Barrier(4)

    def prefill(view: CoreShare, name: str, tokens_left: int) -> None:
        with view.prefill():
            waiting.wait(WAIT_S)  # every ticket is taken before a's batch ends
            with view.batch(tokens_left):
                order.append(name)

    with a.prefill(), a.batch(900):
        threads = [in_thread(lambda v=v, n=n, t=t: prefill(v, n, t))
                   for v, n, t in ((b, "b: 400 left", 400), (c, "c: 60 left", 60), (d, "d: 60 left", 60))]
        waiting.wait(WAIT_S)
        for thread in threads:
            thread.join(0.2)  # none may run while a's batch does
        order.append("a's batch ends")
    for thread in threads:
        thread.join(WAIT_S)
    assert order[0] == "a's batch ends"
    assert order[1:] == ["c: 60 left", "d: 60 left", "b: 400 left"] or \
        order[1:] == ["d: 60 left", "c: 60 left", "b: 400 left"]


def test_a_long_prefill_passed_over_twice_goes_before_a_shorter_one():
    """Short prompts one after another: the long prompt's waiting batch lets two shorter
    batches go first (fewest tokens left), then runs before the next short one."""
    (long_, short, other), _ = workers(3, 2)
    order: list[str] = []
    waiting = threading.Event()

    def prefill(view: CoreShare, name: str, tokens_left: int, asked: threading.Event | None = None) -> None:
        with view.prefill():
            if asked is not None:
                asked.set()
            with view.batch(tokens_left):
                order.append(name)

    with short.prefill():
        with short.batch(40):  # the long one asks while this batch runs
            long_thread = in_thread(lambda: prefill(long_, "long", 900, waiting))
            assert waiting.wait(WAIT_S)
            long_thread.join(0.2)
        with short.batch(20):  # the long batch passed over once: fewer tokens left here
            order.append("short")
        with short.batch(10):  # twice; a shorter prompt asks meanwhile
            order.append("short")
            other_thread = in_thread(lambda: prefill(other, "other short", 5))
            other_thread.join(0.2)
    long_thread.join(WAIT_S)
    other_thread.join(WAIT_S)
    assert order == ["short", "short", "long", "other short"]


def test_a_batch_outside_a_prefill_runs_at_once():
    (a, b), _ = workers(2, 2)
    with b.prefill(), b.batch(50):
        with a.batch(64):  # an idle-time batch: its step already waited
            pass


def test_a_dead_workers_marks_are_released_by_the_pool():
    (a, b), _ = workers(2, 2)
    phase, inside = a.prefill(), a.batch(10)
    phase.__enter__()
    inside.__enter__()  # a dies inside a prefill batch: its marks stay
    assert b.should_yield()
    b.release(0)  # what the pool does before it starts a's new process
    assert not b.should_yield()
    with b.step():
        pass
    with b.prefill(), b.batch(10):
        pass


def test_bad_arguments_are_refused_by_name():
    ctx = multiprocessing.get_context("spawn")
    with pytest.raises(ValueError, match="n_workers and n_threads"):
        CoreShare(ctx, 0, 2)
    with pytest.raises(ValueError, match="n_workers and n_threads"):
        CoreShare(ctx, 2, 0)
    with pytest.raises(ValueError, match="index 2 outside"):
        CoreShare(ctx, 2, 2).attach(2, print)
