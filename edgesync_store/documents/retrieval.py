"""Keeping a document's fragments (:func:`keep_as_document`) and finding documents by meaning
(:class:`DocumentIndex`: an in-memory hnswlib graph, cosine, M 16, ef_construction 200, over the
records' window embeddings, rebuilt whenever the ``documents`` write counter moved; no sidecar)."""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import numpy as np

from edgesync_store.documents.records import DocumentRecord, documents_generation, iterate_documents
from edgesync_store.errors import require_extra
from edgesync_store.ttl import LIFETIME_DOCUMENT

log = logging.getLogger(__name__)

__all__ = ["DocumentIndex", "keep_as_document"]


def keep_as_document(store, keys: Sequence[bytes]) -> int:
    """Put the stored fragments ``keys`` in the document lifetime (``expires_at`` +inf, hits kept);
    returns how many changed.

    Raises:
        StoreIOError: the store could not be written.
    """
    changed = 0
    for key in keys:
        life = store.lifecycle(key)
        if life is None or life.lifetime == LIFETIME_DOCUMENT:
            continue
        life.lifetime = LIFETIME_DOCUMENT
        life.expires_at = float("inf")
        changed += bool(store.set_lifecycle(key, life))
    return changed


class DocumentIndex:
    """Nearest documents of one namespace to a query embedding. Thread-safe.

    Args:
        store: the open store holding the records.
        namespace_digest: 32 bytes; only this namespace's documents are searched.
        ef_search: hnswlib's query breadth.
    """

    def __init__(self, store, namespace_digest: bytes, ef_search: int = 64) -> None:
        self.store = store
        self.namespace_digest = namespace_digest
        self.ef_search = int(ef_search)
        self._lock = threading.Lock()
        self._generation = -1
        self._graph = None
        self._owners: list[bytes] = []

    def _rebuild(self) -> None:
        hnswlib = require_extra("hnswlib", "semantic", "document retrieval")

        records: list[DocumentRecord] = [r for r in iterate_documents(self.store, self.namespace_digest)
                                         if len(r.vectors)]
        self._owners = [r.key for r in records for _ in range(len(r.vectors))]
        if not records:
            self._graph = None
            return
        vectors = np.concatenate([r.vectors for r in records]).astype(np.float32)
        graph = hnswlib.Index(space="cosine", dim=vectors.shape[1])
        graph.init_index(max_elements=len(vectors), ef_construction=200, M=16)
        graph.add_items(vectors, np.arange(len(vectors)), num_threads=1)
        self._graph = graph
        log.debug("document index rebuilt: %d documents, %d windows", len(records), len(vectors))

    def search(self, vector: np.ndarray, k: int) -> list[tuple[bytes, float]]:
        """The ``k`` documents nearest to ``vector`` (float32 ``[d]``, unit), best first, as (document
        key, cosine of its best window); empty when none is stored.

        Raises:
            StoreIOError: the records could not be read.
        """
        with self._lock:
            generation = documents_generation(self.store)
            if generation != self._generation:
                self._rebuild()
                self._generation = generation
            if self._graph is None or k < 1:
                return []
            # a document has several windows: ask for more labels than documents wanted
            want = min(len(self._owners), k * 4)
            self._graph.set_ef(max(self.ef_search, want))
            labels, distances = self._graph.knn_query(np.asarray(vector, np.float32)[None, :], k=want, num_threads=1)
        best: dict[bytes, float] = {}
        for label, dist in zip(labels[0], distances[0]):
            owner = self._owners[int(label)]
            best[owner] = max(best.get(owner, -1.0), 1.0 - float(dist))
        return sorted(best.items(), key=lambda kv: -kv[1])[:k]
