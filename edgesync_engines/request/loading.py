"""What ``EdgeSync`` does before its first request: load the engine, open the configured store,
and warm the engine up for its first hit.

:func:`load_adapter` picks the engine ``config.engine`` names; :func:`open_store` opens the
local store with the configured TTL, budget and compression (read-only, or not at all, with a
warning when the system will not let us write it); :func:`warm_up` asks the adapter to do the
first-time work of a request at load rather than during the first request, and rehearses the
latest hit: the store's reuse hint (``FragmentBackend.reuse_hint``, the token IDs the latest hit
in this namespace injected, from any process) is walked, read, injected and its last token
evaluated, answering nothing (:func:`rehearse`), so that a new process's first hit does not
pay for the template's compilation, the engine's first decode, the kernel providing its
seq-state buffer, or its first faults on the store's pages.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
from edgesync_engines.adapters.onnxrt import OnnxRuntimeAdapter
from edgesync_engines.adapters.protocol import EngineAdapter, missing_members
from edgesync_engines.request import plan as planning
from edgesync_engines.request.execute import Injector
from edgesync_engines.request.plan import ReuseSource, SourceKind
from edgesync_store.core.store import FragmentStore
from edgesync_store.errors import StoreDamagedError, StoreError, StoreIOError, StoreOpenError, StoreUnavailableError
from edgesync_store.schema import MIN_SPAN
from edgesync_store.ttl import TTLPolicy

if TYPE_CHECKING:
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_store.core.backend import FragmentBackend

log = logging.getLogger(__name__)

def adapter_for(model, config: "EdgeSyncConfig") -> tuple[EngineAdapter, bool]:
    """The engine adapter for ``EdgeSync``'s ``model`` and whether it was loaded here (then the
    caller closes it): None, a GGUF path (str or ``os.PathLike``) or a ``llama_cpp.Llama`` is
    loaded (:func:`load_adapter`); any other object is used as is, and must have every member
    of :class:`~edgesync_engines.adapters.protocol.EngineAdapter`.

    Raises:
        TypeError: an object that is neither a path nor a ``llama_cpp.Llama`` and lacks protocol
            members (they are named).
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

    Raises:
        TypeError: the onnx engine given something else than a GGUF path.
        onnx_export.ExportError: ``config.engine == "onnx"`` and the GGUF has no sound export.
    """
    if config.engine == "onnx":
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model: the onnx engine takes a GGUF path or an OnnxRuntimeAdapter, "
                            f"got {type(model).__name__}")
        return OnnxRuntimeAdapter(
            model if model is not None else config.model_path,
            n_ctx=config.n_ctx,
            n_threads=config.n_threads,
            seed=config.seed,
        )
    return LlamaCppAdapter(
        model if model is not None else config.model_path,
        n_ctx=config.n_ctx,
        n_threads=config.n_threads,
        flash_attn=config.flash_attn,
        verbose=config.verbose_engine,
        seed=config.seed,
        kv_type=config.kv_type,
    )


def open_store(path: Path, config: "EdgeSyncConfig") -> "FragmentBackend | None":
    """Open the configured store with this config's TTL, budget and compression. A store the
    system will not let us write (read-only disk or directory, no space or permission) is
    opened read-only, or not at all, with a warning: requests are served from it, or uncached,
    never failed. So is a damaged store (a truncated data file): served uncached, with a
    warning that names the command that recreates it.

    Raises:
        StoreOpenError: the path is not a store (a file, a foreign directory).
        StoreFormatError: a store of a newer format.
    """
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


def warm_up(adapter, store: "FragmentBackend | None") -> int:
    """Before the first request: ``adapter.warm_up`` for an injection the size of the store's
    reuse hint (none without a store), then a rehearsal of that hit (:func:`rehearse`), under
    the adapter's lock. A store failure only skips the rehearsal (logged); its time is logged at
    DEBUG. Returns the tokens the rehearsal injected (0: none)."""
    tokens: list[int] = []
    if store is not None and adapter.cache_refusal is None:
        try:
            tokens = [int(t) for t in store.reuse_hint(adapter.namespace.digest())]
        except StoreError as exc:
            log.warning("could not read the store's reuse hint: %s", exc)
    t0 = time.perf_counter()
    with adapter.lock:
        adapter.warm_up(len(tokens))
        injected = rehearse(store, adapter, tokens) if len(tokens) > MIN_SPAN else 0
        adapter.warm_up(len(tokens))  # an empty cache again, and (llama.cpp) its counters zeroed
    log.debug("engine warmed up, a hit of %d tokens rehearsed, in %.1f ms", injected,
              (time.perf_counter() - t0) * 1000)
    return injected


def rehearse(store: "FragmentBackend", adapter, tokens: list[int]) -> int:
    """A hit on ``tokens`` (the latest hit's injected token IDs) that answers nothing: the walk,
    the in-place read and checksums, the injection and the evaluation of the last token, so
    that the first request finds the store's index pages, the engine's buffers and its kernels
    ready; then the cache is emptied and the store's pages this process mapped are given back
    (``release_mapped``: the first request maps what it reads itself, so a rehearsal of another
    chain never adds to its resident memory). Records no hit, stores nothing, keeps nothing in
    a RAM tier. Returns the tokens injected; a store failure, a refused injection or an engine
    that refuses the hint's tokens (a damaged hint) is logged and leaves 0."""
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
