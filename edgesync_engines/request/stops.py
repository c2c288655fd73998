"""Decoding an answer until it stops: at a stop sequence (what may be sent now, and where the
answer ends), an end-of-generation token, ``max_tokens``, or the caller's :class:`StopDecoding`."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from edgesync_engines.request.result import StopDecoding


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


def decode(adapter, tokens: Sequence[int], n_past: int, sampling: tuple[int, float, float, int],
           stop: Sequence[str], out: list[int], t0: float, first: Callable[[], None]):
    """Prefill ``tokens[n_past:]`` and decode into ``out`` (a generator yielding the text pieces,
    stop strings cut); ``sampling`` is (max_tokens, temperature, top_p, seed); ``first()`` is
    called once the first token is out (at the end when none is). Returns (text, TTFT in ms
    since ``t0`` (``time.perf_counter``), finish reason: ``stop``, ``length`` or ``cancelled``).
    """
    decoder, scanner = adapter.text_stream(), StopScanner(stop)
    pieces: list[str] = []
    ttft_ms, cancelled = None, False
    steps = adapter.generate(list(tokens), n_past, *sampling)
    try:
        for token in steps:
            if ttft_ms is None:
                ttft_ms = (time.perf_counter() - t0) * 1000
            out.append(token)
            # bytes of a character cut by max_tokens stay out of the text (no trailing U+FFFD)
            piece = scanner.feed(decoder.decode(adapter.token_bytes(token)))
            if len(out) == 1:
                first()
            if piece:
                pieces.append(piece)
                try:
                    yield piece
                except StopDecoding:
                    cancelled = True
            if cancelled or scanner.stopped:
                break
    finally:
        steps.close()
    tail = "" if cancelled else scanner.flush()
    if tail:
        pieces.append(tail)
        try:
            yield tail
        except StopDecoding:
            cancelled = True
    if ttft_ms is None:
        ttft_ms = (time.perf_counter() - t0) * 1000
        first()
    finish = "cancelled" if cancelled else "length" if len(out) >= sampling[0] and not scanner.stopped else "stop"
    return "".join(pieces), ttft_ms, finish
