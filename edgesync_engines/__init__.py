"""EdgeSync's engine side: the request path in front of llama.cpp or ONNX Runtime.

The public API, importable from here::

    from edgesync_engines import EdgeSync, EdgeSyncConfig
    with EdgeSync(config=EdgeSyncConfig.load()) as es:
        result = es.generate("...")  # a GenerationResult: text, hit, tokens reused, TTFT

The names load on first use (PEP 562 ``__getattr__``): importing one module loads no engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgesync_store.lazy import lazy_exports

_PUBLIC = {
    "EdgeSync": "edgesync_engines.request.router",
    "GenerationResult": "edgesync_engines.request.result",
    "GenerationStream": "edgesync_engines.request.result",
    "EdgeSyncConfig": "edgesync_engines.config",
    "ContextOverflowError": "edgesync_engines.adapters.protocol",
    "InjectionError": "edgesync_engines.adapters.protocol",
    "HitKind": "edgesync_engines.request.plan",
    "ReuseMode": "edgesync_engines.request.plan",
}
"""Public name -> the module that defines it."""

__all__ = [
    "ContextOverflowError",
    "EdgeSync",
    "EdgeSyncConfig",
    "GenerationResult",
    "GenerationStream",
    "HitKind",
    "InjectionError",
    "ReuseMode",
]

if TYPE_CHECKING:
    from edgesync_engines.adapters.protocol import ContextOverflowError, InjectionError
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_engines.request.plan import HitKind, ReuseMode
    from edgesync_engines.request.result import GenerationResult, GenerationStream
    from edgesync_engines.request.router import EdgeSync

__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
