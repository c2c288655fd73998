"""Numbered store migrations: each store records its format version in ``meta`` under
``format_version`` (ASCII digits); opening a store runs, in order, every migration above it.

* ``m0001_initial``: version 0 (an empty directory) -> 1: the initial layout, the four core
  databases and the version record, created in one transaction.
* ``m0002_lifecycle_v2``: 1 -> 2: lifecycle records that expiry and eviction read without
  touching tensors (creation time, tier, blob sizes) and the ``used_bytes`` counter of the
  size budget.

A migration is crash-safe: each of its transactions commits whole or not at all, its steps are
idempotent, and the version moves on only in its last transaction, so a migration killed
mid-way is finished by the next open. Several processes opening an old store at once all run
it (LMDB serialises their write transactions; the work of one is skipped by the others).
A store whose version is newer than :data:`CURRENT_VERSION` is refused with
:class:`StoreFormatError`; a read-only open of an older store reads it without migrating.
"""

from __future__ import annotations

import logging

import lmdb

from migrations import m0001_initial, m0002_lifecycle_v2
from edgesync_store.errors import StoreFormatError, StoreOpenError

log = logging.getLogger("edgesync.store")

MIGRATIONS = (m0001_initial, m0002_lifecycle_v2)
"""Every migration, in order; migration ``i`` (1-based) takes a store from ``i - 1`` to ``i``."""
CURRENT_VERSION = len(MIGRATIONS)


def read_version(store) -> int:
    """The store's recorded format version; 0 for an environment without the ``meta`` database.

    Raises:
        StoreFormatError: the record is not a number.
    """
    meta = store.named_db(b"meta")
    if meta is None:
        return 0
    found = store._txn(lambda txn: (bytes(v) if (v := txn.get(b"format_version", db=meta)) is not None else None))
    if found is None:
        return 0
    try:
        return int(found)
    except ValueError:
        raise StoreFormatError(f"store {store.path}: format_version {found[:20]!r} is not a number") from None


def write_version(txn: lmdb.Transaction, meta_db, version: int) -> None:
    """Record ``version`` in the caller's transaction (a migration's last step)."""
    txn.put(b"format_version", str(version).encode(), db=meta_db)


def migrate(store) -> int:
    """Bring ``store`` to :data:`CURRENT_VERSION`; return the version it is at afterwards.

    Raises:
        StoreFormatError: the store is newer than this code.
        StoreOpenError: a read-only open of a directory without a store.
    """
    version = read_version(store)
    if version > CURRENT_VERSION:
        raise StoreFormatError(
            f"store {store.path} has format version {version}; this EdgeSync reads up to {CURRENT_VERSION}: "
            "upgrade EdgeSync, or delete the store directory (it is a cache)"
        )
    if store.readonly:
        if version == 0:
            raise StoreOpenError(f"no EdgeSync store at {store.path}")
        return version
    while version < CURRENT_VERSION:
        step = MIGRATIONS[version]
        log.info("store %s: migrating format %d -> %d (%s)", store.path, version, version + 1, step.DESCRIPTION)
        step.apply(store)
        version = read_version(store)
    return version
