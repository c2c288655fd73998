"""Numbered store migrations: opening a store with ``upgrade=migrate`` (the application and the
commands do) runs, in order, every migration above its recorded ``format_version``.

A new store is made at the current version by ``LmdbEnv.create_layout`` (format 1's layout
was four core databases and the version record).

* ``m0002_lifecycle_v2``: 1 -> 2, lifecycle records with creation time, lifetime and sizes, and
  the ``used_bytes`` counter;
* ``m0003_heads``: 2 -> 3, each blob's head in its own database;
* ``batches``: the batched loop over every fragment that 2 and 3 share; ``versions``: writing
  the version record.

A migration is crash-safe: each transaction commits whole, its steps are idempotent, and the
version moves on only in its last transaction, so the next open finishes a killed one. Several
processes may run it at once (LMDB serialises their writes).
"""

from __future__ import annotations

import logging

from edgesync_store.core.lmdb_env import STORE_FORMAT_VERSION, format_version
from edgesync_store.errors import StoreFormatError
from edgesync_store.migrations import m0002_lifecycle_v2, m0003_heads

log = logging.getLogger(__name__)

__all__ = ["CURRENT_VERSION", "MIGRATIONS", "StoreFormatError", "migrate"]

MIGRATIONS = (m0002_lifecycle_v2, m0003_heads)
"""``MIGRATIONS[v - 1]`` takes a store from version ``v`` to ``v + 1``."""
CURRENT_VERSION = STORE_FORMAT_VERSION


def migrate(store) -> int:
    """Bring the writable ``FragmentStore`` ``store`` (format 1 or later) to
    :data:`CURRENT_VERSION`; return it.

    Raises:
        StoreFormatError: a version outside 1 to :data:`CURRENT_VERSION`. StoreIOError: LMDB failed.
    """
    version = format_version(store)
    if not 1 <= version <= CURRENT_VERSION:
        raise StoreFormatError(f"store {store.path} has format version {version}; migrations run from 1 to "
                               f"{CURRENT_VERSION}")
    while version < CURRENT_VERSION:
        step = MIGRATIONS[version - 1]
        log.info("store %s: migrating format %d -> %d (%s)", store.path, version, version + 1, step.DESCRIPTION)
        step.apply(store)
        version = format_version(store)
    return version
