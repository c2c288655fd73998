"""Compaction: one pass over a store (:meth:`Compactor.run`): expire (``ttl.sweep``), dedup, merge
heads and layers (``lifecycle/merge.py``), evict to the budget (``core/eviction.py``), reclaim.

Dedup drops a fragment whose tokens are a prefix of another live one's (same namespace, prefix
and start) with a subset of its layers and heads, unless other fragments continue after it; the
survivor takes its hits, donor record and vector. Each merge or dedup is one transaction; pinned
fragments are left alone; one process compacts at a time (``compact.lock``, else ``skipped``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable

from edgesync_store.core import eviction
from edgesync_store.core.codec import FragmentHeader
from edgesync_store.core.locks import CompactLock
from edgesync_store.lifecycle import merge, reclaim
from edgesync_store.schema import Namespace, prefix_hasher, token_bytes
from edgesync_store.ttl import Lifecycle, sweep

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]
"""``progress(step, done, total)``: called as each step advances (commands draw a bar)."""


@dataclass
class CompactionReport:
    """What one compaction did (or, with ``dry_run``, would do). Sizes are bytes."""

    dry_run: bool = False
    skipped: str | None = None
    expired: int = 0
    expired_bytes: int = 0
    deduplicated: int = 0
    deduplicated_bytes: int = 0
    merged_layers: int = 0
    merged_heads: int = 0
    fragments_merged: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    fragments_before: int = 0
    fragments_after: int = 0
    used_bytes_before: int = 0
    used_bytes_after: int = 0
    max_bytes: int = 0
    disk_bytes_before: int = 0
    disk_bytes_after: int = 0
    reclaim: dict = field(default_factory=dict)
    elapsed_s: float = 0.0
    stopped: bool = False

    @property
    def bytes_reclaimed(self) -> int:
        return int(self.reclaim.get("bytes_reclaimed", 0))

    def to_dict(self) -> dict:
        return {**asdict(self), "bytes_reclaimed": self.bytes_reclaimed}


@dataclass
class _Row:
    key: bytes
    head: FragmentHeader
    life: Lifecycle

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(self.head.layers)

    @property
    def heads(self) -> range:
        return range(self.head.head_start, self.head.head_end)


def _disk_bytes(store) -> int:
    return sum(p.stat().st_size for p in store.path.glob("*.mdb"))


class Compactor:
    """Runs the compaction steps (module docstring) over one open store.

    Args:
        store: an open, writable ``MaintenanceBackend`` (``FragmentStore`` or ``TieredStore``).
        index: the application's open ``SemanticIndex`` (updated in place), or None (indexes
            catch up from the vectors' change log).
        stop: an event that ends the run between steps and groups.
    """

    def __init__(self, store, index=None, stop: threading.Event | None = None,
                 progress: Progress | None = None) -> None:
        self.store = store
        self.index = index
        self.stop = stop or threading.Event()
        self.progress = progress or (lambda step, done, total: None)

    # -- scanning ------------------------------------------------------------------------------

    def _rows(self, now: float) -> list[_Row]:
        """Live, unpinned fragments with a readable header."""
        rows = []
        for key, head, life, _nbytes in self.store.iterate():
            if head is None or life.expired(now) or self.store.pins.is_pinned(key):
                continue
            rows.append(_Row(key, head, life))
        return rows

    def _children(self, rows: list[_Row]) -> set[bytes]:
        """Keys of fragments others continue from, by walking each namespace from position 0;
        fragments no walk reaches count as continued (never dropped as shorter duplicates)."""
        by_index: dict[bytes, list[_Row]] = defaultdict(list)
        for row in rows:
            by_index[row.head.namespace.digest() + row.head.prefix_hash].append(row)
        continued: set[bytes] = set()
        reached: set[bytes] = set()
        roots: dict[bytes, Namespace] = {row.head.namespace.digest(): row.head.namespace for row in rows}
        for ns_digest in roots:
            stack = [(prefix_hasher(), 0)]
            while stack:
                hasher, pos = stack.pop()
                for row in by_index.get(ns_digest + hasher.digest(), []):
                    if row.head.token_start != pos or row.key in reached:
                        continue
                    reached.add(row.key)
                    nxt = hasher.copy()
                    nxt.update(token_bytes(row.head.token_ids))
                    if by_index.get(ns_digest + nxt.digest()):
                        continued.add(row.key)
                    stack.append((nxt, row.head.token_end))
        return continued | {row.key for row in rows if row.key not in reached}

    # -- steps ---------------------------------------------------------------------------------

    def dedup(self, now: float, dry_run: bool = False) -> tuple[int, int]:
        """Step 2; returns (fragments dropped, their blob bytes)."""
        rows = self._rows(now)
        continued = self._children(rows)
        groups: dict[tuple, list[_Row]] = defaultdict(list)
        for row in rows:
            groups[(row.head.namespace.digest(), row.head.prefix_hash, row.head.token_start)].append(row)
        dropped = nbytes = 0
        for n, group in enumerate(groups.values()):
            self.progress("dedup", n + 1, len(groups))
            if self.stop.is_set():
                break
            if len(group) < 2:
                continue
            # the largest fragments first: each survivor absorbs what it holds
            group.sort(key=lambda r: (-r.head.span, -len(r.layers) * len(r.heads), r.key))
            gone: set[bytes] = set()
            for keep in group:
                if keep.key in gone:
                    continue
                absorbed = []
                for other in group:
                    if other is keep or other.key in gone or not self._holds(keep, other, continued):
                        continue
                    absorbed.append(other)
                if not absorbed:
                    continue
                life = self.store.policy.merged([keep.life] + [a.life for a in absorbed], 0, 0, sum_hits=True)
                if dry_run or self.store.absorb(keep.key, [a.key for a in absorbed], life):
                    gone.update(a.key for a in absorbed)
                    dropped += len(absorbed)
                    nbytes += sum(a.life.nbytes for a in absorbed)
        return dropped, nbytes

    @staticmethod
    def _holds(big: _Row, small: _Row, continued: set[bytes]) -> bool:
        """True when ``big`` holds all of ``small``'s KV and dropping ``small`` breaks no chain."""
        a, b = small.head, big.head
        if a.namespace != b.namespace or a.span > b.span:
            return False
        if not (small.layers <= big.layers and a.head_start >= b.head_start and a.head_end <= b.head_end):
            return False
        if (a.token_ids != b.token_ids[: a.span]).any():
            return False
        return a.span == b.span or small.key not in continued

    def merge_step(self, axis: int, now: float, dry_run: bool = False) -> tuple[int, int]:
        """Step 3 (``axis=1``, KV heads) or 4 (``axis=0``, layers); returns (merged fragments
        written, parts replaced)."""
        rows = self._rows(now)
        groups: dict[tuple, list[_Row]] = defaultdict(list)
        for row in rows:
            h = row.head
            part = (tuple(h.layers),) if axis == 1 else (h.head_start, h.head_end)
            groups[
                (h.namespace.digest(), h.prefix_hash, h.token_start, h.token_end, h.token_ids.tobytes(), part)
            ].append(row)
        merged = parts = 0
        candidates = [g for g in groups.values() if len(g) > 1 and self._exact_cover(g, axis)]
        for n, group in enumerate(candidates):
            self.progress("merge heads" if axis == 1 else "merge layers", n + 1, len(candidates))
            if self.stop.is_set():
                break
            if dry_run:
                merged, parts = merged + 1, parts + len(group)
                continue
            frags = [self.store.get(row.key) for row in group]
            if any(f is None for f in frags):
                continue  # gone or corrupt meanwhile: nothing to merge
            try:
                whole = merge.merge_heads(frags) if axis == 1 else merge.merge_layers(frags)
            except ValueError as exc:
                log.warning("cannot merge %d fragments at [%d, %d): %s", len(frags), group[0].head.token_start,
                            group[0].head.token_end, exc)
                continue
            life = self.store.policy.merged([row.life for row in group], 0, 0, sum_hits=False)
            if self.store.put_replacing(whole, life, [row.key for row in group]):
                merged, parts = merged + 1, parts + len(group)
        return merged, parts

    @staticmethod
    def _exact_cover(group: list[_Row], axis: int) -> bool:
        """True when the parts are disjoint and together hold every head (axis 1) or layer
        (axis 0) of the model."""
        ns = group[0].head.namespace
        if axis == 1:
            heads = sorted((r.head.head_start, r.head.head_end) for r in group)
            return heads[0][0] == 0 and heads[-1][1] == ns.n_head_kv and all(
                heads[i][1] == heads[i + 1][0] for i in range(len(heads) - 1))
        layers = [layer for r in group for layer in r.head.layers]
        return len(layers) == len(set(layers)) and set(layers) == set(range(ns.n_layer))

    # -- the whole run -------------------------------------------------------------------------

    def run(self, dry_run: bool = False, do_reclaim: bool = True, max_bytes: int | None = None,
            reclaim_fraction: float = reclaim.DEFAULT_MIN_FREE_FRACTION,
            force_reclaim: bool = False) -> CompactionReport:
        """Every step once (module docstring). ``dry_run``: report, change nothing; ``max_bytes``:
        eviction budget (default: the store's); ``reclaim_fraction``, ``force_reclaim``: the
        reclaim threshold (``reclaim.reclaim``), skipped without ``do_reclaim``."""
        t0 = time.monotonic()
        store = self.store
        report = CompactionReport(dry_run=dry_run, max_bytes=max_bytes or store.max_bytes)
        with CompactLock(store.path, required=not dry_run) as acquired:
            if not acquired:
                report.skipped = "another process is compacting this store"
                return report
            now = store.clock()
            report.fragments_before = len(store.iterate_lifecycle())
            report.used_bytes_before = store.used_bytes()
            report.disk_bytes_before = _disk_bytes(store)
            steps = [
                ("expire", lambda: self._expire(now, dry_run, report)),
                ("dedup", lambda: self._set(report, ("deduplicated", "deduplicated_bytes"), self.dedup(now, dry_run))),
                ("merge heads", lambda: self._merged(report, "merged_heads", self.merge_step(1, now, dry_run))),
                ("merge layers", lambda: self._merged(report, "merged_layers", self.merge_step(0, now, dry_run))),
                ("evict", lambda: self._evict(now, dry_run, report)),
            ]
            for name, step in steps:
                if self.stop.is_set():
                    report.stopped = True
                    break
                log.debug("compaction of %s: %s", store.path, name)
                step()
            if not dry_run and not self.stop.is_set():
                if self.index is not None and (report.expired or report.deduplicated or report.fragments_merged
                                               or report.evicted):
                    self.index.sync()
                    self.index.save()
                store.recount_used()
            if not dry_run:
                reclaim.remove_stale_copy(store)  # a whole copy of the store left by a killed reclaim
            if do_reclaim and not self.stop.is_set():
                report.reclaim = reclaim.reclaim(store, reclaim_fraction, force=force_reclaim,
                                                 dry_run=dry_run).to_dict()
            report.stopped = report.stopped or self.stop.is_set()
            report.fragments_after = len(store.iterate_lifecycle())
            report.used_bytes_after = store.used_bytes()
            report.disk_bytes_after = _disk_bytes(store)
        report.elapsed_s = round(time.monotonic() - t0, 3)
        log.info("compaction of %s: %s", store.path, {k: v for k, v in report.to_dict().items() if v})
        return report

    def _expire(self, now: float, dry_run: bool, report: CompactionReport) -> None:
        gone = sweep(self.store, now, None, dry_run)
        report.expired, report.expired_bytes = len(gone), sum(n for _, n in gone)
        self.progress("expire", 1, 1)

    def _evict(self, now: float, dry_run: bool, report: CompactionReport) -> None:
        gone = eviction.evict_to_budget(self.store, report.max_bytes, now, dry_run)
        report.evicted, report.evicted_bytes = len(gone), sum(n for _, n in gone)
        self.progress("evict", 1, 1)

    @staticmethod
    def _set(report: CompactionReport, names: tuple[str, str], values: tuple[int, int]) -> None:
        setattr(report, names[0], values[0])
        setattr(report, names[1], values[1])

    @staticmethod
    def _merged(report: CompactionReport, name: str, values: tuple[int, int]) -> None:
        setattr(report, name, values[0])
        report.fragments_merged += values[1]


def open_index(store):
    """An open ``SemanticIndex`` over the store's vectors (their recorded backend), or None
    when the store holds none or hnswlib is missing; for commands that compact outside the
    application."""
    from edgesync_store.semantic.index import IndexUnavailableError, SemanticIndex
    from edgesync_store.semantic.vectors import META_DB, VectorTable

    try:
        table = VectorTable(store)
        if not table.exists or table.count() == 0:
            return None
        meta = store.named_db(META_DB)
        backend = store.transact(lambda txn: (bytes(v).decode() if (v := txn.get(b"backend_id", db=meta)) else ""))
        if not backend:
            return None
        return SemanticIndex(store, backend)
    except (IndexUnavailableError, RuntimeError, OSError) as exc:
        log.warning("semantic index of %s not opened: %s", store.path, exc)
        return None
