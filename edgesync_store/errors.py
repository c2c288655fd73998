"""Every error the store raises to the layers above it, under one base, :class:`StoreError`
(``lmdb.Error`` never leaves ``edgesync_store``)."""

from __future__ import annotations

import importlib
from types import ModuleType

from edgesync_store.commands.units import format_binary

__all__ = ["CodecError", "MissingExtraError", "StoreBudgetError", "StoreBusyError", "StoreDamagedError", "StoreError",
           "StoreFormatError", "StoreIOError", "StoreNotFoundError", "StoreOpenError", "StoreUnavailableError",
           "install_hint", "require_extra", "sized"]


def sized(nbytes: int) -> str:
    """A size for a message, human-readable and exact: ``"4.0 GiB (4294967296 bytes)"``."""
    return f"{format_binary(nbytes)} ({nbytes} bytes)"


class StoreError(RuntimeError):
    """Base of the store's errors."""


class StoreOpenError(StoreError):
    """The store path cannot hold or does not hold a store (a file, a foreign non-empty
    directory, no permission, not LMDB); the message names the path and the reason."""


class StoreDamagedError(StoreOpenError):
    """The path holds a store whose files are damaged beyond a per-fragment refusal (a truncated
    ``data.mdb``); requests are served uncached and ``edgesync clear`` recreates it.

    Attributes:
        path: the store directory.
        damage: what is wrong, e.g. ``"data.mdb is truncated (4000000 of 7938048 bytes)"``.
    """

    def __init__(self, path: object, damage: str) -> None:
        super().__init__(f"store {path}: {damage}; `edgesync clear {path} --yes` erases and recreates it "
                         "(it is a cache)")
        self.path, self.damage = path, damage


class StoreUnavailableError(StoreOpenError):
    """The system refused to create, open or lock the store (permission, a read-only or full
    disk): the path may be right, the device will not let us use it."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """There is no store directory at the given path (nothing is created)."""


class StoreFormatError(StoreError):
    """The store on disk has a format this code cannot read (newer, or a malformed record)."""


class StoreBusyError(StoreError):
    """Another process holds the store exclusively (a reclaim or clear) for longer than the wait allowed."""


class StoreIOError(StoreError):
    """The storage backend failed during an operation (LMDB: a full map it cannot grow, a
    corrupt page, an I/O error); the message names the store and the backend's own error."""


class StoreBudgetError(StoreError):
    """A write that cannot fit the store's size budget (``max_bytes``), refused whole: nothing
    was written and nothing evicted. Either the batch alone is larger than the budget, or the
    fragments it would have to evict to fit are pinned by requests reading them.

    Attributes:
        path: the store directory.
        nbytes: bytes the write needs: its blobs, or (refused before encoding) the K and V
            bytes its uncompressed blobs would hold and exceed.
        max_bytes: the budget, bytes.
        held: bytes that would stay stored because they cannot be evicted (0: the batch alone
            is larger than the budget).
    """

    def __init__(self, path: object, nbytes: int, max_bytes: int, held: int = 0) -> None:
        why = (f"does not fit its size budget of {sized(max_bytes)} beside {sized(held)} that cannot be evicted "
               "(pinned by requests reading them)" if held else f"is larger than its size budget of {sized(max_bytes)}")
        super().__init__(f"store {path}: a write of {sized(nbytes)} {why}; nothing written")
        self.path, self.nbytes, self.max_bytes, self.held = path, nbytes, max_bytes, held


class CodecError(StoreError, ValueError):
    """A blob that is not a valid fragment: corrupt, truncated, crafted or of another version."""


def install_hint(extra: str) -> str:
    """How to install the ``edgesync`` distribution with ``extra``: from its wheel file or its
    checkout, because an unrelated project holds the name ``edgesync`` on the package registry."""
    return f"pip install '<EdgeSync wheel or checkout>[{extra}]'"


class MissingExtraError(ImportError):
    """An optional stack is not installed; the one-line message names the extra that brings it
    (:func:`install_hint`).

    Attributes:
        what: the feature that needs the stack (``"semantic lookup"``).
        extra: the extra's name in pyproject.toml (``"semantic"``).
    """

    def __init__(self, what: str, extra: str, module: str) -> None:
        super().__init__(f"{what} needs the {extra!r} extra: {install_hint(extra)} "
                         f"(no module named {module!r})", name=module)
        self.what, self.extra = what, extra


def require_extra(module: str, extra: str, what: str) -> ModuleType:
    """``importlib.import_module(module)``, or :class:`MissingExtraError` naming ``extra`` and
    ``what`` needs it when ``module`` (or a module it imports) cannot be imported."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(what, extra, exc.name or module) from exc
