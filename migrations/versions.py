"""Writing the format-version record (``meta``'s ``format_version``, ASCII digits): each
migration's last transaction. ``core.lmdb_env.format_version`` reads it."""

from __future__ import annotations

from edgesync_store.core.lmdb_env import FORMAT_VERSION_KEY


def write_version(txn, meta_db, version: int) -> None:
    """Record ``version`` in the caller's transaction ``txn``."""
    txn.put(FORMAT_VERSION_KEY, str(version).encode(), db=meta_db)
