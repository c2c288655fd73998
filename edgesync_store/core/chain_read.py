"""What ``FragmentBackend.reading`` yields: the fragments of one chain read for an injection."""

from __future__ import annotations


class ChainRead(list):
    """What :meth:`FragmentBackend.reading` yields: ``(fragment or None, in_place)`` per key,
    and :meth:`confirm`, which waits for the payload checksums still running (``defer_checks``)
    and returns the keys whose fragment failed them (refused and removed after the read, like
    any corrupt fragment). Here nothing is deferred: ``confirm`` returns ``[]``."""

    def confirm(self) -> list[bytes]:
        """Keys whose payload checksum failed (none here)."""
        return []
