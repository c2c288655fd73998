"""Migration 1, version 0 -> 1: the initial layout.

Creates, in ONE write transaction, the four core databases (``fragments``, ``by_prefix`` with
sorted duplicates, ``lifecycle``, ``meta``) and records ``format_version`` 1: a kill leaves either
an empty environment or a complete version-1 store. An older EdgeSync created the databases one
transaction each and wrote the version last; a store it left half-created (some databases, no
version) is completed here too.
"""

from __future__ import annotations

import lmdb

VERSION = 1
DESCRIPTION = "initial layout: fragments, by_prefix, lifecycle, meta"
DATABASES = ((b"fragments", False), (b"by_prefix", True), (b"lifecycle", False), (b"meta", False))


def apply(store) -> None:
    """Create the databases and record version 1 (idempotent)."""
    from migrations import write_version

    def write(txn: lmdb.Transaction) -> None:
        handles = {name: store._env.open_db(name, txn=txn, dupsort=dup, create=True) for name, dup in DATABASES}
        if txn.get(b"format_version", db=handles[b"meta"]) is None:
            write_version(txn, handles[b"meta"], VERSION)

    store._txn(write, write=True)
    store._named.clear()  # handles opened in a write transaction are re-opened outside it
