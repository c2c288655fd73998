"""Erase everything a store holds: ``edgesync clear``.

Deleted LMDB entries leave their bytes in ``data.mdb``'s free pages, so when no other process
has the store open (``OpenLock.try_exclusive``) :func:`clear_store` removes the data files
(:data:`ERASED_FILES`; the lock files stay) and recreates an empty store; otherwise it empties
every database in one transaction (``erased_files=False``). A damaged store is never opened:
its files are removed under the same lock.
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
from edgesync_store.migrations import migrate
from edgesync_store.semantic.sidecar import SIDECAR_HNSW, SIDECAR_JSON

log = logging.getLogger(__name__)

__all__ = ["ClearResult", "check_store_path", "clear_store"]

ERASED_FILES = (SIDECAR_HNSW, SIDECAR_JSON, TMP_NAME, "data.mdb", "lock.mdb")
"""Files a real erase removes, in this order (data last but its lock file: a kill midway never
leaves a sidecar without its store)."""


@dataclass
class ClearResult:
    """What :func:`clear_store` did: ``path``; ``fragments_removed``; ``bytes_before`` and
    ``bytes_after`` (size of ``data.mdb``); ``erased_files`` (True: files removed and the store
    recreated; False: emptied in one transaction); ``reason``; ``files_removed`` (names)."""

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
    """The store directory ``path`` (``~`` expanded) when it holds a ``data.mdb``; changes nothing.

    Raises:
        StoreNotFoundError: nothing exists at ``path``.
        StoreOpenError: ``path`` is empty, not a directory, unreadable, or holds no ``data.mdb``.
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
    """Erase every record of the store at ``path`` and its semantic sidecar files.

    Args:
        path: an existing store directory (never created here).
        open_timeout_s: seconds to wait while another process reclaims or clears the store.

    Raises:
        StoreNotFoundError: nothing at ``path``.
        StoreOpenError: not a directory, no EdgeSync store, or not writable.
        StoreFormatError: the store was written by a newer format version.
        StoreBusyError: another process held it exclusively for ``open_timeout_s``, or has a
            damaged store open.
        OSError, StoreIOError: removing or recreating the files failed.
    """
    path = check_store_path(path)
    try:
        store = FragmentStore(path, open_timeout_s=open_timeout_s, upgrade=migrate)
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
    """Erase a store that cannot be opened (``damage`` says why) and create an empty one.

    Raises:
        StoreBusyError: another process has it open.
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
