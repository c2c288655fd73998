"""Cross-process coordination of one store through three lock files in its directory.

* ``edgesync.lock`` (``flock``): shared while a process has the store open; exclusive for
  reclaim and clear (:class:`OpenLock`).
* ``compact.lock`` (``flock``, exclusive, never waited for): one compactor at a time
  (:class:`CompactLock`).
* ``pins.lock`` (Linux OFD byte-range locks, ``F_OFD_SETLK``): a shared lock on one byte per
  fragment being injected (offset: the first 6 bytes of its store key); eviction probes it with
  ``F_OFD_GETLK`` (:class:`PinTable`). The kernel drops a dead process's locks. Without OFD
  locks (not Linux) pins are seen only within the process.

Both lock kinds belong to an open file description, so two stores in one process coordinate
like two processes (unlike POSIX ``fcntl`` record locks).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from edgesync_store.errors import StoreBusyError

log = logging.getLogger(__name__)

OPEN_LOCK_NAME = "edgesync.lock"
COMPACT_LOCK_NAME = "compact.lock"
PINS_LOCK_NAME = "pins.lock"
_HAS_OFD = hasattr(fcntl, "F_OFD_SETLK") and hasattr(fcntl, "F_OFD_GETLK")
# struct flock on Linux (x86-64 and arm64): short l_type, short l_whence, off_t l_start,
# off_t l_len, pid_t l_pid, padded to 32 bytes (<bits/fcntl.h>); l_pid must be 0 for OFD locks.
_FLOCK = struct.Struct("@hhqqi4x")


class OpenLock:
    """The shared ``flock`` a process holds on ``edgesync.lock`` of ``directory`` while it has the
    store open, waiting up to ``timeout_s`` seconds for another process's reclaim or clear.
    Raises StoreBusyError past ``timeout_s``, OSError when the lock file cannot be opened.
    """

    def __init__(self, directory: Path, timeout_s: float = 120.0) -> None:
        self.path = Path(directory) / OPEN_LOCK_NAME
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.exclusive = False
        try:
            self._acquire(fcntl.LOCK_SH, timeout_s)
        except BaseException:
            os.close(self._fd)
            raise

    def _acquire(self, mode: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(self._fd, mode | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            if time.monotonic() >= deadline:
                raise StoreBusyError(f"store {self.path.parent}: another process holds it exclusively "
                                     f"(a reclaim or clear) for more than {timeout_s:.0f} s")
            time.sleep(0.05)

    def try_exclusive(self) -> bool:
        """Upgrade to an exclusive lock without waiting; True when no other process has the
        store open. On False the shared lock is held again (waiting for it if needed)."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.exclusive = True
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        # a failed conversion may have dropped the shared lock (flock(2)): take it back
        self._acquire(fcntl.LOCK_SH, 3600.0)
        return False

    def share(self) -> None:
        """Back from exclusive to shared."""
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        self.exclusive = False

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class PinTable:
    """Fragments that requests are injecting now, visible to every process: ``with
    pins.pinned(keys)`` pins store keys for the block; :meth:`is_pinned` tells eviction."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / PINS_LOCK_NAME
        self._counts: Counter[bytes] = Counter()
        self._lock = threading.Lock()
        self._hold = self._probe = -1
        if _HAS_OFD:
            try:
                self._hold = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                self._probe = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:  # a read-only store directory: pins stay in-process
                log.debug("pins in this process only: %s", exc)
                self.close()

    @staticmethod
    def _offset(key: bytes) -> int:
        return int.from_bytes(bytes(key[:6]), "big")

    def _set(self, key: bytes, lock_type: int) -> None:
        if self._hold < 0:
            return
        try:
            fcntl.fcntl(self._hold, fcntl.F_OFD_SETLK, _FLOCK.pack(lock_type, os.SEEK_SET, self._offset(key), 1, 0))
        except OSError as exc:  # never fail a request for a pin; eviction then sees the local count only
            log.debug("pin %s: %s", key.hex()[:16], exc)

    @contextmanager
    def pinned(self, keys: Iterable[bytes]) -> Iterator[None]:
        """Pin ``keys`` for the duration of the block (re-entrant, counted per key)."""
        keys = [bytes(k) for k in keys]
        with self._lock:
            for key in keys:
                self._counts[key] += 1
                if self._counts[key] == 1:
                    self._set(key, fcntl.F_RDLCK)
        try:
            yield
        finally:
            with self._lock:
                for key in keys:
                    self._counts[key] -= 1
                    if self._counts[key] <= 0:
                        del self._counts[key]
                        self._set(key, fcntl.F_UNLCK)

    def is_pinned(self, key: bytes) -> bool:
        """True when a request in any process has ``key`` pinned (or, rarely, another key
        whose first 6 bytes are the same: then eviction is merely more careful)."""
        key = bytes(key)
        with self._lock:
            if self._counts.get(key):
                return True
        if self._probe < 0:
            return False
        data = fcntl.fcntl(self._probe, fcntl.F_OFD_GETLK,
                           _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, self._offset(key), 1, 0))
        return _FLOCK.unpack(data)[0] != fcntl.F_UNLCK

    def close(self) -> None:
        """Close the lock files (drops this object's pins)."""
        for name in ("_hold", "_probe"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


class CompactLock:
    """``with CompactLock(store_dir) as acquired:`` the exclusive, non-blocking ``flock`` on
    ``compact.lock``; ``acquired`` is False when another process or lock object holds it. With
    ``required=False`` (a dry run) a lock file that cannot be created lets the run go ahead;
    else OSError.
    """

    def __init__(self, directory: Path, required: bool = True) -> None:
        self.path = Path(directory) / COMPACT_LOCK_NAME
        self.required = required
        self._fd = -1

    def __enter__(self) -> bool:
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            if self.required:
                raise
            return True  # a dry run over a store we cannot write: nothing to serialise
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            os.close(self._fd)
            self._fd = -1
            return False

    def __exit__(self, *exc) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
