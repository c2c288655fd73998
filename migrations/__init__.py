"""Numbered store migrations: each store records its format version in ``meta`` under
``format_version`` (ASCII digits); opening a store runs, in order, every migration above it.

* ``m0001_initial``: version 0 (an empty directory) -> 1: the initial layout, the four core
  databases and the version record, created in one transaction.
* ``versions``: reading and writing the version record; ``batches``: the loop over every
  fragment in batches of write transactions that migrations 2 and 3 share.
* ``m0002_lifecycle_v2``: 1 -> 2: lifecycle records that expiry and eviction read without
  touching tensors (creation time, lifetime, blob sizes) and the ``used_bytes`` counter of the
  size budget.
* ``m0003_heads``: 2 -> 3: each blob's head in its own database (``heads``), so that the prefix
  walk never maps a blob.

A migration is crash-safe: each of its transactions commits whole or not at all, its steps are
idempotent, and the version moves on only in its last transaction, so a migration killed
mid-way is finished by the next open. Several processes opening an old store at once all run
it (LMDB serialises their write transactions; the work of one is skipped by the others).
A store whose version is newer than :data:`CURRENT_VERSION` is refused with
:class:`StoreFormatError`; a read-only open of an older store reads it without migrating.
"""

from __future__ import annotations

import logging

from edgesync_store.errors import StoreFormatError, StoreOpenError
from edgesync_store.migrations import m0001_initial, m0002_lifecycle_v2, m0003_heads
from edgesync_store.migrations.versions import read_version, write_version

log = logging.getLogger(__name__)

__all__ = ["CURRENT_VERSION", "MIGRATIONS", "migrate", "read_version", "write_version"]

MIGRATIONS = (m0001_initial, m0002_lifecycle_v2, m0003_heads)
"""Every migration, in order; migration ``i`` (1-based) takes a store from ``i - 1`` to ``i``."""
CURRENT_VERSION = len(MIGRATIONS)


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
