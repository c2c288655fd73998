"""The size budget's eviction policy, which the store's writes enforce.

When a write would take the stored blobs past ``max_bytes``, fragments are deleted down to
``LOW_WATER`` of the budget, in this order: expired (soonest first), then the short, the long
and the document lifetimes, each least recently used first; ties by key. Pinned fragments and
those being written are never evicted. Only ``lifecycle`` records are scanned, no tensor.
"""

from __future__ import annotations

import logging
from typing import Iterable

from edgesync_store.ttl import LIFETIME_DOCUMENT, LIFETIME_LONG, Lifecycle

log = logging.getLogger(__name__)

LOW_WATER = 0.9
"""Fraction of ``max_bytes`` that eviction frees down to."""


def eviction_order(rows: Iterable[tuple[bytes, Lifecycle]], now: float) -> list[tuple[bytes, Lifecycle]]:
    """``rows`` (key, lifecycle) sorted in the order they are evicted (module docstring)."""

    def rank(row: tuple[bytes, Lifecycle]):
        key, life = row
        if life.expired(now):
            return (0, life.expires_at, key)
        order = 3 if life.lifetime == LIFETIME_DOCUMENT else 2 if life.lifetime == LIFETIME_LONG else 1
        return (order, life.last_used_at, key)

    return sorted(rows, key=rank)


def plan(store, rows: Iterable[tuple[bytes, Lifecycle]], need_bytes: int, now: float,
         protect: set[bytes] = frozenset()) -> list[tuple[bytes, int]]:
    """The ``(key, bytes)`` to evict, in order, to free at least ``need_bytes`` (fewer when
    everything left is pinned or protected)."""
    chosen, freed = [], 0
    for key, life in eviction_order(rows, now):
        if freed >= need_bytes:
            break
        if key in protect or store.pins.is_pinned(key):
            continue
        chosen.append((key, life.nbytes))
        freed += life.nbytes
    return chosen


def evict_in(store, txn, need_bytes: int, now: float, protect: set[bytes] = frozenset()) -> list[tuple[bytes, int]]:
    """Evict inside the caller's write transaction ``txn``; return the ``(key, blob bytes)``
    evicted."""
    chosen = plan(store, store.lifecycle_rows_in(txn), need_bytes, now, protect)
    evicted = []
    for key, _ in chosen:
        nbytes = store.delete_in(txn, key)
        if nbytes:
            evicted.append((key, nbytes))
    if evicted:
        log.info("size budget %d bytes: evicted %d fragments (%d bytes)", store.max_bytes, len(evicted),
                 sum(n for _, n in evicted))
    return evicted


def evict_to_budget(store, max_bytes: int | None = None, now: float | None = None,
                    dry_run: bool = False) -> list[tuple[bytes, int]]:
    """Bring the store to at most ``max_bytes`` (default: its budget) in one write
    transaction, by the policy; return the ``(key, bytes)`` evicted (with ``dry_run``: that
    would be). Used by the compactor; writes enforce the budget themselves."""
    limit = store.max_bytes if max_bytes is None else max_bytes
    now = store.clock() if now is None else now
    if dry_run:
        used = store.used_bytes()
        return plan(store, store.iterate_lifecycle(), used - limit, now) if used > limit else []

    def write(txn):
        used = store.used_in(txn)
        return evict_in(store, txn, used - limit, now) if used > limit else []

    return store.transact(write, write=True)
