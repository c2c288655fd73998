"""The storage seam: what the layers above the store need from a fragment store.

:class:`FragmentBackend` is one abstract class, in the manner of LMCache v1's
``StorageBackendInterface``: every method with its parameters, results and errors. The local
store, ``FragmentStore`` (LMDB, ``core/store.py``), implements it; a shared remote tier
implements the same methods. The request path, the lifecycle jobs and the commands use only
these methods (and ``ttl``/``schema`` types), so they work over either.

Conventions for every method:

* keys are store keys, 32 ``bytes`` (``schema.store_key``, ``KVFragment.key()``);
* times are Unix seconds (float); ``now=None`` means the backend's :attr:`clock`;
* sizes are bytes; a fragment's size is its compressed blob (``codec``);
* a failure of the storage itself raises :class:`~edgesync_store.errors.StoreIOError` (a
  :class:`~edgesync_store.errors.StoreError`); no backend library's own exception crosses
  the seam. A write on a backend opened read-only raises ``PermissionError``.

Maintenance (merge, reclaim, the semantic layer's companion records) runs inside a
transaction, :meth:`transact`, whose ``txn`` object is opaque here: only the ``*_in`` methods
of the same backend (and backend-specific modules) use it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Callable, ContextManager, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from edgesync_store.core.chain_read import ChainRead
from edgesync_store.core.codec import FragmentHeader
from edgesync_store.core.walk import PrefixMatch
from edgesync_store.schema import KVFragment, Namespace
from edgesync_store.ttl import Clock, Lifecycle, TTLPolicy

T = TypeVar("T")

__all__ = ["ChainRead", "FragmentBackend", "PinTableLike"]


class PinTableLike(ABC):
    """Fragments a request is injecting: eviction in any process skips them."""

    @abstractmethod
    def pinned(self, keys: Iterable[bytes]) -> ContextManager[None]:
        """Pin ``keys`` for the duration of the ``with`` block (re-entrant per key)."""

    @abstractmethod
    def is_pinned(self, key: bytes) -> bool:
        """True when some request, in any process, has ``key`` pinned."""


class FragmentBackend(ABC):
    """A store of KV fragments with a prefix index, lifecycle records, pins and a size budget.

    Attributes:
        path: where the store lives (a directory for the local store).
        readonly: True when opened without writing.
        clock: the time source (``() -> float`` Unix seconds).
        policy: the lifetime tiers and promotion (``ttl.TTLPolicy``).
        max_bytes: the size budget, bytes of stored blobs.
        max_raw_bytes: the decompressed-size cap applied when decoding.
        format_version: the store format version on disk.
        dropped_corrupt: corrupt fragments refused (and removed) since opening.
        pins: the pin table (:class:`PinTableLike`).
    """

    path: object
    readonly: bool
    clock: Clock
    policy: TTLPolicy
    max_bytes: int
    max_raw_bytes: int
    format_version: int
    dropped_corrupt: int
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
    def get_blob(self, key: bytes) -> bytes | None:
        """The raw blob under ``key`` (``codec`` layout, a copy), or None when absent.

        Raises:
            StoreIOError: the storage failed.
        """

    @contextmanager
    def reading(self, keys: Sequence[bytes], *, defer_checks: bool = False) -> Iterator["ChainRead"]:
        """The fragments under ``keys`` for one injection, decoded and verified as by
        :meth:`get`, for the ``with`` block: a :class:`ChainRead` of ``(fragment or None,
        in_place)`` per key, in order. ``in_place`` True means K and V are read-only views of
        the backend's own memory (no copy; valid only inside the block: copy what must outlive
        it; after the block a view shows whatever the store later writes there, and once the
        store is closed, touching one crashes the process). With ``defer_checks`` the payload
        checksums of fragments read in place may still be running (in another thread) when the
        block starts: call ``confirm()`` before using anything computed from them. This default
        reads each with :meth:`get` (arrays of their own, ``in_place`` False, nothing deferred).

        Raises:
            StoreIOError: the storage failed.
        """
        yield ChainRead((self.get(bytes(key)), False) for key in keys)

    @property
    def serves_in_place(self) -> bool:
        """True when :meth:`reading` returns the fragments this backend writes in place, as
        cheaply as a RAM copy would serve them (a RAM tier then need not keep them)."""
        return False

    @abstractmethod
    def put_many(self, fragments: Sequence[KVFragment], now: float | None = None, *,
                 also: Callable[[object], object] | None = None) -> int:
        """Store ``fragments`` together (all written or none).

        A fragment whose key is stored and live is left alone; an expired twin, or one whose
        stored head is corrupt, is replaced.
        When the blobs would pass ``max_bytes``, fragments are evicted first (expired, then
        short-lived least recently used, then long-lived; never a pinned one); one that still
        does not fit is skipped (logged). ``also(txn)``, when given, runs in the same write
        transaction after the fragments are written (a companion record keyed by one of them,
        e.g. the prompt's donor record); what it raises aborts the whole write.

        Returns:
            How many fragments were written.

        Raises:
            PermissionError: the backend is read-only.
            StoreIOError: the storage failed (nothing written).
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

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """True when a fragment is stored under ``key`` (expired or not).

        Raises:
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

    def forget_tokens(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> int:
        """Delete every fragment :meth:`keys_along` finds for ``tokens``; return how many."""
        return self.delete_many(self.keys_along(namespace, tokens))

    # -- lifecycle records -----------------------------------------------------------------

    @abstractmethod
    def lifecycle(self, key: bytes) -> Lifecycle | None:
        """The lifecycle record of a stored fragment, or None when absent.

        Raises:
            StoreIOError: the storage failed.
        """

    def lifecycles(self, keys: Sequence[bytes]) -> list[Lifecycle | None]:
        """The records of several fragments, in order (None: absent), read at one point in
        time where the backend can (the local store: one read transaction).

        Raises:
            StoreIOError: the storage failed.
        """
        return [self.lifecycle(key) for key in keys]

    @abstractmethod
    def set_lifecycle(self, key: bytes, life: Lifecycle) -> bool:
        """Overwrite a stored fragment's record (its sizes kept); False when absent.

        Raises:
            PermissionError: read-only. StoreIOError: the storage failed.
        """

    @abstractmethod
    def record_hits(self, keys: Sequence[bytes], now: float | None = None, *,
                    reused: tuple[bytes, Sequence[int]] | None = None) -> None:
        """Count one hit on each stored fragment of ``keys`` at ``now`` (``policy.on_hit``:
        hit count + 1, last hit, promotion to the long-lived tier). ``reused`` is (namespace
        digest, the token IDs the hit injected), kept for :meth:`reuse_hint`, in the same write.

        Raises:
            PermissionError: read-only. StoreIOError: the storage failed.
        """

    def reuse_hint(self, namespace_digest: bytes) -> np.ndarray:
        """The token IDs (int32 ``[n]``) the latest hit in the namespace ``namespace_digest``
        injected, as :meth:`record_hits` kept them (empty: none known): a new process rehearses
        that hit before its first request. This default knows none.

        Raises:
            StoreIOError: the storage failed.
        """
        return np.zeros(0, dtype=np.int32)

    def release_mapped(self) -> None:
        """Give back the memory this process maps the store's data with (a store read in place
        maps what it reads), keeping the data cached by the OS; a no-op by default."""
        return None

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
        """Delete those of ``keys`` that are still expired at ``now`` and not pinned, together.

        Returns:
            The ``(key, blob bytes)`` deleted.

        Raises:
            PermissionError: read-only. StoreIOError: the storage failed.
        """

    @abstractmethod
    def put_replacing(self, fragment: KVFragment, life: Lifecycle, remove: Sequence[bytes]) -> bool:
        """Store ``fragment`` with the record ``life`` and delete ``remove`` (their donor records
        and vectors moved to it), together: a merge happens whole or not at all.

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

    # -- size -------------------------------------------------------------------------------

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes of the stored blobs: what ``max_bytes`` bounds.

        Raises:
            StoreIOError: the storage failed.
        """

    @abstractmethod
    def recount_used(self) -> int:
        """Recompute :meth:`used_bytes` from the blobs and record it; return it.

        Raises:
            PermissionError: read-only. StoreIOError: the storage failed.
        """

    @abstractmethod
    def stats(self):
        """Counts and sizes (``StoreStats``: fragments, compressed, raw and disk bytes, ...).

        Raises:
            StoreIOError: the storage failed.
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
    def contains_in(self, txn, key: bytes) -> bool:
        """:meth:`contains` inside ``txn``."""

    @abstractmethod
    def delete_in(self, txn, key: bytes) -> int:
        """Delete one fragment (index entry, lifecycle, donor record, vector) inside the write
        transaction ``txn``; return its blob bytes (0: it was not stored)."""

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

    @abstractmethod
    def close(self) -> None:
        """Release the backend's resources and locks (idempotent)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
