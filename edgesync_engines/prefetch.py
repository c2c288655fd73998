"""Next-request prediction and the RAM tier that prefetched fragments are decoded into.

:class:`NgramPredictor` watches the sequence of requests, each identified by a caller-chosen
hashable key that is stable across processes (a hex prefix hash, a ``prompt_key`` string; never
Python's ``hash()`` of a string, which changes per process), and proposes the ``top_k`` keys
most likely to come next: first those that followed the current context of the last ``n - 1``
keys, then (backing off) those that followed shorter contexts, then the most frequent keys
overall. Ties are broken by recency (the most recently seen continuation first), so the result
is deterministic and never depends on the keys' own ordering. It keeps top-1 and top-k hit
rates of the predictions it would have made before each observed key.

:class:`RamTier` is a bounded LRU of decoded fragments (key -> object of a known size in bytes)
that a prefetch thread fills while the request thread reads; all methods are thread-safe.

Neither is wired into the router here; both are pure Python and hold no model or store.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Hashable, Iterable

log = logging.getLogger("edgesync.prefetch")


@dataclass(frozen=True)
class PredictionAccuracy:
    """Hit counts of the predictions made before each observed key.

    ``observed``: keys observed; ``predicted``: of those, how many had a non-empty prediction
    (every observation but the first); ``top1_hits``: the next key was the first proposal;
    ``topk_hits``: it was among the ``top_k`` proposals. Rates are over ``predicted``.
    """

    observed: int
    predicted: int
    top1_hits: int
    topk_hits: int
    top_k: int

    @property
    def top1(self) -> float | None:
        """top1_hits / predicted, in [0, 1]; None before any prediction."""
        return self.top1_hits / self.predicted if self.predicted else None

    @property
    def topk(self) -> float | None:
        """topk_hits / predicted, in [0, 1]; None before any prediction."""
        return self.topk_hits / self.predicted if self.predicted else None


class NgramPredictor:
    """An n-gram model of the request sequence with backoff to shorter contexts and unigrams.

    ``NgramPredictor(n=3, top_k=3)``: ``n`` >= 1 is the n-gram order (contexts of up to
    ``n - 1`` previous keys; ``n=1`` is unigram frequency alone), ``top_k`` >= 1 the number of
    proposals. Raises ValueError for smaller values. Memory grows with the distinct
    (context, next key) pairs seen: at most ``n`` entries per observation. Thread-safe.
    """

    def __init__(self, n: int = 3, top_k: int = 3) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
        self.n = n
        self.top_k = top_k
        self._lock = threading.Lock()
        # context (tuple of 1..n-1 keys) -> next key -> [count, index of its last occurrence]
        self._next: dict[tuple, dict[Hashable, list[int]]] = {}
        self._unigram: dict[Hashable, list[int]] = {}
        self._history: deque = deque(maxlen=max(n - 1, 1))
        self._t = 0
        self._predicted = self._top1 = self._topk = 0

    def _predict_locked(self) -> list:
        out: list = []
        chosen: set = set()
        hist = tuple(self._history) if self.n > 1 else ()
        tables = [self._next.get(hist[len(hist) - m:]) for m in range(len(hist), 0, -1)]
        tables.append(self._unigram)
        for table in tables:
            if not table:
                continue
            need = self.top_k - len(out)
            ranked = heapq.nlargest(need + len(chosen), table.items(),
                                    key=lambda kv: (kv[1][0], kv[1][1]))
            for key, _ in ranked:
                if key not in chosen:
                    out.append(key)
                    chosen.add(key)
                    if len(out) == self.top_k:
                        return out
        return out

    def predict(self) -> list:
        """The up to ``top_k`` keys most likely to come next, most likely first.

        Empty before the first observation; only keys already observed are ever proposed.
        """
        with self._lock:
            return self._predict_locked()

    def observe(self, key: Hashable) -> list:
        """Record that ``key`` was requested; returns the prediction that was made for it (the
        list ``predict()`` gave just before), after scoring it. Raises TypeError if ``key`` is
        not hashable."""
        hash(key)
        with self._lock:
            proposal = self._predict_locked()
            if proposal:
                self._predicted += 1
                self._top1 += proposal[0] == key
                self._topk += key in proposal
            t = self._t
            self._t += 1
            hist = tuple(self._history) if self.n > 1 else ()
            for m in range(1, len(hist) + 1):
                entry = self._next.setdefault(hist[len(hist) - m:], {}).setdefault(key, [0, 0])
                entry[0] += 1
                entry[1] = t
            entry = self._unigram.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] = t
            if self.n > 1:
                self._history.append(key)
            return proposal

    def observe_all(self, keys: Iterable[Hashable]) -> None:
        """``observe`` each key in order."""
        for key in keys:
            self.observe(key)

    @property
    def accuracy(self) -> PredictionAccuracy:
        """A snapshot of the hit counts so far (see :class:`PredictionAccuracy`)."""
        with self._lock:
            return PredictionAccuracy(self._t, self._predicted, self._top1, self._topk, self.top_k)

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` has been observed."""
        with self._lock:
            return key in self._unigram

    def __len__(self) -> int:
        """Distinct keys observed."""
        with self._lock:
            return len(self._unigram)


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
