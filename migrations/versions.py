"""The store's format-version record: ``format_version`` in the ``meta`` database, ASCII digits.

Read by :func:`edgesync_store.migrations.migrate` and written by each migration's last transaction; kept in
its own module so that the migrations and their runner both import it (neither imports the
other's package module).
"""

from __future__ import annotations

from edgesync_store.core.lmdb_env import FORMAT_VERSION_KEY, META_DB
from edgesync_store.errors import StoreFormatError


def read_version(store) -> int:
    """The store's recorded format version; 0 for an environment without the ``meta`` database.

    Raises:
        StoreFormatError: the record is not a number.
        StoreIOError: LMDB failed.
    """
    meta = store.named_db(META_DB)
    if meta is None:
        return 0
    found = store.transact(lambda txn: (bytes(v) if (v := txn.get(FORMAT_VERSION_KEY, db=meta)) is not None else None))
    if found is None:
        return 0
    try:
        return int(found)
    except ValueError:
        raise StoreFormatError(f"store {store.path}: format_version {found[:20]!r} is not a number") from None


def write_version(txn, meta_db, version: int) -> None:
    """Record ``version`` in the caller's transaction ``txn`` (a migration's last step)."""
    txn.put(FORMAT_VERSION_KEY, str(version).encode(), db=meta_db)
