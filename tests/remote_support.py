"""Shared material of the remote-tier tests (their Redis servers are the ``redis_server`` and
``redis_cluster`` fixtures of conftest.py): fragments of SmolLM2's geometry built from seeded
random numbers, and tiered stores over fresh local stores in a temp dir.

Each test uses a key prefix of its own (:func:`new_prefix`), so tests sharing a server never
see each other's keys."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from edgesync_store.core.store import FragmentStore
from edgesync_store.remote.tiered import TieredStore
from edgesync_store.schema import KVFragment, Namespace, chunk_spans, prefix_hash
from tests.fragments import SMOL

_COUNTER = itertools.count()


def new_prefix(name: str) -> str:
    """A key prefix no other test uses."""
    return f"t{next(_COUNTER)}-{name}"


def chain(tokens, namespace: Namespace = SMOL, chunk: int = 64, seed: int = 0) -> list[KVFragment]:
    """Whole fragments (all layers and heads) of ``tokens``' chunk grid (``chunk_spans(len - 1,
    chunk)``, as the request path stores them), with seeded low-entropy f16 K and V."""
    rng = np.random.default_rng(seed)
    frags = []
    for s, e in chunk_spans(len(tokens) - 1, chunk):
        shape = (namespace.n_layer, e - s, namespace.n_head_kv * namespace.head_dim)
        k, v = (rng.integers(-4, 4, shape).astype(np.float16) for _ in range(2))
        frags.append(KVFragment(namespace, s, e, 0, namespace.n_layer, k, v, np.asarray(tokens[s:e], np.int32),
                                prefix_hash(tokens[:s])))
    return frags


def prompt(seed: int, n: int = 200) -> list[int]:
    """``n`` seeded random token IDs."""
    return [int(t) for t in np.random.default_rng(1000 + seed).integers(0, 49000, n)]


def tiered(tmp: Path, name: str, url: str, prefix: str, **options) -> TieredStore:
    """A TieredStore over a fresh local store ``tmp/name`` and the remote at ``url``."""
    options.setdefault("timeout_ms", 2000.0)
    return TieredStore.connect(FragmentStore(tmp / name), url, prefix=prefix, **options)
