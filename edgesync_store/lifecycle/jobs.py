"""The application's scheduled store jobs (apscheduler ``BackgroundScheduler``, one daemon thread):
``sweep`` (``ttl.sweep``) every ``sweep_interval_s`` and ``compact`` every ``compact_interval_s``.

One instance of a job at a time, missed runs coalesced; a job that raises is logged, counted
(:attr:`StoreJobs.failures`) and rerun at its next time. The jobs share the application's
``SemanticIndex`` and its lock with the request path; :meth:`StoreJobs.shutdown` stops a
compaction between steps.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Callable

from edgesync_store.core.backend import MaintenanceBackend
from edgesync_store.settings import DEFAULT_COMPACT_INTERVAL_S, DEFAULT_SWEEP_INTERVAL_S
from edgesync_store.ttl import sweep

log = logging.getLogger(__name__)


class StoreJobs:
    """The sweep and compaction jobs of one open, writable ``MaintenanceBackend``.
    ``index_source`` returns the open ``SemanticIndex`` or None (asked at each run); intervals
    are seconds (> 0, else ValueError)."""

    def __init__(self, store, index_source: Callable[[], object] | None = None,
                 sweep_interval_s: float = DEFAULT_SWEEP_INTERVAL_S,
                 compact_interval_s: float = DEFAULT_COMPACT_INTERVAL_S) -> None:
        for name, value in (("sweep_interval_s", sweep_interval_s), ("compact_interval_s", compact_interval_s)):
            if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name}: must be a positive number of seconds, got {value!r}")
        self.store = store
        self.index_source = index_source or (lambda: None)
        self.sweep_interval_s = float(sweep_interval_s)
        self.compact_interval_s = float(compact_interval_s)
        self.runs: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.last_report: dict | None = None
        self._stop = threading.Event()
        self._scheduler = None

    def start(self) -> "StoreJobs":
        """Start the scheduler (idempotent); the first runs come one interval from now."""
        if self._scheduler is not None:
            return self
        from apscheduler.schedulers.background import BackgroundScheduler

        scheduler = BackgroundScheduler(daemon=True, job_defaults={"coalesce": True, "max_instances": 1})
        scheduler.add_job(self._guarded, "interval", args=["sweep", self.run_sweep], id="sweep",
                          seconds=self.sweep_interval_s, misfire_grace_time=None)
        scheduler.add_job(self._guarded, "interval", args=["compact", self.run_compaction], id="compact",
                          seconds=self.compact_interval_s, misfire_grace_time=None)
        scheduler.start()
        self._scheduler = scheduler
        log.info("store jobs for %s: sweep every %.0f s, compaction every %.0f s", self.store.path,
                 self.sweep_interval_s, self.compact_interval_s)
        return self

    def _guarded(self, name: str, job: Callable[[], object]) -> None:
        if self._stop.is_set() or self.store.closed:
            return  # an application that closed its store without closing EdgeSync
        try:
            job()
            self.runs[name] += 1
        except Exception:  # noqa: BLE001 - a job never takes the scheduler or the app down
            self.failures[name] += 1
            log.exception("store job %s failed on %s; it runs again at its next time", name, self.store.path)

    def run_sweep(self) -> int:
        """One sweep now; returns the fragments deleted."""
        return len(sweep(self.store, index=self.index_source()))

    def run_compaction(self) -> dict:
        """One compaction now (skipped when another process compacts); returns its report."""
        from edgesync_store.compactor import Compactor  # loaded by the first run, never by a request

        report = Compactor(self.store, index=self.index_source(), stop=self._stop).run()
        self.last_report = report.to_dict()
        return self.last_report

    def shutdown(self) -> None:
        """Stop the jobs: end a running compaction between steps, wait for it, stop the
        scheduler's thread (idempotent)."""
        self._stop.set()
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=True)
            self._scheduler = None


def start_jobs(store, index=None, sweep_interval_s: float = DEFAULT_SWEEP_INTERVAL_S,
               compact_interval_s: float = DEFAULT_COMPACT_INTERVAL_S) -> StoreJobs | None:
    """The started jobs of ``store`` (:class:`StoreJobs`' arguments; ``index``: its
    ``index_source``), or None when ``store`` is not a writable ``MaintenanceBackend``."""
    if not isinstance(store, MaintenanceBackend) or store.readonly:
        return None
    return StoreJobs(store, index, sweep_interval_s, compact_interval_s).start()
