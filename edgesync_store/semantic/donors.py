"""Donor records: the whole token sequence behind a semantically indexed prompt.

The semantic index (:mod:`edgesync_store.semantic.index`) maps a prompt's embedding to ONE store key: the
key of the last fragment of the prompt's chain (the chunk that ends where the prompt's stored KV
ends). A fragment holds only its own span's token IDs, and a prefix hash cannot be inverted, so
verifying a nominated donor token by token needs the donor's tokens from position 0. This
module keeps them, in a named LMDB database ``donors`` of the store's own environment
(``core/companions.py``):

    key: the last fragment's store key (32 bytes)
    value: the namespace digest (32 bytes, ``schema.Namespace.digest``), ``<I`` token count n,
        n ``<i4`` token IDs (the encoding of ``schema.token_bytes``), then the embedded text
        (UTF-8, the rest of the value: the text the request path chose to embed, kept so that
        the record can be embedded later, and ``edgesync reindex --backend`` can re-embed the
        store without the engine)

plus one counter, ``core.companions.PENDING_KEY`` -> ``<Q``, bumped by every record written
without its vector.

A record may exist without a vector: the default (exact) mode records each stored prompt in
the same write transaction as its fragments (:func:`put_donor_in`) and never embeds it; a
process that opens the semantic index embeds the records that lack a vector afterwards, in the
background (:func:`embed_unindexed`; ``edgesync reindex`` does the same). Such a record is
neither broken nor stale: it is simply not findable by meaning yet. A record outlives nothing:
readers check that its fragment is still stored, the store deletes it with its fragment
(``core/companions.py``), with or without a vector, and :func:`delete_donor` removes it when
the index drops the vector.
"""

from __future__ import annotations

import logging
import struct
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from edgesync_store.core.companions import DONORS_DB, PENDING_KEY, VECTORS_DB, bump_pending_in, u64
from edgesync_store.schema import token_bytes

log = logging.getLogger(__name__)

_COUNT = struct.Struct("<I")

__all__ = ["DONORS_DB", "DonorRecord", "delete_donor", "donor_value", "embed_unindexed", "get_donor",
           "iterate_donors", "pending_generation", "put_donor", "put_donor_in", "put_pending_donor",
           "unindexed_keys"]


@dataclass(frozen=True)
class DonorRecord:
    """One donor: its namespace digest (32 bytes), token IDs (int32 ``[n]``) and the text its
    embedding was computed from."""

    namespace_digest: bytes
    tokens: np.ndarray
    text: str


def _db(store, create: bool):
    """The ``donors`` database of ``store``'s environment, or None when it does not exist yet
    and ``create`` is False (asked for at each use: a disk reclaim reopens the environment)."""
    return store.named_db(DONORS_DB, create=create)


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != 32:
        raise ValueError(f"key: expected a 32-byte store key, got {key!r:.40}")


def donor_value(namespace_digest: bytes, tokens: Sequence[int] | np.ndarray, text: str = "") -> bytes:
    """The value of a donor record (module docstring): ``tokens`` (the prompt's token IDs from
    position 0, int32 range) of the namespace ``namespace_digest`` and the ``text`` to embed.

    Raises:
        ValueError: ``namespace_digest`` is not 32 bytes, or ``tokens`` is empty.
    """
    if not isinstance(namespace_digest, bytes) or len(namespace_digest) != 32:
        raise ValueError(f"namespace_digest: expected 32 bytes, got {namespace_digest!r:.40}")
    if len(tokens) == 0:
        raise ValueError("tokens: empty")
    return namespace_digest + _COUNT.pack(len(tokens)) + token_bytes(tokens) + text.encode("utf-8")


def put_donor(store, key: bytes, namespace_digest: bytes, tokens: Sequence[int] | np.ndarray, text: str = "") -> None:
    """Record ``tokens`` (the donor prompt's token IDs from position 0, int32 range) of the
    namespace ``namespace_digest`` as the sequence behind the fragment ``key``, with the
    ``text`` its embedding is computed from (one write transaction; replaces a record; the
    caller adds the vector, so the pending counter is not bumped).

    Raises:
        ValueError: ``key`` or ``namespace_digest`` is not 32 bytes, or ``tokens`` is empty.
        StoreIOError: the write failed (the caller degrades: a missing donor is only a lost hint).
    """
    _check_key(key)
    value = donor_value(namespace_digest, tokens, text)
    db = _db(store, create=True)
    store.transact(lambda txn: txn.put(key, value, db=db), write=True)


def put_donor_in(store, txn, key: bytes, value: bytes) -> bool:
    """In the caller's write transaction ``txn``: record ``value`` (:func:`donor_value`) for
    the fragment ``key`` when the fragment is stored and has no record yet, without a vector
    (the pending counter is bumped; the ``donors`` database is created when missing). True
    when written.

    Raises:
        ValueError: ``key`` is not 32 bytes.
    """
    _check_key(key)
    if not store.contains_in(txn, key):
        return False
    db = store.named_db(DONORS_DB, create=True, txn=txn)
    if db is None or txn.get(key, db=db) is not None:
        return False
    txn.put(key, value, db=db)
    bump_pending_in(txn, db)
    return True


