"""The fragment record, its namespace, its invariants and its hashes.

A fragment is identified by :func:`store_key` (never Python's ``hash()``, which changes per
process). Byte encodings, fixed because the hashes persist on disk:

* token IDs: ``int32`` little-endian, one after another (``np.asarray(ids, "<i4").tobytes()``);
* ``content_hash`` = SHA-256(b"edgesync/content/v1\\0" + token bytes);
* ``prefix_hash`` = SHA-256(b"edgesync/prefix/v1\\0" + token bytes of every token before
  ``token_start``; the empty prefix included);
* ``store_key`` = SHA-256(b"edgesync/key/v1\\0" + namespace digest + prefix hash + token bytes +
  six ``<i4`` integers layer_start, layer_end, layer_stride, head_start, head_end, token_start).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

MIN_SPAN = 64
"""Smallest token span a fragment may hold (nothing shorter is injected at position 0)."""
MAX_SPAN = 2048
"""Largest token span a fragment may hold (bounds one blob and one decode)."""
EMBEDDING_DIM = 384
"""MiniLM-L6-v2 sentence-embedding width."""
DEFAULT_TTL_SECONDS = 30 * 60
"""The short lifetime: 30 minutes from creation (``ttl.TTLPolicy.ttl_seconds``)."""

_CONTENT_TAG = b"edgesync/content/v1\0"
_PREFIX_TAG = b"edgesync/prefix/v1\0"
_KEY_TAG = b"edgesync/key/v1\0"
_NAMESPACE_TAG = b"edgesync/namespace/v1\0"

KV_DTYPES = {"f16": np.float16, "f32": np.float32, "bf16": np.uint16, "q8_0": np.uint8, "q4_0": np.uint8}
"""KV types by llama.cpp's type_k/type_v names -> numpy dtype of a row's items (bf16 as raw
16-bit words; bytes for the block-quantized types of :data:`KV_BLOCKS`)."""
KV_BLOCKS = {"q8_0": (32, 34), "q4_0": (32, 18)}
"""Block-quantized KV types: (values, bytes) per block, from ggml's ``ggml-common.h``
(``block_q8_0``, ``block_q4_0``: an f16 scale and the quants)."""


def token_bytes(token_ids: Iterable[int] | np.ndarray) -> bytes:
    """Encode token IDs as little-endian int32 bytes, the encoding every hash here uses."""
    return np.ascontiguousarray(np.asarray(token_ids, dtype="<i4")).tobytes()


def content_hash(token_ids: Iterable[int] | np.ndarray) -> str:
    """The ContentHash: SHA-256 hex digest over the fragment's token IDs alone (an integrity
    check; the lookup key also covers the prefix and namespace, ``store_key``)."""
    return hashlib.sha256(_CONTENT_TAG + token_bytes(token_ids)).hexdigest()


def prefix_hasher() -> "hashlib._Hash":
    """A SHA-256 object primed for prefix hashes: feed it :func:`token_bytes` of consecutive
    tokens and ``digest()`` equals :func:`prefix_hash` of all tokens fed so far."""
    return hashlib.sha256(_PREFIX_TAG)


def prefix_hash(prefix_token_ids: Iterable[int] | np.ndarray) -> bytes:
    """SHA-256 (32 raw bytes) over every token before a fragment's first token (``[]``: position 0)."""
    return hashlib.sha256(_PREFIX_TAG + token_bytes(prefix_token_ids)).digest()


