"""The LMDB side of the semantic index: vectors, labels, a generation counter and a change log,
in the store's own environment (key layout in ``core/companions.py``):

* ``emb_vectors``: store key -> ``<Q`` label + ``dim`` ``<f4`` (the unit vector); labels are
  hnswlib ids, allocated here, never reused.
* ``emb_meta``: ``format`` (b"1"), ``backend_id``, ``dim``, ``index_id`` (random hex, new when
  the vectors are dropped), ``next_label`` and ``generation`` (``<Q``), and the change log
  ``log/`` + ``>Q`` generation -> op (``+``/``-``) + ``<Q`` label + store key, trimmed to
  ``log_keep`` entries.

Every write is one transaction and checks ``index_id`` first (:class:`BackendMismatchError`
when another process dropped or re-claimed the vectors); one store holds one embedder's vectors.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from edgesync_store.core.companions import BE64, LOG_KEEP, LOG_PREFIX, VECTORS_DB, drop_vectors_in, log_change, u64
from edgesync_store.core.companions import VECTORS_META_DB as META_DB
from edgesync_store.core.lmdb_env import U64
from edgesync_store.schema import EMBEDDING_DIM
from edgesync_store.semantic.vector_records import (
    BackendMismatchError,
    Change,
    Snapshot,
    as_unit_rows,
    check_key,
    same_vector,
)

__all__ = [
    "BackendMismatchError",
    "Change",
    "LOG_KEEP",
    "META_DB",
    "Snapshot",
    "VECTORS_DB",
    "VectorTable",
    "as_unit_rows",
    "check_key",
    "drop_all",
]

META_FORMAT = b"1"


def _open_dbs(store, create: bool, txn=None) -> tuple[Any, Any] | None:
    """The named databases (created when ``create``), or None when absent (a reclaim reopens the env)."""
    vec = store.named_db(VECTORS_DB, create=create, txn=txn)
    meta = store.named_db(META_DB, create=create, txn=txn)
    if vec is None or meta is None:
        return None
    return vec, meta


def drop_all(store) -> int:
    """Remove every vector and all of ``emb_meta`` in one write transaction; returns the vectors
    removed (the sidecar files are left: ``index.drop_vectors``)."""
    _open_dbs(store, create=True)
    return store.transact(lambda txn: drop_vectors_in(store, txn), write=True)


class VectorTable:
    """The ``emb_vectors`` and ``emb_meta`` databases of one ``FragmentStore``. Call :meth:`claim`
    before writing. Not locked: the caller serialises its threads.

    Args:
        store: an open ``FragmentStore`` (read-only: reads as empty until a writer creates them).
        dim: vector width (384 for MiniLM-L6-v2); a record is ``8 + 4 * dim`` bytes.
        log_keep: change-log entries this writer keeps (default :data:`LOG_KEEP`).
    """

    def __init__(self, store, dim: int = EMBEDDING_DIM, log_keep: int = LOG_KEEP) -> None:
        self.store = store
        self.path = Path(store.path)
        self.dim = int(dim)
        self.log_keep = int(log_keep)
        self.record_size = 8 + 4 * self.dim
        self.backend_id = ""
        self.index_id = ""
        """The ``index_id`` recorded when this table last claimed the store ("" before)."""
        _open_dbs(store, create=not store.readonly)

    @property
    def _vec_db(self):
        return self.store.named_db(VECTORS_DB)

    @property
    def _meta_db(self):
        return self.store.named_db(META_DB)

    @property
    def exists(self) -> bool:
        """False for a read-only store whose databases were never created."""
        return self._vec_db is not None

    # -- the backend record -------------------------------------------------------------------

    def claim(self, backend_id: str) -> str:
        """Record ``backend_id`` and this width (with a new ``index_id``) when none is recorded or no
        vector is stored; returns the ``index_id`` ("" when the databases do not exist). Raises
        BackendMismatchError when the store holds vectors of another backend or width."""
        self.backend_id = backend_id
        self.index_id = self._claim(backend_id)
        return self.index_id

    def _claim(self, backend_id: str) -> str:
        if self._meta_db is None:  # read-only store without the databases: empty
            return ""
        dim_s = str(self.dim)

        def read(txn):
            def get(k):
                return bytes(v).decode() if (v := txn.get(k, db=self._meta_db)) is not None else None

            return get(b"backend_id"), get(b"dim"), get(b"index_id"), txn.stat(self._vec_db)["entries"]

        def write(txn):
            backend, dim, index_id, n = read(txn)
            if backend is not None and n and (backend != backend_id or dim != dim_s):
                return backend, dim, index_id
            if backend != backend_id or dim != dim_s or index_id is None:
                index_id = uuid.uuid4().hex
                txn.put(b"format", META_FORMAT, db=self._meta_db)
                txn.put(b"backend_id", backend_id.encode(), db=self._meta_db)
                txn.put(b"dim", dim_s.encode(), db=self._meta_db)
                txn.put(b"index_id", index_id.encode(), db=self._meta_db)
                if txn.get(b"next_label", db=self._meta_db) is None:
                    txn.put(b"next_label", U64.pack(0), db=self._meta_db)
                    txn.put(b"generation", U64.pack(0), db=self._meta_db)
            return backend_id, dim_s, index_id

        backend, dim, index_id, n = self.store.transact(read)
        if self.store.readonly or (backend == backend_id and dim == dim_s and index_id is not None):
            if backend is not None and n and (backend != backend_id or dim != dim_s):
                raise BackendMismatchError(self.path, f"{backend} (dim {dim})", f"{backend_id} (dim {self.dim})")
            return index_id or ""
        backend, dim, index_id = self.store.transact(write, write=True)
        if backend != backend_id or dim != dim_s:
            if dim != dim_s and backend == backend_id:
                backend, requested = f"{backend} (dim {dim})", f"{backend_id} (dim {self.dim})"
            else:
                requested = backend_id
            raise BackendMismatchError(self.path, backend, requested)
        return index_id

    # -- reads ----------------------------------------------------------------------------------

    def count(self) -> int:
        """Entries in ``emb_vectors`` (malformed ones included)."""
        if self._vec_db is None:
            return 0
        return self.store.transact(lambda txn: txn.stat(self._vec_db)["entries"])

    def generation(self) -> int:
        """The current generation (0 when nothing was ever written)."""
        if self._meta_db is None:
            return 0
        return self.store.transact(lambda txn: u64(txn.get(b"generation", db=self._meta_db)))

    def state(self) -> tuple[str, int]:
        """``(index_id, generation)`` in one read transaction (``""`` when none is recorded)."""
        if self._meta_db is None:
            return "", 0

        def read(txn):
            index_id = txn.get(b"index_id", db=self._meta_db)
            generation = u64(txn.get(b"generation", db=self._meta_db))
            return (bytes(index_id).decode() if index_id is not None else ""), generation

        return self.store.transact(read)

    def get(self, key: bytes) -> np.ndarray | None:
        """The stored unit vector of ``key`` (float32 ``[dim]``, a copy) or None (absent or malformed)."""
        if self._vec_db is None:
            return None

        def read(txn):
            stored = txn.get(key, db=self._vec_db)
            if stored is None or len(stored) != self.record_size:
                return None
            return np.frombuffer(stored, dtype="<f4", offset=8).astype(np.float32)

        return self.store.transact(read)

    def unstored(self, keys: list[bytes]) -> list[bytes]:
        """The keys of ``keys`` whose fragment the store's ``fragments`` database no longer
        holds (one read transaction)."""
        store = self.store
        return store.transact(lambda txn: [k for k in keys if not store.contains_in(txn, k)])

    def scan(self, want_vectors: Callable[[int], bool]) -> Snapshot:
        """One snapshot of ``emb_vectors``: live labels -> keys, the vectors ``want_vectors`` selects,
        the entries whose fragment is gone or malformed, and the generation."""
        if self._vec_db is None:
            return Snapshot({}, {}, [], 0)
        store = self.store
        vec_size = self.record_size

        def read(txn):
            live: dict[int, bytes] = {}
            vectors: dict[int, np.ndarray] = {}
            gone: list[tuple[bytes, int]] = []
            for key, value in txn.cursor(db=self._vec_db):
                key = bytes(key)
                if len(value) != vec_size:
                    gone.append((key, u64(value[:8]) if len(value) >= 8 else -1))
                    continue
                label = U64.unpack(value[:8])[0]
                if not store.contains_in(txn, key):
                    gone.append((key, label))
                    continue
                live[label] = key
                if want_vectors(label):
                    vectors[label] = np.frombuffer(value, dtype="<f4", offset=8).astype(np.float32)
            return Snapshot(live, vectors, gone, u64(txn.get(b"generation", db=self._meta_db)))

        return self.store.transact(read)

    def changes_since(self, seen: int) -> tuple[int, list[Change] | None]:
        """``(generation, changes)``: the log entries after ``seen``, oldest first; ``changes`` is
        None when the log no longer reaches back to ``seen + 1``."""
        if self._vec_db is None:
            return 0, []
        vec_size = self.record_size

        def read(txn):
            generation = u64(txn.get(b"generation", db=self._meta_db))
            if generation <= seen:
                return generation, []
            cursor = txn.cursor(db=self._meta_db)
            ops = []
            expect = seen + 1
            if not cursor.set_range(LOG_PREFIX + BE64.pack(expect)):
                return generation, None
            for key, value in cursor:
                key = bytes(key)
                if not key.startswith(LOG_PREFIX):
                    break
                gen = BE64.unpack(key[len(LOG_PREFIX):])[0]
                if gen != expect:
                    return generation, None  # trimmed: the log no longer reaches back
                expect += 1
                value = bytes(value)
                op, label, store_key = value[:1], U64.unpack(value[1:9])[0], value[9:]
                vector = None
                if op == b"+":
                    stored = txn.get(store_key, db=self._vec_db)
                    if stored is not None and len(stored) == vec_size and U64.unpack(stored[:8])[0] == label:
                        vector = np.frombuffer(stored, dtype="<f4", offset=8).astype(np.float32)
                ops.append(Change(op, label, store_key, vector))
                if gen >= generation:
                    break
            if expect != generation + 1:
                return generation, None
            return generation, ops

        return self.store.transact(read)

    # -- writes (each one transaction, guarded by the claimed index_id) ------------------------

    def _log_op(self, txn, op: bytes, label: int, key: bytes) -> None:
        log_change(txn, self._meta_db, op, label, key, self.log_keep)

    def _write(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn`` in a write transaction once ``index_id`` is checked unchanged since :meth:`claim`."""

        def guarded(txn):
            index_id = txn.get(b"index_id", db=self._meta_db)
            if index_id is None or bytes(index_id).decode() != self.index_id:
                backend = txn.get(b"backend_id", db=self._meta_db)
                raise BackendMismatchError(
                    self.path, bytes(backend).decode() if backend is not None else "(none: dropped)", self.backend_id
                )
            return fn(txn)

        return self.store.transact(guarded, write=True)

    def put_many(self, keys: Sequence[bytes], unit_rows: np.ndarray) -> list[int]:
        """Store the vectors of the stored fragments ``keys`` (``unit_rows``: float32 ``[len(keys),
        dim]``, unit rows) in one write transaction; returns their labels. An equal vector (to 1e-6)
        keeps its label; another one replaces it under a new label.

        Raises:
            KeyError: the store holds no fragment under one of ``keys``.
            BackendMismatchError: the vectors were dropped or re-claimed since :meth:`claim`.
        """
        blobs = [unit_rows[i].astype("<f4").tobytes() for i in range(len(keys))]
        store = self.store

        def write(txn):
            labels = []
            next_label = u64(txn.get(b"next_label", db=self._meta_db))
            for key, blob in zip(keys, blobs):
                if not store.contains_in(txn, key):
                    raise KeyError(f"no fragment {key.hex()[:16]}... in store {self.path}: store it before its vector")
                old = txn.get(key, db=self._vec_db)
                if old is not None and len(old) == self.record_size and same_vector(old[8:], blob):
                    labels.append(u64(old[:8]))
                    continue
                if old is not None:
                    self._log_op(txn, b"-", u64(old[:8]) if len(old) >= 8 else 0, key)
                label = next_label
                next_label += 1
                txn.put(key, U64.pack(label) + blob, db=self._vec_db)
                self._log_op(txn, b"+", label, key)
                labels.append(label)
            txn.put(b"next_label", U64.pack(next_label), db=self._meta_db)
            return labels

        return self._write(write)

    def delete(self, key: bytes) -> bool:
        """Remove the vector of ``key`` (one write transaction); False when it had none. Raises
        BackendMismatchError when the vectors were dropped or re-claimed since :meth:`claim`."""

        def write(txn):
            old = txn.get(key, db=self._vec_db)
            if old is None:
                return False
            label = u64(old[:8]) if len(old) >= 8 else 0
            txn.delete(key, db=self._vec_db)
            self._log_op(txn, b"-", label, key)
            return True

        return self._write(write)

    def purge(self, gone: list[tuple[bytes, int]]) -> int:
        """Remove the ``gone`` entries (``(key, label)``, :attr:`Snapshot.gone`) still absent or
        malformed, in one write transaction; returns how many. Raises BackendMismatchError when
        the vectors were dropped or re-claimed since :meth:`claim`."""

        store = self.store

        def write(txn):
            n = 0
            for key, _label in gone:
                stored = txn.get(key, db=self._vec_db)
                if stored is None:
                    continue  # removed meanwhile
                if store.contains_in(txn, key) and len(stored) == self.record_size:
                    continue  # the fragment is back
                label = u64(stored[:8]) if len(stored) >= 8 else 0
                txn.delete(key, db=self._vec_db)
                self._log_op(txn, b"-", label, key)
                n += 1
            return n

        return self._write(write)
