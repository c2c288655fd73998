"""EdgeSync's store: KV-cache fragments kept on the device, found by token prefix and by meaning.

Sub-packages, from the bottom up:

* :mod:`edgesync_store.core`: the storage seams (``backend.FragmentBackend`` for requests,
  ``backend.MaintenanceBackend`` for maintenance) and their local implementation on LMDB
  (``store.FragmentStore``, ``lmdb_env``, ``companions``), the blob format (``codec``), the
  prefix walk (``walk``) and the cross-process locks (``locks``);
* :mod:`edgesync_store.lifecycle`: maintenance under the lifetime policy (``edgesync_store.ttl``):
  eviction under the size budget, merging layer/head groups, disk reclaim, scheduled jobs;
* :mod:`edgesync_store.semantic`: finding stored prompts by meaning: embedders, the vectors kept
  in the store, the HNSW sidecar index, donor records, re-embedding a store;
* :mod:`edgesync_store.commands`: store commands for people (dump, clear, byte units).

Beside them: ``schema`` (fragments, namespaces, keys and hashes), ``ttl`` (lifetimes and
the clock), ``compactor`` (one compaction run), ``compact`` (the command that runs one:
``python -m edgesync_store.compact``), ``settings`` (the store's settings, ``StoreSettings``, and
the declaration of settings as dataclass fields), ``errors`` (every error the store raises; the
storage library's own errors never leave the store).

The public API, importable from here::

    from edgesync_store import FragmentStore, KVFragment, Namespace
    with FragmentStore("~/.cache/edgesync/store") as store:
        match = store.prefix_walk(namespace, token_ids)

The names load on first use (PEP 562 ``__getattr__``), so that importing one sub-module loads
neither hnswlib nor onnxruntime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgesync_store.lazy import lazy_exports

_PUBLIC = {
    "FragmentBackend": "edgesync_store.core.backend",
    "MaintenanceBackend": "edgesync_store.core.backend",
    "FragmentStore": "edgesync_store.core.store",
    "StoreStats": "edgesync_store.core.store",
    "DEFAULT_MAX_BYTES": "edgesync_store.core.store",
    "STORE_FORMAT_VERSION": "edgesync_store.core.store",
    "PrefixMatch": "edgesync_store.core.walk",
    "SpanMatch": "edgesync_store.core.walk",
    "KVFragment": "edgesync_store.schema",
    "Namespace": "edgesync_store.schema",
    "store_key": "edgesync_store.schema",
    "prefix_hash": "edgesync_store.schema",
    "chunk_spans": "edgesync_store.schema",
    "Lifecycle": "edgesync_store.ttl",
    "ManualClock": "edgesync_store.ttl",
    "TTLPolicy": "edgesync_store.ttl",
    "LIFETIME_LONG": "edgesync_store.ttl",
    "LIFETIME_SHORT": "edgesync_store.ttl",
    "DEFAULT_TTL_SECONDS": "edgesync_store.ttl",
    "Compactor": "edgesync_store.compactor",
    "SemanticIndex": "edgesync_store.semantic.index",
    "get_embedder": "edgesync_store.semantic.embedders",
    "CodecError": "edgesync_store.errors",
    "StoreBusyError": "edgesync_store.errors",
    "StoreError": "edgesync_store.errors",
    "StoreFormatError": "edgesync_store.errors",
    "StoreIOError": "edgesync_store.errors",
    "StoreNotFoundError": "edgesync_store.errors",
    "StoreOpenError": "edgesync_store.errors",
    "StoreUnavailableError": "edgesync_store.errors",
    "StoreSettings": "edgesync_store.settings",
}
"""Public name -> the module that defines it."""

__all__ = [
    "CodecError",
    "Compactor",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_TTL_SECONDS",
    "FragmentBackend",
    "MaintenanceBackend",
    "FragmentStore",
    "KVFragment",
    "LIFETIME_LONG",
    "LIFETIME_SHORT",
    "Lifecycle",
    "ManualClock",
    "Namespace",
    "PrefixMatch",
    "STORE_FORMAT_VERSION",
    "SemanticIndex",
    "SpanMatch",
    "StoreBusyError",
    "StoreError",
    "StoreFormatError",
    "StoreIOError",
    "StoreNotFoundError",
    "StoreOpenError",
    "StoreSettings",
    "StoreStats",
    "StoreUnavailableError",
    "TTLPolicy",
    "chunk_spans",
    "get_embedder",
    "prefix_hash",
    "store_key",
]

if TYPE_CHECKING:
    from edgesync_store.compactor import Compactor
    from edgesync_store.core.backend import FragmentBackend, MaintenanceBackend
    from edgesync_store.core.store import DEFAULT_MAX_BYTES, STORE_FORMAT_VERSION, FragmentStore, StoreStats
    from edgesync_store.core.walk import PrefixMatch, SpanMatch
    from edgesync_store.errors import (
        CodecError,
        StoreBusyError,
        StoreError,
        StoreFormatError,
        StoreIOError,
        StoreNotFoundError,
        StoreOpenError,
        StoreUnavailableError,
    )
    from edgesync_store.schema import KVFragment, Namespace, chunk_spans, prefix_hash, store_key
    from edgesync_store.semantic.embedders import get_embedder
    from edgesync_store.semantic.index import SemanticIndex
    from edgesync_store.settings import StoreSettings
    from edgesync_store.ttl import DEFAULT_TTL_SECONDS, LIFETIME_LONG, LIFETIME_SHORT, Lifecycle, ManualClock, TTLPolicy

__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