@dataclass(frozen=True)
class Namespace:
    """Everything besides the tokens that a fragment's KV depends on; fragments are
    interchangeable only within one namespace.

    * ``model_fingerprint``: SHA-256 hex of the model file (``fingerprint.py``);
    * ``engine``, ``engine_version``: e.g. ``"llama.cpp"``, ``"llama-cpp-python 0.3.36"``;
    * ``kv_dtype``: a key of :data:`KV_DTYPES`;
    * ``flash_attn``: flash attention changes the V layout and the numbers;
    * ``layout``: the tensor layout and state format the engine wrote;
    * ``n_layer``, ``n_head_kv``, ``head_dim``: the model's KV geometry;
    * ``kernels``: the engine's kernel digest, hex of a hash over the numbers its compute
      kernels give for a fixed probe (e.g. ``LlamaCppAdapter.probe_kernels``). Builds and
      machines whose kernels compute other bits (NEON against AVX2, AVX-512 against AVX2) have
      other digests, so their KV is never taken as exact for one another; ``""`` in a fragment
      written before the digest was recorded (never equal to a probed one).
    """

    model_fingerprint: str
    engine: str
    engine_version: str
    kv_dtype: str
    flash_attn: bool
    layout: str
    n_layer: int
    n_head_kv: int
    head_dim: int
    kernels: str

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("namespace.model_fingerprint: must be non-empty")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"namespace.kv_dtype: {self.kv_dtype!r} is not one of {sorted(KV_DTYPES)}")
        for name in ("n_layer", "n_head_kv", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"namespace.{name}: must be a positive integer, got {value!r}")
        block = KV_BLOCKS.get(self.kv_dtype, (1, 0))[0]
        if self.head_dim % block:
            raise ValueError(f"namespace.head_dim: {self.head_dim} is not whole {self.kv_dtype} blocks of {block}")
        if not isinstance(self.kernels, str):
            raise ValueError(f"namespace.kernels: must be a string, got {self.kernels!r}")

    @property
    def np_dtype(self) -> np.dtype:
        """numpy dtype of the items of a K or V row (bytes for quantized types)."""
        return np.dtype(KV_DTYPES[self.kv_dtype])

    @property
    def quantized(self) -> bool:
        """True for block-quantized KV (rows are raw bytes; no conversion to another engine)."""
        return self.kv_dtype in KV_BLOCKS

    @property
    def head_width(self) -> int:
        """Row items per KV head: ``head_dim`` values, or their bytes for quantized types."""
        if self.kv_dtype in KV_BLOCKS:
            values, nbytes = KV_BLOCKS[self.kv_dtype]
            return self.head_dim // values * nbytes
        return self.head_dim

    def to_dict(self) -> dict:
        """Plain JSON-able dict (the on-disk form). An empty ``kernels`` is left out, so a
        fragment written before it existed keeps its digest and its index entries."""
        data = {
            "model_fingerprint": self.model_fingerprint,
            "engine": self.engine,
            "engine_version": self.engine_version,
            "kv_dtype": self.kv_dtype,
            "flash_attn": bool(self.flash_attn),
            "layout": self.layout,
            "n_layer": int(self.n_layer),
            "n_head_kv": int(self.n_head_kv),
            "head_dim": int(self.head_dim),
        }
        if self.kernels:
            data["kernels"] = self.kernels
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Namespace":
        """Inverse of :meth:`to_dict`; raises ValueError naming a missing or bad field. A
        record written before ``kernels`` existed reads as ``kernels=""``."""
        try:
            return cls(**{name: data[name] if name != "kernels" else data.get(name, "")
                          for name in cls.__dataclass_fields__})
        except KeyError as exc:
            raise ValueError(f"namespace.{exc.args[0]}: missing") from None
        except TypeError as exc:
            raise ValueError(f"namespace: {exc}") from None

    def digest(self) -> bytes:
        """SHA-256 (32 raw bytes) over the canonical JSON of :meth:`to_dict` (sorted keys)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(_NAMESPACE_TAG + canonical).digest()


def store_key(
    namespace: Namespace,
    prefix: bytes,
    token_ids: Iterable[int] | np.ndarray,
    token_start: int,
    layer_start: int,
    layer_end: int,
    layer_stride: int,
    head_start: int,
    head_end: int,
) -> bytes:
    """The LMDB key of a fragment: SHA-256 (32 raw bytes), encoding in the module docstring."""
    ranges = np.asarray(
        [layer_start, layer_end, layer_stride, head_start, head_end, token_start], dtype="<i4"
    ).tobytes()
    return hashlib.sha256(
        _KEY_TAG + namespace.digest() + bytes(prefix) + token_bytes(token_ids) + ranges
    ).digest()


def layer_indices(layer_start: int, layer_end: int, layer_stride: int) -> range:
    """The model layers a fragment holds: ``range(layer_start, layer_end, layer_stride)``."""
    return range(layer_start, layer_end, layer_stride)


@dataclass(eq=False)
class KVFragment:
    """The K and V of one token span over a layer range and a KV-head range.

    * ``keys``, ``values``: dtype ``namespace.np_dtype``, ``[n_layers, span, (head_end - head_start)
      * head_dim]`` with ``n_layers = len(range(layer_start, layer_end, layer_stride))``, ``span =
      token_end - token_start`` (llama.cpp's per-layer K row layout, ``src/llama-kv-cache.cpp``
      ``state_write_data``); C-contiguous, or a transposed view of ``[layers, width, span]`` (V as
      staged for llama.cpp).
    * ``token_ids``: int32 ``[span]``; ``embedding``: float32 ``[384]`` or ``[0]``.
    * ``created_at``, ``expires_at``, ``last_hit_at``: Unix seconds (``last_hit_at`` 0.0 before a hit).

    Raises:
        ValueError: an invariant fails (message starts with the field): span in [64, 2048], layer
            and head ranges within the namespace, ``len(token_ids) == span``, tensor shapes, a
            32-byte prefix hash, ``content_hash`` equal to :func:`content_hash` of the tokens.
    """

    namespace: Namespace
    token_start: int
    token_end: int
    layer_start: int
    layer_end: int
    keys: np.ndarray
    values: np.ndarray
    token_ids: np.ndarray
    prefix_hash: bytes
    layer_stride: int = 1
    head_start: int = 0
    head_end: int | None = None
    content_hash: str = ""
    embedding: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    created_at: float = 0.0
    expires_at: float = 0.0
    hit_count: int = 0
    last_hit_at: float = 0.0

    def __post_init__(self) -> None:
        """Check every field (ValueError naming the field) and normalise types: ranges, token
        IDs, arrays, hashes and embedding, then times (unset ones from the clock)."""
        if not isinstance(self.namespace, Namespace):
            raise ValueError(f"namespace: expected Namespace, got {type(self.namespace).__name__}")
        self._check_ranges()
        self._check_token_ids()
        self._check_arrays()
        self._check_hashes()
        self._check_times()

    def _check_ranges(self) -> None:
        ns = self.namespace
        for name in ("token_start", "token_end", "layer_start", "layer_end", "layer_stride", "head_start"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise ValueError(f"{name}: must be an integer, got {value!r}")
            setattr(self, name, int(value))
        if self.head_end is None:
            self.head_end = ns.n_head_kv
        self.head_end = int(self.head_end)

        if self.token_start < 0:
            raise ValueError(f"token_start: must be >= 0, got {self.token_start}")
        span = self.token_end - self.token_start
        if not MIN_SPAN <= span <= MAX_SPAN:
            raise ValueError(
                f"token_end: span token_end - token_start = {span} is outside [{MIN_SPAN}, {MAX_SPAN}]"
            )
        if self.layer_stride < 1:
            raise ValueError(f"layer_stride: must be >= 1, got {self.layer_stride}")
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(
                f"layer_start: need 0 <= layer_start < layer_end, got [{self.layer_start}, {self.layer_end})"
            )
        if self.layer_end > ns.n_layer:
            raise ValueError(f"layer_end: {self.layer_end} exceeds the model's {ns.n_layer} layers")
        if not 0 <= self.head_start < self.head_end:
            raise ValueError(
                f"head_start: need 0 <= head_start < head_end, got [{self.head_start}, {self.head_end})"
            )
        if self.head_end > ns.n_head_kv:
            raise ValueError(f"head_end: {self.head_end} exceeds the model's {ns.n_head_kv} KV heads")

    def _check_token_ids(self) -> None:
        span = self.token_end - self.token_start
        ids = np.asarray(self.token_ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token_ids: must be a 1-D integer array, got shape {ids.shape} dtype {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
            raise ValueError("token_ids: IDs must lie in [0, 2**31 - 1]")
        if len(ids) != span:
            raise ValueError(f"token_ids: length {len(ids)} != span {span}")
        self.token_ids = np.ascontiguousarray(ids, dtype=np.int32)

    def _check_arrays(self) -> None:
        ns = self.namespace
        expected = (self.n_layers, self.token_end - self.token_start, (self.head_end - self.head_start) * ns.head_width)
        for name in ("keys", "values"):
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.size == 0:
                raise ValueError(f"{name}: must be a non-empty numpy array")
            if arr.shape != expected:
                raise ValueError(
                    f"{name}: shape {arr.shape} does not agree with [layers, span, heads*head_dim] = {expected}"
                )
            if arr.dtype != ns.np_dtype:
                raise ValueError(f"{name}: dtype {arr.dtype} != namespace kv_dtype {ns.kv_dtype}")
            # C-contiguous, or channel-major (a transposed view: see the class docstring)
            if not arr.flags.c_contiguous and not arr.transpose(0, 2, 1).flags.c_contiguous:
                setattr(self, name, np.ascontiguousarray(arr))

    def _check_hashes(self) -> None:
        if not isinstance(self.prefix_hash, (bytes, bytearray)) or len(self.prefix_hash) != 32:
            raise ValueError("prefix_hash: must be 32 bytes (SHA-256 of the tokens before token_start)")
        self.prefix_hash = bytes(self.prefix_hash)

        emb = np.asarray(self.embedding, dtype=np.float32)
        if emb.shape not in ((0,), (EMBEDDING_DIM,)):
            raise ValueError(f"embedding: shape {emb.shape} is neither (0,) nor ({EMBEDDING_DIM},)")
        if emb.size and not np.all(np.isfinite(emb)):
            raise ValueError("embedding: contains NaN or infinity")
        self.embedding = emb

        computed = content_hash(self.token_ids)
        if not self.content_hash:
            self.content_hash = computed
        elif self.content_hash != computed:
            raise ValueError(
                f"content_hash: {self.content_hash[:16]}... does not match the token IDs ({computed[:16]}...)"
            )

    def _check_times(self) -> None:
        for name in ("created_at", "expires_at", "last_hit_at"):
            value = float(getattr(self, name))
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: must be a finite time >= 0, got {value}")
            setattr(self, name, value)
        if self.created_at == 0.0:
            self.created_at = time.time()
        if self.expires_at == 0.0:
            self.expires_at = self.created_at + DEFAULT_TTL_SECONDS
        if not isinstance(self.hit_count, (int, np.integer)) or self.hit_count < 0:
            raise ValueError(f"hit_count: must be an integer >= 0, got {self.hit_count!r}")
        self.hit_count = int(self.hit_count)

    @property
    def span(self) -> int:
        """Number of tokens: ``token_end - token_start``."""
        return self.token_end - self.token_start

    @property
    def layers(self) -> range:
        """The model layers held, in the order of axis 0 of ``keys``/``values``."""
        return layer_indices(self.layer_start, self.layer_end, self.layer_stride)

    @property
    def n_layers(self) -> int:
        """Length of axis 0 of ``keys``/``values``."""
        return len(self.layers)

    @property
    def raw_nbytes(self) -> int:
        """Bytes of K plus V before compression."""
        return int(self.keys.nbytes + self.values.nbytes)

    def key(self) -> bytes:
        """This fragment's store key (:func:`store_key`)."""
        return store_key(
            self.namespace,
            self.prefix_hash,
            self.token_ids,
            self.token_start,
            self.layer_start,
            self.layer_end,
            self.layer_stride,
            self.head_start,
            self.head_end,
        )


def chunk_spans(n_tokens: int, chunk_tokens: int = 128) -> list[tuple[int, int]]:
    """Split ``[0, n_tokens)`` into spans of ``chunk_tokens``; the last absorbs a remainder
    shorter than :data:`MIN_SPAN`, and fewer than :data:`MIN_SPAN` tokens give none.

    >>> chunk_spans(300)
    [(0, 128), (128, 300)]
    """
    if chunk_tokens < MIN_SPAN or chunk_tokens + MIN_SPAN - 1 > MAX_SPAN:
        raise ValueError(f"chunk_tokens: {chunk_tokens} must be in [{MIN_SPAN}, {MAX_SPAN - MIN_SPAN + 1}]")
    spans: list[tuple[int, int]] = []
    start = 0
    while n_tokens - start >= MIN_SPAN:
        end = start + chunk_tokens
        if n_tokens - end < MIN_SPAN:
            end = n_tokens
        spans.append((start, end))
        start = end
    return spans


def common_prefix_len(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Number of leading positions where the two token sequences agree."""
    a = np.asarray(a)
    b = np.asarray(b)
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if diff.size else n
