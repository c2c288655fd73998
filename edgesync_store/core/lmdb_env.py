"""The LMDB side of a store: directory (mode 0700: it holds prompts), environment, key layout and
the transactions that grow the map. Five core databases (:meth:`LmdbEnv.create_layout`):

* ``fragments``: store key (32 bytes, ``schema.store_key``) -> blob (``codec``);
* ``heads``: store key -> the blob's head (``codec.head_of``), written and deleted with the
  blob: what the walk, the sweep and ``dump`` read, so they never map a blob;
* ``by_prefix`` (dupsort): namespace digest + prefix hash (``walk.index_key``, 64 bytes) -> keys
  of the fragments that start right after that prefix;
* ``lifecycle``: store key -> ``ttl.Lifecycle`` (45 bytes): hits, times, sizes, apart from the
  tensors;
* ``meta``: ``format_version`` (ASCII digits), ``used_bytes`` and ``max_bytes`` (``<Q``), and
  ``reuse_tokens:`` + namespace digest -> the latest hit's token IDs (``<i4``).

Companions (``donors``, ``emb_vectors``, ``emb_meta``, ``documents``) make nine of :data:`MAX_DBS`.
Before a large write the map is grown to hold it (:meth:`LmdbEnv.reserve`); a map that still
fills is doubled and the write retried; any other ``lmdb.Error`` leaves as ``StoreIOError``.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

import lmdb

from edgesync_store.core.locks import COMPACT_LOCK_NAME, OPEN_LOCK_NAME, PINS_LOCK_NAME
from edgesync_store.core.map_advice import MapAdvice
from edgesync_store.errors import (
    StoreDamagedError,
    StoreFormatError,
    StoreIOError,
    StoreOpenError,
    StoreUnavailableError,
)

log = logging.getLogger(__name__)

FRAGMENTS_DB = b"fragments"
HEADS_DB = b"heads"
BY_PREFIX_DB = b"by_prefix"
LIFECYCLE_DB = b"lifecycle"
META_DB = b"meta"
CORE_DATABASES = ((FRAGMENTS_DB, False), (BY_PREFIX_DB, True), (LIFECYCLE_DB, False), (META_DB, False))
"""``(name, dupsort)`` of the four core databases."""
USED_BYTES_KEY = b"used_bytes"
MAX_BYTES_KEY = b"max_bytes"
REUSE_TOKENS_PREFIX = b"reuse_tokens:"
FORMAT_VERSION_KEY = b"format_version"
STORE_FORMAT_VERSION = 3
"""The layout this code reads and writes (``meta``'s ``format_version``)."""
U64 = struct.Struct("<Q")
"""Little-endian unsigned 64-bit counter: ``used_bytes``, ``max_bytes`` and the vectors' labels."""

MAX_DBS = 16
"""Named databases an environment may hold (a per-process setting of LMDB, not on disk)."""
DEFAULT_MAP_SIZE = 256 * 1024 * 1024
"""Initial LMDB map size in bytes: address space, not disk (the file grows with the pages written);
doubled before a write that needs more (:meth:`LmdbEnv.reserve`) or when a write finds it full.
Small, so that a small store maps little; a 4.3 GB store-back (32K tokens of Llama-3.1-8B's f16
KV) grows it to 8 GiB in five doublings before its one transaction (docs/configuration.md)."""
MAX_MAP_SIZE = 1 << 40
"""The largest map, bytes (1 TiB): growth stops there and a write that needs more fails
(StoreIOError). Far above any budget a device holds; a 32-bit process cannot map even 4 GiB."""
MAP_SLACK = 1024 * 1024
"""Bytes :meth:`LmdbEnv.reserve` adds to every write's estimate, besides :data:`RECORD_PAGES` a
record and :data:`FREE_LIST_SHARE` of the map in use: branch pages the write copies (LMDB copies
every page it changes)."""
FREE_LIST_SHARE = 1 / 256
"""Share of the pages in use plus the write that :meth:`LmdbEnv.reserve` adds for the free-page
list: a write that evicts records lists each page it frees (8 bytes a 4 KiB page, 1/512), twice over."""
RECORD_PAGES = 4
"""Pages :meth:`LmdbEnv.reserve` allows each record of a write besides its bytes: its last
overflow page, rounded up, and the leaf pages of its head, index entry and lifecycle record."""
OWN_FILES = ("lock.mdb", OPEN_LOCK_NAME, PINS_LOCK_NAME, COMPACT_LOCK_NAME)
"""Files of ours that may sit in a store directory without ``data.mdb`` (besides ``semantic.*``)."""
T = TypeVar("T")


def read_u64(value) -> int | None:
    """A ``<Q`` record as an int, or None when absent or not 8 bytes."""
    return U64.unpack(bytes(value))[0] if value is not None and len(value) == U64.size else None


def format_version(db_owner) -> int:
    """The format version in ``meta`` of an :class:`LmdbEnv` or a store; 0 without ``meta``.
    Raises StoreFormatError when the record is not a number, StoreIOError when LMDB fails."""
    meta = db_owner.named_db(META_DB)
    if meta is None:
        return 0
    found = db_owner.transact(lambda txn: bytes(v) if (v := txn.get(FORMAT_VERSION_KEY, db=meta)) is not None else None)
    if found is None:
        return 0
    try:
        return int(found)
    except ValueError:
        raise StoreFormatError(f"store {db_owner.path}: format_version {found[:20]!r} is not a number") from None


def fsync_dir(path: str | os.PathLike) -> None:
    """``fsync`` a directory, so that a rename or unlink in it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def path_state(path: Path) -> tuple[bool, bool, bool]:
    """``(exists, is_dir, readable)`` of a store path, without raising: ``readable`` is False
    for a directory we may not list or enter, or a path inside a directory we may not enter
    (then the other two are False)."""
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except PermissionError:  # a parent directory we may not enter
        return False, False, False
    return exists, is_dir, not is_dir or os.access(path, os.R_OK | os.X_OK)


def prepare_dir(path: Path, readonly: bool) -> None:
    """Check that ``path`` can hold a store and create it (mode 0700) when missing and writable.

    Raises StoreOpenError when the path is not UTF-8, a file, a non-empty directory without a
    store, or (read-only) holds no store; StoreUnavailableError when it cannot be created or read.
    """
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise StoreOpenError(f"store path {path!r}: is not valid UTF-8 (LMDB needs it)") from None
    exists, is_dir, readable = path_state(path)
    if not readable:
        raise StoreUnavailableError(f"cannot read the store directory {path}: permission denied")
    if exists and not is_dir:
        raise StoreOpenError(f"store path {path}: exists and is not a directory")
    if is_dir and not (path / "data.mdb").exists():
        others = [p.name for p in path.iterdir()
                  if p.name not in OWN_FILES and not p.name.startswith(("semantic.", ".reclaim"))]
        if others:
            shown = ", ".join(sorted(others)[:3]) + (", ..." if len(others) > 3 else "")
            raise StoreOpenError(
                f"store path {path}: holds other files ({shown}) and no EdgeSync store"
                + ("" if readonly else "; choose an empty or new directory")
            )
    if readonly and not (path / "data.mdb").exists():
        raise StoreOpenError(f"no EdgeSync store at {path}")
    if not readonly and not exists:
        try:
            path.mkdir(mode=0o700, parents=True)  # a new store is private: it holds prompts
            os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
        except FileExistsError:
            if not path.is_dir():  # another process made a file there meanwhile
                raise StoreOpenError(f"store path {path}: exists and is not a directory") from None
            # another process opening the same new store created it first: it set the mode
        except OSError as exc:
            raise StoreUnavailableError(f"cannot create the store directory {path}: {exc}") from None


class LmdbEnv:
    """One store directory's LMDB environment, its named-database handles and transactions.

    Args:
        map_size: initial map size in bytes.
        lock: use LMDB's lock file (False only for a read-only look at a store we cannot write).

    Attributes:
        lock: the re-entrant lock of this process's threads around the environment.
        fragments, by_prefix, lifecycle, meta, heads: handles (after :meth:`open_core`; ``heads``
            is None in a pre-3 store opened read-only: heads are then read from the blobs).

    Raises:
        StoreDamagedError: unreadable meta pages where a store was opened before (``pins.lock``).
        StoreOpenError: ``data.mdb`` is not an LMDB file. StoreUnavailableError: LMDB refused.
    """

    def __init__(self, path: Path, map_size: int, readonly: bool, lock: bool) -> None:
        self.path = path
        self.readonly = readonly
        self.lock = threading.RLock()
        self._map_size = map_size
        self._use_lock_file = lock
        self._named: dict[bytes, object] = {}
        self._open_txns = 0  # transactions of this process open now (held under self.lock)
        self.advice = MapAdvice(path / "data.mdb")
        self.fragments = self.by_prefix = self.lifecycle = self.meta = self.heads = None
        self._env = self._open()

    def _open(self) -> lmdb.Environment:
        try:
            return lmdb.open(str(self.path), map_size=self._map_size, subdir=True, max_dbs=MAX_DBS, mode=0o600,
                             readonly=self.readonly, lock=self._use_lock_file, readahead=False, meminit=False,
                             max_readers=256)
        except lmdb.InvalidError as exc:
            size = (self.path / "data.mdb").stat().st_size if (self.path / "data.mdb").exists() else 0
            # pins.lock is created only after a successful open (FragmentStore): only then did
            # this directory hold an EdgeSync store, which is damaged; else the file is foreign
            if (self.path / PINS_LOCK_NAME).exists():
                if 0 < size < 2 * mmap.PAGESIZE:  # cut inside LMDB's two meta pages (mdb.c: mdb_env_read_header)
                    raise StoreDamagedError(self.path, f"data.mdb is truncated to {size} bytes, inside LMDB's "
                                                       "meta pages") from None
                raise StoreDamagedError(self.path, f"data.mdb's LMDB meta pages are unreadable ({exc})") from None
            raise StoreOpenError(f"cannot open the store at {self.path}: data.mdb is not an LMDB file "
                                 f"({exc})") from None
        except lmdb.Error as exc:
            raise StoreUnavailableError(f"cannot open the store at {self.path}: {exc}") from None

    def check_is_edgesync(self) -> None:
        """Close and refuse a truncated data file (LMDB would SIGBUS past its end) with
        StoreDamagedError, and a foreign LMDB environment with StoreOpenError."""
        info, psize = self._env.info(), self._env.stat()["psize"]
        data = self.path / "data.mdb"
        needed = (info["last_pgno"] + 1) * psize
        if data.exists() and data.stat().st_size < needed:
            self._env.close()
            raise StoreDamagedError(self.path, f"data.mdb is truncated ({data.stat().st_size} of {needed} bytes)")
        # in a transaction: another process may grow the map between lmdb.open and this read
        names = self.transact(lambda txn: {bytes(k) for k, _ in txn.cursor()})
        # any one core database marks an EdgeSync store (a store created one database per
        # transaction may have been killed before it had all four: create_layout completes it)
        if names and not names & {name for name, _ in CORE_DATABASES}:
            self._env.close()
            raise StoreOpenError(f"store path {self.path}: holds an LMDB database that is not an EdgeSync store")

    def create_layout(self) -> None:
        """Create a new store's databases at :data:`STORE_FORMAT_VERSION` in one write
        transaction (idempotent: it completes a store killed while creating them one by one)."""
        def write(txn) -> None:
            handles = {name: self.named_db(name, create=True, dupsort=dup, txn=txn)
                       for name, dup in (*CORE_DATABASES, (HEADS_DB, False))}
            if txn.get(USED_BYTES_KEY, db=handles[META_DB]) is None:
                txn.put(USED_BYTES_KEY, U64.pack(0), db=handles[META_DB])
            txn.put(FORMAT_VERSION_KEY, str(STORE_FORMAT_VERSION).encode(), db=handles[META_DB])

        self.transact(write, write=True)
        self.forget_handles()

    def open_core(self, companions: Iterable[bytes] = ()) -> bool:
        """Open the four core database handles (and cache ``companions`` when they exist);
        False when one of the core databases is missing."""
        self._named.clear()
        self.fragments = self.named_db(FRAGMENTS_DB)
        self.by_prefix = self.named_db(BY_PREFIX_DB, dupsort=True)
        self.lifecycle = self.named_db(LIFECYCLE_DB)
        self.meta = self.named_db(META_DB)
        self.heads = self.named_db(HEADS_DB)
        for name in companions:  # cached now, if they exist: see named_db
            self.named_db(name)
        return None not in (self.fragments, self.by_prefix, self.lifecycle, self.meta)

    def forget_handles(self) -> None:
        """Drop the cached handles (after a write transaction that created databases)."""
        self._named.clear()

    def named_db(self, name: bytes, create: bool = False, dupsort: bool = False, txn=None):
        """The handle of database ``name``, or None when it does not exist and ``create`` is
        False or the environment is read-only. Cached until :meth:`reopen` unless opened in
        ``txn`` (opening without one starts a write transaction: pass it inside another)."""
        with self.lock:
            handle = self._named.get(name)
            if handle is not None:
                return handle
            for _ in range(64):
                try:
                    try:
                        handle = self._env.open_db(name, txn=txn, dupsort=dupsort, create=create and not self.readonly)
                        break
                    except lmdb.MapResizedError:  # another process grew the map since lmdb.open
                        if txn is not None:
                            raise  # the enclosing transact() adopts the new size and retries
                        self._env.set_mapsize(0)
                    except (lmdb.NotFoundError, lmdb.ReadonlyError):
                        return None
                except lmdb.Error as exc:
                    if txn is not None:
                        raise  # transact() turns it into StoreIOError
                    raise StoreIOError(f"store {self.path}: cannot open database {name!r}: {exc}") from exc
            else:
                raise StoreIOError(f"store {self.path}: cannot open database {name!r} (the map keeps growing)")
            if txn is None:
                self._named[name] = handle
            return handle

    def transact(self, fn: Callable[[lmdb.Transaction], T], write: bool = False) -> T:
        """``fn(txn)`` in one transaction (committed when it returns, aborted when it raises),
        rerun after growing or re-reading the map. Raises PermissionError for ``write`` when
        read-only, StoreIOError when LMDB fails (map past 1 TiB, I/O, corruption), else what ``fn`` raises."""
        if write and self.readonly:
            raise PermissionError(f"store {self.path} is open read-only")
        for _ in range(64):
            with self.lock:
                try:
                    try:
                        with self._env.begin(write=write, buffers=True) as txn, self._counted():
                            return fn(txn)
                    except lmdb.MapFullError:
                        new_size = min(self._env.info()["map_size"] * 2, MAX_MAP_SIZE)
                        log.info("LMDB map full: growing %s to %d bytes", self.path, new_size)
                        self._set_mapsize(new_size)
                    except lmdb.MapResizedError:
                        log.debug("another process grew the map of %s", self.path)
                        self._env.set_mapsize(0)
                except lmdb.Error as exc:  # also a failed growth
                    raise StoreIOError(f"store {self.path}: {type(exc).__name__}: {exc}") from exc
        raise StoreIOError(f"store {self.path}: cannot grow the map beyond {MAX_MAP_SIZE} bytes")

    @contextmanager
    def _counted(self) -> Iterator[None]:
        """Count a transaction of this process as open for the ``with`` block (under :attr:`lock`)."""
        self._open_txns += 1
        try:
            yield
        finally:
            self._open_txns -= 1

    def _set_mapsize(self, size: int) -> None:
        """``set_mapsize`` when no transaction of this process is open: LMDB remaps the file, and
        the values a transaction still holds (memoryviews into the map) would point at nothing.
        Caller holds :attr:`lock`; StoreIOError when a transaction is open, ``lmdb.Error`` when
        LMDB refuses."""
        if self._open_txns:
            raise StoreIOError(f"store {self.path}: the map must grow to {size} bytes, but a transaction of this "
                               "process is open (a write inside a read)")
        self._env.set_mapsize(size)

    def reserve(self, nbytes: int, records: int = 1) -> int:
        """Grow the map before a write of ``nbytes`` bytes of values in ``records`` records, so
        that it holds the pages in use plus the write's (:data:`RECORD_PAGES` a record, the
        free-page list, :data:`MAP_SLACK`): doubled until it does, up to :data:`MAX_MAP_SIZE`. Pages the write
        frees are not reused by it (LMDB), so the pages in use count whole. Without it a write
        of gigabytes would fill the map, be dropped and be redone at every doubling.

        Returns the map size, bytes. A read-only environment, a map that holds the write, or a
        call inside another transaction of this process (the map may not be remapped then)
        changes nothing; the write's own retry still grows the map if the estimate falls short.
        Raises StoreIOError when LMDB refuses.
        """
        with self.lock:
            try:
                info = self._env.info()
                size = info["map_size"]
                if self.readonly or self._open_txns:
                    return size
                psize = self._env.stat()["psize"]
                end = (info["last_pgno"] + 1) * psize + nbytes
                need = end + int(end * FREE_LIST_SHARE) + RECORD_PAGES * max(records, 1) * psize + MAP_SLACK
                if need <= size:
                    return size
                while size < need and size < MAX_MAP_SIZE:
                    size = min(size * 2, MAX_MAP_SIZE)
                log.info("LMDB map: growing %s to %d bytes ahead of a write of %d bytes", self.path, size, nbytes)
                self._set_mapsize(size)
                return size
            except lmdb.Error as exc:
                raise StoreIOError(f"store {self.path}: {type(exc).__name__}: {exc}") from exc

    def has_blob(self, txn, key: bytes) -> bool:
        """True when ``fragments`` holds ``key``; a cursor reads only the B-tree (getting a large
        value would map its pages)."""
        return txn.cursor(db=self.fragments).set_key(key)

    def head_in(self, txn, key: bytes) -> memoryview | None:
        """The head of fragment ``key`` (a ``codec.peek`` input), read in ``txn`` without
        mapping its blob; None when no blob is stored. It comes from ``heads``, or from the blob
        itself where that database has none (a store older than format 3 opened read-only)."""
        if not self.has_blob(txn, key):
            return None
        head = txn.get(key, db=self.heads) if self.heads is not None else None
        return head if head is not None else txn.get(key, db=self.fragments)

    @contextmanager
    def reader(self) -> Iterator[lmdb.Transaction]:
        """A read transaction whose values are views into the map, held with :attr:`lock` for
        the ``with`` block (keep it short: other threads wait, and writers cannot reuse freed
        pages), read-ahead on (``MapAdvice``). StoreIOError: LMDB failed to begin it."""
        with self.lock:
            for _ in range(64):
                try:
                    txn = self._env.begin(buffers=True)
                    break
                except lmdb.MapResizedError:
                    self._env.set_mapsize(0)
                except lmdb.Error as exc:
                    raise StoreIOError(f"store {self.path}: {type(exc).__name__}: {exc}") from exc
            else:
                raise StoreIOError(f"store {self.path}: the map keeps growing")
            try:
                with self.advice.whole_values(self._env.info()["map_size"]), self._counted():
                    yield txn
            except lmdb.Error as exc:
                raise StoreIOError(f"store {self.path}: {type(exc).__name__}: {exc}") from exc
            finally:
                txn.abort()

    def map_size(self) -> int:
        """The current map size in bytes."""
        return self._env.info()["map_size"]

    def page_bytes(self, names: Iterable[bytes] | None = None) -> int:
        """Bytes of the pages the databases ``names`` use; None: every page in use (LMDB's two
        meta pages, the main database and every named one)."""

        def read(txn):
            psize = self._env.stat()["psize"]
            pages = 0 if names is not None else 2 + _pages(txn.stat())
            for name in (names if names is not None else [bytes(k) for k, _ in txn.cursor()]):
                db = self.named_db(bytes(name), txn=txn)
                if db is not None:
                    pages += _pages(txn.stat(db))
            return pages * psize

        return self.transact(read)

    def copy_compact(self, fd: int) -> None:
        """Write a compact copy of the environment (no free pages) to the open file ``fd``."""
        try:
            self._env.copyfd(fd, compact=True)
        except lmdb.Error as exc:
            raise StoreIOError(f"store {self.path}: compact copy failed: {exc}") from exc

    def close(self) -> None:
        """Close the environment (idempotent; handles become invalid)."""
        self._env.close()

    def reopen(self, companions: Iterable[bytes] = ()) -> None:
        """Close and reopen the environment (after its ``data.mdb`` was replaced) and its core
        handles. The caller holds :attr:`lock`."""
        self._env.close()
        self._env = self._open()
        self.open_core(companions)


def _pages(stat: dict) -> int:
    return stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
