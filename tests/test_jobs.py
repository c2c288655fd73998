"""StoreJobs (edgesync_store/lifecycle/jobs.py): the scheduled expiry sweep and compaction in the
application process.

Store-level tests use seeded synthetic K/V (``tests/test_store.make_fragment``, SmolLM2's KV
geometry) on a ``ManualClock``: the clock moves only when told, and waiting is polling of what
the jobs changed (no fixed sleeps). The EdgeSync test uses the real SmolLM2 (``adapter``).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.router import EdgeSync
from edgesync_store.compactor import Compactor
from edgesync_store.core.store import FragmentStore
from edgesync_store.lifecycle import jobs as jobs_module
from edgesync_store.lifecycle import merge
from edgesync_store.lifecycle.jobs import StoreJobs, start_jobs
from edgesync_store.lifecycle.merge import split_layers
from edgesync_store.ttl import ManualClock
from tests.test_store import make_fragment

MIN = 60.0
T0 = 1_800_000_000.0


def poll(condition, timeout_s: float = 5.0) -> bool:
    """True as soon as ``condition()`` holds; False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def clock():
    return ManualClock(T0)


@pytest.fixture
def store(tmp_path, clock):
    s = FragmentStore(tmp_path / "store", clock=clock)
    yield s
    s.close()


@pytest.fixture
def started():
    """Start StoreJobs through this and they are shut down after the test, whatever happens."""
    made: list[StoreJobs] = []

    def start(*args, **kw) -> StoreJobs:
        jobs = StoreJobs(*args, **kw)
        made.append(jobs)
        return jobs.start()

    yield start
    for jobs in made:
        jobs.shutdown()


def test_scheduled_sweep_deletes_fragments_once_30_minutes_pass(store, clock, started):
    short = [make_fragment(seed=i, created_at=clock(), expires_at=clock() + 30 * MIN) for i in range(3)]
    long = make_fragment(seed=9, created_at=clock(), expires_at=clock() + 7 * 24 * 60 * MIN)
    assert store.put_many(short + [long]) == 4
    jobs = started(store, sweep_interval_s=0.2, compact_interval_s=3600)
    assert poll(lambda: jobs.runs["sweep"] >= 2)
    assert store.stats().fragments == 4  # sweeps before the half hour delete nothing
    clock.advance(30 * MIN)  # expires_at <= now: expired
    assert poll(lambda: store.stats().fragments == 1)
    assert [key for key, _ in store.iterate_lifecycle()] == [long.key()]
    assert jobs.failures == {} and jobs.runs["compact"] == 0