def put_pending_donor(store, key: bytes, value: bytes) -> bool:
    """:func:`put_donor_in` in a write transaction of its own, only when a read finds the
    fragment ``key`` stored and without a record (so that a prompt served again costs no
    write). True when written.

    Raises:
        ValueError: ``key`` is not 32 bytes. StoreIOError: the store failed.
    """
    _check_key(key)
    db = _db(store, create=False)

    def missing(txn) -> bool:
        return store.contains_in(txn, key) and (db is None or txn.get(key, db=db) is None)

    if not store.transact(missing):
        return False
    return bool(store.transact(lambda txn: put_donor_in(store, txn, key, value), write=True))


def pending_generation(store) -> int:
    """The pending counter (module docstring): it changes whenever a record without a vector
    is written; 0 when the database does not exist (one read transaction)."""
    db = _db(store, create=False)
    if db is None:
        return 0
    return store.transact(lambda txn: u64(txn.get(PENDING_KEY, db=db)))


def _parse(key: bytes, value: bytes) -> DonorRecord | None:
    head = 32 + _COUNT.size
    if len(value) < head:
        log.warning("donor record %s: %d bytes, too short; ignored", key.hex()[:16], len(value))
        return None
    (n,) = _COUNT.unpack_from(value, 32)
    end = head + 4 * n
    if len(value) < end or n == 0:
        log.warning("donor record %s: claims %d tokens in %d bytes; ignored", key.hex()[:16], n, len(value))
        return None
    try:
        text = value[end:].decode("utf-8")
    except UnicodeDecodeError:
        log.warning("donor record %s: text is not UTF-8; ignored", key.hex()[:16])
        return None
    return DonorRecord(value[:32], np.frombuffer(value[head:end], dtype="<i4").astype(np.int32), text)


def get_donor(store, key: bytes) -> DonorRecord | None:
    """The record of fragment ``key``, or None when there is none or it is malformed (logged
    and ignored)."""
    db = _db(store, create=False)
    if db is None:
        return None
    value = store.transact(lambda txn: (bytes(v) if (v := txn.get(key, db=db)) is not None else None))
    return None if value is None else _parse(key, value)


def iterate_donors(store) -> Iterator[tuple[bytes, DonorRecord]]:
    """Every well-formed donor record as (fragment key, record), in key order (one read
    transaction, materialised first)."""
    db = _db(store, create=False)
    if db is None:
        return iter(())
    rows = store.transact(lambda txn: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db) if len(k) == 32])
    return ((k, r) for k, v in rows if (r := _parse(k, v)) is not None)


def unindexed_keys(store) -> list[bytes]:
    """Keys of the records whose fragment is stored and that have no vector in ``emb_vectors``
    (whatever backend wrote the vectors), in key order (one read transaction; no value is
    read)."""
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


def _still_unindexed(store, keys: Sequence[bytes]) -> list[tuple[bytes, DonorRecord]]:
    """The well-formed records of ``keys`` whose fragment is still stored and that still have
    no vector (another process may have embedded them meanwhile), in order (one read
    transaction)."""
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

    return [(k, r) for k, v in store.transact(read) if (r := _parse(k, v)) is not None]


def embed_unindexed(store, index, encode: Callable[[list[str]], np.ndarray], batch: int = 16,
                    stop: threading.Event | None = None,
                    progress: Callable[[int, int], None] | None = None) -> int:
    """Embed the records :func:`unindexed_keys` finds (those with a non-blank text) and add
    their vectors to ``index`` (a ``SemanticIndex``), ``batch`` records read per transaction,
    texts per ``encode`` call and vectors per write transaction; returns how many vectors were
    added.

    Safe beside other processes doing the same: a vector another process added meanwhile is
    replaced by an equal one (a no-op in ``VectorTable.put_many``), and a fragment deleted
    meanwhile is skipped (the index refuses a vector without its fragment; the store deletes
    record and vector with the fragment, in one transaction). ``stop`` set ends the run
    between batches; ``progress(done, total)`` is called after each.

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


def _add_vectors(store, index, keys: list[bytes], vectors: np.ndarray) -> int:
    """``index.add_many(keys, vectors)``; a fragment deleted since it was read (the index
    refuses its vector: KeyError) is dropped and the rest added. Returns how many were."""
    for _ in range(3):
        try:
            index.add_many(keys, vectors)
            return len(keys)
        except KeyError:
            live = [j for j, key in enumerate(keys) if store.contains(key)]
            keys, vectors = [keys[j] for j in live], vectors[live]
    return 0


def delete_donor(store, key: bytes) -> bool:
    """Remove the record of ``key``; True if there was one."""
    db = _db(store, create=False)
    if db is None or store.readonly:
        return False
    return bool(store.transact(lambda txn: txn.delete(key, db=db), write=True))
