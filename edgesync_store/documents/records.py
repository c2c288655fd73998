"""Document records: what the store keeps about a document beside its KV fragments.

A document's KV lives in ordinary fragments (its own token chain from position 0, after an
optional header, in the ``document`` lifetime). Its record, in the named LMDB database
``documents``::

    key: SHA-256(tag + namespace digest + token IDs as <i4) (32 bytes, :func:`document_key`)
    value: <I json length, UTF-8 JSON {"title", "source", "text", "added_at"},
        <I n, n <i4 token IDs, <I h, h <i4 header token IDs,
        <I m, <I d, m x d <f4 window embeddings (unit rows; d = 384 for MiniLM-L6-v2)
    key GENERATION_KEY (10 bytes): <Q, bumped by every write

A record does not promise that its fragments are still stored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import reprlib
import struct
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from edgesync_store.core.companions import DOCUMENTS_DB
from edgesync_store.schema import token_bytes

log = logging.getLogger(__name__)

GENERATION_KEY = b"generation"
_TAG = b"edgesync/document/v1\x00"
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

__all__ = ["DOCUMENTS_DB", "DocumentRecord", "delete_document", "document_key", "documents_generation",
           "get_document", "iterate_documents", "put_document"]


def document_key(namespace_digest: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    """The 32-byte key of a document: SHA-256 over a tag, the namespace digest and the
    document's own token IDs (``schema.token_bytes``), the same in every process."""
    return hashlib.sha256(_TAG + namespace_digest + token_bytes(tokens)).digest()


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = 60  # a title or source in DocumentRecord's repr


@dataclass(frozen=True)
class DocumentRecord:
    """One stored document.

    Attributes:
        namespace_digest: 32 bytes, the namespace its KV is stored in.
        tokens: int32 ``[n]``, the document's own token IDs (tokenized alone, no BOS).
        header: int32 ``[h]``, the tokens its KV was computed after (empty: standalone).
        title, source: what the application called it (may be empty).

        added_at: Unix seconds.
        vectors: float32 ``[m, d]`` unit embeddings of its text windows (m may be 0).
    """

    namespace_digest: bytes
    tokens: np.ndarray
    header: np.ndarray
    title: str
    source: str
    text: str
    added_at: float
    vectors: np.ndarray = field(default_factory=lambda: np.zeros((0, 384), np.float32))

    @property
    def key(self) -> bytes:
        """The record's key (:func:`document_key`)."""
        return document_key(self.namespace_digest, self.tokens)

    @property
    def doc_id(self) -> str:
        """The key as 64 hex digits (what commands show and accept)."""
        return self.key.hex()

    @property
    def chain(self) -> list[int]:
        """The token IDs its stored KV covers from position 0: header, then the document."""
        return [int(t) for t in self.header] + [int(t) for t in self.tokens]

    def __repr__(self) -> str:
        # the dataclass repr would print the text, the token IDs and the embedding rows
        return (f"DocumentRecord(doc_id={self.doc_id[:16] + '...'!r}, title={_SHOWN.repr(self.title)}, "
                f"source={_SHOWN.repr(self.source)}, tokens={len(self.tokens)}, header={len(self.header)}, "
                f"text_chars={len(self.text)}, windows={len(self.vectors)})")

    def pack(self) -> bytes:
        """The value layout in the module docstring."""
        meta = json.dumps({"title": self.title, "source": self.source, "text": self.text,
                           "added_at": self.added_at}).encode("utf-8")
        vec = np.ascontiguousarray(self.vectors, dtype="<f4")
        m, d = (vec.shape if vec.ndim == 2 else (0, 0))
        return b"".join([_U32.pack(len(meta)), meta, _U32.pack(len(self.tokens)), token_bytes(self.tokens),
                         _U32.pack(len(self.header)), token_bytes(self.header), _U32.pack(m), _U32.pack(d),
                         vec.tobytes()])

    @classmethod
    def unpack(cls, namespace_digest: bytes, value: bytes) -> "DocumentRecord":
        """Parse a value written by :meth:`pack`; ValueError when truncated or malformed."""
        at = 0

        def take(n: int) -> bytes:
            nonlocal at
            if at + n > len(value):
                raise ValueError(f"document record: truncated at byte {at} of {len(value)}")
            chunk = value[at:at + n]
            at += n
            return chunk

        meta = json.loads(take(_U32.unpack(take(4))[0]).decode("utf-8"))
        tokens = np.frombuffer(take(4 * _U32.unpack(take(4))[0]), dtype="<i4").astype(np.int32)
        header = np.frombuffer(take(4 * _U32.unpack(take(4))[0]), dtype="<i4").astype(np.int32)
        m, d = _U32.unpack(take(4))[0], _U32.unpack(take(4))[0]
        vectors = np.frombuffer(take(4 * m * d), dtype="<f4").astype(np.float32).reshape(m, d)
        if at != len(value) or not len(tokens):
            raise ValueError("document record: trailing bytes or no tokens")
        return cls(namespace_digest, tokens, header, str(meta.get("title", "")), str(meta.get("source", "")),
                   str(meta.get("text", "")), float(meta.get("added_at", 0.0)), vectors)


