"""The read-through RAM tier: decoded fragments kept for repeats within a process, never served
once the store no longer holds them live.

An entry's version is the ``created_at`` of its lifecycle record: a deleted fragment has none
and a rewritten one a new one, so neither is served from RAM.

A chain larger than the budget bypasses the tier: its fragments are neither staged nor kept.
It could never be served whole from RAM, and keeping its tail would evict everything else for
the few fragments a repeat reads last (least recently used order cycles through it), at the
cost of a staging copy each. So the tier holds at most ``max_bytes`` beside the engine's KV
cache, whatever the context's size (docs/configuration.md).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable, Sequence

from edgesync_engines.request.ramtier import RamTier

if TYPE_CHECKING:
    from edgesync_store.core.backend import FragmentBackend
    from edgesync_store.schema import KVFragment
    from edgesync_store.ttl import Lifecycle

log = logging.getLogger(__name__)


class FragmentCache:
    """A read-through RAM tier of decoded fragments of ``store``, thread-safe. ``max_bytes`` >= 1
    (else ValueError): the budget, bytes of decoded K + V; ``stage``: makes the copy kept (the
    engine's ``stage_fragment``; None keeps it as decoded)."""

    def __init__(self, store: "FragmentBackend", max_bytes: int,
                 stage: "Callable[[KVFragment], KVFragment] | None" = None) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be an int >= 1, got {max_bytes!r}")
        self.store = store
        self.stage = stage
        self.ram = RamTier(max_bytes)
        self._lock = threading.Lock()
        self._stale = self._bypassed = 0
        self._chain = threading.local()  # .bypass: keys of this thread's latest chain too large for the tier

    @property
    def stale(self) -> int:
        """Entries refused since the start because the store no longer held them live."""
        with self._lock:
            return self._stale

    @property
    def bypassed(self) -> int:
        """Fragments not kept since the start because their chain (or store-back) was larger
        than the budget."""
        with self._lock:
            return self._bypassed

    def records(self, keys: Sequence[bytes]) -> dict[bytes, "Lifecycle | None"]:
        """The store's lifecycle record of each key (None: not stored), read in one transaction.
        ``keys`` are one chain, read next on this thread: when its stored fragments' decoded
        bytes (the records' ``raw_nbytes``) exceed the budget, this thread's :meth:`put` of
        them keeps none, until its next call. Raises StoreError when the store fails."""
        found = dict(zip(keys, self.store.lifecycles(keys)))
        chain_bytes = sum(life.raw_nbytes for life in found.values() if life is not None)
        self._chain.bypass = frozenset(found) if chain_bytes > self.ram.max_bytes else frozenset()
        if chain_bytes > self.ram.max_bytes:
            log.debug("RAM tier: a chain of %d B exceeds the %d B budget; not kept", chain_bytes, self.ram.max_bytes)
        return found

    def cached(self, key: bytes, life: "Lifecycle | None", now: float) -> "KVFragment | None":
        """The entry under ``key`` when ``life`` (the store's record, None: not stored) says the
        store holds that version live at ``now`` (Unix seconds), with its hit count, last hit
        and expiry refreshed from ``life``; else None, dropping a stale entry. Counts a RAM
        tier hit or miss."""
        entry = self.ram.peek(key)
        if entry is not None:
            if life is not None and life.created_at == entry.created_at and life.expires_at > now:
                entry.hit_count, entry.last_hit_at, entry.expires_at = life.hit_count, life.last_hit_at, life.expires_at
                self.ram.get(key)  # counts the hit, most recently used
                return entry
            self.ram.discard(key)
            with self._lock:
                self._stale += 1
            log.debug("RAM tier: %s is no longer live in the store; not served", key.hex()[:16])
        self.ram.get(key)  # counts the miss
        return None

    def put(self, key: bytes, frag: "KVFragment", life: "Lifecycle") -> "KVFragment":
        """Keep ``frag`` (decoded from the store under ``key``), staged, as the version of
        record ``life``, unless it alone exceeds the budget or its chain does (:meth:`records`):
        then it is returned as given, nothing evicted. Returns the fragment to use."""
        if key in getattr(self._chain, "bypass", ()):
            with self._lock:
                self._bypassed += 1
            return frag
        return self._keep(key, frag, life)

    def _keep(self, key: bytes, frag: "KVFragment", life: "Lifecycle") -> "KVFragment":
        if self.stage is not None and frag.raw_nbytes <= self.ram.max_bytes:
            frag = self.stage(frag)
        frag.created_at = life.created_at  # the version the next reads compare with
        self.ram.put(key, frag)
        return frag

    def keep_stored(self, fragments: "Sequence[KVFragment]") -> int:
        """Keep fragments the store-back just wrote, as the version the store holds, and return
        how many were kept: none when together they exceed the budget (see the module
        docstring); one the store did not write is skipped. StoreError: the store failed."""
        total = sum(f.raw_nbytes for f in fragments)
        if total > self.ram.max_bytes:
            with self._lock:
                self._bypassed += len(fragments)
            log.debug("RAM tier: %d stored fragments of %d B exceed the %d B budget; not kept", len(fragments),
                      total, self.ram.max_bytes)
            return 0
        keys = [f.key() for f in fragments]
        kept = 0
        for key, frag, life in zip(keys, fragments, self.store.lifecycles(keys)):
            if life is not None and life.created_at == frag.created_at:
                self._keep(key, frag, life)
                kept += 1
        return kept

    def clear(self) -> None:
        """Drop every entry (the counters are kept)."""
        self.ram.clear()
