"""Donor records: the whole token sequence (from position 0) behind a semantically indexed prompt,
keyed by the last fragment of its chain, in the store's ``donors`` database (value layout:
``core/donor_record.py``; pending counter: ``core/companions.py``). Records are written with the
fragments and embedded later by whoever opens the semantic index (:func:`embed_unindexed`).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from edgesync_store.core.companions import DONORS_DB, PENDING_KEY, VECTORS_DB, u64
from edgesync_store.core.donor_record import DonorRecord, check_key, donor_value, parse_donor

if TYPE_CHECKING:
    from edgesync_store.core.backend import MaintenanceBackend

log = logging.getLogger(__name__)

__all__ = ["DONORS_DB", "DonorRecord", "delete_donor", "donor_value", "embed_unindexed", "get_donor",
           "iterate_donors", "pending_generation", "put_donor", "unindexed_keys"]


def _db(store: "MaintenanceBackend", create: bool):
    """The ``donors`` database (created when ``create``), else None when absent; asked for at each use."""
    return store.named_db(DONORS_DB, create=create)


def put_donor(store: "MaintenanceBackend", key: bytes, namespace_digest: bytes,
              tokens: Sequence[int] | np.ndarray, text: str = "") -> None:
    """Record ``tokens`` (token IDs from position 0) of the namespace ``namespace_digest`` and
    the embedded ``text`` behind the fragment ``key``, replacing a record (the caller adds the
    vector: the pending counter is not bumped).

    Raises:
        ValueError: ``key`` or ``namespace_digest`` is not 32 bytes, or ``tokens`` is empty.
        StoreIOError: the write failed (the caller degrades: a missing donor is only a lost hint).
    """
    check_key(key)
    value = donor_value(namespace_digest, tokens, text)
    db = _db(store, create=True)
    store.transact(lambda txn: txn.put(key, value, db=db), write=True)


def pending_generation(store: "MaintenanceBackend") -> int:
    """The pending counter (module docstring): it changes whenever a record without a vector
    is written; 0 when the database does not exist (one read transaction)."""
    db = _db(store, create=False)
    if db is None:
        return 0
    return store.transact(lambda txn: u64(txn.get(PENDING_KEY, db=db)))


def get_donor(store: "MaintenanceBackend", key: bytes) -> DonorRecord | None:
    """The record of fragment ``key``, or None when there is none or it is malformed (logged
    and ignored)."""
    db = _db(store, create=False)
    if db is None:
        return None
    value = store.transact(lambda txn: (bytes(v) if (v := txn.get(key, db=db)) is not None else None))
    return None if value is None else parse_donor(key, value)


def iterate_donors(store: "MaintenanceBackend") -> Iterator[tuple[bytes, DonorRecord]]:
    """Every well-formed donor record as (fragment key, record), in key order (one read
    transaction, materialised first)."""
    db = _db(store, create=False)
    if db is None:
        return iter(())
    rows = store.transact(lambda txn: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db) if len(k) == 32])
    return ((k, r) for k, v in rows if (r := parse_donor(k, v)) is not None)


def unindexed_keys(store: "MaintenanceBackend") -> list[bytes]:
    """Keys of the records whose fragment is stored and that have no vector in ``emb_vectors``
    (of any backend), in key order (one read transaction)."""

    db = _db(store, create=False)
    if db is None:
        return []

    def read(txn):
        vec_db = store.named_db(VECTORS_DB, txn=txn)
        out = []
        for key in txn.cursor(db=db).iternext(keys=True, values=False):
            key = bytes(key)
            if len(key) != 32 or (vec_db is not None and txn.get(key, db=vec_db) is not None):
                continue
            if store.contains_in(txn, key):
                out.append(key)
        return out

    return store.transact(read)


def _still_unindexed(store: "MaintenanceBackend", keys: Sequence[bytes]) -> list[tuple[bytes, DonorRecord]]:
    """The well-formed records of ``keys`` still stored and still without a vector, in order."""
    db = _db(store, create=False)
    if db is None:
        return []

    def read(txn):
        vec_db = store.named_db(VECTORS_DB, txn=txn)
        rows = []
        for key in keys:
            value = txn.get(key, db=db)
            if value is None or not store.contains_in(txn, key):
                continue
            if vec_db is None or txn.get(key, db=vec_db) is None:
                rows.append((key, bytes(value)))
        return rows

    return [(k, r) for k, v in store.transact(read) if (r := parse_donor(k, v)) is not None]


def embed_unindexed(store: "MaintenanceBackend", index, encode: Callable[[list[str]], np.ndarray], batch: int = 16,
                    stop: threading.Event | None = None,
                    progress: Callable[[int, int], None] | None = None) -> int:
    """Embed the records :func:`unindexed_keys` finds (non-blank text) and add their vectors to
    ``index`` (a ``SemanticIndex``), ``batch`` at a time; return how many were added. Safe beside
    other processes doing the same (an equal vector is a no-op; a fragment deleted meanwhile is
    skipped). ``stop`` ends the run between batches; ``progress(done, total)`` after each.

    Raises:
        StoreError: the store could not be read or written.
        BackendMismatchError: the vectors were dropped or re-claimed by another backend.
        ValueError: ``encode`` returned rows of the wrong shape.
    """
    todo = unindexed_keys(store)
    added = 0
    for i in range(0, len(todo), batch):
        if stop is not None and stop.is_set():
            break
        part = [(key, rec.text) for key, rec in _still_unindexed(store, todo[i : i + batch]) if rec.text.strip()]
        if part:
            vectors = np.asarray(encode([text for _, text in part]), dtype=np.float32)
            added += _add_vectors(store, index, [key for key, _ in part], vectors)
        if progress is not None:
            progress(min(i + batch, len(todo)), len(todo))
    if added:
        log.info("embedded %d donor records of %s", added, store.path)
    return added


def _add_vectors(store: "MaintenanceBackend", index, keys: list[bytes], vectors: np.ndarray) -> int:
    """``index.add_many(keys, vectors)`` less the fragments deleted meanwhile; returns how many."""
    for _ in range(3):
        try:
            index.add_many(keys, vectors)
            return len(keys)
        except KeyError:
            live = [j for j, key in enumerate(keys) if store.contains(key)]
            keys, vectors = [keys[j] for j in live], vectors[live]
    return 0


def delete_donor(store: "MaintenanceBackend", key: bytes) -> bool:
    """Remove the record of ``key``; True if there was one."""
    db = _db(store, create=False)
    if db is None or store.readonly:
        return False
    return bool(store.transact(lambda txn: txn.delete(key, db=db), write=True))
