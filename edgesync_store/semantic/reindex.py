"""Rebuild a store's semantic index on demand (``edgesync reindex [STORE] [--backend NAME]``):
the graph from LMDB with the recorded backend, embedding donors without a vector; with another
backend, every vector dropped and every donor re-embedded. Donors whose fragment is gone are
removed."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from edgesync_store.core.store import FragmentStore
from edgesync_store.errors import StoreOpenError
from edgesync_store.migrations import migrate
from edgesync_store.semantic.donors import delete_donor, embed_unindexed, iterate_donors
from edgesync_store.semantic.embedders import BACKENDS, DEFAULT_BACKEND, get_embedder
from edgesync_store.semantic.index import BackendMismatchError, SemanticIndex, drop_vectors

log = logging.getLogger(__name__)

EMBED_BATCH = 64
"""Donor texts encoded per call."""


@dataclass
class ReindexReport:
    """What :func:`reindex` did. Times in seconds."""

    store: str
    backend_id: str
    previous_backend_id: str | None
    vectors_dropped: int
    vectors_indexed: int
    donors_embedded: int
    donors_removed: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def _backend_name(backend_id: str) -> str | None:
    """The embedding backend name whose ``backend_id`` is ``backend_id`` (None: unknown)."""
    backend_id = backend_id.split(" (dim", 1)[0]
    for name, cls in BACKENDS.items():
        if cls.backend_id == backend_id:
            return name
    return None


def _open_index(store: FragmentStore, backend: str | None) -> tuple[SemanticIndex, str, str | None, int]:
    """The index to rebuild: ``(index, backend name, previous backend id, vectors dropped)``.
    The recorded backend is kept when ``backend`` is None; another backend drops the vectors."""
    name = backend or DEFAULT_BACKEND
    try:
        return SemanticIndex(store, BACKENDS[name].backend_id), name, BACKENDS[name].backend_id, 0
    except BackendMismatchError as exc:
        if backend is None:
            name = _backend_name(exc.recorded)
            if name is None:
                raise ValueError(
                    f"store {store.path} holds vectors of an unknown embedding backend {exc.recorded!r}; "
                    f"choose one with --backend ({', '.join(sorted(BACKENDS))})"
                ) from None
            return SemanticIndex(store, BACKENDS[name].backend_id), name, exc.recorded, 0
        dropped = drop_vectors(store)
        log.info("dropped %d vectors of %s to re-embed with %s", dropped, exc.recorded, name)
        return SemanticIndex(store, BACKENDS[name].backend_id), name, exc.recorded, dropped


def _embed_donors(store: FragmentStore, index: SemanticIndex, name: str,
                  progress: Callable[[str, int, int], None] | None) -> tuple[int, int]:
    """Remove donor records whose fragment is gone and embed those without a vector (backend
    ``name``, loaded only if needed); returns ``(removed, embedded)``."""
    removed = sum(delete_donor(store, key) for key, _ in iterate_donors(store) if not store.contains(key))

    def encode(texts: list[str]) -> np.ndarray:
        return get_embedder(name).encode(texts)

    embedded = embed_unindexed(store, index, encode, EMBED_BATCH, progress=None if progress is None else (
        lambda done, total: progress("embedding donors", done, total)))
    return removed, embedded


def reindex(
    path: str | Path,
    backend: str | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> ReindexReport:
    """Rebuild the semantic index of the store at ``path``.

    Args:
        path: an existing store directory.
        backend: ``onnx`` or ``sentence-transformers``; None keeps the recorded one.
        progress: ``progress(stage, done, total)`` while donors are embedded.

    Raises:
        StoreOpenError: no store at ``path``.
        ValueError: unknown backend name, or an unknown recorded one and no ``backend``.
        EmbeddingUnavailableError, IndexUnavailableError: a package is missing.
    """
    t0 = time.perf_counter()
    path = Path(path).expanduser()
    if not (path / "data.mdb").is_file():
        raise StoreOpenError(f"no EdgeSync store at {path}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown embedding backend {backend!r}; choose one of {sorted(BACKENDS)}")
    with FragmentStore(path, upgrade=migrate) as store:
        index, name, previous, dropped = _open_index(store, backend)
        try:
            removed, embedded = _embed_donors(store, index, name, progress)
            graph_progress = None
            if progress is not None:
                def graph_progress(done, total):
                    progress("rebuilding the HNSW graph", done, total)
            n = index.rebuild(progress=graph_progress)
            index.save()
            backend_id = index.backend_id
        finally:
            index.close()
    report = ReindexReport(
        store=str(path),
        backend_id=backend_id,
        previous_backend_id=previous,
        vectors_dropped=dropped,
        vectors_indexed=n,
        donors_embedded=embedded,
        donors_removed=removed,
        seconds=round(time.perf_counter() - t0, 3),
    )
    log.info("reindex %s: %s", path, report)
    return report
