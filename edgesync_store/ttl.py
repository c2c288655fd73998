"""Fragment lifetimes: short, long and document; hits, promotion, the clock, the expiry sweep.

A **short** fragment lives ``ttl_seconds``; the hit bringing ``hit_count`` to ``promote_hits``
moves it to **long** (``now + long_ttl_seconds``, renewed by each later hit); **document**
fragments never expire and leave with their document. An expired fragment (``expires_at <= now``)
is never served and :func:`sweep` deletes it. Times are Unix seconds (float), clock injectable.

The record in the ``lifecycle`` database (little-endian ``<IdddBQQ``, 45 bytes, store format 2)::

    hit_count u32 | last_hit_at f64 | expires_at f64 | created_at f64 | lifetime u8
    (0 short, 1 long, 2 document) | nbytes u64 (stored blob) | raw_nbytes u64 (K + V uncompressed)
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Callable

from edgesync_store.schema import DEFAULT_TTL_SECONDS

__all__ = ["Clock", "DEFAULT_TTL_SECONDS", "LIFECYCLE_V1", "LIFECYCLE_V2", "LIFETIME_DOCUMENT", "LIFETIME_LONG",
           "LIFETIME_SHORT", "LONG_TTL_SECONDS", "Lifecycle", "ManualClock", "PROMOTE_HITS", "TTLPolicy",
           "merged_counters", "sweep"]

LIFETIME_SHORT = "short"
"""The lifetime of a new fragment (``ttl_seconds``); the value is what JSON reports show."""
LIFETIME_LONG = "long"
"""The lifetime of a promoted fragment (``long_ttl_seconds`` after each hit)."""
LIFETIME_DOCUMENT = "document"
"""The lifetime of a document's fragments: never expired, evicted last."""
PROMOTE_HITS = 5
"""Hits that move a fragment to the long lifetime."""
LONG_TTL_SECONDS = 7 * 24 * 3600
"""Seconds the long lifetime lasts after promotion and after each later hit: 7 days."""

Clock = Callable[[], float]
"""A function returning the current time in Unix seconds (``time.time`` by default)."""

LIFECYCLE_V1 = struct.Struct("<Idd")
LIFECYCLE_V2 = struct.Struct("<IdddBQQ")
_LIFETIME_CODES = {LIFETIME_SHORT: 0, LIFETIME_LONG: 1, LIFETIME_DOCUMENT: 2}
_LIFETIME_NAMES = {code: name for name, code in _LIFETIME_CODES.items()}


class ManualClock:
    """A clock for tests and simulations: starts at ``start`` (Unix seconds) and moves only
    when told (:meth:`advance`, :meth:`set`). Thread-safe; call it like ``time.time``."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._now = float(start)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move the clock forward by ``seconds``; return the new time."""
        if seconds < 0:
            raise ValueError(f"seconds: a clock does not go back, got {seconds}")
        with self._lock:
            self._now += float(seconds)
            return self._now

    def set(self, now: float) -> None:
        """Set the time (Unix seconds)."""
        with self._lock:
            self._now = float(now)


@dataclass
class Lifecycle:
    """Per-fragment counters kept apart from the tensors (times in Unix seconds).

    Attributes:
        hit_count: requests that injected the fragment.
        last_hit_at, created_at: last hit, creation (0.0: never hit; unknown, format-1 record).
        expires_at: after it the fragment is never served.
        lifetime: ``"short"``, ``"long"`` or ``"document"``.
        nbytes, raw_nbytes: bytes of the stored blob (what the budget counts), of K + V uncompressed.
    """

    hit_count: int = 0
    last_hit_at: float = 0.0
    expires_at: float = 0.0
    created_at: float = 0.0
    lifetime: str = LIFETIME_SHORT
    nbytes: int = 0
    raw_nbytes: int = 0

    def pack(self) -> bytes:
        """The 45-byte format-2 record (module docstring)."""
        return LIFECYCLE_V2.pack(self.hit_count, self.last_hit_at, self.expires_at, self.created_at,
                                 _LIFETIME_CODES[self.lifetime], self.nbytes, self.raw_nbytes)

    @classmethod
    def unpack(cls, data: bytes | memoryview | None) -> "Lifecycle":
        """Read a format-2 or format-1 record; a missing or malformed one reads as a fresh,
        already expired record (``expires_at`` 0.0), so it is never served."""
        if data is None:
            return cls()
        if len(data) == LIFECYCLE_V2.size:
            hits, last, expires, created, lifetime, nbytes, raw = LIFECYCLE_V2.unpack(bytes(data))
            return cls(hits, last, expires, created, _LIFETIME_NAMES.get(lifetime, LIFETIME_SHORT), nbytes, raw)
        if len(data) == LIFECYCLE_V1.size:
            return cls(*LIFECYCLE_V1.unpack(bytes(data)))
        return cls()

    @property
    def last_used_at(self) -> float:
        """The later of the last hit and creation: the recency least-recently-used eviction orders by (Unix seconds)."""
        return max(self.last_hit_at, self.created_at)

    def expired(self, now: float) -> bool:
        """True when the fragment may no longer be served at ``now``."""
        return self.expires_at <= now


