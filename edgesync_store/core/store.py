"""FragmentStore: both storage seams (``core/backend.py``) over LMDB, shared by a device's processes.

Every read verifies what it returns (``codec.decode``: checksums, header, content hash, and the
key it was stored under); a corrupt fragment is refused, logged and removed after the read. A
blob is written with its head and its ``by_prefix`` entry in one transaction; a commit is
durable (LMDB's default sync) and only committed transactions survive a kill.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import lmdb
import numpy as np

from edgesync_store.core import codec, companions, eviction, map_advice, walk
from edgesync_store.core.backend import MaintenanceBackend, PinTableLike
from edgesync_store.core.chain_read import ChainRead, CheckedChainRead
from edgesync_store.core.codec import FragmentHeader
from edgesync_store.core.donor_record import check_key
from edgesync_store.core.lmdb_env import (
    DEFAULT_MAP_SIZE,
    MAX_BYTES_KEY,
    REUSE_TOKENS_PREFIX,
    STORE_FORMAT_VERSION,
    U64,
    USED_BYTES_KEY,
    LmdbEnv,
    format_version,
    prepare_dir,
    read_u64,
)
from edgesync_store.core.locks import OPEN_LOCK_NAME, OpenLock, PinTable
from edgesync_store.core.page_check import verify as verify_pages
from edgesync_store.core.walk import PrefixMatch, SpanMatch, index_key
from edgesync_store.errors import (
    CodecError,
    StoreBudgetError,
    StoreBusyError,
    StoreDamagedError,
    StoreFormatError,
    StoreIOError,
    StoreOpenError,
    StoreUnavailableError,
    sized,
)
from edgesync_store.schema import KVFragment, Namespace
from edgesync_store.ttl import Clock, Lifecycle, TTLPolicy

log = logging.getLogger(__name__)

T = TypeVar("T")

Encoded = tuple[bytes, bytes, bytes, Lifecycle]
"""(store key, by_prefix index key, blob, lifecycle record)."""

__all__ = ["DEFAULT_FREE_SHARE", "DEFAULT_MAP_SIZE", "DEFAULT_MAX_BYTES", "FragmentStore", "Lifecycle", "PrefixMatch",
           "STORE_FORMAT_VERSION", "SpanMatch", "StoreBudgetError", "StoreBusyError", "StoreFormatError",
           "StoreIOError", "StoreOpenError", "StoreStats", "StoreUnavailableError", "budget_for_space",
           "default_max_bytes"]

PinTableLike.register(PinTable)

DEFAULT_MAX_BYTES = 8 * 1024**3
"""The default size budget's ceiling, bytes of stored fragments: 8 GiB, the default of
llama-server's host prompt cache (``--cache-ram``: ``cache_ram_mib = 8192`` in llama.cpp's
``common/common.h``). It holds a 32K-token context of Llama-3.1-8B's f16 KV (128 KiB a token:
4 GiB) with room for more. A new store takes the smaller of it and :data:`DEFAULT_FREE_SHARE` of
the free space (:func:`default_max_bytes`); the reasoning is in docs/configuration.md."""
DEFAULT_FREE_SHARE = 0.25
"""Share of the space free to a new store that its default budget may take (:func:`default_max_bytes`):
a quarter, because a full store's file can reach about twice its budget (a write's evicted pages
are not reused in its own transaction) and a reclaim writes a compact copy beside it."""


def budget_for_space(space: int) -> int:
    """The default size budget, bytes, for ``space`` bytes free to a store: the smaller of
    :data:`DEFAULT_MAX_BYTES` and :data:`DEFAULT_FREE_SHARE` of it, at least 1."""
    return max(1, min(DEFAULT_MAX_BYTES, int(space * DEFAULT_FREE_SHARE)))


def default_max_bytes(path: str | os.PathLike) -> int:
    """The size budget a store at ``path`` (an existing directory) takes when none is given or
    recorded, bytes: :func:`budget_for_space` of the filesystem's free space plus what the
    store's ``data.mdb`` already takes there. OSError: the filesystem cannot be asked
    (``shutil.disk_usage``)."""
    data = Path(path) / "data.mdb"
    own = data.stat().st_size if data.exists() else 0
    return budget_for_space(shutil.disk_usage(path).free + own)


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


class FragmentStore(MaintenanceBackend):
    """KV fragments in LMDB, keyed by ``schema.store_key`` (methods: ``core/backend.py``).

    Args:
        path: store directory; created (mode 0700) when missing.
        map_size: initial LMDB map size in bytes (grows on demand).
        readonly: no growth, no migration, no removal of corrupt ones.
        clock: Unix seconds (default ``time.time``).
        max_bytes: size budget, bytes of stored blobs; None keeps the one recorded in the store,
            else takes :func:`default_max_bytes` (recorded, when writable, so that it does not
            shrink as the disk fills); a value given is recorded for the compaction command.
        open_timeout_s: seconds to wait while another process reclaims or clears the store.
        compression: new blobs' tensors, ``"none"`` (read in place) or ``"zstd"``.
        upgrade: brings a writable store of an older format to ``STORE_FORMAT_VERSION`` and
            returns the version (``edgesync_store.migrations.migrate``: the application and
            the commands pass it); without it such a store is refused.

    Attributes ``env``: the ``LmdbEnv``. The page check (``core/page_check.py``) runs before LMDB reads a page.

    Raises:
        StoreFormatError: the store was written by a newer format version, or an older one
            without ``upgrade``.
        StoreOpenError: the path is a file, a non-empty directory without a store, cannot be
            created, or does not open as LMDB (read-only: holds no store).
        StoreBusyError: another process held the store exclusively for ``open_timeout_s``.
        StoreIOError: LMDB failed while reading or migrating the store.
        ValueError: ``max_bytes`` < 1 or >= 2**63 (the largest file offset), or an unknown ``compression``.
    """

    def __init__(self, path: str | os.PathLike, map_size: int = DEFAULT_MAP_SIZE, readonly: bool = False, *,
                 clock: Clock | None = None, policy: TTLPolicy | None = None, max_bytes: int | None = None,
                 open_timeout_s: float = 120.0, compression: str = codec.DEFAULT_COMPRESSION,
                 upgrade: Callable[["FragmentStore"], int] | None = None) -> None:
        if compression not in codec.COMPRESSIONS:
            raise ValueError(f"compression: {compression!r} is not one of {', '.join(codec.COMPRESSIONS)}")
        self.compression = compression
        self.path = Path(path).expanduser()
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
        lock_files = [self.path / name for name in (OPEN_LOCK_NAME, "lock.mdb") if not (self.path / name).exists()]
        self._open_lock: OpenLock | None = None
        if writable_dir:
            try:
                self._open_lock = OpenLock(self.path, open_timeout_s)
            except OSError as exc:
                raise StoreUnavailableError(f"cannot lock the store at {self.path}: {exc}") from None
        try:
            # before LMDB reads a page: a corrupt one can kill this process (core/check.py);
            # unreadable meta pages LMDB refuses by itself (LmdbEnv tells foreign from damaged)
            report = verify_pages(self.path)
            if not report.healthy and not report.header:
                raise StoreDamagedError(self.path, report.damage)
            # a read-only look at a store we cannot write (another user's, read-only media)
            # cannot take LMDB's lock file
            self.env = LmdbEnv(self.path, map_size, readonly, lock=not readonly or writable_dir)
            self.env.check_is_edgesync()
            self.format_version = self._settle_format(upgrade)
            if not self.env.open_core(companions.COMPANION_DATABASES):
                raise StoreOpenError(f"store {self.path}: its databases are missing (format {self.format_version})")
            self.max_bytes = self._settle_budget(max_bytes)
        except lmdb.Error as exc:
            self._release_lock()
            raise StoreIOError(f"store {self.path}: {type(exc).__name__}: {exc}") from exc
        except StoreOpenError:
            # a refused directory (a foreign data.mdb) is left as it was: without the lock files
            # this open created
            self._release_lock()
            for created in lock_files:
                created.unlink(missing_ok=True)
            raise
        except BaseException:
            self._release_lock()
            raise
        self.pins = PinTable(self.path)

    def _settle_format(self, upgrade: Callable[["FragmentStore"], int] | None) -> int:
        version = format_version(self.env)
        if version > STORE_FORMAT_VERSION:
            raise StoreFormatError(
                f"store {self.path} has format version {version}; this EdgeSync reads up to {STORE_FORMAT_VERSION}: "
                "upgrade EdgeSync, or delete the store directory (it is a cache)")
        if version == 0 and self.readonly:
            raise StoreOpenError(f"no EdgeSync store at {self.path}")
        if version == STORE_FORMAT_VERSION or self.readonly:
            return version
        if version == 0:
            self.env.create_layout()
            return STORE_FORMAT_VERSION
        if upgrade is not None:
            return upgrade(self)
        raise StoreFormatError(f"store {self.path} has format version {version}, older than {STORE_FORMAT_VERSION}: "
                               "open it with upgrade=edgesync_store.migrations.migrate to migrate it")

    def _settle_budget(self, max_bytes: int | None) -> int:
        recorded = self.recorded_max_bytes()
        if max_bytes is None and recorded:
            return recorded
        if max_bytes is None:
            try:
                max_bytes = default_max_bytes(self.path)
            except OSError as exc:
                max_bytes = DEFAULT_MAX_BYTES
                log.warning("store %s: cannot read the free space (%s); size budget %s", self.path, exc,
                            sized(max_bytes))
            else:
                log.info("store %s: size budget %s (the smaller of %s and %.0f%% of the free space)", self.path,
                         sized(max_bytes), sized(DEFAULT_MAX_BYTES), DEFAULT_FREE_SHARE * 100)
        if max_bytes != recorded and not self.readonly:
            self.transact(lambda txn: txn.put(MAX_BYTES_KEY, U64.pack(max_bytes), db=self.env.meta), write=True)
        return max_bytes

    def _release_lock(self) -> None:
        if self._open_lock is not None:
            self._open_lock.close()
            self._open_lock = None

    # -- the environment, for maintenance ---------------------------------------------------

    def named_db(self, name: bytes, create: bool = False, dupsort: bool = False, txn=None):
        """A named database of the environment (None also when read-only and missing), cached
        until :meth:`reopen`; inside a transaction pass ``txn`` (else: a deadlock)."""
        return self.env.named_db(name, create=create, dupsort=dupsort, txn=txn)

    def transact(self, fn: Callable[[lmdb.Transaction], T], write: bool = False) -> T:
        """See :meth:`MaintenanceBackend.transact`; ``txn`` is an ``lmdb.Transaction`` (buffers:
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

    # -- reads ----------------------------------------------------------------------------

    @property
    def serves_in_place(self) -> bool:
        """True when its blobs are uncompressed (``compression="none"``)."""
        return self.compression == "none"

    def contains(self, key: bytes) -> bool:
        return self.transact(lambda txn: self.contains_in(txn, key))

    def is_live(self, key: bytes, now: float | None = None) -> bool:
        now = self.clock() if now is None else now

        def read(txn) -> bool:
            if not self.env.has_blob(txn, key):
                return False
            return Lifecycle.unpack(txn.get(key, db=self.env.lifecycle)).expires_at > now

        return self.transact(read)

    def get_blob(self, key: bytes) -> bytes | None:
        def read(txn) -> bytes | None:
            value = txn.get(key, db=self.env.fragments)
            return bytes(value) if value is not None else None

        return self.transact(read)

    def _verified(self, key: bytes, blob, life: Lifecycle, views: bool,
                  corrupt: list, check_payload: bool = True) -> KVFragment | None:
        """``blob`` decoded, checked against ``key``, with ``life``'s counters; None when corrupt
        (``(key, reason)`` appended to ``corrupt``)."""
        try:
            frag = codec.decode(blob, copy=not views, check_payload=check_payload)
        except CodecError as exc:
            corrupt.append((key, str(exc)))
            return None
        if frag.key() != key:
            corrupt.append((key, "stored under a key that its content does not hash to"))
            return None
        frag.hit_count, frag.last_hit_at, frag.expires_at = life.hit_count, life.last_hit_at, life.expires_at
        return frag

    def _read_in(self, txn, key: bytes, in_place: bool, corrupt: list,
                 deferred: list | None = None) -> tuple[KVFragment | None, bool]:
        """(verified fragment or None, K/V are views of the map); ``deferred`` receives
        ``(key, payload view, expected xxh3)`` of in-place reads whose checksum the caller runs."""
        value = txn.get(key, db=self.env.fragments)
        if value is None:
            return None, False
        life = Lifecycle.unpack(txn.get(key, db=self.env.lifecycle))
        try:
            head = codec.peek(value)
            views = in_place and head.compression == "none"
            later = views and deferred is not None and head.version >= 2
            if later:
                deferred.append((key, *codec.payload_check(value)))
        except CodecError as exc:
            corrupt.append((key, str(exc)))
            return None, False
        frag = self._verified(key, value, life, views, corrupt, check_payload=not later)
        if frag is None and later:
            deferred.pop()
        if later:
            # the head and checksum reads mapped pages of the whole blob (large folios): a long
            # chain read ahead of its injection would be resident twice over
            map_advice.drop_pages(value)
        return frag, views and frag is not None

    def _drop_all_corrupt(self, corrupt: list) -> None:
        for key, reason in corrupt:
            self.drop_corrupt(key, reason)

    def get(self, key: bytes, *, copy: bool = False) -> KVFragment | None:
        """See :meth:`FragmentBackend.get`: decoded into arrays of its own inside one read
        transaction (blob and lifecycle record together); with ``copy`` the blob is copied out
        and decoded after the transaction."""
        corrupt: list = []
        if copy:
            def read(txn):
                value = txn.get(key, db=self.env.fragments)
                if value is None:
                    return None, None
                return bytes(value), Lifecycle.unpack(txn.get(key, db=self.env.lifecycle))

            blob, life = self.transact(read)
            frag = None if blob is None else self._verified(key, blob, life, False, corrupt)
        else:
            frag = self.transact(lambda txn: self._read_in(txn, key, False, corrupt)[0])
        self._drop_all_corrupt(corrupt)
        return frag

    @contextmanager
    def reading(self, keys: Sequence[bytes], *, defer_checks: bool = False) -> Iterator[ChainRead]:
        """One read transaction held for the ``with`` block (other threads wait: inject and
        leave); uncompressed K and V are views of LMDB's map. ``defer_checks``: payload checksums
        run on a thread of their own meanwhile; ``confirm()`` and the block's end wait for them."""
        corrupt: list = []
        deferred: list | None = [] if defer_checks else None
        try:
            with self.env.reader() as txn:
                got = CheckedChainRead(self._read_in(txn, bytes(key), True, corrupt, deferred) for key in keys)
                if deferred:
                    got.start(deferred, corrupt)
                try:
                    yield got
                finally:
                    got.confirm()
        finally:
            self._drop_all_corrupt(corrupt)

    # -- writes ---------------------------------------------------------------------------

    def put_many(self, fragments: Sequence[KVFragment], now: float | None = None, *,
                 donor: tuple[bytes, bytes] | None = None) -> int:
        """See :meth:`FragmentBackend.put_many`. Encoding happens before the transaction so the
        writer lock is held only for the copy into LMDB. StoreBudgetError, with nothing written or
        evicted: the batch cannot fit the size budget (uncompressed, checked before encoding:
        each blob holds its K and V bytes and more)."""
        if donor is not None:
            check_key(donor[0])
        if self.compression == "none":
            raw = sum({f.key(): f.raw_nbytes for f in fragments}.values())
            if raw > self.max_bytes:
                raise StoreBudgetError(self.path, raw, self.max_bytes)
        encoded = []
        for f in fragments:
            blob = codec.encode(f, self.compression)
            life = Lifecycle(f.hit_count, f.last_hit_at, f.expires_at, f.created_at, nbytes=len(blob),
                             raw_nbytes=f.raw_nbytes)
            encoded.append((f.key(), index_key(f.namespace.digest(), f.prefix_hash), blob, life))
        return self._write_encoded(encoded, now, donor)

    def put_donor(self, key: bytes, value: bytes) -> bool:
        check_key(key)
        if not self.transact(lambda txn: companions.lacks_donor_in(self, txn, key)):
            return False
        return self.transact(lambda txn: companions.add_donor_in(self, txn, key, value), write=True)

    def put_blobs(self, items: Sequence[tuple[bytes, bytes, Lifecycle]], now: float | None = None) -> int:
        """:meth:`put_many` of ``(store key, blob, lifecycle record)`` items whose blobs the caller
        verified (``codec.decode`` and the key); the records' sizes are set here. CodecError: a
        head that does not parse (nothing written)."""
        encoded = []
        for key, blob, life in items:
            head = codec.peek(blob)
            life = Lifecycle(life.hit_count, life.last_hit_at, life.expires_at, life.created_at, life.lifetime,
                             nbytes=len(blob), raw_nbytes=head.raw_nbytes)
            encoded.append((bytes(key), index_key(head.namespace.digest(), head.prefix_hash), bytes(blob), life))
        return self._write_encoded(encoded, now)

    def _put_blob_in(self, txn, key: bytes, ikey: bytes, blob: bytes) -> None:
        """Write ``blob``, its head and ``by_prefix`` entry (not lifecycle, ``used_bytes``); CodecError: bad head."""
        head = codec.head_of(blob)
        env = self.env
        txn.put(key, blob, db=env.fragments)
        txn.put(key, head, db=env.heads)
        txn.put(ikey, key, db=env.by_prefix, dupdata=True)

    def _sound_head_in(self, txn, key: bytes) -> bool:
        """True when the stored head of ``key`` parses; else False, logged and counted."""
        try:
            codec.peek(self.env.head_in(txn, key))
            return True
        except CodecError as exc:
            self.dropped_corrupt += 1
            log.warning("replacing fragment %s: its stored head is corrupt (%s)", key.hex()[:16], exc)
            return False

    def _write_encoded(self, encoded: Sequence[Encoded], now: float | None,
                       donor: tuple[bytes, bytes] | None = None) -> int:
        """Write ``encoded`` in one transaction, all or nothing; the number written (a live twin
        with a sound head is left alone). StoreBudgetError, before anything is written or evicted:
        the batch's blobs alone exceed the budget, or what it must evict to fit is pinned."""
        now = self.clock() if now is None else now
        env = self.env
        batch = {item[0]: len(item[2]) for item in encoded}
        total = sum(batch.values())
        if total > self.max_bytes:
            raise StoreBudgetError(self.path, total, self.max_bytes)
        env.reserve(total, len(batch))

        def write(txn) -> int:
            todo, seen = [], set()
            for item in encoded:
                key = item[0]
                if key in seen:
                    continue
                seen.add(key)
                if env.has_blob(txn, key):
                    live = not Lifecycle.unpack(txn.get(key, db=env.lifecycle)).expired(now)
                    if live and self._sound_head_in(txn, key):
                        continue
                    self.delete_in(txn, key)
                todo.append(item)
            incoming = sum(len(t[2]) for t in todo)
            used = self._make_room_in(txn, incoming, now, {t[0] for t in todo})
            for key, ikey, blob, life in todo:
                self._put_blob_in(txn, key, ikey, blob)
                txn.put(key, life.pack(), db=env.lifecycle)
            txn.put(USED_BYTES_KEY, U64.pack(used + incoming), db=env.meta)
            if donor is not None:
                companions.add_donor_in(self, txn, *donor)
            return len(todo)

        return self.transact(write, write=True)

    def _make_room_in(self, txn, incoming: int, now: float, protect: set[bytes]) -> int:
        """Evict by the policy (``core/eviction.py``, down to ``LOW_WATER`` of the budget) so that
        ``incoming`` more bytes fit, and return the bytes stored after it. StoreBudgetError, with
        nothing evicted, when they cannot fit (what is left is pinned or in ``protect``)."""
        used = self.used_in(txn)
        if used + incoming <= self.max_bytes:
            return used
        need = used + incoming - int(self.max_bytes * eviction.LOW_WATER)
        held = used - sum(nbytes for _, nbytes in eviction.plan(self, self.lifecycle_rows_in(txn), need, now, protect))
        if held + incoming > self.max_bytes:
            raise StoreBudgetError(self.path, incoming, self.max_bytes, held=held)
        used -= sum(nbytes for _, nbytes in eviction.evict_in(self, txn, need, now, protect))
        if used + incoming > self.max_bytes:  # records that undercounted their blob: the transaction is dropped
            raise StoreBudgetError(self.path, incoming, self.max_bytes, held=used)
        return used

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

    # -- lifecycle records and maintenance ------------------------------------------------

    def put_replacing(self, fragment: KVFragment, life: Lifecycle, remove: Sequence[bytes]) -> bool:
        key = fragment.key()
        blob = codec.encode(fragment, self.compression)
        env = self.env

        def write(txn) -> bool:
            if not all(env.has_blob(txn, k) for k in remove):
                return False
            if not env.has_blob(txn, key):
                self._put_blob_in(txn, key, index_key(fragment.namespace.digest(), fragment.prefix_hash), blob)
                self._add_used(txn, len(blob))
            life.nbytes, life.raw_nbytes = len(blob), fragment.raw_nbytes
            txn.put(key, life.pack(), db=env.lifecycle)
            for k in remove:
                if k != key:
                    companions.move_in(self, txn, k, key)
                    self.delete_in(txn, k)
            return True

        return self.transact(write, write=True)

    def absorb(self, keep: bytes, remove: Sequence[bytes], life: Lifecycle) -> bool:
        env = self.env

        def write(txn) -> bool:
            if not all(env.has_blob(txn, k) for k in [keep, *remove]):
                return False
            old = Lifecycle.unpack(txn.get(keep, db=env.lifecycle))
            life.nbytes, life.raw_nbytes = old.nbytes, old.raw_nbytes
            txn.put(keep, life.pack(), db=env.lifecycle)
            for k in remove:
                companions.move_in(self, txn, k, keep)
                self.delete_in(txn, k)
            return True

        return self.transact(write, write=True)

    def delete_expired(self, keys: Sequence[bytes], now: float | None = None) -> list[tuple[bytes, int]]:
        now = self.clock() if now is None else now
        env = self.env

        def write(txn) -> list[tuple[bytes, int]]:
            gone = []
            for key in keys:
                raw = txn.get(key, db=env.lifecycle)
                if raw is None and not env.has_blob(txn, key):
                    continue
                if not Lifecycle.unpack(raw).expired(now) or self.pins.is_pinned(key):
                    continue
                nbytes = self.delete_in(txn, key)
                if nbytes:
                    gone.append((key, nbytes))
                else:
                    txn.delete(key, db=env.lifecycle)  # a record without its fragment
            return gone

        return self.transact(write, write=True)

    def set_lifecycle(self, key: bytes, life: Lifecycle) -> bool:
        env = self.env

        def write(txn) -> bool:
            if not env.has_blob(txn, key):
                return False
            old = Lifecycle.unpack(txn.get(key, db=env.lifecycle))
            life.nbytes, life.raw_nbytes = old.nbytes, old.raw_nbytes
            txn.put(key, life.pack(), db=env.lifecycle)
            return True

        return self.transact(write, write=True)

    def record_hits(self, keys: Sequence[bytes], now: float | None = None, *,
                    reused: tuple[bytes, Sequence[int]] | None = None) -> None:
        now = self.clock() if now is None else now
        env = self.env
        hint = None if reused is None else np.asarray(reused[1], dtype="<i4").tobytes()

        def write(txn) -> None:
            if hint is not None:
                name = REUSE_TOKENS_PREFIX + reused[0]
                if txn.get(name, db=env.meta) != hint:
                    txn.put(name, hint, db=env.meta)
            for key in keys:
                if not env.has_blob(txn, key):
                    continue
                life = self.policy.on_hit(Lifecycle.unpack(txn.get(key, db=env.lifecycle)), now)
                txn.put(key, life.pack(), db=env.lifecycle)

        self.transact(write, write=True)

    def reuse_hint(self, namespace_digest: bytes) -> np.ndarray:
        """See :meth:`FragmentBackend.reuse_hint`: the ``reuse_tokens:`` record in ``meta``."""
        raw = self.transact(lambda txn: bytes(v) if (v := txn.get(REUSE_TOKENS_PREFIX + namespace_digest,
                                                                  db=self.env.meta)) is not None else b"")
        return np.frombuffer(raw[:len(raw) - len(raw) % 4], dtype="<i4").astype(np.int32)

    def release_mapped(self) -> None:
        with self.env.lock:
            self.env.advice.release(self.env.map_size())

    def lifecycle(self, key: bytes) -> Lifecycle | None:
        def read(txn):
            if not self.env.has_blob(txn, key):
                return None
            return Lifecycle.unpack(txn.get(key, db=self.env.lifecycle))

        return self.transact(read)

    def lifecycles(self, keys: Sequence[bytes]) -> list[Lifecycle | None]:
        """See :meth:`FragmentBackend.lifecycles`: one read transaction."""
        def read(txn):
            env = self.env
            return [Lifecycle.unpack(txn.get(key, db=env.lifecycle)) if env.has_blob(txn, key) else None
                    for key in keys]

        return self.transact(read)

    def iterate(self) -> Iterator[tuple[bytes, FragmentHeader | None, Lifecycle, int]]:
        def read(txn):
            rows = []
            for key in txn.cursor(db=self.env.fragments).iternext(keys=True, values=False):
                key = bytes(key)
                life = Lifecycle.unpack(txn.get(key, db=self.env.lifecycle))
                try:
                    head = codec.peek(self.env.head_in(txn, key))
                except CodecError:
                    head = None
                rows.append((key, head, life, life.nbytes or len(txn.get(key, db=self.env.fragments))))
            return rows

        yield from self.transact(read)

    def iterate_lifecycle(self) -> list[tuple[bytes, Lifecycle]]:
        return self.transact(self.lifecycle_rows_in)

    def drop_all(self) -> int:
        """Empty the store in one write transaction (format version and budget stay); return the
        fragment count. Freed pages keep their bytes until overwritten (``clear.py`` rewrites)."""
        env = self.env

        def write(txn) -> int:
            n = txn.stat(env.fragments)["entries"]
            for db in (env.fragments, env.heads, env.by_prefix, env.lifecycle):
                txn.drop(db, delete=False)
            companions.drop_in(self, txn)
            txn.put(USED_BYTES_KEY, U64.pack(0), db=env.meta)
            return n

        return self.transact(write, write=True)

    def recount_used(self) -> int:
        def write(txn) -> int:
            total = sum(len(v) for _, v in txn.cursor(db=self.env.fragments))
            txn.put(USED_BYTES_KEY, U64.pack(total), db=self.env.meta)
            return total

        return self.transact(write, write=True)

    # -- size and closing ---------------------------------------------------------------------

    def used_bytes(self) -> int:
        return self.transact(self.used_in)

    # -- the prefix index ---------------------------------------------------------------------

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
