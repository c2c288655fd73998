"""Erase everything a store holds: ``edgesync clear``.

A store holds users' prompts (token IDs in the fragment headers and the prefix index, prompt
text in the donor records, embeddings in the vectors and the semantic sidecar). Deleting the
LMDB entries is not enough to erase them: LMDB frees the pages for reuse but leaves their
bytes in ``data.mdb`` until they are overwritten. So :func:`clear_store`

1. opens the store and takes its ``edgesync.lock`` exclusively without waiting
   (``locks.OpenLock.try_exclusive``): only when no other process has the store open;
2. if it got it: closes the LMDB environment and removes the files that hold data (the
   semantic sidecar ``semantic.hnsw`` / ``semantic.json``, a leftover reclaim copy
   ``.reclaim.tmp``, then ``data.mdb`` and ``lock.mdb``), syncs the directory, and reopens the
   path, which creates an empty store (same size budget). The lock files (``edgesync.lock``,
   ``pins.lock``, ``compact.lock``, ``semantic.lock``) stay: other processes may be waiting
   on them;
3. otherwise (another process has the store open and may have ``data.mdb`` mapped, or the
   directory does not let us remove files):
   ``FragmentStore.drop_all`` empties every database in one write transaction, and nothing
   else is removed; the result says ``erased_files=False`` with the reason. Run the clear
   again when the other processes are gone to erase the bytes too.

A kill during step 2 leaves either the old ``data.mdb`` or none; a directory without
``data.mdb`` opens as a new, empty store.

A damaged store (``StoreDamagedError``: a truncated ``data.mdb``, which LMDB cannot open
safely, or one whose meta pages are unreadable) is never opened: with the exclusive lock taken
the same way, its files are removed and an empty store (default budget) created; while another
process has it open, nothing is done.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgesync_store.core.check import has_data_file
from edgesync_store.core.lmdb_env import fsync_dir, path_state
from edgesync_store.core.locks import OpenLock
from edgesync_store.core.store import FragmentStore
from edgesync_store.errors import StoreBusyError, StoreDamagedError, StoreNotFoundError, StoreOpenError
from edgesync_store.lifecycle.reclaim import TMP_NAME
from edgesync_store.semantic.sidecar import SIDECAR_HNSW, SIDECAR_JSON

log = logging.getLogger(__name__)

__all__ = ["ClearResult", "check_store_path", "clear_store"]

ERASED_FILES = (SIDECAR_HNSW, SIDECAR_JSON, TMP_NAME, "data.mdb", "lock.mdb")
"""Files a real erase removes from the store directory, in this order (the data file last but
its lock file, so that a kill midway never leaves a sidecar without its store)."""


@dataclass
class ClearResult:
    """What :func:`clear_store` did.

    Attributes:
        path: the store directory.
        fragments_removed: fragments the store held before (all removed).
        bytes_before: size of ``data.mdb`` before, bytes.
        bytes_after: size of ``data.mdb`` after, bytes (an empty store's after a real erase;
            unchanged after the fallback, whose freed pages stay in the file).
        erased_files: True when the files were removed and the store recreated (the old bytes
            are gone from the disk's view of the store); False for the fallback.
        reason: why the files were or were not erased.
        files_removed: names of the files removed from the directory (empty for the
            fallback).
    """

    path: str
    fragments_removed: int
    bytes_before: int
    bytes_after: int
    erased_files: bool
    reason: str
    files_removed: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """A JSON-able dict of the fields."""
        return asdict(self)


def check_store_path(path: str | os.PathLike) -> Path:
    """The store directory ``path`` (``~`` expanded) when it holds an EdgeSync store's
    ``data.mdb``; nothing is created or changed.

    Raises:
        StoreNotFoundError: nothing exists at ``path`` (a ``FileNotFoundError``).
        StoreOpenError: ``path`` is empty, is not a directory, cannot be read, or holds no
            ``data.mdb``.
    """
    if not str(path).strip():
        raise StoreOpenError("store path: is empty")
    path = Path(path).expanduser()
    exists, is_dir, readable = path_state(path)
    if not readable:
        raise StoreOpenError(f"store path {path}: cannot be read (permission denied)")
    if not exists:
        raise StoreNotFoundError(f"no store at {path}")
    if not is_dir:
        raise StoreOpenError(f"store path {path}: exists and is not a directory")
    if not has_data_file(path):
        raise StoreOpenError(f"no EdgeSync store at {path} (no data.mdb)")
    return path


def _data_bytes(path: Path) -> int:
    data = path / "data.mdb"
    return data.stat().st_size if data.is_file() else 0


def clear_store(path: str | os.PathLike, open_timeout_s: float = 120.0) -> ClearResult:
    """Erase every fragment, prefix-index entry, lifecycle record, donor record and vector of
    the store at ``path``, and its semantic sidecar files (module docstring: erase the files
    when no other process has the store open, else empty it in one transaction).

    Args:
        path: an existing store directory (never created here).
        open_timeout_s: seconds to wait while another process reclaims or clears the store.

    Returns:
        A :class:`ClearResult` (sizes in bytes of ``data.mdb``).

    Raises:
        StoreNotFoundError: nothing at ``path``.
        StoreOpenError: ``path`` is not a directory, holds no EdgeSync store, or is
            not writable.
        StoreFormatError: the store was written by a newer format version.
        StoreBusyError: another process held the store exclusively for ``open_timeout_s``,
            or has a damaged store open.
        OSError, StoreIOError: removing or recreating the files failed.
    """
    path = check_store_path(path)
    try:
        store = FragmentStore(path, open_timeout_s=open_timeout_s)
    except StoreDamagedError as exc:
        return _clear_damaged(path, exc.damage, open_timeout_s)
    reopen_budget: int | None = None
    try:
        bytes_before = _data_bytes(path)
        with store.exclusive() as alone:
            if not alone:
                n = store.drop_all()
                why = ("the directory is not writable (its files cannot be removed)" if not store.lockable
                       else "another process has the store open")
                result = ClearResult(
                    str(path), n, bytes_before, _data_bytes(path), False,
                    f"{why}: emptied in one transaction; the freed pages keep their bytes until overwritten "
                    "(clear again when the files can be removed)",
                )
                log.info("cleared %s: %d fragments dropped; files kept (store open elsewhere)", path, n)
                return result
            n = store.fragment_count()
            reopen_budget = store.recorded_max_bytes() or None
            store.close_env()
            removed = _remove_files(path)
            # leaving exclusive() (back to shared) before the new store below opens: it takes
            # another lock on the same file, and waiting processes may come in
    finally:
        store.close()
    FragmentStore(path, max_bytes=reopen_budget, open_timeout_s=open_timeout_s).close()
    result = ClearResult(str(path), n, bytes_before, _data_bytes(path), True,
                         "no other process had the store open: files removed and an empty store created", removed)
    log.info("cleared %s: %d fragments; data.mdb %d -> %d bytes; removed %s",
             path, n, bytes_before, result.bytes_after, ", ".join(removed))
    return result


def _remove_files(path: Path) -> list[str]:
    """Remove :data:`ERASED_FILES` from ``path`` (those present), then sync the directory."""
    removed = []
    for name in ERASED_FILES:
        target = path / name
        try:
            if target.is_dir() and not target.is_symlink():  # a damaged store's data.mdb may be one
                shutil.rmtree(target)
            else:
                target.unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
    fsync_dir(path)
    return removed


def _clear_damaged(path: Path, damage: str, open_timeout_s: float) -> ClearResult:
    """Erase a store that cannot be opened (``damage`` says why) and create an empty one, when
    no other process has it open (module docstring).

    Raises:
        StoreBusyError: another process has it open (or holds it exclusively).
        OSError: removing or recreating the files failed.
    """
    bytes_before = _data_bytes(path)
    lock = OpenLock(path, open_timeout_s)
    try:
        if not lock.try_exclusive():
            raise StoreBusyError(f"store {path}: {damage}, and another process has it open: clear it when that "
                                 "process is gone")
        removed = _remove_files(path)
    finally:
        lock.close()
    FragmentStore(path, open_timeout_s=open_timeout_s).close()
    log.info("cleared damaged store %s (%s): removed %s", path, damage, ", ".join(removed))
    return ClearResult(str(path), 0, bytes_before, _data_bytes(path), True,
                       f"the store was damaged ({damage}): its fragments could not be counted; files removed "
                       "and an empty store created", removed)
