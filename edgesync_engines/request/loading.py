"""What ``EdgeSync`` does before its first request: load the engine (:func:`adapter_for`), open
its store (:func:`store_for`, the remote tier behind it: :func:`with_remote_tier`), make the
semantic lookup (:func:`semantic_for`) and the RAM tier (:func:`ram_tiers`), start the store
jobs (:func:`start_jobs`) and warm the engine up for its first hit (:func:`warm_up`). Engines,
the local store and features are imported when first used.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from edgesync_engines.adapters.protocol import EngineAdapter, missing_members
from edgesync_engines.request import plan as planning
from edgesync_engines.request.execute import Injector
from edgesync_engines.request.plan import ReuseMode, ReuseSource, SourceKind
from edgesync_store.core.backend import FragmentBackend, MaintenanceBackend
from edgesync_store.errors import StoreDamagedError, StoreError, StoreIOError, StoreOpenError, StoreUnavailableError
from edgesync_store.schema import MIN_SPAN
from edgesync_store.ttl import TTLPolicy

if TYPE_CHECKING:
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_engines.request.fragment_cache import FragmentCache
    from edgesync_engines.request.prefetch import Prefetcher
    from edgesync_engines.request.semantic_lookup import SemanticLookup
    from edgesync_store.lifecycle.jobs import StoreJobs

log = logging.getLogger(__name__)


def adapter_for(model, config: "EdgeSyncConfig") -> tuple[EngineAdapter, bool]:
    """The engine adapter for ``EdgeSync``'s ``model`` and whether it was loaded here (the caller
    then closes it): None, a GGUF path or a ``llama_cpp.Llama`` is loaded (:func:`load_adapter`);
    any other object must have every member of ``EngineAdapter`` (else TypeError naming them).
    """
    if model is None or isinstance(model, (str, os.PathLike)) or is_llama(model):
        return load_adapter(model, config), True
    missing = missing_members(model)
    if missing:
        raise TypeError(f"model: expected a GGUF path, a llama_cpp.Llama or an engine adapter (EngineAdapter); "
                        f"{type(model).__name__} lacks {', '.join(missing)}")
    return model, False


def is_llama(model) -> bool:
    """Whether ``model`` is a ``llama_cpp.Llama`` (checked without importing llama_cpp)."""
    return any(cls.__name__ == "Llama" and cls.__module__.split(".")[0] == "llama_cpp" for cls in type(model).__mro__)


def load_adapter(model, config: "EdgeSyncConfig"):
    """The engine ``config.engine`` names for ``model`` (a GGUF path, a ``llama_cpp.Llama`` for
    llama.cpp, or None for ``config.model_path``).

    Raises TypeError (the onnx engine given no GGUF path), onnx_export.ExportError (no sound export).
    """
    if config.engine == "onnx":
        from edgesync_engines.adapters.onnxrt import OnnxRuntimeAdapter

        if config.slots > 1:
            log.warning("slots: the onnx engine answers one sequence at a time; serving one")

        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model: the onnx engine takes a GGUF path or an OnnxRuntimeAdapter, "
                            f"got {type(model).__name__}")
        return OnnxRuntimeAdapter(
            model if model is not None else config.model_path,
            n_ctx=config.n_ctx,
            n_threads=config.n_threads,
            seed=config.seed,
        )
    if config.slots > 1:
        slots = load_slots(model, config)
        if slots is not None:
            return slots
    from edgesync_engines.adapters.llamacpp import LlamaCppAdapter

    return LlamaCppAdapter(
        model if model is not None else config.model_path,
        n_ctx=config.n_ctx,
        n_threads=config.n_threads,
        flash_attn=config.flash_attn,
        verbose=config.verbose_engine,
        seed=config.seed,
        kv_type=config.kv_type,
    )


def load_slots(model, config: "EdgeSyncConfig") -> "EngineAdapter | None":
    """The first slot of a ``SlotEngine`` of ``config.slots`` sequences, or None (warned) for a
    ``llama_cpp.Llama`` passed in or a model slots cannot serve: it is then served with one."""
    from edgesync_engines.adapters.llamacpp_slots import SlotEngine, SlotsRefused

    if model is not None and not isinstance(model, (str, os.PathLike)):
        log.warning("slots: a llama_cpp.Llama passed in has its own context; serving one sequence")
        return None
    try:
        engine = SlotEngine(model if model is not None else config.model_path, slots=config.slots,
                            n_ctx=config.n_ctx, n_threads=config.n_threads, flash_attn=config.flash_attn,
                            verbose=config.verbose_engine, seed=config.seed, kv_type=config.kv_type)
    except SlotsRefused as exc:
        log.warning("slots: %s", exc)
        return None
    return engine.adapters[0]


def begin_page_check(store, config: "EdgeSyncConfig") -> None:
    """Start the page check of the store ``EdgeSync`` will open (``store`` None or a path; the
    check runs in a child process while the model loads, and :func:`open_store` waits for it)."""
    if config.cache_enabled and (store is None or isinstance(store, (str, os.PathLike))):
        from edgesync_store.core import page_check

        page_check.begin(Path(store or config.store_path))


def store_for(store, adapter: EngineAdapter, config: "EdgeSyncConfig"
              ) -> "tuple[FragmentBackend | None, bool, str | None]":
    """``EdgeSync``'s store for its ``store`` argument: (the backend or None, whether it was
    opened here, why the engine is served uncached or None). A path or None opens the local
    store (with the remote tier in front when configured); an engine whose KV cannot be cut
    (``adapter.cache_refusal``) gets no store. Raises TypeError for a ``store`` of another type.
    """
    if store is False or not config.cache_enabled:
        return None, False, None
    if adapter.cache_refusal is not None:  # KV we cannot cut: the store is not opened
        return None, False, adapter.cache_refusal
    if isinstance(store, FragmentBackend):
        return store, False, None
    if store is not None and not isinstance(store, (str, os.PathLike)):
        raise TypeError(f"store: expected a FragmentBackend (e.g. a FragmentStore), a path, None or False, "
                        f"got {type(store).__name__}")
    opened = with_remote_tier(open_store(Path(store or config.store_path), config), config)
    return opened, opened is not None, None


def with_remote_tier(local: "FragmentBackend | None", config: "EdgeSyncConfig") -> "FragmentBackend | None":
    """``local`` with the configured remote tier behind it (a ``TieredStore``), or ``local``
    itself: no ``remote_url``, no local store (the remote is never the only tier), or no
    redis-py (the ``remote`` extra; logged). Connecting is lazy: an unreachable remote fails its
    calls, and requests go on local-only."""
    if local is None or config.remote_url is None:
        return local
    try:
        from edgesync_store.remote.tiered import TieredStore
    except ImportError as exc:
        log.warning("EDGESYNC_REMOTE_URL is set but %s: serving from the local store only", exc)
        return local
    return TieredStore.connect(local, config.remote_url, prefix=config.remote_prefix, cluster=config.remote_cluster,
                               timeout_ms=config.remote_timeout_ms, write_timeout_ms=config.remote_write_timeout_ms,
                               retry_s=config.remote_retry_s, queue_size=config.remote_queue,
                               grid=config.chunk_tokens, fetch_budget_ms=config.remote_fetch_budget_ms)


def semantic_for(store: "FragmentBackend | None", config: "EdgeSyncConfig") -> "SemanticLookup | None":
    """The semantic lookup of ``store`` (it loads nothing until first needed; warmed up in the
    ``semantic`` mode), or None: ``config.semantic`` off, no store, or a store that is not a
    ``MaintenanceBackend`` (its donor index needs those members; a warning in the ``semantic``
    mode, whose requests are then answered exactly)."""
    if store is None or not config.semantic:
        return None
    if not isinstance(store, MaintenanceBackend):
        if config.reuse == ReuseMode.SEMANTIC:
            log.warning("reuse=semantic: the store is not a MaintenanceBackend, so no semantic lookup runs; "
                        "requests are answered exactly")
        return None
    from edgesync_engines.request.semantic_lookup import SemanticLookup

    semantic = SemanticLookup(store, config)
    if config.reuse == ReuseMode.SEMANTIC:
        semantic.warm_up()
    return semantic


def open_store(path: Path, config: "EdgeSyncConfig") -> "FragmentBackend | None":
    """Open the configured store with this config's TTL, budget and compression. A store the
    system will not let us write is opened read-only, or not at all, and a damaged store is
    served uncached, with a warning: requests are never failed.

    Raises StoreOpenError (the path is not a store), StoreFormatError (a newer format).
    """
    from edgesync_store.core.store import FragmentStore

    policy = TTLPolicy(ttl_seconds=config.ttl_seconds)
    try:
        return FragmentStore(path, policy=policy, max_bytes=config.max_bytes, compression=config.compression)
    except StoreDamagedError as exc:
        log.warning("fragment store damaged, serving uncached: %s", exc)
        return None
    except StoreUnavailableError as exc:
        if not _has_data_file(path):
            log.warning("fragment store unavailable, serving uncached: %s", exc)
            return None
        log.warning("fragment store %s cannot be written (%s); serving from it read-only", path, exc)
    try:
        return FragmentStore(path, readonly=True, policy=policy, compression=config.compression)
    except (StoreOpenError, StoreIOError, OSError) as exc:
        log.warning("fragment store unavailable, serving uncached: %s", exc)
        return None


def _has_data_file(path: Path) -> bool:
    try:
        return (path / "data.mdb").exists()
    except OSError:  # a directory we may not read
        return False


def ram_tiers(store: "FragmentBackend", adapter: "EngineAdapter",
              config: "EdgeSyncConfig") -> "tuple[FragmentCache | None, Prefetcher | None]":
    """The RAM tier (``ram_tier_bytes``; None when 0) of fragments staged for ``adapter``
    (``stage_fragment``) and, with ``prefetch``, the prefetcher that fills it (None otherwise;
    the config refuses prefetch without a tier)."""
    if not config.ram_tier_bytes:
        return None, None
    from edgesync_engines.request.fragment_cache import FragmentCache

    cache = FragmentCache(store, config.ram_tier_bytes, adapter.stage_fragment)
    if not config.prefetch:
        return cache, None
    from edgesync_engines.request.prefetch import Prefetcher

    return cache, Prefetcher(cache, adapter.namespace, chunk_tokens=config.chunk_tokens)


def start_jobs(store: "FragmentBackend", index, config: "EdgeSyncConfig") -> "StoreJobs | None":
    """The store's sweep and compaction jobs, started (``config.jobs``), or None: jobs off, or a
    store that is read-only or not a ``MaintenanceBackend``. ``index`` returns the open semantic
    index or None."""
    if not config.jobs:
        return None
    from edgesync_store.lifecycle.jobs import start_jobs as start

    return start(store, index, config.sweep_interval_s, config.compact_interval_s)


def warm_up(adapter, store: "FragmentBackend | None") -> int:
    """Before the first request, under the adapter's lock: ``adapter.warm_up`` for an injection
    the size of the store's reuse hint (the token IDs the latest hit injected), then a rehearsal
    of that hit (:func:`rehearse`; a store failure skips it). Returns the tokens it injected."""
    tokens: list[int] = []
    if store is not None and adapter.cache_refusal is None:
        try:
            tokens = [int(t) for t in store.reuse_hint(adapter.namespace.digest())]
        except StoreError as exc:
            log.warning("could not read the store's reuse hint: %s", exc)
    tokens = tokens[:max(0, adapter.n_ctx - 1)]  # a hint from a larger context: rehearse what fits
    t0 = time.perf_counter()
    with adapter.lock:
        adapter.warm_up(len(tokens), any_hit=store is not None)
        injected = rehearse(store, adapter, tokens) if len(tokens) > MIN_SPAN else 0
        adapter.warm_up(len(tokens), any_hit=store is not None)  # an empty cache, counters zeroed
    for slot in adapter.slot_adapters()[1:]:  # any slot may take the next hit
        with slot.lock:
            slot.warm_up(len(tokens))
    log.debug("engine warmed up, a hit of %d tokens rehearsed, in %.1f ms", injected,
              (time.perf_counter() - t0) * 1000)
    return injected


def rehearse(store: "FragmentBackend", adapter, tokens: list[int]) -> int:
    """A hit on ``tokens`` (the store's reuse hint) that answers nothing: walk, read, inject and
    evaluate the last token, then empty the cache. Records no hit, stores nothing. Returns the
    tokens injected (0, logged, on any failure)."""
    try:
        match = planning.walk(store, adapter.namespace, tokens)
        source = ReuseSource(SourceKind.PREFIX, tuple(tokens), match, match.matched_tokens, adapter.namespace,
                             required=MIN_SPAN)
        injected = Injector(store, adapter).inject(source)[0]
        if injected:
            for _token in adapter.generate(tokens, injected, 1):
                pass
        return injected
    except (StoreError, ValueError) as exc:
        log.warning("could not rehearse the latest hit: %s", exc)
        return 0
    except RuntimeError as exc:  # the hint is not checksummed: a damaged one can hold IDs the engine refuses
        log.warning("could not rehearse the latest hit (the store's reuse hint may be damaged): %s", exc)
        return 0
    finally:
        adapter.clear_kv_cache()
        try:
            store.release_mapped()
        except StoreError as exc:
            log.debug("could not release the store's mapped pages: %s", exc)
