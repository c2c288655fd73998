"""Donor records: the whole token sequence behind a semantically indexed prompt.

The semantic index (:mod:`edgesync_store.semantic.index`) maps a prompt's embedding to ONE store key: the
key of the last fragment of the prompt's chain (the chunk that ends where the prompt's stored KV
ends). A fragment holds only its own span's token IDs, and a prefix hash cannot be inverted, so
verifying a nominated donor token by token needs the donor's tokens from position 0. This
module keeps them, in a named LMDB database ``donors`` of the store's own environment (the
store opens it with ``max_dbs=8``: ``fragments``, ``by_prefix``, ``lifecycle``, ``meta``,
``emb_vectors``, ``emb_meta`` and this one):

    key: the last fragment's store key (32 bytes)
    value: the namespace digest (32 bytes, ``schema.Namespace.digest``), ``<I`` token count n,
        n ``<i4`` token IDs (the encoding of ``schema.token_bytes``), then the embedded text
        (UTF-8, the rest of the value: the text the request path chose to embed, kept so that
        ``edgesync reindex --backend`` can re-embed the store without the engine)

A record outlives nothing: readers check that its fragment is still stored, the store deletes
it with its fragment (``core/companions.py``), and :func:`delete_donor` removes it when the
index drops the vector.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from edgesync_store.core.companions import DONORS_DB
from edgesync_store.schema import token_bytes

log = logging.getLogger(__name__)

_COUNT = struct.Struct("<I")

__all__ = ["DONORS_DB", "DonorRecord", "delete_donor", "get_donor", "iterate_donors", "put_donor"]


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


def put_donor(store, key: bytes, namespace_digest: bytes, tokens: Sequence[int] | np.ndarray, text: str = "") -> None:
    """Record ``tokens`` (the donor prompt's token IDs from position 0, int32 range) of the
    namespace ``namespace_digest`` as the sequence behind the fragment ``key``, with the
    ``text`` its embedding was computed from.

    Raises:
        ValueError: ``key`` or ``namespace_digest`` is not 32 bytes, or ``tokens`` is empty.
        StoreIOError: the write failed (the caller degrades: a missing donor is only a lost hint).
    """
    if not isinstance(key, bytes) or len(key) != 32:
        raise ValueError(f"key: expected a 32-byte store key, got {key!r:.40}")
    if not isinstance(namespace_digest, bytes) or len(namespace_digest) != 32:
        raise ValueError(f"namespace_digest: expected 32 bytes, got {namespace_digest!r:.40}")
    if len(tokens) == 0:
        raise ValueError("tokens: empty")
    value = namespace_digest + _COUNT.pack(len(tokens)) + token_bytes(tokens) + text.encode("utf-8")
    db = _db(store, create=True)
    store.transact(lambda txn: txn.put(key, value, db=db), write=True)


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
    rows = store.transact(lambda txn: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)])
    return ((k, r) for k, v in rows if (r := _parse(k, v)) is not None)


def delete_donor(store, key: bytes) -> bool:
    """Remove the record of ``key``; True if there was one."""
    db = _db(store, create=False)
    if db is None or store.readonly:
        return False
    return bool(store.transact(lambda txn: txn.delete(key, db=db), write=True))
