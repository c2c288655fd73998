"""Keeping a SemanticIndex's in-memory hnswlib graph equal to the vectors in LMDB.

:class:`GraphSync` is the part of :class:`~edgesync_store.semantic.index.SemanticIndex` that
changes the graph: adds (reusing the slots of deleted elements, growing the graph when full),
removals (hnswlib marks them deleted), loading the saved graph, and the three ways of catching up with LMDB: replaying
the change log from the generation the graph reflects, reconciling against a full scan when the
log no longer reaches back, and rebuilding from scratch. Every method runs with the index's
lock held. Labels are never reused (``vectors.py``), so a label deleted in the graph and added
again carries the same vector.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import numpy as np

from edgesync_store.semantic import sidecar
from edgesync_store.semantic.sidecar import EF_CONSTRUCTION, HNSW_M, SPACE

log = logging.getLogger(__name__)

INITIAL_CAPACITY = 1024
"""Elements the graph is first sized for; doubled (``resize_index``) when full."""
REBUILD_BATCH = 1024
"""Vectors per ``add_items`` call (and per progress report)."""


class GraphSync:
    """Graph updates of ``SemanticIndex``; it provides ``_hnswlib``, ``_index`` (the graph),
    ``_keys`` (live label -> store key), ``_labels`` (store key -> live label), ``_maybe_dead``
    (labels marked deleted, a superset), ``_n_dead`` (reusable slots), ``_seen_gen``,
    ``_index_id``, ``_dirty``, ``_vectors`` (``VectorTable``), ``backend_id``, ``dim``,
    ``ef_search``, ``num_threads``, ``path``, ``hnsw_path``, ``json_path``, ``_open()`` and
    ``_purge()``."""

    def _load_sidecar(self) -> set[int] | None:
        """Load ``semantic.hnsw`` if ``semantic.json`` vouches for it and it belongs to this
        store and backend; return the graph's live labels, or None (graph to rebuild)."""
        if not self.json_path.exists() and not self.hnsw_path.exists():
            return None
        try:
            graph, generation, deleted = sidecar.load_graph(
                self._hnswlib, self.path, sidecar.header(self.backend_id, self.dim, self._index_id),
                self._vectors.generation())
        except FileNotFoundError as exc:
            log.warning("semantic index sidecar of %s incomplete (%s): rebuilding from LMDB", self.path, exc.filename)
            return None
        except (ValueError, OSError, RuntimeError) as exc:
            log.warning("semantic index sidecar of %s unusable (%s): rebuilding from LMDB", self.path, exc)
            return None
        if graph.dim != self.dim:
            log.warning("semantic index sidecar of %s has dim %d: rebuilding from LMDB", self.path, graph.dim)
            return None
        graph.set_num_threads(self.num_threads)
        graph.set_ef(self.ef_search)
        ids = set(int(x) for x in graph.get_ids_list())
        dead = set(deleted) & ids
        self._index = graph
        self._keys, self._labels = {}, {}
        self._maybe_dead = set(dead)
        self._n_dead = len(dead)
        self._seen_gen = generation
        self._dirty = False
        log.debug(
            "loaded %s: %d live, %d deleted, generation %d", self.hnsw_path, len(ids - dead), len(dead), generation
        )
        return ids - dead

    def _new_graph(self, capacity: int):
        graph = self._hnswlib.Index(space=SPACE, dim=self.dim)
        graph.init_index(max_elements=max(INITIAL_CAPACITY, capacity), ef_construction=EF_CONSTRUCTION, M=HNSW_M,
                         random_seed=100, allow_replace_deleted=True)
        graph.set_num_threads(self.num_threads)
        graph.set_ef(self.ef_search)
        return graph


    def _graph_add(self, labels: list[int], vectors: np.ndarray, keys: list[bytes], progress=None) -> None:
        if not labels:
            return
        graph = self._index
        fresh_labels, fresh_rows = [], []
        for i, label in enumerate(labels):
            if label in self._maybe_dead:
                self._maybe_dead.discard(label)
                try:  # labels are never reused, so a deleted label's vector is this one
                    graph.unmark_deleted(label)
                    self._n_dead -= 1
                    self._keys[label] = keys[i]
                    self._labels[keys[i]] = label
                    continue
                except RuntimeError:
                    pass  # its slot was reused by a later add
            fresh_labels.append(label)
            fresh_rows.append(i)
        if fresh_labels:
            needed = graph.get_current_count() + len(fresh_labels) - min(len(fresh_labels), self._n_dead)
            if needed > graph.get_max_elements():
                new_max = max(needed, graph.get_max_elements() * 2)
                log.debug("semantic index: resizing the graph to %d elements", new_max)
                graph.resize_index(new_max)
            rows = vectors[fresh_rows]
            for start in range(0, len(fresh_labels), REBUILD_BATCH):
                part = np.asarray(fresh_labels[start : start + REBUILD_BATCH], dtype=np.uint64)
                graph.add_items(
                    rows[start : start + REBUILD_BATCH], part, num_threads=self.num_threads, replace_deleted=True
                )
                self._n_dead -= min(len(part), self._n_dead)
                if progress is not None:
                    progress(len(part))
            for i, label in zip(fresh_rows, fresh_labels):
                self._keys[label] = keys[i]
                self._labels[keys[i]] = label
        self._dirty = True


    def _graph_remove(self, label: int) -> None:
        key = self._keys.pop(label, None)
        if key is None:
            return
        if self._labels.get(key) == label:
            del self._labels[key]
        self._mark_dead(label)


    def _mark_dead(self, label: int) -> None:
        """Mark ``label`` deleted in the graph (its slot becomes reusable); already deleted
        or unknown labels are ignored (hnswlib raises RuntimeError for them)."""
        try:
            self._index.mark_deleted(label)
            self._n_dead += 1
            self._maybe_dead.add(label)
        except RuntimeError:
            pass
        self._dirty = True


    def _reconcile(self, graph_live: set[int]) -> tuple[int, int]:
        """Make the graph hold exactly LMDB's live vectors. ``graph_live``: labels live in the
        graph (their keys may not be known yet). Returns (added, removed)."""
        live, vectors, gone, generation = self._vectors.scan(lambda label: label not in graph_live)
        removed = 0  # graph removals (vectors of gone fragments included)
        for label in graph_live - live.keys():
            if label in self._keys:
                self._graph_remove(label)
            else:
                self._mark_dead(label)
            removed += 1
        for label in graph_live & live.keys():
            self._keys[label] = live[label]
            self._labels[live[label]] = label
        missing = sorted(vectors)
        if missing:
            self._graph_add(
                missing, np.stack([vectors[label] for label in missing]), [live[label] for label in missing]
            )
        self._seen_gen = generation
        if gone:
            self._purge(gone)
        return len(missing), removed


    def _catch_up(self) -> None:
        """Replay the LMDB change log from the generation this graph reflects."""
        if not self._vectors.exists:
            return
        seen = self._seen_gen
        generation, ops = self._vectors.changes_since(seen)
        if ops is None:
            log.debug("semantic index: change log of %s does not reach generation %d; reconciling", self.path, seen)
            self._reconcile(set(self._keys))
            return
        for op, label, store_key, vector in ops:
            if op == b"+" and vector is not None and label not in self._keys:
                old = self._labels.get(store_key)
                if old is not None:
                    self._graph_remove(old)
                self._graph_add([label], vector[None, :], [store_key])
            elif op == b"-" and label in self._keys:
                self._graph_remove(label)
        self._seen_gen = generation


    def _refresh(self) -> None:
        """Catch up when another process (or thread) wrote since this graph's generation;
        reload when the vectors were dropped (or the backend changed) meanwhile."""
        index_id, generation = self._vectors.state()
        if index_id != self._index_id:
            log.info("semantic index of %s was reset by another process; reloading", self.path)
            self._keys, self._labels, self._maybe_dead, self._n_dead = {}, {}, set(), 0
            self._index = None
            self._open()
        elif generation != self._seen_gen:
            self._catch_up()


    def _rebuild_locked(self, progress: Callable[[int, int], None] | None) -> int:
        live, vectors, gone, generation = self._vectors.scan(lambda label: True)
        labels = sorted(live)
        self._index = self._new_graph(math.ceil(len(labels) * 1.25))
        self._keys, self._labels, self._maybe_dead, self._n_dead = {}, {}, set(), 0
        if labels:
            mat = np.stack([vectors[label] for label in labels])
            keys = [live[label] for label in labels]
            if progress is not None:
                done = [0]

                def advance(n: int) -> None:
                    done[0] += n
                    progress(done[0], len(labels))

                self._graph_add(labels, mat, keys, progress=advance)
            else:
                self._graph_add(labels, mat, keys)
        self._seen_gen = generation
        self._dirty = True
        if gone:
            self._purge(gone)
        return len(self._keys)
