"""LabelGraph: an hnswlib graph of unit vectors under integer labels, and the store key of each
live label. Knows nothing of LMDB; removals are marked deleted and their slots reused; the
graph doubles when full. Not thread-safe (the index holds its lock)."""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from edgesync_store.semantic.sidecar import EF_CONSTRUCTION, HNSW_M, SPACE

log = logging.getLogger(__name__)

INITIAL_CAPACITY = 1024
"""Elements a new graph is first sized for."""
ADD_BATCH = 1024
"""Vectors per ``add_items`` call (and per progress report)."""


class LabelGraph:
    """An hnswlib graph (``graph``: initialised, inner product, unit vectors; :meth:`new` makes
    one) and its live labels' store keys, known after :meth:`bind` or :meth:`add`.
    ``num_threads``: for adds; ``ef_search``: query ef (raised to k); ``deleted``: labels marked
    deleted in the graph."""

    def __init__(self, graph, num_threads: int, ef_search: int, deleted: set[int] = frozenset()) -> None:
        graph.set_num_threads(num_threads)
        graph.set_ef(ef_search)
        self.graph = graph
        self.num_threads = num_threads
        self.ef_search = ef_search
        self.keys: dict[int, bytes] = {}  # live label -> store key
        self.labels: dict[bytes, int] = {}  # store key -> live label
        if deleted:
            deleted = set(deleted) & set(int(x) for x in graph.get_ids_list())
        self.maybe_dead: set[int] = set(deleted)  # labels marked deleted (a superset)
        self.n_dead = len(self.maybe_dead)  # slots holding a deleted element (reusable)
        self.dirty = False  # changed since loaded or saved

    @classmethod
    def new(cls, hnswlib, dim: int, capacity: int, num_threads: int, ef_search: int) -> "LabelGraph":
        """An empty graph of ``dim``-wide vectors sized for ``capacity`` elements (at least
        :data:`INITIAL_CAPACITY`)."""
        graph = hnswlib.Index(space=SPACE, dim=dim)
        graph.init_index(max_elements=max(INITIAL_CAPACITY, capacity), ef_construction=EF_CONSTRUCTION, M=HNSW_M,
                         random_seed=100, allow_replace_deleted=True)
        out = cls(graph, num_threads, ef_search)
        out.dirty = True
        return out

    def __len__(self) -> int:
        """Live labels whose key is known."""
        return len(self.keys)

    def graph_labels(self) -> set[int]:
        """Every label the graph holds that is not marked deleted."""
        return set(int(x) for x in self.graph.get_ids_list()) - self.maybe_dead

    def bind(self, label: int, key: bytes) -> None:
        """Record that the live ``label`` stands for store key ``key``."""
        self.keys[label] = key
        self.labels[key] = label

    def add(self, labels: list[int], vectors: np.ndarray, keys: list[bytes],
            progress: Callable[[int], None] | None = None) -> None:
        """Add ``vectors`` (float32 ``[len(labels), dim]``, unit rows) under ``labels`` for ``keys``
        (a deleted label is revived in place); ``progress(n)`` after each batch of ``n``."""
        if not labels:
            return
        graph = self.graph
        fresh_labels, fresh_rows = [], []
        for i, label in enumerate(labels):
            if label in self.maybe_dead:
                self.maybe_dead.discard(label)
                try:
                    graph.unmark_deleted(label)
                    self.n_dead -= 1
                    self.bind(label, keys[i])
                    continue
                except RuntimeError:
                    pass  # its slot was reused by a later add
            fresh_labels.append(label)
            fresh_rows.append(i)
        if fresh_labels:
            needed = graph.get_current_count() + len(fresh_labels) - min(len(fresh_labels), self.n_dead)
            if needed > graph.get_max_elements():
                new_max = max(needed, graph.get_max_elements() * 2)
                log.debug("semantic index: resizing the graph to %d elements", new_max)
                graph.resize_index(new_max)
            rows = vectors[fresh_rows]
            for start in range(0, len(fresh_labels), ADD_BATCH):
                part = np.asarray(fresh_labels[start : start + ADD_BATCH], dtype=np.uint64)
                graph.add_items(rows[start : start + ADD_BATCH], part, num_threads=self.num_threads,
                                replace_deleted=True)
                self.n_dead -= min(len(part), self.n_dead)
                if progress is not None:
                    progress(len(part))
            for i, label in zip(fresh_rows, fresh_labels):
                self.bind(label, keys[i])
        self.dirty = True

    def remove(self, label: int) -> None:
        """Mark the live ``label`` deleted and forget its key; an unknown label is ignored."""
        key = self.keys.pop(label, None)
        if key is None:
            return
        if self.labels.get(key) == label:
            del self.labels[key]
        self.mark_dead(label)

    def mark_dead(self, label: int) -> None:
        """Mark ``label`` deleted in the graph (its slot becomes reusable); already deleted or
        unknown labels are ignored (hnswlib raises RuntimeError for them)."""
        try:
            self.graph.mark_deleted(label)
            self.n_dead += 1
            self.maybe_dead.add(label)
        except RuntimeError:
            pass
        self.dirty = True

    def search(self, q: np.ndarray, k: int,
               filter: Callable[[bytes], bool] | None = None) -> list[tuple[bytes, float]]:
        """The at most ``k`` live keys nearest to ``q`` (float32 ``[1, dim]``, unit) for which
        ``filter`` is True, with their cosine similarity in [-1, 1], most similar first."""
        keys = self.keys
        if not keys:
            return []
        kk = min(k, len(keys))
        self.graph.set_ef(max(self.ef_search, kk))
        label_filter = None
        if filter is not None:
            def label_filter(label) -> bool:
                return (key := keys.get(int(label))) is not None and bool(filter(key))

        while kk >= 1:
            try:
                labels, dists = self.graph.knn_query(q, k=kk, num_threads=1, filter=label_filter)
                break
            except RuntimeError:  # fewer than kk reachable (filter, deletions): ask for fewer
                kk //= 2
        else:
            return []
        out = []
        for label, dist in zip(labels[0], dists[0]):
            key = keys.get(int(label))
            if key is not None:
                out.append((key, float(min(1.0, max(-1.0, 1.0 - float(dist))))))
        return out

    def deleted_labels(self) -> list[int]:
        """The labels the graph holds that are not live (sorted), for the sidecar."""
        dead = set(int(x) for x in self.graph.get_ids_list()) - self.keys.keys()
        self.maybe_dead &= dead
        return sorted(dead)
