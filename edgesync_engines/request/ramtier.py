"""The RAM tier's container: a bounded, thread-safe LRU of decoded fragments (:class:`RamTier`),
read and filled by the request thread (``request/fragment_cache.py``) and a prefetch thread."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class RamTierStats:
    """Counters of a :class:`RamTier`: ``hits``/``misses`` of ``get``; ``puts`` stored;
    ``rejected`` puts larger than the whole budget; ``evictions`` entries dropped as least
    recently used; ``bytes`` held now (sum of entry sizes) against ``max_bytes``; ``entries``."""

    hits: int
    misses: int
    puts: int
    rejected: int
    evictions: int
    bytes: int
    max_bytes: int
    entries: int

    @property
    def hit_rate(self) -> float | None:
        """hits / (hits + misses) in [0, 1]; None before any ``get``."""
        n = self.hits + self.misses
        return self.hits / n if n else None


class RamTier:
    """A thread-safe LRU of decoded fragments bounded by their size in bytes.

    ``RamTier(max_bytes)``: ``max_bytes`` >= 0 is the budget (0 stores nothing). An entry's size
    is the ``nbytes`` given to :meth:`put`, else the value's ``raw_nbytes`` (``KVFragment``'s
    K + V bytes before compression). ``get`` counts a hit or a miss and makes the entry the most
    recently used; ``in`` does neither. Held bytes never exceed ``max_bytes``.
    """

    def __init__(self, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._puts = self._rejected = self._evictions = 0

    @staticmethod
    def _size(value: Any, nbytes: int | None) -> int:
        size = nbytes if nbytes is not None else getattr(value, "raw_nbytes", None)
        if size is None:
            raise TypeError(f"{type(value).__name__} has no raw_nbytes: pass nbytes=")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"entry size must be an int >= 0 bytes, got {size!r}")
        return size

    def put(self, key: Hashable, value: Any, nbytes: int | None = None) -> bool:
        """Store ``value`` under ``key`` as the most recently used entry, replacing any previous
        one, and evict least recently used entries until the budget holds. Returns False (and
        stores nothing, dropping a previous entry of that key) when the value alone is larger
        than ``max_bytes``. Raises TypeError when the size is unknown, ValueError when it is
        negative or not an int."""
        size = self._size(value, nbytes)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if size > self.max_bytes:
                self._rejected += 1
                log.debug("RAM tier: %d B entry exceeds the %d B budget", size, self.max_bytes)
                return False
            self._items[key] = (value, size)
            self._bytes += size
            self._puts += 1
            while self._bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self._bytes -= dropped
                self._evictions += 1
            return True

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value under ``key`` (now the most recently used), or ``default``; counts a hit or
        a miss."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self._misses += 1
                return default
            self._items.move_to_end(key)
            self._hits += 1
            return item[0]

    def peek(self, key: Hashable, default: Any = None) -> Any:
        """The value under ``key``, or ``default``; changes neither the LRU order nor the
        counters (for a prefetcher checking what it holds)."""
        with self._lock:
            item = self._items.get(key)
            return default if item is None else item[0]

    def discard(self, key: Hashable) -> bool:
        """Drop ``key`` if present (not counted as an eviction); returns whether it was."""
        with self._lock:
            item = self._items.pop(key, None)
            if item is None:
                return False
            self._bytes -= item[1]
            return True

    def clear(self) -> None:
        """Drop every entry; the counters are kept."""
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` is held; changes neither the LRU order nor the counters."""
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        """Entries held."""
        with self._lock:
            return len(self._items)

    def keys(self) -> list:
        """Keys held, least recently used first."""
        with self._lock:
            return list(self._items)

    @property
    def bytes(self) -> int:
        """Bytes held now (sum of entry sizes), never above ``max_bytes``."""
        with self._lock:
            return self._bytes

    def stats(self) -> RamTierStats:
        """A consistent snapshot of the counters (see :class:`RamTierStats`)."""
        with self._lock:
            return RamTierStats(self._hits, self._misses, self._puts, self._rejected,
                                self._evictions, self._bytes, self.max_bytes, len(self._items))
