"""Commands on the remote tier as a whole: ``edgesync clear --remote``."""

from __future__ import annotations

import logging

from edgesync_store.errors import StoreIOError
from edgesync_store.remote.client import RemoteClient, RemoteUnavailable, checked_target
from edgesync_store.remote.tier import KeyLayout
from edgesync_store.remote.url import RemoteURL

log = logging.getLogger(__name__)

__all__ = ["clear_remote"]


def clear_remote(url: RemoteURL | str, prefix: str = "edgesync", cluster: bool = False,
                 timeout_ms: float = 2000.0) -> int:
    """Remove every key of the remote tier under ``prefix`` (on every node of a cluster); returns
    the keys removed.

    Raises:
        ValueError: a bad URL (message redacted) or prefix.
        StoreIOError: the remote did not answer or refused (message redacted).
    """
    url = checked_target(url, prefix, cluster)
    client = RemoteClient(url, cluster=cluster, timeout_ms=timeout_ms, write_timeout_ms=timeout_ms)
    try:
        removed = client.call("slow", KeyLayout(prefix).clear, "clear")
    except RemoteUnavailable as exc:
        raise StoreIOError(f"remote tier {url.redacted}: {exc}") from None
    finally:
        client.close()
    log.info("cleared %d keys under %s: on the remote tier %s", removed, prefix, url.redacted)
    return removed
