"""Putting the shared remote tier behind the local store when the configuration names one.

:func:`with_remote_tier` is how the router opens its store: with ``remote_url`` unset (the
default) it returns the local store as it is; with it set, a
:class:`~edgesync_store.remote.tiered.TieredStore` over the local store and that remote. The
request path then talks to that ``FragmentBackend`` like to any other. The remote client
library (redis-py, the ``remote`` extra) is imported only here and only then.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_store.core.backend import FragmentBackend

log = logging.getLogger(__name__)

__all__ = ["with_remote_tier"]


def with_remote_tier(local: "FragmentBackend | None", config: "EdgeSyncConfig") -> "FragmentBackend | None":
    """``local`` with the configured remote tier behind it, or ``local`` itself when no remote is
    configured, there is no local store (the remote tier is a second tier, never the only one),
    or redis-py is not installed (logged). Connecting is lazy: an unreachable remote does not
    fail this, its calls fail and the requests go on local-only."""
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
