"""A structural check of an LMDB data file (``data.mdb``) that parses LMDB's on-disk format with
``pread`` calls: it never maps the file nor runs LMDB's C code, so a corrupt page cannot send it
outside the file. Callers still run it in a child process (``core/page_check.py``).

From the newest valid meta page (0 or 1, the larger transaction id) it verifies:

* both meta pages: ``P_META``, magic ``0xBEEFC0DE``, version 1, one page size;
* the free-page, main and every named database (``F_SUBDATA`` nodes), walked from their roots:
  page numbers within ``mm_last_pg`` and the file, each page's number and flags, its
  ``mp_lower``/``mp_upper`` and every node inside it, keys strictly increasing (``memcmp``)
  within and across pages and inside the branch separators, all leaves at ``md_depth``;
* duplicates (``F_DUPDATA``): sub-pages inside their node, sub-databases like any tree;
* large values (``F_BIGDATA``): the overflow run inside the file, its first page
  ``P_OVERFLOW`` with enough pages (``OVPAGES``); no payload is read;
* each database's ``md_entries`` and page counts against the walk's; no page reached twice.

Layout (64-bit ``pgno_t``, little-endian, ``PAGEHDRSZ`` 16, ``NODESIZE`` 8): LMDB 0.9's
``mdb.c`` as vendored by py-lmdb (``MDB_page``, ``MDB_meta``, ``MDB_db``, ``MDB_node``).
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

MDB_MAGIC = 0xBEEFC0DE
MDB_DATA_VERSION = 1
PAGEHDRSZ = 16
NODESIZE = 8
P_INVALID = (1 << 64) - 1
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_DIRTY, P_LEAF2, P_SUBP = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MDB_REVERSEKEY, MDB_DUPSORT, MDB_INTEGERKEY, MDB_DUPFIXED, MDB_INTEGERDUP, MDB_REVERSEDUP = (
    0x02, 0x04, 0x08, 0x10, 0x20, 0x40)
WALKS = 5
"""Walks of a store that writers keep changing before its damage is believed (``check_file``)."""
FREE_NAME = "(free pages)"
MAX_DEPTH = 64
"""Deeper than any B-tree a 64-bit page number can address with two keys per page."""

_PAGE_HEADER = struct.Struct("<QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
_OVERFLOW_HEADER = struct.Struct("<QHHI")  # mp_pgno, mp_pad, mp_flags, mp_pages
_META = struct.Struct("<IIQQ")  # mm_magic, mm_version, mm_address, mm_mapsize (after PAGEHDRSZ)
_DB = struct.Struct("<IHHQQQQQ")  # MDB_db: pad, flags, depth, branch, leaf, overflow, entries, root
_NODE = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
_META_DBS = PAGEHDRSZ + _META.size  # mm_dbs[FREE_DBI], then mm_dbs[MAIN_DBI]
_META_TAIL = struct.Struct("<QQ")  # mm_last_pg, mm_txnid
_META_BYTES = _META_DBS + 2 * _DB.size + _META_TAIL.size


class Damage(Exception):
    """What the check found wrong: ``str(exc)`` names the database, the page and the fault."""


class HeaderDamage(Damage):
    """The meta pages are not LMDB's (a file cut inside them, a wrong magic, version or page
    size): LMDB refuses such a file itself, with ``pread`` only (``mdb_env_read_header``)."""


@dataclass
class Db:
    """One ``MDB_db`` record (sizes in pages; ``root`` is ``P_INVALID`` for an empty tree)."""

    name: str
    flags: int
    depth: int
    branch_pages: int
    leaf_pages: int
    overflow_pages: int
    entries: int
    root: int
    pad: int = 0

    @classmethod
    def unpack(cls, name: str, raw: bytes) -> Db:
        pad, flags, depth, branch, leaf, overflow, entries, root = _DB.unpack(raw)
        return cls(name, flags, depth, branch, leaf, overflow, entries, root, pad)


@dataclass
class Report:
    """The outcome of :func:`check_file`: ``damage`` is None for a healthy file.

    Attributes:
        header: the damage is in the meta pages, which LMDB refuses safely by itself.
        databases: named databases walked (the main and free databases not included).
        pages: tree and overflow pages accounted for.
        txnid: the transaction id of the meta page used.
        runs: ``(first page, pages, database, page flags)`` of every page reached, by page
            number (a healthy file's map: where tests and the fuzz run aim their damage).
    """

    damage: str | None = None
    header: bool = False
    databases: list[str] = field(default_factory=list)
    pages: int = 0
    txnid: int = 0
    runs: list[tuple[int, int, str, int]] = field(default_factory=list, repr=False)

    @property
    def healthy(self) -> bool:
        return self.damage is None

    def to_dict(self) -> dict:
        return {"healthy": self.healthy, "damage": self.damage, "header": self.header, "databases": self.databases,
                "pages": self.pages, "txnid": self.txnid}


@dataclass
class _Count:
    branch: int = 0
    leaf: int = 0
    overflow: int = 0
    entries: int = 0


class _Walker:
    def __init__(self, fd: int, size: int, psize: int, last_pg: int) -> None:
        self.fd, self.size, self.psize, self.last_pg = fd, size, psize, last_pg
        self.runs: list[tuple[int, int, str, int]] = []  # (first page, pages, database, page flags)
        self.named: list[str] = []
        self.seen: set[int] = set()  # tree pages reached

    def read_page(self, pgno: int, what: str) -> bytes:
        if pgno > self.last_pg or (pgno + 1) * self.psize > self.size:
            raise Damage(f"{what}: page {pgno} is beyond the file (last page {self.last_pg}, "
                         f"{self.size} bytes)")
        data = os.pread(self.fd, self.psize, pgno * self.psize)
        if len(data) != self.psize:
            raise Damage(f"{what}: page {pgno} could not be read whole")
        return data

    def walk(self, db: Db) -> None:
        """Walk the tree of ``db`` and compare the counts with its record."""
        if db.root == P_INVALID:
            if db.entries or db.depth or db.branch_pages or db.leaf_pages or db.overflow_pages:
                raise Damage(f"database {db.name}: empty root but {db.entries} entries, depth {db.depth}")
            return
        count = _Count()
        self._tree(db, db.root, 1, None, None, count, [None])
        expected = _Count(db.branch_pages, db.leaf_pages, db.overflow_pages, db.entries)
        if count != expected:
            raise Damage(f"database {db.name}: counted {count.branch} branch, {count.leaf} leaf and "
                         f"{count.overflow} overflow pages and {count.entries} entries; its record says "
                         f"{db.branch_pages}, {db.leaf_pages}, {db.overflow_pages} and {db.entries}")

    def _tree(self, db: Db, pgno: int, depth: int, low: bytes | None, high: bytes | None,
              count: _Count, last: list) -> None:
        where = f"database {db.name}, page {pgno}"
        if depth > min(db.depth, MAX_DEPTH):
            raise Damage(f"{where}: deeper than the tree's depth {db.depth}")
        if pgno in self.seen:  # at once: a loop of branches would otherwise be walked again and again
            raise Damage(f"{where}: the page is reached twice")
        self.seen.add(pgno)
        page = self.read_page(pgno, f"database {db.name}")
        own, _pad, flags, lower, upper = _PAGE_HEADER.unpack_from(page)
        if own != pgno:
            raise Damage(f"{where}: the page says it is page {own}")
        self.runs.append((pgno, 1, db.name, flags))
        kind = flags & ~(P_DIRTY | 0xC000)
        if kind == P_BRANCH:
            if depth == db.depth:
                raise Damage(f"{where}: a branch page at the leaf depth {db.depth}")
            count.branch += 1
            nodes = _nodes(page, lower, upper, self.psize, where)
            if not nodes:
                raise Damage(f"{where}: a branch page without children")
            keys = [None] + [_key(db, _branch_node(page, off, self.psize, where)[1]) for off in nodes[1:]]
            _ordered(keys[1:], low, high, where)
            for i, off in enumerate(nodes):
                child, _sep = _branch_node(page, off, self.psize, where)
                self._tree(db, child, depth + 1, keys[i] if i else low,
                           keys[i + 1] if i + 1 < len(keys) else high, count, last)
        elif kind == P_LEAF:
            if depth != db.depth:
                raise Damage(f"{where}: a leaf page at depth {depth}, the tree's depth is {db.depth}")
            count.leaf += 1
            nodes = _nodes(page, lower, upper, self.psize, where)
            if not nodes and pgno != db.root:
                raise Damage(f"{where}: an empty leaf page below a branch")
            keys = [_key(db, self._leaf_node(db, page, off, where, count)) for off in nodes]
            _ordered(keys, low, high, where)
            if keys and last[0] is not None and keys[0] <= last[0]:
                raise Damage(f"{where}: its first key is not after the previous page's last key")
            if keys:
                last[0] = keys[-1]
        else:
            raise Damage(f"{where}: flags 0x{flags:x}, expected a branch or leaf page")

    def _leaf_node(self, db: Db, page: bytes, off: int, where: str, count: _Count) -> bytes:
        lo, hi, nflags, ksize = _NODE.unpack_from(page, off)
        dsize = lo | hi << 16
        inline = 8 if nflags & F_BIGDATA else dsize
        end = off + NODESIZE + ksize + inline
        if end > len(page):
            raise Damage(f"{where}: a node at offset {off} (key {ksize}, value {dsize} bytes) overruns the page")
        key = page[off + NODESIZE:off + NODESIZE + ksize]
        value = page[off + NODESIZE + ksize:end]
        if nflags & ~(F_BIGDATA | F_SUBDATA | F_DUPDATA):
            raise Damage(f"{where}: a node with unknown flags 0x{nflags:x}")
        if nflags & F_BIGDATA:
            if nflags & (F_SUBDATA | F_DUPDATA):
                raise Damage(f"{where}: a node flagged both large and duplicate/sub-database")
            count.overflow += self._overflow(db, struct.unpack("<Q", value)[0], dsize, where)
            count.entries += 1
        elif nflags & F_DUPDATA:
            if not db.flags & MDB_DUPSORT:
                raise Damage(f"{where}: duplicates in a database without MDB_DUPSORT")
            count.entries += self._dups(db, key, value, nflags, where)
        elif nflags & F_SUBDATA:
            if db.name != "(main)" or dsize != _DB.size:
                raise Damage(f"{where}: a sub-database record outside the main database or of {dsize} bytes")
            name = key.decode("utf-8", "backslashreplace")
            sub = Db.unpack(name, value)
            if sub.flags & (MDB_REVERSEKEY | MDB_INTEGERKEY | MDB_INTEGERDUP | MDB_REVERSEDUP):
                raise Damage(f"database {name}: flags 0x{sub.flags:x}, not ones EdgeSync uses")
            self.named.append(name)
            self.walk(sub)
            count.entries += 1
        else:
            count.entries += 1
        return key

    def _overflow(self, db: Db, first: int, dsize: int, where: str) -> int:
        pages = (PAGEHDRSZ - 1 + dsize) // self.psize + 1  # OVPAGES
        if first > self.last_pg or first + pages - 1 > self.last_pg or (first + pages) * self.psize > self.size:
            raise Damage(f"{where}: a value of {dsize} bytes on overflow pages {first}..{first + pages - 1}, "
                         f"beyond the file (last page {self.last_pg}, {self.size} bytes)")
        own, _pad, flags, run = _OVERFLOW_HEADER.unpack(os.pread(self.fd, _OVERFLOW_HEADER.size, first * self.psize))
        if own != first or flags & ~(P_DIRTY | 0xC000) != P_OVERFLOW:
            raise Damage(f"database {db.name}, overflow page {first}: header says page {own}, flags 0x{flags:x}")
        if run < pages or first + run - 1 > self.last_pg:
            raise Damage(f"database {db.name}, overflow page {first}: {run} pages, the value of {dsize} bytes "
                         f"needs {pages} (last page {self.last_pg})")
        self.runs.append((first, run, db.name, flags))
        return run

    def _dups(self, db: Db, key: bytes, value: bytes, nflags: int, where: str) -> int:
        name = f"{db.name} (duplicates of key {bytes(key[:8]).hex()}...)"
        if nflags & F_SUBDATA:
            if len(value) != _DB.size:
                raise Damage(f"{where}: a duplicates record of {len(value)} bytes")
            sub = Db.unpack(name, value)
            self.walk(sub)
            if sub.entries == 0:
                raise Damage(f"{where}: an empty duplicates sub-database")
            return sub.entries
        # a sub-page inside the node: a page header and nodes whose keys are the values
        if len(value) < PAGEHDRSZ:
            raise Damage(f"{where}: a duplicates sub-page of {len(value)} bytes")
        _own, pad, flags, lower, upper = _PAGE_HEADER.unpack_from(value)
        if not flags & P_SUBP:
            raise Damage(f"{where}: a duplicates sub-page with flags 0x{flags:x}")
        if flags & P_LEAF2:
            n = (lower - PAGEHDRSZ) >> 1 if lower >= PAGEHDRSZ else -1
            if pad == 0 or n < 1 or PAGEHDRSZ + n * pad > len(value):
                raise Damage(f"{where}: a fixed-size duplicates sub-page overruns its node")
            keys = [value[PAGEHDRSZ + i * pad:PAGEHDRSZ + (i + 1) * pad] for i in range(n)]
        else:
            sub_where = f"{where}, duplicates sub-page of {name}"
            offsets = _nodes(value, lower, upper, len(value), sub_where)
            keys = []
            for off in offsets:
                _lo, _hi, _fl, ksize = _NODE.unpack_from(value, off)
                if off + NODESIZE + ksize > len(value):
                    raise Damage(f"{sub_where}: a value overruns the sub-page")
                keys.append(value[off + NODESIZE:off + NODESIZE + ksize])
            if not keys:
                raise Damage(f"{sub_where}: no values")
        _ordered(keys, None, None, f"{where}, duplicates")
        return len(keys)

    def overlaps(self) -> None:
        """Raise when two pages reached (or overflow runs) share a page, or one is a meta page."""
        prev_end, prev = 2, ("the meta pages", 0)
        for first, pages, name, _flags in sorted(self.runs):
            if first < prev_end:
                raise Damage(f"database {name}: page {first} is reached twice (also by {prev[0]}, "
                             f"page {prev[1]})")
            prev_end, prev = first + pages, (f"database {name}", first)


def _key(db: Db, raw: bytes) -> bytes | int:
    """A key as it sorts: native ``size_t`` in the free-page database (``MDB_INTEGERKEY``), else bytes."""
    return int.from_bytes(raw, "little") if db.name == FREE_NAME and len(raw) == 8 else raw


def _nodes(page: bytes, lower: int, upper: int, psize: int, where: str) -> list[int]:
    """A page's node offsets (``NUMKEYS``/``NODEPTR``), each checked within ``[mp_upper, page end)``."""
    if not PAGEHDRSZ <= lower <= upper <= psize or (lower - PAGEHDRSZ) % 2:
        raise Damage(f"{where}: lower {lower} / upper {upper} outside the page of {psize} bytes")
    n = (lower - PAGEHDRSZ) >> 1
    offsets = list(struct.unpack_from(f"<{n}H", page, PAGEHDRSZ))
    for off in offsets:
        if off < upper or off + NODESIZE > psize:
            raise Damage(f"{where}: a node pointer {off} outside the nodes' area {upper}..{psize}")
    return offsets


def _branch_node(page: bytes, off: int, psize: int, where: str) -> tuple[int, bytes]:
    lo, hi, flags, ksize = _NODE.unpack_from(page, off)
    if off + NODESIZE + ksize > psize:
        raise Damage(f"{where}: a branch node at offset {off} with a key of {ksize} bytes overruns the page")
    return lo | hi << 16 | flags << 32, page[off + NODESIZE:off + NODESIZE + ksize]  # NODEPGNO


def _ordered(keys: list[bytes], low: bytes | None, high: bytes | None, where: str) -> None:
    for a, b in zip(keys, keys[1:]):
        if not a < b:
            raise Damage(f"{where}: keys out of order")
    if keys and ((low is not None and keys[0] < low) or (high is not None and keys[-1] >= high)):
        raise Damage(f"{where}: keys outside the range of the branch above")


def _meta(fd: int, offset: int, which: int) -> tuple[int, int, int, Db, Db]:
    """``(psize, txnid, last_pg, free_db, main_db)`` of meta page ``which``."""
    raw = os.pread(fd, _META_BYTES, offset)
    if len(raw) < _META_BYTES:
        raise HeaderDamage(f"meta page {which}: the file ends inside it")
    _pgno, _pad, flags, _lower, _upper = _PAGE_HEADER.unpack_from(raw)
    magic, version, _addr, _mapsize = _META.unpack_from(raw, PAGEHDRSZ)
    if not flags & P_META or magic != MDB_MAGIC or version != MDB_DATA_VERSION:
        raise HeaderDamage(f"meta page {which}: flags 0x{flags:x}, magic 0x{magic:x}, version {version}: "
                     "not an LMDB meta page")
    free = Db.unpack(FREE_NAME, raw[_META_DBS:_META_DBS + _DB.size])
    main = Db.unpack("(main)", raw[_META_DBS + _DB.size:_META_DBS + 2 * _DB.size])
    last_pg, txnid = _META_TAIL.unpack_from(raw, _META_DBS + 2 * _DB.size)
    psize = free.pad
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        raise HeaderDamage(f"meta page {which}: page size {psize}")
    return psize, txnid, last_pg, free, main


def opened_as_store(store_dir: str | os.PathLike) -> bool:
    """True when a store was opened in ``store_dir`` before (it holds ``pins.lock``, made after
    a successful open): a data file that fails the check there is a damaged store, which
    ``edgesync clear`` recreates; elsewhere it is someone else's file, which nothing touches."""
    return (Path(store_dir) / "pins.lock").exists()


def has_data_file(store_dir: str | os.PathLike) -> bool:
    """True when ``store_dir`` holds a ``data.mdb`` to check: a regular file, or anything at that
    name where a store was opened before (:func:`opened_as_store`): a damaged store, not no store."""
    data = Path(store_dir) / "data.mdb"
    return data.is_file() or (os.path.lexists(data) and opened_as_store(store_dir))


def check_file(data_file: str | os.PathLike) -> Report:
    """Check the LMDB data file ``data_file``; damage is in the report (OSError: unreadable).
    A page freed by transaction N is reused from N + 2 on (``mdb_find_oldest``), so damage found
    while another process committed may be a reused page: the walk runs again, up to
    :data:`WALKS` times."""
    mode = os.stat(Path(data_file)).st_mode
    if not stat.S_ISREG(mode):  # a FIFO would block the read, a directory cannot be walked
        return Report(damage=f"{Path(data_file).name} is not a regular file")
    fd = os.open(Path(data_file), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        for _ in range(WALKS):
            report = _check_fd(fd)
            if report.healthy or report.header or _newest_txnid(fd) == report.txnid:
                return report
        report.damage += f" (the store changed during each of {WALKS} walks)"
        return report
    finally:
        os.close(fd)


def _newest_txnid(fd: int) -> int | None:
    try:
        psize, txnid, *_ = _meta(fd, 0, 0)
        return max(txnid, _meta(fd, psize, 1)[1])
    except Damage:
        return None


def _check_fd(fd: int) -> Report:
    report = Report()
    try:
        size = os.fstat(fd).st_size
        psize, txnid, last_pg, free, main = _meta(fd, 0, 0)
        psize1, txnid1, last_pg1, free1, main1 = _meta(fd, psize, 1)
        if psize1 != psize:
            raise HeaderDamage(f"meta pages: page sizes {psize} and {psize1} differ")
        if txnid1 > txnid:
            txnid, last_pg, free, main = txnid1, last_pg1, free1, main1
        report.txnid = txnid
        if (last_pg + 1) * psize > size:
            raise Damage(f"data.mdb is truncated ({size} of {(last_pg + 1) * psize} bytes)")
        walker = _Walker(fd, size, psize, last_pg)
        if main.flags & (MDB_REVERSEKEY | MDB_INTEGERKEY | MDB_DUPSORT):
            raise Damage(f"database (main): flags 0x{main.flags:x}")
        walker.walk(free)
        walker.walk(main)
        walker.overlaps()
        report.databases = walker.named
        report.pages = sum(run[1] for run in walker.runs)
        report.runs = sorted(walker.runs)
    except Damage as exc:
        report.damage, report.header = str(exc), isinstance(exc, HeaderDamage)
    except (struct.error, RecursionError, UnicodeError) as exc:  # a size that slipped past a check
        report.damage = f"unreadable structure: {exc}"
    return report
