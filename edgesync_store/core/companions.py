"""Companion records: databases keyed by a fragment's store key in the store's own environment,
deleted and re-keyed with their fragment in the same transaction (whatever modules the
process imported):

* ``donors``: store key -> donor record (``donor_record.py``), plus a counter under
  :data:`PENDING_KEY` (never a 32-byte key);
* ``emb_vectors``: store key -> ``<Q`` label + the unit vector (``<f4``);
* ``emb_meta``: counters (``next_label``, ``generation``: ``<Q``) and the change log, ``log/``
  + ``>Q`` generation -> op (``+``/``-``) + ``<Q`` label + store key (``semantic/vectors.py``).

The ``*_in`` functions run inside the caller's write transaction; a database that does not
exist yet holds nothing to change.
"""

from __future__ import annotations

import struct

from edgesync_store.core.lmdb_env import U64

DONORS_DB = b"donors"
PENDING_KEY = b"pending"
"""Key, in ``donors``, of a ``<Q`` counter bumped by every write of a donor record that has no
vector yet (a prompt stored in the exact mode, or a record moved without one), so that an open
semantic index can tell cheaply when there are records to embed (``semantic/donors.py``)."""
DOCUMENTS_DB = b"documents"
"""Document records (``edgesync_store/documents/records.py`` lays them out): not keyed by a
fragment, so a fragment's deletion leaves them (readers recompute what is gone); emptied with
the store."""
VECTORS_DB = b"emb_vectors"
VECTORS_META_DB = b"emb_meta"
COMPANION_DATABASES = (DONORS_DB, VECTORS_DB, VECTORS_META_DB)
LOG_PREFIX = b"log/"
LOG_KEEP = 100_000
"""Change-log entries kept in ``emb_meta`` (about 45 bytes each); a reader further behind
reconciles against the whole ``emb_vectors`` database instead of replaying."""
BE64 = struct.Struct(">Q")
"""Big-endian generation in a change-log key, so that the log sorts by generation."""


def u64(value) -> int:
    """A ``<Q`` counter (the first 8 bytes of ``value``), 0 when absent."""
    return U64.unpack(bytes(value[:8]))[0] if value is not None else 0


def log_change(txn, meta_db, op: bytes, label: int, key: bytes, log_keep: int = LOG_KEEP) -> None:
    """Append one change-log entry (generation + 1) in ``txn``; drop the entry that falls out
    of the last ``log_keep``."""
    generation = u64(txn.get(b"generation", db=meta_db)) + 1
    txn.put(b"generation", U64.pack(generation), db=meta_db)
    txn.put(LOG_PREFIX + BE64.pack(generation), op + U64.pack(label) + key, db=meta_db)
    if generation > log_keep:
        txn.delete(LOG_PREFIX + BE64.pack(generation - log_keep), db=meta_db)


def bump_pending_in(txn, donors_db) -> None:
    """Bump the :data:`PENDING_KEY` counter of ``donors_db`` by one in ``txn``."""
    txn.put(PENDING_KEY, U64.pack(u64(txn.get(PENDING_KEY, db=donors_db)) + 1), db=donors_db)


def add_donor_in(store, txn, key: bytes, value: bytes) -> bool:
    """Record ``value`` (:func:`donor_value`) for the stored fragment ``key`` when it has no
    record yet, without a vector (the pending counter is bumped). True when written."""
    if not store.contains_in(txn, key):
        return False
    db = store.named_db(DONORS_DB, create=True, txn=txn)
    if db is None or txn.get(key, db=db) is not None:
        return False
    txn.put(key, value, db=db)
    bump_pending_in(txn, db)
    return True


def lacks_donor_in(store, txn, key: bytes) -> bool:
    """True when the fragment ``key`` is stored and has no donor record."""
    db = store.named_db(DONORS_DB, txn=txn)
    return store.contains_in(txn, key) and (db is None or txn.get(key, db=db) is None)


def _vector_dbs(store, txn):
    vec = store.named_db(VECTORS_DB, txn=txn)
    meta = store.named_db(VECTORS_META_DB, txn=txn)
    return None if vec is None or meta is None else (vec, meta)


def delete_in(store, txn, key: bytes) -> None:
    """Remove the donor record and the vector of fragment ``key``; log the vector's removal so
    that every open index drops its label."""
    donors_db = store.named_db(DONORS_DB, txn=txn)
    if donors_db is not None:
        txn.delete(key, db=donors_db)
    dbs = _vector_dbs(store, txn)
    if dbs is None:
        return
    vec_db, meta_db = dbs
    old = txn.get(key, db=vec_db)
    if old is None:
        return
    txn.delete(key, db=vec_db)
    log_change(txn, meta_db, b"-", u64(old) if len(old) >= 8 else 0, key)


def move_in(store, txn, old: bytes, new: bytes) -> None:
    """Give the donor record and the vector of fragment ``old`` to ``new`` (a merge or dedup
    replaced ``old`` with ``new``), unless ``new`` has its own: the vector gets a new label,
    ``old``'s is removed, both logged. ``old``'s records are deleted with ``old`` itself. A
    record that arrives at ``new`` without a vector bumps the pending counter (to be embedded)."""
    donors_db = store.named_db(DONORS_DB, txn=txn)
    moved = False
    if donors_db is not None:
        record = txn.get(old, db=donors_db)
        if record is not None and txn.get(new, db=donors_db) is None:
            txn.put(new, bytes(record), db=donors_db)
            moved = True
    dbs = _vector_dbs(store, txn)
    if dbs is None:
        if moved:
            bump_pending_in(txn, donors_db)
        return
    vec_db, meta_db = dbs
    record = txn.get(old, db=vec_db)
    if record is None or txn.get(new, db=vec_db) is not None or len(record) < 8:
        if moved and txn.get(new, db=vec_db) is None:
            bump_pending_in(txn, donors_db)
        return
    label = u64(txn.get(b"next_label", db=meta_db))
    txn.put(b"next_label", U64.pack(label + 1), db=meta_db)
    txn.put(new, U64.pack(label) + bytes(record[8:]), db=vec_db)
    log_change(txn, meta_db, b"+", label, new)
    txn.delete(old, db=vec_db)
    log_change(txn, meta_db, b"-", u64(record), old)


def drop_vectors_in(store, txn) -> int:
    """Remove every vector and all of ``emb_meta``; return how many vectors there were."""
    dbs = _vector_dbs(store, txn)
    if dbs is None:
        return 0
    vec_db, meta_db = dbs
    n = txn.stat(vec_db)["entries"]
    txn.drop(vec_db, delete=False)
    txn.drop(meta_db, delete=False)
    return n


def drop_in(store, txn) -> None:
    """Empty every companion database (donor records, document records, vectors, their
    counters and log)."""
    for name in (DONORS_DB, DOCUMENTS_DB):
        db = store.named_db(name, txn=txn)
        if db is not None:
            txn.drop(db, delete=False)
    drop_vectors_in(store, txn)