def test_a_failing_job_is_logged_counted_and_run_again(store, clock, started, monkeypatch, caplog):
    caplog.set_level(logging.ERROR, logger="edgesync_store.lifecycle.jobs")
    expired = [make_fragment(seed=20 + i, created_at=clock() - 40 * MIN, expires_at=clock() - 10 * MIN)
               for i in range(2)]
    assert store.put_many(expired) == 2
    real_sweep, calls = jobs_module.sweep, []

    def sweep_failing_once(*args, **kw):
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("injected sweep failure")
        return real_sweep(*args, **kw)

    monkeypatch.setattr(jobs_module, "sweep", sweep_failing_once)
    jobs = started(store, sweep_interval_s=0.2, compact_interval_s=3600)
    assert poll(lambda: jobs.runs["sweep"] >= 1)
    assert jobs.failures["sweep"] == 1 and len(calls) >= 2
    assert store.stats().fragments == 0  # the run after the failure swept them
    errors = [r for r in caplog.records if r.name == "edgesync_store.lifecycle.jobs" and r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "sweep" in errors[0].getMessage()
    assert errors[0].exc_info is not None and errors[0].exc_info[0] is RuntimeError
    assert "injected sweep failure" in caplog.text  # the traceback is in the log


def test_shutdown_stops_a_running_compaction_between_merge_groups(store, clock, started, monkeypatch):
    wholes = [make_fragment(seed=40 + i, heads=(0, 1), created_at=clock(), expires_at=clock() + 30 * MIN)
              for i in range(16)]
    halves = [half for whole in wholes for half in split_layers(whole, 15)]
    assert store.put_many(halves) == 32
    entered = threading.Event()
    real_merge = merge.merge_layers

    def slow_merge(frags):
        entered.set()
        time.sleep(0.5)  # 16 groups: about 8 s for the whole run
        return real_merge(frags)

    monkeypatch.setattr(merge, "merge_layers", slow_merge)
    jobs = started(store, sweep_interval_s=3600, compact_interval_s=0.1)
    assert entered.wait(10), "the compaction never reached the merges"
    t0 = time.monotonic()
    jobs.shutdown()
    elapsed = time.monotonic() - t0
    assert elapsed < 2.0, f"shutdown took {elapsed:.1f} s"
    report = jobs.last_report
    assert report is not None and report["stopped"] is True
    assert 1 <= report["merged_layers"] < 16
    assert jobs.runs["compact"] == 1 and jobs.failures == {}
    # every group merged whole or not at all: the whole chunk's key, or both halves
    merged = 0
    for whole, (a, b) in zip(wholes, zip(halves[::2], halves[1::2])):
        if store.contains(whole.key()):
            got = store.get(whole.key())
            assert np.array_equal(got.keys, whole.keys) and np.array_equal(got.values, whole.values)
            assert not store.contains(a.key()) and not store.contains(b.key())
            merged += 1
        else:
            assert store.contains(a.key()) and store.contains(b.key())
    assert merged == report["merged_layers"]
    assert store.stats().fragments == 32 - merged
    assert store.stats().dropped_corrupt == 0


def test_a_compaction_is_skipped_while_another_process_compacts(store, clock, tmp_path):
    expired = [make_fragment(seed=60 + i, created_at=clock() - 40 * MIN, expires_at=clock() - 10 * MIN)
               for i in range(3)]
    assert store.put_many(expired) == 3
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from pathlib import Path; from edgesync_store.core.locks import CompactLock\n"
         "lock = CompactLock(Path(sys.argv[1]))\n"
         "print('held' if lock.__enter__() else 'busy', flush=True)\n"
         "sys.stdin.read()\n",
         str(store.path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        report = Compactor(store).run()
        assert report.skipped and "another process" in report.skipped
        assert report.expired == 0 and report.fragments_before == 0  # it looked at nothing
        assert StoreJobs(store).run_compaction()["skipped"]
        assert store.stats().fragments == 3  # nothing was swept
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert holder.returncode == 0
    report = Compactor(store).run(do_reclaim=False)
    assert report.skipped is None and report.expired == 3
    assert store.stats().fragments == 0


def _apscheduler_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "APScheduler"}


@pytest.mark.model
def test_edgesync_runs_the_jobs_when_configured_and_close_stops_them(adapter, tmp_path):
    path = tmp_path / "store"
    now = time.time()
    with FragmentStore(path) as s:
        s.put_many([make_fragment(seed=80 + i, created_at=now - 40 * MIN, expires_at=now - 10 * MIN) for i in range(2)])
    cfg = {"semantic": False, "sweep_interval_s": 0.2, "compact_interval_s": 0.3}

    before = _apscheduler_threads()
    off = EdgeSync(adapter, store=path, config=EdgeSyncConfig.load({**cfg, "jobs": False}))
    try:
        assert off.jobs is None
        assert not _apscheduler_threads() - before
    finally:
        off.close()

    es = EdgeSync(adapter, store=path, config=EdgeSyncConfig.load({**cfg, "jobs": True}))
    try:
        jobs = es.jobs
        assert jobs is not None and jobs.store is es.store
        assert (jobs.sweep_interval_s, jobs.compact_interval_s) == (0.2, 0.3)
        scheduler = jobs._scheduler
        thread = scheduler._thread
        assert scheduler.running and thread.is_alive() and thread in _apscheduler_threads() - before
        assert poll(lambda: jobs.runs["sweep"] >= 1 and jobs.runs["compact"] >= 1)
        assert es.store.stats().fragments == 0  # the expired fragments are gone
        assert jobs.failures == {}
        pool_threads = list(scheduler._executors["default"]._pool._threads)
        assert pool_threads
    finally:
        es.close()
    assert es.jobs is None
    assert not scheduler.running
    assert not thread.is_alive()
    assert not any(t.is_alive() for t in pool_threads)
    assert not _apscheduler_threads() - before


def test_start_jobs_starts_them_on_a_writable_store_only(store, tmp_path):
    jobs = start_jobs(store, None, 60.0, 900.0)
    try:
        assert isinstance(jobs, StoreJobs) and jobs.sweep_interval_s == 60.0
    finally:
        jobs.shutdown()
    with FragmentStore(tmp_path / "store", readonly=True) as readonly:
        assert start_jobs(readonly) is None
    assert start_jobs(object()) is None


def test_importing_the_jobs_does_not_load_the_compactor():
    import subprocess
    import sys

    code = "import sys, edgesync_store.lifecycle.jobs; print('edgesync_store.compactor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
