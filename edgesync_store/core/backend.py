"""The storage seams: what the layers above the store need from a fragment store.

Two abstract classes, in the manner of LMCache v1's ``StorageBackendInterface``, every method
with its parameters, results and errors:

* :class:`FragmentBackend`, the request seam: what the request path (``edgesync_engines``:
  the reuse plan, injection, store-back, prefetch, documents, the commands that run requests)
  calls. Engines name only this one.
* :class:`MaintenanceBackend`, which extends it with what the compactor, the lifecycle jobs
  (expiry sweep, eviction, reclaim), the store's commands (dump, clear, inventory, reindex), the
  semantic layer's records and the migrations need: whole-store iteration, merges, deletes and
  transactions.

The local store, ``FragmentStore`` (LMDB, ``core/store.py``), and the local store with a shared
remote tier behind it, ``TieredStore`` (``remote/tiered.py``), implement both.

Conventions for every method:

* keys are store keys, 32 ``bytes`` (``schema.store_key``, ``KVFragment.key()``);
* times are Unix seconds (float); ``now=None`` means the backend's ``clock``;
* sizes are bytes; a fragment's size is its compressed blob (``codec``);
* a failure of the storage itself raises :class:`~edgesync_store.errors.StoreIOError` (a
  :class:`~edgesync_store.errors.StoreError`); no backend library's own exception crosses
  the seam. A write on a backend opened read-only raises ``PermissionError``.

Maintenance (merge, reclaim, the semantic layer's companion records) runs inside a transaction,
:meth:`MaintenanceBackend.transact`, whose ``txn`` object is opaque here: only the ``*_in``
methods and :meth:`~MaintenanceBackend.named_db` of the same backend (and backend-specific
modules) use it.
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
        path: where the store lives (a directory for the local store).
        readonly: True when opened without writing.
        clock: the time source (``() -> float`` Unix seconds).
        pins: the pin table (:class:`PinTableLike`).
    """

    path: object
    readonly: bool
    clock: Clock
    pins: PinTableLike

    # -- fragments ------------------------------------------------------------------------

    @abstractmethod
    def get(self, key: bytes, *, copy: bool = False) -> KVFragment | None:
        """The fragment stored under ``key``, decoded and verified.

        Args:
            key: the store key.
            copy: read the blob into memory and decode it after the read is over (the local
                store then releases its lock before decompressing): for background threads,
                so that requests on other threads never wait for their decode. False decodes
                straight from the backend's buffer (zero-copy where the backend allows).

        Returns:
            The fragment with its lifecycle counters (``hit_count``, ``last_hit_at``,
            ``expires_at``), or None when absent or corrupt (a corrupt one is logged, removed
            and counted in ``dropped_corrupt``).

        Raises:
            StoreIOError: the storage failed.
        """

    @abstractmethod
    def reading(self, keys: Sequence[bytes], *, defer_checks: bool = False) -> ContextManager[ChainRead]:
        """The fragments under ``keys`` for one injection, for a ``with`` block.

        Args:
            keys: store keys, in chain order.
            defer_checks: the payload checksums of fragments read in place may still be
                running (in another thread) when the block starts; call ``confirm()`` on what
                it yields before using anything computed from them.

        Returns:
            A context manager yielding a :class:`ChainRead`: ``(fragment or None, in_place)``
            per key, in order, decoded and verified as by :meth:`get`. ``in_place`` True means
            K and V are read-only views of the backend's own memory (no copy), valid only
            inside the block: copy what must outlive it; after the block a view shows whatever
            the store later writes there, and once the store is closed touching one crashes
            the process.

        Raises:
            StoreIOError: the storage failed.
        """

    @property
    @abstractmethod
    def serves_in_place(self) -> bool:
        """True when :meth:`reading` returns the fragments this backend writes in place, as
        cheaply as a RAM copy would serve them (a RAM tier then need not keep them)."""

    @abstractmethod
    def put_many(self, fragments: Sequence[KVFragment], now: float | None = None, *,
                 donor: tuple[bytes, bytes] | None = None) -> int:
        """Store ``fragments`` together (all written or none).

        A fragment whose key is stored and live is left alone; an expired twin, or one whose
        stored head is corrupt, is replaced. When the blobs would pass the size budget,
        fragments are evicted first (expired, then short-lived least recently used, then
        long-lived; never a pinned one); one that still does not fit is skipped (logged).

        Args:
            fragments: the fragments to store.
            now: the write's time (eviction's "expired").
            donor: ``(key, value)`` of the prompt's donor record (``companions.donor_value``),
                written in the same write when the fragment ``key`` is stored and has none yet.

        Returns:
            How many fragments were written.

        Raises:
            PermissionError: the backend is read-only.
            StoreIOError: the storage failed (nothing written).
        """

    @abstractmethod
    def put_donor(self, key: bytes, value: bytes) -> bool:
        """Record the donor record ``value`` (``companions.donor_value``) of the stored fragment
        ``key`` when it has none yet: a prompt whose chunks were all stored already. A read
        decides first, so a prompt served again costs no write.

        Returns:
            True when written.

        Raises:
            ValueError: ``key`` is not 32 bytes. PermissionError: read-only.
            StoreIOError: the storage failed.
        """

    @abstractmethod
    def is_live(self, key: bytes, now: float | None = None) -> bool:
        """True when a fragment is stored under ``key`` and not expired at ``now``.

        Raises:
            StoreIOError: the storage failed.
        """

    # -- the prefix index ---------------------------------------------------------------------

    @abstractmethod
    def prefix_walk(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray,
                    now: float | None = None) -> PrefixMatch:
        """The longest run of live fragments of ``namespace`` matching ``tokens`` (token IDs)
        from position 0, each span covering every layer and KV head.

        Returns:
            A ``PrefixMatch`` (spans in token order; ``matched_tokens``).

        Raises:
            StoreIOError: the storage failed.
        """

    @abstractmethod
    def covers_span(self, namespace: Namespace, prefix: bytes, token_ids: Sequence[int] | np.ndarray,
                    token_start: int, now: float | None = None) -> bool:
        """True when live fragments of exactly ``[token_start, token_start + len(token_ids))``
        after the prefix hash ``prefix`` (32 bytes), with these token IDs, together hold every
        layer and KV head of ``namespace``.

        Raises:
            StoreIOError: the storage failed.
        """

    @abstractmethod
    def keys_along(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        """Every stored fragment (live or expired) that the prompt ``tokens`` wrote or could hit.

        Raises:
            StoreIOError: the storage failed.
        """

    @abstractmethod
    def namespaces(self) -> list[Namespace]:
        """The namespaces whose chains start (at position 0) in this store, in no order.

        Raises:
            StoreIOError: the storage failed.
        """

    @abstractmethod
    def forget_tokens(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> int:
        """Delete every fragment :meth:`keys_along` finds for ``tokens``, with its records.

        Returns:
            How many fragments were removed.

        Raises:
            PermissionError: read-only. StoreIOError: the storage failed.
        """

    # -- lifecycle records -----------------------------------------------------------------

    @abstractmethod
    def lifecycle(self, key: bytes) -> Lifecycle | None:
        """The lifecycle record of a stored fragment, or None when absent.

        Raises:
            StoreIOError: the storage failed.
        """

    @abstractmethod
    def lifecycles(self, keys: Sequence[bytes]) -> list[Lifecycle | None]:
        """The records of several fragments, in order (None: absent), read at one point in
        time where the backend can (the local store: one read transaction).

        Raises:
            StoreIOError: the storage failed.
        """

    @abstractmethod
    def record_hits(self, keys: Sequence[bytes], now: float | None = None, *,
                    reused: tuple[bytes, Sequence[int]] | None = None) -> None:
        """Count one hit on each stored fragment of ``keys`` at ``now`` (``policy.on_hit``:
        hit count + 1, last hit, promotion to the long-lived lifetime).

        Args:
            keys: the fragments the hit injected (absent ones are skipped).
            now: the hit's time.
            reused: (namespace digest, the token IDs the hit injected), kept for
                :meth:`reuse_hint` in the same write.

        Raises:
            PermissionError: read-only. StoreIOError: the storage failed.
        """

    @abstractmethod
    def reuse_hint(self, namespace_digest: bytes) -> np.ndarray:
        """The token IDs (int32 ``[n]``) the latest hit in the namespace ``namespace_digest``
        injected, as :meth:`record_hits` kept them (empty: none known): a new process rehearses
        that hit before its first request.

        Raises:
            StoreIOError: the storage failed.
        """

    @abstractmethod
    def release_mapped(self) -> None:
        """Give back the memory this process maps the store's data with (a store read in place
        maps what it reads), keeping the data cached by the OS."""

    # -- size and closing -------------------------------------------------------------------

    @abstractmethod
    def stats(self):
        """Counts and sizes (``StoreStats``: fragments, compressed, raw and disk bytes, ...).

        Raises:
            StoreIOError: the storage failed.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the backend's resources and locks (idempotent)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MaintenanceBackend(FragmentBackend):
    """The maintenance seam: the request seam with what the compactor, the lifecycle jobs, the
    store's commands, the semantic layer's records and the migrations need.

    Attributes:
        policy: the lifetimes and promotion (``ttl.TTLPolicy``).
        max_bytes: the size budget, bytes of stored blobs.
        dropped_corrupt: corrupt fragments refused (and removed) since opening.
    """

    policy: TTLPolicy
    max_bytes: int
    dropped_corrupt: int

    # -- fragments ------------------------------------------------------------------------

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """True when a fragment is stored under ``key`` (expired or not).

        Raises:
            StoreIOError: the storage failed.
        """

    def put(self, fragment: KVFragment) -> bool:
        """:meth:`put_many` of one fragment; True when it was written."""
        return self.put_many([fragment]) == 1

    @abstractmethod
    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete fragments with their index entries, lifecycle records, donor records and
        vectors, together.

        Returns:
            How many of ``keys`` were stored.

        Raises:
            PermissionError: read-only. StoreIOError: the storage failed (nothing deleted).
        """

    def delete(self, key: bytes) -> bool:
        """:meth:`delete_many` of one key; False when it was not stored."""
        return self.delete_many([key]) == 1

    def forget_tokens(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> int:
        """:meth:`delete_many` of what :meth:`keys_along` finds (see
        :meth:`FragmentBackend.forget_tokens`)."""
        return self.delete_many(self.keys_along(namespace, tokens))

    # -- lifecycle records and whole-store reads ------------------------------------------

    @abstractmethod
    def set_lifecycle(self, key: bytes, life: Lifecycle) -> bool:
        """Overwrite a stored fragment's record (its sizes kept).

        Returns:
            False when the fragment is absent.

        Raises:
            PermissionError: read-only. StoreIOError: the storage failed.
        """

    @abstractmethod
    def iterate(self) -> Iterator[tuple[bytes, FragmentHeader | None, Lifecycle, int]]:
        """Every fragment as ``(key, header or None if corrupt, lifecycle, blob bytes)``, from
        one snapshot; headers only (no decompression).

        Raises:
            StoreIOError: the storage failed.
        """

    @abstractmethod
    def iterate_lifecycle(self) -> list[tuple[bytes, Lifecycle]]:
        """Every fragment's ``(key, lifecycle)`` without reading blobs, from one snapshot.

        Raises:
            StoreIOError: the storage failed.
        """

    @abstractmethod
    def delete_expired(self, keys: Sequence[bytes], now: float | None = None) -> list[tuple[bytes, int]]:
        """Delete those of ``keys`` that are still expired at ``now`` and not pinned, together
        (a hit in another process may have promoted one meanwhile).

        Returns:
            The ``(key, blob bytes)`` deleted.

        Raises:
            PermissionError: read-only. StoreIOError: the storage failed.
        """

    @abstractmethod
    def put_replacing(self, fragment: KVFragment, life: Lifecycle, remove: Sequence[bytes]) -> bool:
        """Store ``fragment`` with the record ``life`` (its sizes set here) and delete ``remove``
        (their donor records and vectors moved to it), together: a merge happens whole or not
        at all. When the new key is stored already, only the removals happen.

        Returns:
            False, writing nothing, when one of ``remove`` is gone meanwhile.

        Raises:
            PermissionError: read-only. StoreIOError: the storage failed.
        """

    @abstractmethod
    def absorb(self, keep: bytes, remove: Sequence[bytes], life: Lifecycle) -> bool:
        """Give ``keep`` the record ``life`` (sizes kept) and delete ``remove`` (their donor
        records and vectors moved to ``keep``), together: a dedup.

        Returns:
            False, writing nothing, when any of them is gone meanwhile.

        Raises:
            PermissionError: read-only. StoreIOError: the storage failed.
        """

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes of the stored blobs: what the size budget bounds.

        Raises:
            StoreIOError: the storage failed.
        """

    @abstractmethod
    def recount_used(self) -> int:
        """Recompute :meth:`used_bytes` from the blobs and record it.

        Returns:
            The recomputed bytes.

        Raises:
            PermissionError: read-only. StoreIOError: the storage failed.
        """

    # -- maintenance transactions -------------------------------------------------------

    @abstractmethod
    def transact(self, fn: Callable[[object], T], write: bool = False) -> T:
        """Run ``fn(txn)`` in one transaction of the backend: committed when ``fn`` returns,
        rolled back when it raises; ``fn`` may run more than once (retries), so it must not
        have effects outside ``txn``.

        Returns:
            What ``fn`` returned.

        Raises:
            PermissionError: ``write`` on a read-only backend.
            StoreIOError: the storage failed.
            Whatever ``fn`` raises.
        """

    @abstractmethod
    def named_db(self, name: bytes, create: bool = False, dupsort: bool = False, txn=None):
        """The handle of the backend's database ``name`` (companion records: donors, vectors,
        documents, the index's metadata), for use inside :meth:`transact`.

        Args:
            name: the database's name.
            create: create it when missing (ignored read-only).
            dupsort: several values per key (only when creating).
            txn: the transaction the caller is inside, if any (opening without one starts a
                write transaction of its own).

        Returns:
            The handle, or None when the database does not exist and is not created. Handles
            may be invalidated by maintenance (ask again rather than keep one).

        Raises:
            StoreIOError: the storage failed.
        """

    @abstractmethod
    def contains_in(self, txn, key: bytes) -> bool:
        """:meth:`contains` inside ``txn``."""

    @abstractmethod
    def delete_in(self, txn, key: bytes) -> int:
        """Delete one fragment (index entry, lifecycle, donor record, vector) inside the write
        transaction ``txn``.

        Returns:
            Its blob bytes (0: it was not stored).
        """

    @abstractmethod
    def used_in(self, txn) -> int:
        """:meth:`used_bytes` inside ``txn``."""

    @abstractmethod
    def lifecycle_rows_in(self, txn) -> list[tuple[bytes, Lifecycle]]:
        """:meth:`iterate_lifecycle` inside ``txn``."""

    # -- closing ------------------------------------------------------------------------------

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True after :meth:`close`."""
