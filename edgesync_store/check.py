"""The page check moved to :mod:`edgesync_store.core.page_check` (the store's own open runs it);
``begin`` and ``verify`` stay importable here until the router and the command line import them
from there."""

from edgesync_store.core.page_check import begin, verify

__all__ = ["begin", "verify"]
