"""FragmentStore: KV fragments in LMDB, shared by the processes of one device.

The local implementation of the storage seam (:class:`~edgesync_store.core.backend.FragmentBackend`);
the environment, its databases and key layout are in :mod:`edgesync_store.core.lmdb_env`, the
prefix index's queries in :mod:`edgesync_store.core.walk`, the records that the semantic layer
keys by fragment in :mod:`edgesync_store.core.companions`.

Lifetimes follow ``ttl.TTLPolicy`` on the store's clock (injectable); the size budget
(``max_bytes``) is enforced when writing (``lifecycle/eviction.py``: expired first, then the
short-lived tier least recently used, then the long-lived tier least recently used, never a
fragment a request has pinned). Cross-process coordination beyond LMDB's own is in
``locks.py``. Several processes may read and write one store at once; only committed
transactions survive a kill, and a commit is durable (LMDB's default sync).
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import lmdb
import numpy as np

from edgesync_store import migrations
from edgesync_store.core import codec, companions, walk
from edgesync_store.core.backend import FragmentBackend, PinTableLike
from edgesync_store.core.lmdb_env import (
    DEFAULT_MAP_SIZE,
    MAX_BYTES_KEY,
    U64,
    USED_BYTES_KEY,
    LmdbEnv,
    index_key,
    prepare_dir,
    read_u64,
)
from edgesync_store.core.locks import OpenLock, PinTable
from edgesync_store.core.store_lifecycle import LifecycleOps
from edgesync_store.core.store_reads import ReadOps
from edgesync_store.core.store_writes import WriteOps
from edgesync_store.core.walk import PrefixMatch, SpanMatch
from edgesync_store.errors import (
    CodecError,
    StoreBusyError,
    StoreFormatError,
    StoreIOError,
    StoreOpenError,
    StoreUnavailableError,
)
from edgesync_store.schema import Namespace
from edgesync_store.ttl import Clock, Lifecycle, TTLPolicy

log = logging.getLogger(__name__)

STORE_FORMAT_VERSION = migrations.CURRENT_VERSION
"""On-disk layout version recorded in the ``meta`` database (``migrations/``)."""
DEFAULT_MAX_BYTES = 1024 * 1024 * 1024
"""Default size budget: 1 GiB of stored fragments (compressed blobs), about 500 cached
350-token SmolLM2-135M prompts at the 2 MB each that the benchmark measured."""
T = TypeVar("T")

__all__ = ["DEFAULT_MAP_SIZE", "DEFAULT_MAX_BYTES", "FragmentStore", "Lifecycle", "PrefixMatch", "STORE_FORMAT_VERSION",
           "SpanMatch", "StoreBusyError", "StoreFormatError", "StoreIOError", "StoreOpenError", "StoreStats",
           "StoreUnavailableError"]

PinTableLike.register(PinTable)


@dataclass
class StoreStats:
    """Counts and sizes (bytes) of a store."""

    fragments: int
    compressed_bytes: int
    raw_bytes: int
    disk_bytes: int
    map_size: int
    dropped_corrupt: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class FragmentStore(ReadOps, LifecycleOps, WriteOps, FragmentBackend):
    """KV fragments in LMDB, keyed by ``schema.store_key`` (the seam's methods are documented
    on :class:`FragmentBackend`).

    Args:
        path: store directory; created (mode 0700) when missing.
        map_size: initial LMDB map size in bytes (grows on demand).
        max_raw_bytes: decompressed-size cap passed to ``codec.decode``.
        readonly: open without writing (no growth, no migration, no removal of corrupt
            entries).
        clock: the time source, Unix seconds (default ``time.time``); tests inject
            ``ttl.ManualClock``.
        policy: lifetimes and promotion (default ``TTLPolicy()``: 30 minutes, 5 hits, 7 days).
        max_bytes: size budget in bytes of stored blobs; None keeps the budget recorded in the
            store (the last one an application set) or :data:`DEFAULT_MAX_BYTES`. A value given
            here is recorded for ``python -m edgesync_engines.app.compact`` to follow.
        open_timeout_s: seconds to wait while another process reclaims or clears the store.
        compression: how new blobs hold their tensors, one of ``codec.COMPRESSIONS``:
            ``"none"`` (default; a hit reads them in place, :meth:`reading`) or ``"zstd"``
            (about 0.86x the bytes of f16 KV, decompressed on every read).

    Attributes:
        env: the :class:`~edgesync_store.core.lmdb_env.LmdbEnv` (for the core's modules; the
            layers above use the methods).

    An existing directory's mode is left alone. Opening an older store runs its migrations
    (``migrations/``).

    Raises:
        StoreFormatError: the store was written by a newer format version.
        StoreOpenError: the path is a file, a non-empty directory without a store, cannot be
            created, or does not open as LMDB (read-only: holds no store).
        StoreBusyError: another process held the store exclusively for ``open_timeout_s``.
        StoreIOError: LMDB failed while reading or migrating the store.
        ValueError: ``max_bytes`` < 1 or >= 2**63 (the largest file offset), or an unknown ``compression``.
    """

    def __init__(self, path: str | os.PathLike, map_size: int = DEFAULT_MAP_SIZE,
                 max_raw_bytes: int = codec.DEFAULT_MAX_RAW_BYTES, readonly: bool = False, *,
                 clock: Clock | None = None, policy: TTLPolicy | None = None, max_bytes: int | None = None,
                 open_timeout_s: float = 120.0, compression: str = codec.DEFAULT_COMPRESSION) -> None:
        if compression not in codec.COMPRESSIONS:
            raise ValueError(f"compression: {compression!r} is not one of {', '.join(codec.COMPRESSIONS)}")
        self.compression = compression
        self.path = Path(path).expanduser()
        self.max_raw_bytes = max_raw_bytes
        self.readonly = readonly
        self.dropped_corrupt = 0
        self.clock: Clock = clock or time.time
        self.policy = policy or TTLPolicy()
        self._closed = False
        if max_bytes is not None and (not isinstance(max_bytes, int) or not 1 <= max_bytes < 1 << 63):
            raise ValueError(f"max_bytes: must be a number of bytes from 1 to 2**63 - 1, got {max_bytes!r}")
        if not str(path).strip():
            raise StoreOpenError("store path: is empty")
        prepare_dir(self.path, readonly)
        writable_dir = os.access(self.path, os.W_OK)
        self._open_lock: OpenLock | None = None
        if writable_dir:
            try:
                self._open_lock = OpenLock(self.path, open_timeout_s)
            except OSError as exc:
                raise StoreUnavailableError(f"cannot lock the store at {self.path}: {exc}") from None
        try:
            # a read-only look at a store we cannot write (another user's, read-only media)
            # cannot take LMDB's lock file
            self.env = LmdbEnv(self.path, map_size, readonly, lock=not readonly or writable_dir)
            self.env.check_is_edgesync()
            self.format_version = migrations.migrate(self)
            if not self.env.open_core(companions.COMPANION_DATABASES):
                raise StoreOpenError(f"store {self.path}: its databases are missing (format {self.format_version})")
            self.max_bytes = self._settle_budget(max_bytes)
        except lmdb.Error as exc:
            self._release_lock()
            raise StoreIOError(f"store {self.path}: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            self._release_lock()
            raise
        self.pins = PinTable(self.path)

    def _settle_budget(self, max_bytes: int | None) -> int:
        recorded = self.recorded_max_bytes()
        if max_bytes is None:
            return recorded or DEFAULT_MAX_BYTES
        if max_bytes != recorded and not self.readonly:
            self.transact(lambda txn: txn.put(MAX_BYTES_KEY, U64.pack(max_bytes), db=self.env.meta), write=True)
        return max_bytes

    def _release_lock(self) -> None:
        if self._open_lock is not None:
            self._open_lock.close()
            self._open_lock = None

    # -- the environment, for maintenance ---------------------------------------------------

    def named_db(self, name: bytes, create: bool = False, dupsort: bool = False, txn=None):
        """The handle of the named database ``name`` in this store's environment, or None when
        it does not exist and ``create`` is False or the store is read-only. Handles are cached
        until :meth:`reopen` (ask again rather than keep one); inside a transaction pass it as
        ``txn`` (opening without one starts a write transaction, which would deadlock).

        Raises:
            StoreIOError: LMDB failed."""
        return self.env.named_db(name, create=create, dupsort=dupsort, txn=txn)

    def forget_handles(self) -> None:
        """Forget cached database handles (after a transaction that created databases)."""
        self.env.forget_handles()

    def transact(self, fn: Callable[[lmdb.Transaction], T], write: bool = False) -> T:
        """See :meth:`FragmentBackend.transact`; ``txn`` is an ``lmdb.Transaction`` (buffers:
        values are memoryviews valid inside ``fn`` only)."""
        return self.env.transact(fn, write=write)

    def contains_in(self, txn, key: bytes) -> bool:
        return self.env.has_blob(txn, key)

    def used_in(self, txn) -> int:
        return read_u64(txn.get(USED_BYTES_KEY, db=self.env.meta)) or 0

    def _add_used(self, txn, delta: int) -> None:
        txn.put(USED_BYTES_KEY, U64.pack(max(0, self.used_in(txn) + delta)), db=self.env.meta)

    def lifecycle_rows_in(self, txn) -> list[tuple[bytes, Lifecycle]]:
        return [(bytes(k), Lifecycle.unpack(v)) for k, v in txn.cursor(db=self.env.lifecycle)]

    def recorded_max_bytes(self) -> int | None:
        """The budget recorded in the store (None: none recorded, the default applies)."""
        return read_u64(self.transact(lambda txn: txn.get(MAX_BYTES_KEY, db=self.env.meta)))

    def fragment_count(self) -> int:
        """Fragments stored (expired included), from the database's own count."""
        return self.transact(lambda txn: txn.stat(self.env.fragments)["entries"])

    @property
    def lockable(self) -> bool:
        """False when the directory is not writable: no open lock, so never exclusive."""
        return self._open_lock is not None

    @contextmanager
    def exclusive(self) -> Iterator[bool]:
        """Hold this process's lock on the environment and, when no other process has the store
        open, the exclusive open lock (``locks.OpenLock``), given back (shared) at the end.
        Yields True when exclusive, False when another process has the store open or the
        directory is not writable (then nothing else is held but the thread lock)."""
        with self.env.lock:
            if self._open_lock is None or not self._open_lock.try_exclusive():
                yield False
                return
            try:
                yield True
            finally:
                self._open_lock.share()

    def copy_compact(self, fd: int) -> None:
        """Write a compact copy of the environment to the open file ``fd`` (StoreIOError)."""
        self.env.copy_compact(fd)

    def close_env(self) -> None:
        """Close the environment only (while its file is replaced; then :meth:`reopen`)."""
        self.env.close()

    def reopen(self) -> None:
        """Reopen the environment (after ``data.mdb`` was replaced); hold :meth:`exclusive`."""
        with self.env.lock:
            self.env.reopen(companions.COMPANION_DATABASES)

    def page_bytes(self, names: Sequence[bytes] | None = None) -> int:
        """Bytes of the LMDB pages the databases ``names`` use (None: every page in use)."""
        return self.env.page_bytes(names)

    # -- writes ---------------------------------------------------------------------------

    def delete_many(self, keys: Sequence[bytes]) -> int:
        return self.transact(lambda txn: sum(self.delete_in(txn, bytes(k)) > 0 for k in keys), write=True)

    def delete_in(self, txn, key: bytes) -> int:
        env = self.env
        head_bytes = env.head_in(txn, key)
        if head_bytes is None:
            return 0
        # the size the record holds spares mapping the blob (LmdbEnv.has_blob); a record without
        # one (corrupt, or lost) falls back to the blob's length
        nbytes = Lifecycle.unpack(txn.get(key, db=env.lifecycle)).nbytes or len(txn.get(key, db=env.fragments))
        try:
            head = codec.peek(head_bytes)
            txn.delete(index_key(head.namespace.digest(), head.prefix_hash), key, db=env.by_prefix)
        except CodecError:
            pass  # a dangling by_prefix entry is dropped by the next walk that meets it
        txn.delete(key, db=env.fragments)
        if env.heads is not None:
            txn.delete(key, db=env.heads)
        txn.delete(key, db=env.lifecycle)
        companions.delete_in(self, txn, key)
        self._add_used(txn, -nbytes)
        return nbytes

    def drop_corrupt(self, key: bytes, reason: str) -> None:
        """Count, log and (unless read-only) delete the corrupt fragment ``key``."""
        self.dropped_corrupt += 1
        log.warning("refusing corrupt fragment %s: %s; removing it", key.hex()[:16], reason)
        if not self.readonly:
            self.transact(lambda txn: self.delete_in(txn, key), write=True)

    def used_bytes(self) -> int:
        return self.transact(self.used_in)

    def covers_span(self, namespace: Namespace, prefix: bytes, token_ids: Sequence[int] | np.ndarray,
                    token_start: int, now: float | None = None) -> bool:
        return walk.covers_span(self, namespace, prefix, token_ids, token_start, now)

    def keys_along(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        return walk.keys_along(self, namespace, tokens)

    def prefix_walk(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray,
                    now: float | None = None) -> PrefixMatch:
        return walk.prefix_walk(self, namespace, tokens, now)

    def namespaces(self) -> list[Namespace]:
        return walk.stored_namespaces(self)

    def stats(self) -> StoreStats:
        """Fragment count, compressed and raw bytes, bytes on disk and the LMDB map size."""
        count = compressed = raw = 0
        for _key, head, _life, nbytes in self.iterate():
            count += 1
            compressed += nbytes
            raw += head.raw_nbytes if head is not None else 0
        disk = sum(p.stat().st_size for p in self.path.glob("*.mdb"))
        try:
            map_size = self.env.map_size()
        except lmdb.Error as exc:
            raise StoreIOError(f"store {self.path}: {exc}") from exc
        return StoreStats(count, compressed, raw, disk, map_size, self.dropped_corrupt)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self.env.lock:
            self._closed = True
            self.env.close()
            self.pins.close()
            self._release_lock()
