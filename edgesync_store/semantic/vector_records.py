"""The vector tables' records as values (mismatch error, scan snapshot, change-log entry) and the
checks that turn caller input into stored rows; no I/O."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

__all__ = ["BackendMismatchError", "Change", "Snapshot", "as_unit_rows", "check_key", "same_vector"]


class BackendMismatchError(RuntimeError):
    """The store's vectors were written by another embedder (or with another width)."""

    def __init__(self, path: Path, recorded: str, requested: str) -> None:
        self.recorded = recorded
        self.requested = requested
        super().__init__(
            f"store {path} holds vectors of embedding backend {recorded!r}, not {requested!r}: vectors of "
            f"two backends are never mixed. Open the index with {recorded!r}, or clear the vectors with "
            f"edgesync_store.semantic.index.drop_vectors(store) and re-embed with {requested!r}."
        )


class Snapshot(NamedTuple):
    """One read transaction's view of ``emb_vectors`` (:meth:`VectorTable.scan`)."""

    live: dict[int, bytes]
    """label -> store key, for the entries whose fragment is still stored."""
    vectors: dict[int, np.ndarray]
    """label -> float32 ``[dim]`` unit vector, for the live labels the scan selected."""
    gone: list[tuple[bytes, int]]
    """``(store key, label)`` of entries whose fragment is gone or malformed (label -1: unreadable)."""
    generation: int
    """The generation counter in the same transaction."""


class Change(NamedTuple):
    """One change-log entry (:meth:`VectorTable.changes_since`)."""

    op: bytes
    """``b"+"`` (vector added) or ``b"-"`` (vector removed)."""
    label: int
    key: bytes
    """The fragment's store key."""
    vector: np.ndarray | None
    """For ``+``: the float32 ``[dim]`` vector if the entry still holds this label, else None."""


def same_vector(stored, blob: bytes) -> bool:
    """True when two stored unit vectors differ by no more than float32 rounding (1e-6)."""
    a = np.frombuffer(stored, dtype="<f4")
    b = np.frombuffer(blob, dtype="<f4")
    return bool(np.max(np.abs(a - b)) <= 1e-6)


def as_unit_rows(vectors, dim: int, n: int | None = None) -> np.ndarray:
    """``vectors`` (float ``[dim]`` or ``[rows, dim]``; ``[n, dim]`` with ``n``) as C-contiguous
    float32 ``[rows, dim]`` unit rows.

    Raises:
        ValueError: wrong shape, NaN or infinity, or a zero row.
    """
    arr = np.asarray(vectors, dtype=np.float32)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[1] != dim or (n is not None and arr.shape[0] != n):
        want = f"[{n}, {dim}]" if n is not None else f"[{dim}] or [n, {dim}]"
        raise ValueError(f"vector: shape {np.shape(vectors)}, expected {want}")
    if not np.all(np.isfinite(arr)):
        raise ValueError("vector: contains NaN or infinity")
    norms = np.linalg.norm(arr, axis=1, keepdims=True)
    if np.any(norms == 0):
        raise ValueError("vector: zero vector has no direction")
    return np.ascontiguousarray(arr / norms, dtype=np.float32)


def check_key(key) -> bytes:
    """``key`` as ``bytes``.

    Raises:
        TypeError: not bytes, bytearray or memoryview.
        ValueError: length not in [1, 511] (LMDB's key size limit).
    """
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise TypeError(f"key: expected bytes, got {type(key).__name__}")
    key = bytes(key)
    if not 1 <= len(key) <= 511:
        raise ValueError(f"key: length {len(key)} is not in [1, 511]")
    return key
