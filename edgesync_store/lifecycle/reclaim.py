"""Disk reclaim: rewrite ``data.mdb`` without its free pages (LMDB never shrinks the file).

:func:`reclaim` takes ``edgesync.lock`` exclusively without waiting (``locks.OpenLock``), copies
compactly (``MDB_CP_COMPACT``) into ``.reclaim.tmp``, fsyncs, renames it over ``data.mdb``,
fsyncs the directory, removes ``lock.mdb`` and reopens: a kill leaves the old file or the new one.
Crash points ``reclaim.locked``, ``.copied``, ``.synced``, ``.renamed``, ``.reopened``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass

from edgesync_store.core.crashpoints import crash_point
from edgesync_store.core.lmdb_env import fsync_dir

log = logging.getLogger(__name__)

TMP_NAME = ".reclaim.tmp"
DEFAULT_MIN_FREE_FRACTION = 0.25
"""Reclaim when at least this fraction of ``data.mdb`` is free pages..."""
DEFAULT_MIN_FREE_BYTES = 8 * 1024 * 1024
"""...and at least this many bytes (8 MiB) would be returned to the disk."""


@dataclass
class ReclaimResult:
    """What :func:`reclaim` found and did. Sizes are bytes of ``data.mdb``."""

    file_bytes_before: int
    free_bytes: int
    file_bytes_after: int
    reclaimed: bool
    reason: str

    @property
    def bytes_reclaimed(self) -> int:
        return max(0, self.file_bytes_before - self.file_bytes_after) if self.reclaimed else 0

    def to_dict(self) -> dict:
        return {**asdict(self), "bytes_reclaimed": self.bytes_reclaimed}


def free_bytes(store) -> tuple[int, int]:
    """``(data.mdb bytes, bytes of its pages that hold nothing)``: pages up to the last used
    one that no database uses (LMDB's free list) plus file space beyond the last page."""
    size = (store.path / "data.mdb").stat().st_size
    return size, max(0, size - store.page_bytes())


def reclaim(store, min_free_fraction: float = DEFAULT_MIN_FREE_FRACTION, force: bool = False,
            dry_run: bool = False) -> ReclaimResult:
    """Rewrite ``data.mdb`` compactly when its free space passes ``min_free_fraction`` and
    :data:`DEFAULT_MIN_FREE_BYTES` (``force``: whenever any is free). The :class:`ReclaimResult`
    says why not when it did not (threshold, dry run, read-only, open elsewhere).
    OSError, StoreIOError: the copy or swap failed (the old file is still in place)."""
    if not dry_run and (store.readonly or not store.lockable):
        before, free = free_bytes(store)
        return ReclaimResult(before, free, before, False, "store is open read-only")
    if not dry_run:
        remove_stale_copy(store)
    before, free = free_bytes(store)
    result = ReclaimResult(before, free, before, False, "")
    if free <= 0 or (not force and (free < DEFAULT_MIN_FREE_BYTES or free < min_free_fraction * before)):
        result.reason = (f"{free} free bytes of {before}: below the threshold "
                         f"({min_free_fraction:.0%} and {DEFAULT_MIN_FREE_BYTES} bytes)")
        return result
    if dry_run:
        result.reason = "dry run: would rewrite the file"
        return result
    with store.exclusive() as alone:
        if not alone:
            result.reason = "another process has the store open; reclaim deferred"
            return result
        _swap_in_copy(store)
    result.file_bytes_after = (store.path / "data.mdb").stat().st_size
    result.reclaimed = True
    result.reason = "rewritten"
    log.info("reclaimed %d bytes of %s", result.bytes_reclaimed, store.path)
    return result


def _swap_in_copy(store) -> None:
    """Steps 2 and 3 of the module docstring; the caller holds ``store.exclusive()``."""
    tmp = store.path / TMP_NAME
    try:
        crash_point("reclaim.locked")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            store.copy_compact(fd)
            crash_point("reclaim.copied")
            os.fsync(fd)
        finally:
            os.close(fd)
        crash_point("reclaim.synced")
        store.close_env()
        os.replace(tmp, store.path / "data.mdb")
        fsync_dir(store.path)
        crash_point("reclaim.renamed")
        (store.path / "lock.mdb").unlink(missing_ok=True)
        store.reopen()
        crash_point("reclaim.reopened")
    except BaseException:
        tmp.unlink(missing_ok=True)
        try:  # the environment may be closed: reopen whichever file is in place
            store.reopen()
        except Exception:  # noqa: BLE001 - the original error matters more
            log.exception("reopening %s after a failed reclaim", store.path)
        raise


def remove_stale_copy(store) -> bool:
    """Remove the temp copy a killed reclaim left behind (a whole copy of the store), when no
    other process has the store open (so it is never another process's copy in progress);
    True when one was removed. :func:`reclaim` calls it first, whatever its threshold."""
    tmp = store.path / TMP_NAME
    if not tmp.exists() or not store.lockable:
        return False
    with store.exclusive() as alone:
        if not alone:
            return False
        tmp.unlink(missing_ok=True)
        log.info("removed %s left by an interrupted reclaim", tmp)
    return True
