"""Commands on the remote tier as a whole: ``edgesync clear --remote``.

Needs redis-py (the ``remote`` extra), like every module of the remote tier but ``url``.
"""

from __future__ import annotations

import logging

from edgesync_store.errors import StoreIOError
from edgesync_store.remote.client import RemoteClient, RemoteUnavailable, check_options
from edgesync_store.remote.tier import KeyLayout
from edgesync_store.remote.url import RemoteURL, check_prefix

log = logging.getLogger(__name__)

__all__ = ["clear_remote"]


def clear_remote(url: RemoteURL | str, prefix: str = "edgesync", cluster: bool = False,
                 timeout_ms: float = 2000.0) -> int:
    """Remove every key of the remote tier under ``prefix`` (blobs, hit counters, index,
    namespaces; on every node of a cluster); keys of other prefixes stay. Returns the keys
    removed.

    Raises:
        ValueError: a bad URL (message redacted) or prefix.
        StoreIOError: the remote did not answer or refused (message redacted).
    """
    try:
        url = url if isinstance(url, RemoteURL) else RemoteURL(url)
    except ValueError as exc:  # its message shows the URL redacted
        raise ValueError(f"remote URL: {exc}") from None
    problem = check_prefix(prefix)
    if problem:
        raise ValueError(f"remote prefix: {problem}")
    problem = check_options(url, cluster)
    if problem:
        raise ValueError(f"remote URL: {problem}")
    client = RemoteClient(url, cluster=cluster, timeout_ms=timeout_ms, write_timeout_ms=timeout_ms)
    try:
        removed = client.call("slow", KeyLayout(prefix).clear, "clear")
    except RemoteUnavailable as exc:
        raise StoreIOError(f"remote tier {url.redacted}: {exc}") from None
    finally:
        client.close()
    log.info("cleared %d keys under %s: on the remote tier %s", removed, prefix, url.redacted)
    return removed
