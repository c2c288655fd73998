"""Stop sequences over streamed text: what may be sent now, and where the answer ends."""

from __future__ import annotations

from typing import Sequence


class StopScanner:
    """Cuts streamed text at the first of ``stops`` (OpenAI ``stop``: the stop text itself is
    not returned).

    :meth:`feed` takes each new piece and returns the text that is safe to send: text that
    could still be the start of a stop sequence is held back until the next piece decides it.
    :attr:`stopped` turns True once a stop sequence was seen; :meth:`flush` returns what was
    held back when the stream ends without one.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The part of ``piece`` (with what was held back) that can be sent; "" once stopped."""
        if self.stopped:
            return ""
        text = self._pending + piece
        if not self.stops:
            self._pending = ""
            return text
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return text[:cut]
        hold = 0
        for s in self.stops:
            # the longest tail of text that is a proper prefix of s
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self._pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]

    def flush(self) -> str:
        """What was held back (the stream ended without a stop sequence)."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