def _db(store, create: bool):
    return store.named_db(DOCUMENTS_DB, create=create)


def _bump(txn, db) -> None:
    raw = txn.get(GENERATION_KEY, db=db)
    txn.put(GENERATION_KEY, _U64.pack((_U64.unpack(bytes(raw))[0] if raw is not None else 0) + 1), db=db)


def put_document(store, record: DocumentRecord) -> bytes:
    """Write (or replace) ``record``; returns its key. Raises StoreIOError when the write fails,
    PermissionError when the store is read-only."""
    db = _db(store, create=True)
    if db is None:
        raise PermissionError(f"{store.path}: the store is read-only; documents cannot be added")
    key, value = record.key, record.namespace_digest + record.pack()

    def write(txn):
        txn.put(key, value, db=db)
        _bump(txn, db)

    store.transact(write, write=True)
    return key


def _parse(key: bytes, value: bytes) -> DocumentRecord | None:
    try:
        return DocumentRecord.unpack(value[:32], value[32:])
    except (ValueError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("document record %s is malformed (%s); ignored", key.hex()[:16], exc)
        return None


def get_document(store, key: bytes) -> DocumentRecord | None:
    """The record under ``key`` (None: none, or malformed: logged)."""
    db = _db(store, create=False)
    if db is None:
        return None
    value = store.transact(lambda txn: (bytes(v) if (v := txn.get(key, db=db)) is not None else None))
    return None if value is None else _parse(key, value)


def iterate_documents(store, namespace_digest: bytes | None = None) -> Iterator[DocumentRecord]:
    """Every well-formed record (of ``namespace_digest`` when given), in key order, read in one transaction."""
    db = _db(store, create=False)
    if db is None:
        return iter(())
    rows = store.transact(lambda txn: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db) if len(k) == 32])
    return (r for k, v in rows
            if (namespace_digest is None or v[:32] == namespace_digest) and (r := _parse(k, v)) is not None)


def delete_document(store, key: bytes) -> bool:
    """Remove the record under ``key`` (not its fragments); True if there was one. Raises
    StoreIOError when the write fails."""
    db = _db(store, create=False)
    if db is None or store.readonly:
        return False

    def write(txn):
        gone = bool(txn.delete(key, db=db))
        if gone:
            _bump(txn, db)
        return gone

    return bool(store.transact(write, write=True))


def documents_generation(store) -> int:
    """The write counter of the ``documents`` database (0: none yet)."""
    db = _db(store, create=False)
    if db is None:
        return 0
    raw = store.transact(lambda txn: (bytes(v) if (v := txn.get(GENERATION_KEY, db=db)) is not None else None))
    return _U64.unpack(raw)[0] if raw is not None and len(raw) == 8 else 0
