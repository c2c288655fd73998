"""The sequences an ``EdgeSync`` answers in (a slot each; one for an engine without slots), and
which one a request takes.

A request takes a free lane, preferring the one whose live sequence holds the longest exact
prefix of its prompt (the conversation it continues), then an empty one, then the one used
longest ago; it waits while every lane answers another request.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Sequence

from edgesync_store.schema import common_prefix_len

if TYPE_CHECKING:
    from edgesync_engines.adapters.protocol import EngineAdapter
    from edgesync_engines.request.execute import Injector


class Lane:
    """One sequence: its adapter (whose ``lock`` a request holds throughout), its injector, and
    the count of leading live tokens whose KV equals an uncached prefill's.

    Attributes:
        index: the slot number (0 without slots).
        driver: the thread whose request holds the lane, or None.
        used: when a request last took it (the lanes' request count).
    """

    def __init__(self, index: int, adapter: "EngineAdapter", injector: "Injector | None") -> None:
        self.index, self.adapter, self.injector = index, adapter, injector
        self._live = (0, -1)  # (exact leading live tokens, the adapter's kv_epoch then)
        self.driver: int | None = None
        self.used = 0

    def take_live(self) -> int:
        """The count of leading live tokens with exact KV (0 once the sequence changed
        otherwise), which the caller then owns (the count is reset; lock held)."""
        live, epoch = self._live
        self._live = (0, -1)
        return live if epoch == self.adapter.kv_epoch else 0

    def set_live(self, n: int) -> None:
        """The live sequence now holds ``n`` leading tokens of exact KV (lock held)."""
        self._live = (n, self.adapter.kv_epoch)

    def exact_prefix(self, tokens: Sequence[int]) -> int:
        """Leading tokens of ``tokens`` this lane holds with exact KV (no lock needed: a guess)."""
        live, epoch = self._live
        if live < 1 or epoch != self.adapter.kv_epoch:
            return 0
        return common_prefix_len(self.adapter.live_tokens()[:live], tokens)


class Lanes:
    """The lanes of one engine, handed to one request each.

    Args:
        lanes: at least one.
    """

    def __init__(self, lanes: Sequence[Lane]) -> None:
        if not lanes:
            raise ValueError("Lanes: at least one lane")
        self.all = list(lanes)
        self._free = set(range(len(self.all)))
        self._cond = threading.Condition()
        self._taken = 0
        self.by_prefix = 0
        """Requests placed on the lane whose live sequence held part of their prompt (of several free)."""

    def __len__(self) -> int:
        return len(self.all)

    def __getitem__(self, i: int) -> Lane:
        return self.all[i]

    def driven_by(self, thread: int) -> bool:
        """A request of ``thread`` holds a lane."""
        return any(lane.driver == thread for lane in self.all)

    @contextmanager
    def taken(self, tokens: Sequence[int] = (), lane: Lane | None = None) -> Iterator[Lane]:
        """Hold a lane for a request of ``tokens`` (``lane``: that one), waiting while none is free;
        the lane's adapter lock is taken too."""
        chosen = self._take(tokens, lane)
        try:
            with chosen.adapter.lock:
                chosen.driver = threading.get_ident()
                try:
                    yield chosen
                finally:
                    chosen.driver = None
        finally:
            with self._cond:
                self._free.add(chosen.index)
                self._cond.notify_all()

    def _take(self, tokens: Sequence[int], lane: Lane | None) -> Lane:
        with self._cond:
            while not (self._free if lane is None else lane.index in self._free):
                self._cond.wait()
            chosen = lane if lane is not None else self.best(tokens, [self.all[i] for i in self._free])
            self._free.discard(chosen.index)
            self._taken += 1
            chosen.used = self._taken
            return chosen

    def best(self, tokens: Sequence[int], free: Sequence[Lane]) -> Lane:
        """Of the ``free`` lanes, the one for ``tokens``: the longest exact prefix, else an empty
        one, else the one used longest ago (ties: the lowest index)."""
        scores = {lane.index: lane.exact_prefix(tokens) if tokens else 0 for lane in free}
        held = {lane.index: not scores[lane.index] and bool(lane.adapter.live_tokens()) for lane in free}
        pick = min(free, key=lambda lane: (-scores[lane.index], held[lane.index], lane.used, lane.index))
        if scores[pick.index] > 0 and len(free) > 1:
            self.by_prefix += 1
        return pick

    def is_taken(self, lane: Lane) -> bool:
        """A request holds ``lane`` (or waits for it)."""
        return lane.index not in self._free

    def idle_lane(self, tokens: Sequence[int]) -> Lane | None:
        """The lane idle-time work on ``tokens`` should use: of the free lanes, as :meth:`best`
        (None: none is free). A request may take it meanwhile: the work then stops."""
        with self._cond:
            free = [self.all[i] for i in sorted(self._free)]
            return self.best(tokens, free) if free else None
