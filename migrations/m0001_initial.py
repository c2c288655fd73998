"""Migration 1, version 0 -> 1: the initial layout.

Creates, in ONE write transaction, the four core databases (``fragments``, ``by_prefix`` with
sorted duplicates, ``lifecycle``, ``meta``) and records ``format_version`` 1: a kill leaves either
an empty environment or a complete version-1 store. A store whose databases were created one
transaction each, with the version written last, may hold some of them and no version if it
was killed meanwhile; it is completed here too.
"""

from __future__ import annotations

from edgesync_store.core.lmdb_env import CORE_DATABASES, META_DB
from edgesync_store.migrations.versions import write_version

VERSION = 1
DESCRIPTION = "initial layout: fragments, by_prefix, lifecycle, meta"
DATABASES = CORE_DATABASES


def apply(store) -> None:
    """Create the databases and record version 1 (idempotent)."""
    def write(txn) -> None:
        handles = {name: store.named_db(name, create=True, dupsort=dup, txn=txn) for name, dup in DATABASES}
        if txn.get(b"format_version", db=handles[META_DB]) is None:
            write_version(txn, handles[META_DB], VERSION)

    store.transact(write, write=True)
    store.forget_handles()  # handles opened in a write transaction are re-opened outside it
