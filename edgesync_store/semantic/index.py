"""SemanticIndex: an HNSW (hnswlib) graph over a FragmentStore's vectors (:mod:`.vectors`), a cache
(:mod:`.sidecar`) rebuilt from LMDB when missing, damaged or of another store. Inner-product space on
unit vectors (distance = 1 - cosine), M = 16, ef_construction = 200, ef_search = 100 (../shared/DESIGN.md 2.1).
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from edgesync_store.errors import MissingExtraError, require_extra
from edgesync_store.schema import EMBEDDING_DIM
from edgesync_store.semantic import sidecar
from edgesync_store.semantic.graph import LabelGraph
from edgesync_store.semantic.sidecar import SIDECAR_HNSW, SIDECAR_JSON, SIDECAR_LOCK
from edgesync_store.semantic.vectors import (
    LOG_KEEP,
    BackendMismatchError,
    VectorTable,
    as_unit_rows,
    check_key,
    drop_all,
)

log = logging.getLogger(__name__)

__all__ = [
    "BackendMismatchError",
    "DEFAULT_EF_SEARCH",
    "IndexUnavailableError",
    "SemanticIndex",
    "SIDECAR_JSON",
    "SIDECAR_HNSW",
    "drop_vectors",
]

DEFAULT_EF_SEARCH = 100
"""hnswlib ef at query time; raised to k when k is larger (DESIGN.md 2.1: 50 misses near-duplicates)."""


class IndexUnavailableError(RuntimeError):
    """hnswlib is not installed."""


def _import_hnswlib():
    try:
        return require_extra("hnswlib", "semantic", "the semantic index")
    except MissingExtraError as exc:
        raise IndexUnavailableError(str(exc)) from exc


def drop_vectors(store) -> int:
    """Remove every stored vector and the index's metadata from ``store`` (one write
    transaction) and delete the sidecar files; returns the vectors removed. Any backend may then
    open a :class:`SemanticIndex` on the store."""
    n = drop_all(store)
    for name in (SIDECAR_HNSW, SIDECAR_JSON):
        try:
            (Path(store.path) / name).unlink()
        except FileNotFoundError:
            pass
    log.info("dropped %d vectors from %s", n, store.path)
    return n


class SemanticIndex:
    """Nearest-neighbour search over the embeddings of a FragmentStore's fragments. Opening loads
    the sidecar if intact, else rebuilds from LMDB, then catches up with LMDB.

    Args:
        store: an open ``FragmentStore`` holding the vectors; close the index before it.
        embedder_backend_id: ``backend_id`` of the embedder (or an ``Embedder``).
        dim: vector width (384 for MiniLM-L6-v2).
        ef_search, num_threads: hnswlib's query ef and threads (default 1: llama.cpp owns the cores).
        autosave: :meth:`close` saves the sidecar when the graph changed.
        log_keep: change-log entries this writer keeps (default :data:`LOG_KEEP`).

    Raises BackendMismatchError (vectors of another backend or width), IndexUnavailableError (no hnswlib).
    """

    def __init__(
        self,
        store,
        embedder_backend_id: str | Any,
        dim: int = EMBEDDING_DIM,
        ef_search: int = DEFAULT_EF_SEARCH,
        num_threads: int = 1,
        autosave: bool = True,
        log_keep: int = LOG_KEEP,
    ) -> None:
        self._hnswlib = _import_hnswlib()
        backend_id = getattr(embedder_backend_id, "backend_id", embedder_backend_id)
        if not isinstance(backend_id, str) or not backend_id:
            raise ValueError(f"embedder_backend_id: expected a non-empty string, got {embedder_backend_id!r}")
        if min(dim, ef_search, num_threads, log_keep) < 1:
            raise ValueError(
                f"dim, ef_search, num_threads and log_keep must be >= 1, "
                f"got {dim}, {ef_search}, {num_threads}, {log_keep}"
            )
        self.store = store
        self.backend_id = backend_id
        self.dim = int(dim)
        self.ef_search = int(ef_search)
        self.num_threads = int(num_threads)
        self.autosave = autosave
        self.log_keep = int(log_keep)
        self.path = Path(store.path)
        self.hnsw_path = self.path / SIDECAR_HNSW
        self.json_path = self.path / SIDECAR_JSON
        self.lock_path = self.path / SIDECAR_LOCK  # sidecar.file_lock's file
        self._lock = threading.RLock()
        self._closed = False
        self._graph: LabelGraph | None = None
        self._seen_gen = 0  # the LMDB generation the graph reflects
        self._index_id = ""
        self._vectors = VectorTable(store, self.dim, self.log_keep)
        with self._lock:
            self._open()

    # -- keeping the graph equal to LMDB (every method runs with the lock held) ------------------

    def _open(self) -> None:
        """Check the recorded backend, load or rebuild the graph, catch up with LMDB."""
        self._index_id = self._vectors.claim(self.backend_id)  # raises BackendMismatchError
        if not self._load_sidecar():
            n = self._vectors.count()
            if n:
                log.warning("semantic index of %s: rebuilding %d vectors from LMDB", self.path, n)
            self._rebuild_locked(progress=None)
            if (n or self.hnsw_path.exists() or self.json_path.exists()) and not self.store.readonly:
                self._save_quietly()  # replaces a damaged sidecar too
        else:
            self._reconcile(self._graph.graph_labels())

    def _load_sidecar(self) -> bool:
        """Load the sidecar if intact and this store's and backend's; False: rebuild."""
        if not self.json_path.exists() and not self.hnsw_path.exists():
            return False
        try:
            graph, generation, deleted = sidecar.load_graph(
                self._hnswlib, self.path, sidecar.header(self.backend_id, self.dim, self._index_id),
                self._vectors.generation())
        except FileNotFoundError as exc:
            log.warning("semantic index sidecar of %s incomplete (%s): rebuilding from LMDB", self.path, exc.filename)
            return False
        except (ValueError, OSError, RuntimeError) as exc:
            log.warning("semantic index sidecar of %s unusable (%s): rebuilding from LMDB", self.path, exc)
            return False
        if graph.dim != self.dim:
            log.warning("semantic index sidecar of %s has dim %d: rebuilding from LMDB", self.path, graph.dim)
            return False
        self._graph = LabelGraph(graph, self.num_threads, self.ef_search, set(deleted))
        self._seen_gen = generation
        log.debug("loaded %s: %d deleted, generation %d", self.hnsw_path, self._graph.n_dead, generation)
        return True

    def _reconcile(self, graph_live: set[int]) -> tuple[int, int]:
        """Make the graph hold exactly LMDB's live vectors (``graph_live``: its labels); (added, removed)."""
        graph = self._graph
        live, vectors, gone, generation = self._vectors.scan(lambda label: label not in graph_live)
        removed = 0  # graph removals (vectors of gone fragments included)
        for label in graph_live - live.keys():
            if label in graph.keys:
                graph.remove(label)
            else:
                graph.mark_dead(label)
            removed += 1
        for label in graph_live & live.keys():
            graph.bind(label, live[label])
        missing = sorted(vectors)
        if missing:
            graph.add(missing, np.stack([vectors[label] for label in missing]), [live[label] for label in missing])
        self._seen_gen = generation
        if gone:
            self._purge(gone)
        return len(missing), removed

    def _catch_up(self) -> None:
        """Replay the LMDB change log since the graph's generation (reconcile when it is too short)."""
        if not self._vectors.exists:
            return
        graph = self._graph
        generation, ops = self._vectors.changes_since(self._seen_gen)
        if ops is None:
            log.debug("semantic index: change log of %s does not reach generation %d; reconciling", self.path,
                      self._seen_gen)
            self._reconcile(set(graph.keys))
            return
        for op, label, store_key, vector in ops:
            if op == b"+" and vector is not None and label not in graph.keys:
                old = graph.labels.get(store_key)
                if old is not None:
                    graph.remove(old)
                graph.add([label], vector[None, :], [store_key])
            elif op == b"-" and label in graph.keys:
                graph.remove(label)
        self._seen_gen = generation

    def _refresh(self) -> None:
        """Catch up with other writers; reload when the vectors were dropped or re-claimed."""
        index_id, generation = self._vectors.state()
        if index_id != self._index_id or self._graph is None:
            log.info("semantic index of %s was reset by another process; reloading", self.path)
            self._graph = None
            self._open()
        elif generation != self._seen_gen:
            self._catch_up()

    def _rebuild_locked(self, progress: Callable[[int, int], None] | None) -> int:
        live, vectors, gone, generation = self._vectors.scan(lambda label: True)
        labels = sorted(live)
        self._graph = LabelGraph.new(self._hnswlib, self.dim, math.ceil(len(labels) * 1.25), self.num_threads,
                                     self.ef_search)
        if labels:
            advance = None
            if progress is not None:
                done = [0]

                def advance(n: int) -> None:
                    done[0] += n
                    progress(done[0], len(labels))

            self._graph.add(labels, np.stack([vectors[label] for label in labels]),
                            [live[label] for label in labels], progress=advance)
        self._seen_gen = generation
        if gone:
            self._purge(gone)
        return len(self._graph)

    def _check_writable(self) -> None:
        if self._closed:
            raise RuntimeError("semantic index is closed")
        if self.store.readonly or not self._vectors.exists:
            raise PermissionError(f"store {self.path} is open read-only")

    def _purge(self, gone: list[tuple[bytes, int]]) -> None:
        """Remove vectors whose fragment the store no longer holds (and malformed entries)."""
        for _key, label in gone:
            self._graph.remove(label)
        if self.store.readonly:
            return
        n = self._vectors.purge(gone)
        if n:
            log.info("semantic index: removed %d vectors whose fragments are gone from %s", n, self.path)
        self._catch_up()

    # -- public API ----------------------------------------------------------------------------

    def add(self, key: bytes, vector) -> int:
        """Record and index the embedding (float ``[dim]`` or ``[1, dim]``, normalised here) of the
        stored fragment ``key``; returns its label. An equal vector (to 1e-6) is a no-op; another one
        replaces it under a new label.

        Raises:
            KeyError: the store holds no fragment under ``key``.
            ValueError: wrong shape, NaN/inf or zero vector.
            BackendMismatchError: the vectors were dropped or re-claimed meanwhile.
            PermissionError: read-only store.
        """
        return self.add_many([key], as_unit_rows(vector, self.dim, 1))[0]

    def add_many(self, keys: Sequence[bytes], vectors) -> list[int]:
        """:meth:`add` for several fragments in ONE write transaction (all or none); return
        their labels in order. ``vectors``: float ``[len(keys), dim]``."""
        self._check_writable()
        keys = [check_key(k) for k in keys]
        if len(set(keys)) != len(keys):
            raise ValueError("keys: duplicates")
        mat = as_unit_rows(vectors, self.dim, len(keys)) if keys else np.zeros((0, self.dim), np.float32)
        if not keys:
            return []
        with self._lock:
            self._refresh()  # re-claims the store if its vectors were dropped meanwhile
            labels = self._vectors.put_many(keys, mat)
            self._catch_up()
        return labels

    def remove(self, key: bytes) -> bool:
        """Remove the vector of ``key`` (one write transaction); False when it had none."""
        self._check_writable()
        key = check_key(key)
        with self._lock:
            self._refresh()
            removed = self._vectors.delete(key)
            self._catch_up()
        return removed

    def query(
        self, vector, k: int = 8, *, filter: Callable[[bytes], bool] | None = None
    ) -> list[tuple[bytes, float]]:
        """The ``k`` stored fragments nearest to ``vector`` (float ``[dim]``, normalised here),
        after catching up with LMDB; results whose fragment is gone are dropped and their vectors removed.
        ``filter``: optional predicate on store keys. Returns ``[(store key, cosine similarity in [-1, 1])]``,
        most similar first."""
        if self._closed:
            raise RuntimeError("semantic index is closed")
        q = as_unit_rows(vector, self.dim, 1)
        if k < 1:
            return []
        results: list[tuple[bytes, float]] = []
        for _ in range(4):
            with self._lock:
                self._refresh()
                results = self._graph.search(q, k, filter)
            if not results:
                return results
            gone = self._vectors.unstored([key for key, _ in results])
            if not gone:
                return results
            with self._lock:
                self._purge([(key, self._graph.labels.get(key, -1)) for key in gone])
        gone_set = set(self._vectors.unstored([key for key, _ in results]))
        return [r for r in results if r[0] not in gone_set]

    def sync(self) -> tuple[int, int]:
        """Catch up with LMDB completely (gone fragments' vectors dropped); ``(added, removed)``."""
        with self._lock:
            index_id, _ = self._vectors.state()
            if index_id != self._index_id or self._graph is None:
                self._refresh()
                return len(self._graph), 0
            return self._reconcile(set(self._graph.keys))

    def rebuild(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Rebuild the graph from LMDB, save the sidecar (unless read-only); returns the vectors indexed.
        ``progress(done, total)`` is called as vectors are added."""
        with self._lock:
            n = self._rebuild_locked(progress)
            if not self.store.readonly:
                self.save()
            return n

    def save(self) -> None:
        """Write ``semantic.hnsw`` and ``semantic.json`` atomically (temp file in the store
        directory, fsync, ``os.replace``; graph first, JSON last, then fsync the directory)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("semantic index is closed")
            graph = self._graph
            if graph is None:  # a reload after another process reset the vectors failed
                log.warning("semantic index of %s: no graph to save", self.path)
                return
            info = {**sidecar.header(self.backend_id, self.dim, self._index_id), "generation": self._seen_gen,
                    "count": len(graph), "max_elements": int(graph.graph.get_max_elements()),
                    "deleted_labels": graph.deleted_labels()}
            sidecar.save_graph(self.path, graph.graph, info)
            graph.dirty = False

    def _save_quietly(self) -> None:
        try:
            self.save()
        except OSError as exc:
            log.warning("cannot save the semantic index sidecar in %s: %s", self.path, exc)

    def close(self) -> None:
        """Save the sidecar if changed (``autosave``), release the graph; idempotent; before the store."""

        with self._lock:
            if self._closed:
                return
            if self.autosave and self._graph is not None and self._graph.dirty and not self.store.readonly:
                self._save_quietly()
            self._closed = True
            self._graph = None

    # -- introspection ---------------------------------------------------------------------------

    def __len__(self) -> int:
        """Vectors in the graph (as of the last catch-up)."""
        return 0 if self._graph is None else len(self._graph)

    def __contains__(self, key: bytes) -> bool:
        return self._graph is not None and bytes(key) in self._graph.labels

    @property
    def generation(self) -> int:
        """The LMDB write generation the in-memory graph reflects."""
        return self._seen_gen

    def vector(self, key: bytes) -> np.ndarray | None:
        """The stored unit vector of ``key`` (float32 ``[dim]``, a copy from LMDB) or None."""
        if not self._vectors.exists:
            return None
        return self._vectors.get(check_key(key))

    def __enter__(self) -> "SemanticIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SemanticIndex({str(self.path)!r}, backend_id={self.backend_id!r}, "
                f"count={len(self)}, generation={self._seen_gen})")
