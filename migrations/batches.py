"""The batched loop over every fragment that migrations 2 and 3 share: one write transaction per
batch; a run killed between batches (crash point ``migrate.batch``) is redone from the start by
the next open, skipping what is done (the steps are idempotent).
"""

from __future__ import annotations

from typing import Callable

from edgesync_store.core.crashpoints import crash_point

BATCH = 256
"""Fragments per write transaction."""


def each_fragment(store, fragments_db, step: Callable[[object, bytes, memoryview], None], batch: int = BATCH) -> None:
    """Call ``step(txn, key, blob)`` for every entry of ``fragments_db`` in key order, ``batch``
    entries per write transaction of ``store`` (``blob`` is valid inside the call only)."""
    after = b""
    while True:
        def one_batch(txn, after: bytes = after) -> bytes | None:  # runs inside this iteration's transact
            cursor = txn.cursor(db=fragments_db)
            if not (cursor.set_range(after) if after else cursor.first()):
                return None
            last, n = None, 0
            for key, blob in cursor:
                key = bytes(key)
                if key == after:
                    continue
                step(txn, key, blob)
                last, n = key, n + 1
                if n >= batch:
                    break
            return last

        last = store.transact(one_batch, write=True)
        if last is None:
            return
        crash_point("migrate.batch")
        after = last
