"""What ``FragmentBackend.reading`` yields: the fragments of one chain read for an injection."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from edgesync_store.core import codec, map_advice


class ChainRead(list):
    """What :meth:`FragmentBackend.reading` yields: ``(fragment or None, in_place)`` per key,
    and :meth:`confirm`, which waits for the payload checksums still running (``defer_checks``)
    and returns the keys whose fragment failed them (refused and removed after the read, like
    any corrupt fragment). Here nothing is deferred: ``confirm`` returns ``[]``."""

    def confirm(self) -> list[bytes]:
        """Keys whose payload checksum failed (none here)."""
        return []


class CheckedChainRead(ChainRead):
    """A :class:`ChainRead` whose in-place payload checksums run in this process's one checksum
    thread (``FragmentStore.reading`` with ``defer_checks``)."""

    _future: Future | None = None
    _failed: list[bytes] | None = None
    _corrupt: list | None = None

    def start(self, deferred: list, corrupt: list) -> None:
        """Check ``(key, payload view, expected xxh3)`` of each of ``deferred`` in the background;
        a mismatch goes to ``corrupt`` (by :meth:`confirm`)."""
        self._corrupt = corrupt
        self._future = _checks().submit(_failing, deferred)

    def confirm(self) -> list[bytes]:
        """Wait for the checks; the keys that failed (also reported as corrupt)."""
        if self._failed is None:
            self._failed = self._future.result() if self._future is not None else []
            if self._corrupt is not None:
                self._corrupt.extend((key, "payload checksum: xxh3 mismatch (corrupt tensors)") for key in self._failed)
        return list(self._failed)


def _failing(deferred: list) -> list[bytes]:
    """Keys of ``(key, payload, expected)`` whose payload's xxh3 differs (xxhash releases the GIL).
    Each checked payload's whole pages are unmapped again (``map_advice.drop_pages``), so that a
    long chain checked ahead of its injection is not resident twice over."""
    failing = []
    for key, payload, expected in deferred:
        if codec.checksum(payload) != expected:
            failing.append(key)
        map_advice.drop_pages(payload)
    return failing


_CHECKS: ThreadPoolExecutor | None = None
_CHECKS_LOCK = threading.Lock()


def _checks() -> ThreadPoolExecutor:
    """The one thread of this process that runs deferred payload checksums (made on first use)."""
    global _CHECKS
    with _CHECKS_LOCK:
        if _CHECKS is None:
            _CHECKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgesync-checksum")
        return _CHECKS
