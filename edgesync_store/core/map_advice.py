"""Read-ahead for whole-blob reads through LMDB's map (opened ``readahead=False``: ``MADV_RANDOM``).

:meth:`MapAdvice.whole_values` turns the map to ``MADV_NORMAL`` for a block of whole-blob reads
and back after it. The map's address, which py-lmdb does not expose, is read from
``/proc/self/maps``. Linux only: elsewhere, or when ``madvise`` fails, reads run without advice.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

log = logging.getLogger(__name__)

MADV_NORMAL = 0
MADV_RANDOM = 1
MADV_DONTNEED = 4
"""``madvise`` advice values (Linux ``<sys/mman.h>``)."""

_LIBC = None


def _madvise():
    """libc's ``madvise``, or None off Linux."""
    global _LIBC
    if _LIBC is None and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _LIBC = libc
    return _LIBC.madvise if _LIBC is not None else None


def mapped_ranges(data_file: Path) -> list[tuple[int, int]]:
    """The ``[start, end)`` address ranges this process maps ``data_file`` at (from
    ``/proc/self/maps``; empty when unreadable)."""
    target = os.path.realpath(data_file)
    ranges = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                if line.rstrip("\n").endswith(target):
                    start, end = line.split(None, 1)[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:
        return []
    return ranges


def drop_pages(view: memoryview) -> bool:
    """Unmap this process's pages under ``view``, a read-only view of a shared file mapping
    (``MADV_DONTNEED`` on the whole pages inside it): resident memory drops, the page cache
    keeps the bytes, and a later read of the view maps them again. Never for anonymous memory,
    whose pages it would zero. Returns whether it was done (not off Linux)."""
    madvise = _madvise()
    if madvise is None or not len(view):
        return False
    start = np.frombuffer(view, np.uint8).ctypes.data
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + len(view)) // mmap.PAGESIZE * mmap.PAGESIZE
    return last <= first or madvise(first, last - first, MADV_DONTNEED) == 0


class MapAdvice:
    """Read-ahead toggling for the map of ``data_file`` (the environment's ``data.mdb``)."""

    def __init__(self, data_file: Path) -> None:
        self.data_file = data_file
        self._ranges: list[tuple[int, int]] = []
        self._for_size = -1

    def _advise(self, advice: int, map_size: int) -> bool:
        madvise = _madvise()
        if madvise is None:
            return False
        if map_size != self._for_size:
            self._ranges, self._for_size = mapped_ranges(self.data_file), map_size
        done = False
        for start, end in self._ranges:
            if madvise(start, end - start, advice) == 0:
                done = True
            else:
                log.debug("madvise(%d) on %s failed: errno %d", advice, self.data_file, ctypes.get_errno())
                self._for_size = -1  # the mapping moved: read the ranges again next time
        return done

    @contextmanager
    def whole_values(self, map_size: int) -> Iterator[None]:
        """Read-around for the block's reads (``MADV_NORMAL``), ``MADV_RANDOM`` again after it.
        ``map_size``: the environment's current map size in bytes (the ranges are read again
        when it changed). The caller holds the environment's lock, so no other thread of this
        process reads through the map meanwhile."""
        advised = self._advise(MADV_NORMAL, map_size)
        try:
            yield
        finally:
            if advised:
                self._advise(MADV_RANDOM, map_size)

    def release(self, map_size: int) -> bool:
        """Unmap this process's pages of the map (``MADV_DONTNEED``: its resident memory drops,
        the page cache keeps them, the next read maps them again). The caller holds the
        environment's lock and no read transaction's views. Returns whether it was done."""
        return self._advise(MADV_DONTNEED, map_size)
