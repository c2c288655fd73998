"""Numbered store migrations: opening a store with ``upgrade=migrate`` runs, in order, every
migration above its recorded ``format_version`` (``m0002_lifecycle_v2``: 1 -> 2;
``m0003_heads``: 2 -> 3; ``batches``: their shared batched loop; ``versions``: the version record).

Crash-safe: each transaction commits whole, steps are idempotent and the version moves only in
the last transaction, so the next open finishes a killed one. Several processes may run it at once.
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
    """Bring the writable ``FragmentStore`` ``store`` to :data:`CURRENT_VERSION`; return it. Raises
    StoreFormatError for a version outside 1 to :data:`CURRENT_VERSION`, StoreIOError when LMDB fails."""
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
