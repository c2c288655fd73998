"""Migration 2, version 1 -> 2: lifecycle records from ``<Idd`` (20 bytes: hits, last hit, expiry)
to ``ttl.Lifecycle`` (``<IdddBQQ``, 45 bytes), plus ``used_bytes`` in ``meta``.

Each record is rebuilt from the old one and the blob's header (``codec.peek``); ``promote_hits``
or more hits join the long lifetime (expiry at least last hit + 7 days); a missing record becomes
an expired one. Batches of :data:`BATCH`; the last transaction recounts ``used_bytes`` and records
version 2 (crash point ``migrate.before_version`` before it).
"""

from __future__ import annotations

from edgesync_store.core.codec import peek
from edgesync_store.core.crashpoints import crash_point
from edgesync_store.core.lmdb_env import FRAGMENTS_DB, LIFECYCLE_DB, META_DB, U64, USED_BYTES_KEY
from edgesync_store.errors import CodecError
from edgesync_store.migrations.batches import each_fragment
from edgesync_store.migrations.versions import write_version
from edgesync_store.ttl import LIFECYCLE_V2, LIFETIME_LONG, Lifecycle, TTLPolicy

VERSION = 2
DESCRIPTION = "lifecycle v2: created_at, lifetime, blob sizes; used_bytes"
BATCH = 256


def upgrade_record(old: bytes | None, blob, policy: TTLPolicy) -> Lifecycle:
    """The format-2 record of a fragment from its format-1 record ``old`` and its ``blob``."""
    life = Lifecycle.unpack(old)
    life.nbytes = len(blob)
    try:
        head = peek(blob)
        life.created_at, life.raw_nbytes = head.created_at, head.raw_nbytes
    except CodecError:
        pass  # a corrupt blob: the next read refuses and removes it
    if life.hit_count >= policy.promote_hits:
        life.lifetime = LIFETIME_LONG
        life.expires_at = max(life.expires_at, life.last_hit_at + policy.long_ttl_seconds)
    return life


def apply(store) -> None:
    """Rewrite every format-1 lifecycle record, then recount ``used_bytes`` and record
    version 2 (module docstring)."""
    fragments, lifecycle, meta = store.named_db(FRAGMENTS_DB), store.named_db(LIFECYCLE_DB), store.named_db(META_DB)
    policy = store.policy

    def upgrade(txn, key: bytes, blob) -> None:
        old = txn.get(key, db=lifecycle)
        if old is None or len(old) != LIFECYCLE_V2.size:
            txn.put(key, upgrade_record(old, blob, policy).pack(), db=lifecycle)

    each_fragment(store, fragments, upgrade, BATCH)
    crash_point("migrate.before_version")

    def finish(txn) -> None:
        total = sum(len(blob) for _, blob in txn.cursor(db=fragments))
        txn.put(USED_BYTES_KEY, U64.pack(total), db=meta)
        write_version(txn, meta, VERSION)

    store.transact(finish, write=True)
