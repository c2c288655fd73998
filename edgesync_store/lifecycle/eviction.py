"""The eviction policy moved to :mod:`edgesync_store.core.eviction` (the store's write path enforces
it); these names stay importable here until ``settings.py`` and the document tests import it
from there."""

from edgesync_store.core.eviction import DEFAULT_MAX_BYTES, eviction_order

__all__ = ["DEFAULT_MAX_BYTES", "eviction_order"]
