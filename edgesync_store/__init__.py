"""EdgeSync's store: KV-cache fragments kept on the device, found by token prefix and by meaning;
layers and modules in ``docs/architecture.md``::

    from edgesync_store import FragmentStore
    with FragmentStore("~/.cache/edgesync/store") as store:
        match = store.prefix_walk(namespace, token_ids)

The public names load on first use (PEP 562): importing one sub-module loads neither hnswlib nor
onnxruntime.
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