@dataclass(frozen=True)
class TTLPolicy:
    """Lengths of the short and long lifetimes (seconds) and the promotion threshold (hits).
    Raises ValueError for a lifetime not positive and finite, or ``promote_hits`` < 1."""

    ttl_seconds: float = float(DEFAULT_TTL_SECONDS)
    promote_hits: int = PROMOTE_HITS
    long_ttl_seconds: float = float(LONG_TTL_SECONDS)

    def __post_init__(self) -> None:
        for name in ("ttl_seconds", "long_ttl_seconds"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name}: must be a positive number of seconds, got {value!r}")
        if not isinstance(self.promote_hits, int) or self.promote_hits < 1:
            raise ValueError(f"promote_hits: must be an integer >= 1, got {self.promote_hits!r}")

    def on_hit(self, life: Lifecycle, now: float) -> Lifecycle:
        """Count one hit at ``now`` (in place; also returned): promote at ``promote_hits``,
        and extend a long-lived fragment's expiry to ``now + long_ttl_seconds``."""
        life.hit_count += 1
        life.last_hit_at = now
        if life.lifetime == LIFETIME_DOCUMENT:
            return life
        if life.lifetime == LIFETIME_LONG or life.hit_count >= self.promote_hits:
            life.lifetime = LIFETIME_LONG
            life.expires_at = max(life.expires_at, now + self.long_ttl_seconds)
        return life

    def merged(self, parts: list[Lifecycle], nbytes: int, raw_nbytes: int, sum_hits: bool) -> Lifecycle:
        """The record of a fragment that replaces ``parts`` (:func:`merged_counters`), in the
        long lifetime when any part was long-lived or the hits reach ``promote_hits``."""
        hits, last_hit, expires, created = merged_counters(parts, sum_hits)
        if any(p.lifetime == LIFETIME_DOCUMENT for p in parts):
            return Lifecycle(hit_count=hits, last_hit_at=last_hit, expires_at=float("inf"), created_at=created,
                             lifetime=LIFETIME_DOCUMENT, nbytes=nbytes, raw_nbytes=raw_nbytes)
        was_long = any(p.lifetime == LIFETIME_LONG for p in parts)
        lifetime = LIFETIME_LONG if hits >= self.promote_hits or was_long else LIFETIME_SHORT
        if lifetime == LIFETIME_LONG and not was_long:
            expires = max(expires, last_hit + self.long_ttl_seconds)  # promoted by the summed hits
        return Lifecycle(hit_count=hits, last_hit_at=last_hit, expires_at=expires, created_at=created,
                         lifetime=lifetime, nbytes=nbytes, raw_nbytes=raw_nbytes)


def merged_counters(parts, sum_hits: bool) -> tuple[int, float, float, float]:
    """``(hit_count, last_hit_at, expires_at, created_at)`` of a fragment replacing ``parts``
    (anything with those attributes): latest hit and expiry, earliest known creation, hits summed
    (``sum_hits``: a dedup) or their maximum (a merge of layer or head groups)."""
    hits = sum(p.hit_count for p in parts) if sum_hits else max(p.hit_count for p in parts)
    created = [p.created_at for p in parts if p.created_at]
    return (hits, max(p.last_hit_at for p in parts), max(p.expires_at for p in parts),
            min(created) if created else 0.0)


def sweep(store, now: float | None = None, index=None, dry_run: bool = False,
          batch: int = 512) -> list[tuple[bytes, int]]:
    """Delete every expired fragment (``expires_at <= now``; default: the store's clock) with its
    index entry, donor record and vector, ``batch`` per write transaction, skipping any promoted or
    pinned meanwhile; then update ``index`` (an open ``SemanticIndex``) when given. Returns the
    ``(key, blob bytes)`` deleted (``dry_run``: that would be, nothing deleted)."""
    now = store.clock() if now is None else now
    expired = [(key, life.nbytes) for key, life in store.iterate_lifecycle() if life.expired(now)]
    if dry_run:
        return expired
    keys = [key for key, _ in expired]
    gone: list[tuple[bytes, int]] = []
    for i in range(0, len(keys), batch):
        gone.extend(store.delete_expired(keys[i : i + batch], now))
    if index is not None and gone:
        index.sync()
        index.save()
    return gone
