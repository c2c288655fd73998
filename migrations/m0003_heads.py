"""Migration 3, version 2 -> 3: each fragment's head (``codec.head_of``) into the ``heads`` database
beside its blob, so that the prefix walk never maps a blob; blobs stay as they are. A blob whose
head does not parse gets none (the next read removes it). Batches of :data:`BATCH`; the last
transaction records version 3 (crash point ``migrate.before_version`` before it).
"""

from __future__ import annotations

from edgesync_store.core.codec import head_of
from edgesync_store.core.crashpoints import crash_point
from edgesync_store.core.lmdb_env import FRAGMENTS_DB, HEADS_DB, META_DB
from edgesync_store.errors import CodecError
from edgesync_store.migrations.batches import each_fragment
from edgesync_store.migrations.versions import write_version

VERSION = 3
DESCRIPTION = "heads: each blob's head in its own database"
BATCH = 256


def apply(store) -> None:
    """Create ``heads``, fill it from every blob, then record version 3 (module docstring)."""
    fragments, meta = store.named_db(FRAGMENTS_DB), store.named_db(META_DB)
    heads = store.named_db(HEADS_DB, create=True)

    def add_head(txn, key: bytes, blob) -> None:
        if txn.get(key, db=heads) is None:
            try:
                txn.put(key, head_of(blob), db=heads)
            except CodecError:
                pass  # a corrupt blob: the next read refuses and removes it

    each_fragment(store, fragments, add_head, BATCH)
    crash_point("migrate.before_version")
    store.transact(lambda txn: write_version(txn, meta, VERSION), write=True)
