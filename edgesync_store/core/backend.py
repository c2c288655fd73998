"""The storage seams: what the layers above the store need from a fragment store.

* :class:`FragmentBackend`, the request seam: everything the request path calls (plan,
  injection, store-back, hits). ``tests/dict_backend.py`` implements it alone, in dicts.
* :class:`MaintenanceBackend` adds what the compactor, the lifecycle jobs, the store's commands,
  the semantic layer's records and the migrations need: whole-store reads, merges, deletes and
  transactions (``transact``, whose ``txn`` only this backend's ``*_in`` methods and
  ``named_db`` use).

``FragmentStore`` (LMDB, ``core/store.py``) and ``TieredStore`` (``remote/tiered.py``) implement
both. Conventions: keys are 32-byte store keys (``schema.store_key``); times are Unix seconds
(``now=None``: the backend's ``clock``); sizes are bytes of compressed blobs (``codec``). A
failure of the storage raises :class:`~edgesync_store.errors.StoreIOError` (no backend library's
exception crosses the seam); a write on a read-only backend raises ``PermissionError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, ContextManager, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from edgesync_store.core.chain_read import ChainRead
from edgesync_store.core.codec import FragmentHeader
from edgesync_store.core.walk import PrefixMatch
from edgesync_store.schema import KVFragment, Namespace
from edgesync_store.ttl import Clock, Lifecycle, TTLPolicy

T = TypeVar("T")

__all__ = ["ChainRead", "FragmentBackend", "MaintenanceBackend", "PinTableLike"]


class PinTableLike(ABC):
    """Fragments a request is injecting: eviction in any process skips them."""

    @abstractmethod
    def pinned(self, keys: Iterable[bytes]) -> ContextManager[None]:
        """Pin ``keys`` for the duration of the ``with`` block (re-entrant per key)."""

    @abstractmethod
    def is_pinned(self, key: bytes) -> bool:
        """True when some request, in any process, has ``key`` pinned."""


class FragmentBackend(ABC):
    """The request seam: KV fragments behind a prefix index, with lifecycle records and pins.

    Attributes:
        path: where the store lives. readonly: opened without writing.
        clock: ``() -> float`` Unix seconds. pins: the :class:`PinTableLike`.
    """

    path: object
    readonly: bool
    clock: Clock
    pins: PinTableLike

    # -- fragments ------------------------------------------------------------------------

    @abstractmethod
    def get(self, key: bytes, *, copy: bool = False) -> KVFragment | None:
        """The fragment under ``key``, decoded and verified, with its lifecycle counters
        (``hit_count``, ``last_hit_at``, ``expires_at``); None when absent or corrupt (a corrupt
        one is logged, removed and counted in ``dropped_corrupt``). ``copy``: decode after the
        read is over (for background threads: requests never wait for their decode)."""

    @abstractmethod
    def reading(self, keys: Sequence[bytes], *, defer_checks: bool = False) -> ContextManager[ChainRead]:
        """For a ``with`` block: a :class:`ChainRead` of ``(fragment or None, in_place)`` per key,
        in order, verified as by :meth:`get`. ``in_place`` True: K and V are read-only views of
        the backend's memory, valid inside the block only. ``defer_checks``: payload checksums
        may still run when the block starts; call ``confirm()`` before using what was computed
        from them."""

    @property
    @abstractmethod
    def serves_in_place(self) -> bool:
        """True when :meth:`reading` serves the fragments in place as cheaply as a RAM copy."""

    @abstractmethod
    def put_many(self, fragments: Sequence[KVFragment], now: float | None = None, *,
                 donor: tuple[bytes, bytes] | None = None) -> int:
        """Store ``fragments`` together (all or none); return how many were written.

        A stored live twin is left alone; an expired one, or one whose stored head is corrupt,
        is replaced. Past the size budget, fragments are evicted first (``core/eviction.py``;
        never a pinned one); a batch that still does not fit raises ``StoreBudgetError`` with nothing
        written or evicted.

        Args:
            donor: ``(key, value)`` of the prompt's donor record (``core/donor_record.py``),
                written in the same write when the fragment ``key`` is stored and has none yet.
        """

    @abstractmethod
    def put_donor(self, key: bytes, value: bytes) -> bool:
        """Write the donor record ``value`` of the stored fragment ``key`` if it has none (a
        read decides first: a prompt served again costs no write); True when written.

        Raises:
            ValueError: ``key`` is not 32 bytes.
        """

    @abstractmethod
    def is_live(self, key: bytes, now: float | None = None) -> bool:
        """True when a fragment is stored under ``key`` and not expired at ``now``."""

    # -- the prefix index ---------------------------------------------------------------------

    @abstractmethod
    def prefix_walk(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray,
                    now: float | None = None) -> PrefixMatch:
        """The longest run of live fragments of ``namespace`` matching the token IDs ``tokens``
        from position 0, each span covering every layer and KV head."""

    @abstractmethod
    def covers_span(self, namespace: Namespace, prefix: bytes, token_ids: Sequence[int] | np.ndarray,
                    token_start: int, now: float | None = None) -> bool:
        """True when live fragments of exactly ``[token_start, token_start + len(token_ids))``
        after the prefix hash ``prefix``, with these token IDs, hold every layer and KV head."""

    @abstractmethod
    def keys_along(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        """Every stored fragment (live or expired) that the prompt ``tokens`` wrote or could hit."""

    @abstractmethod
    def namespaces(self) -> list[Namespace]:
        """The namespaces whose chains start (at position 0) in this store, in no order."""

    @abstractmethod
    def forget_tokens(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> int:
        """Delete what :meth:`keys_along` finds, with its records; return how many."""

    # -- lifecycle records -----------------------------------------------------------------

    @abstractmethod
    def lifecycle(self, key: bytes) -> Lifecycle | None:
        """The lifecycle record of a stored fragment, or None when absent."""

    @abstractmethod
    def lifecycles(self, keys: Sequence[bytes]) -> list[Lifecycle | None]:
        """The records of ``keys`` in order (None: absent), read at one point in time."""

    @abstractmethod
    def record_hits(self, keys: Sequence[bytes], now: float | None = None, *,
                    reused: tuple[bytes, Sequence[int]] | None = None) -> None:
        """Count a hit on each stored fragment of ``keys`` (``policy.on_hit``) and keep
        ``reused`` (namespace digest, the token IDs injected) for :meth:`reuse_hint`."""

    @abstractmethod
    def reuse_hint(self, namespace_digest: bytes) -> np.ndarray:
        """The token IDs (int32 ``[n]``, empty: none) the latest hit in the namespace
        injected: a new process rehearses that hit before its first request."""

    @abstractmethod
    def release_mapped(self) -> None:
        """Give back the memory this process maps the store's data with (kept in the OS cache)."""

    # -- size and closing -------------------------------------------------------------------

    @abstractmethod
    def stats(self):
        """Counts and sizes (``StoreStats``: fragments, compressed, raw and disk bytes, ...)."""

    @abstractmethod
    def close(self) -> None:
        """Release the backend's resources and locks (idempotent)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MaintenanceBackend(FragmentBackend):
    """The request seam and what maintenance needs (module docstring).

    Attributes:
        policy: lifetimes and promotion (``ttl.TTLPolicy``). max_bytes: the size budget.
        dropped_corrupt: corrupt fragments refused (and removed) since opening.
    """

    policy: TTLPolicy
    max_bytes: int
    dropped_corrupt: int

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """True when a fragment is stored under ``key`` (expired or not)."""

    def put(self, fragment: KVFragment) -> bool:
        """:meth:`put_many` of one fragment; True when it was written."""
        return self.put_many([fragment]) == 1

    @abstractmethod
    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete fragments with their index entries, lifecycle and donor records and vectors,
        together; return how many of ``keys`` were stored."""

    def delete(self, key: bytes) -> bool:
        """:meth:`delete_many` of one key; False when it was not stored."""
        return self.delete_many([key]) == 1

    def forget_tokens(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> int:
        return self.delete_many(self.keys_along(namespace, tokens))

    @abstractmethod
    def set_lifecycle(self, key: bytes, life: Lifecycle) -> bool:
        """Overwrite a stored fragment's record (its sizes kept); False when absent."""

    @abstractmethod
    def iterate(self) -> Iterator[tuple[bytes, FragmentHeader | None, Lifecycle, int]]:
        """Every fragment as ``(key, header or None if corrupt, lifecycle, blob bytes)``, from
        one snapshot, headers only."""

    @abstractmethod
    def iterate_lifecycle(self) -> list[tuple[bytes, Lifecycle]]:
        """Every fragment's ``(key, lifecycle)`` from one snapshot, no blob read."""

    @abstractmethod
    def delete_expired(self, keys: Sequence[bytes], now: float | None = None) -> list[tuple[bytes, int]]:
        """Delete those of ``keys`` still expired at ``now`` and not pinned, together; return
        the ``(key, blob bytes)`` deleted."""

    @abstractmethod
    def put_replacing(self, fragment: KVFragment, life: Lifecycle, remove: Sequence[bytes]) -> bool:
        """A merge, whole or not at all: store ``fragment`` with ``life`` (sizes set here) and
        delete ``remove`` (their donor records and vectors moved to it). False, writing
        nothing, when one of ``remove`` is gone."""

    @abstractmethod
    def absorb(self, keep: bytes, remove: Sequence[bytes], life: Lifecycle) -> bool:
        """A dedup: give ``keep`` the record ``life`` (sizes kept) and delete ``remove`` (their
        records moved to ``keep``), together. False, writing nothing, when one is gone."""

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes of the stored blobs: what the size budget bounds."""

    @abstractmethod
    def recount_used(self) -> int:
        """Recompute :meth:`used_bytes` from the blobs, record and return it."""

    # -- maintenance transactions -------------------------------------------------------

    @abstractmethod
    def transact(self, fn: Callable[[object], T], write: bool = False) -> T:
        """``fn(txn)`` in one transaction, committed when it returns, rolled back when it
        raises; ``fn`` may run more than once (retries), so it must have no other effects.
        Returns what ``fn`` returned; raises what it raises."""

    @abstractmethod
    def named_db(self, name: bytes, create: bool = False, dupsort: bool = False, txn=None):
        """The handle of the database ``name`` (donors, vectors, documents, ...), None when it
        does not exist and is not created; pass ``txn`` when inside :meth:`transact`. Ask again
        rather than keep a handle (maintenance may invalidate it)."""

    @abstractmethod
    def contains_in(self, txn, key: bytes) -> bool:
        """:meth:`contains` inside ``txn``."""

    @abstractmethod
    def delete_in(self, txn, key: bytes) -> int:
        """Delete one fragment with its records inside the write transaction ``txn``; return its
        blob bytes (0: not stored)."""

    @abstractmethod
    def used_in(self, txn) -> int:
        """:meth:`used_bytes` inside ``txn``."""

    @abstractmethod
    def lifecycle_rows_in(self, txn) -> list[tuple[bytes, Lifecycle]]:
        """:meth:`iterate_lifecycle` inside ``txn``."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True after :meth:`close`."""
