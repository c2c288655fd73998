"""Next-request prediction (:class:`NgramPredictor`), and the prefetching of the predicted
requests' fragments into the RAM tier in a background thread (:class:`Prefetcher`), so that the
next request's injection skips the decompression.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Iterable, Sequence

import numpy as np

from edgesync_engines.request.fragment_cache import FragmentCache
from edgesync_engines.request.storeback import chunk_key
from edgesync_store.errors import StoreError
from edgesync_store.schema import Namespace

if TYPE_CHECKING:
    from edgesync_store.schema import KVFragment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PredictionAccuracy:
    """Hit counts of the predictions made before each observed key.

    ``observed``: keys observed; ``predicted``: of those, how many had a non-empty prediction
    (every observation but the first); ``top1_hits``: the next key was the first proposal;
    ``topk_hits``: it was among the ``top_k`` proposals. Rates are over ``predicted``.
    """

    observed: int
    predicted: int
    top1_hits: int
    topk_hits: int
    top_k: int

    @property
    def top1(self) -> float | None:
        """top1_hits / predicted, in [0, 1]; None before any prediction."""
        return self.top1_hits / self.predicted if self.predicted else None

    @property
    def topk(self) -> float | None:
        """topk_hits / predicted, in [0, 1]; None before any prediction."""
        return self.topk_hits / self.predicted if self.predicted else None


class NgramPredictor:
    """An n-gram model of the request sequence (keys stable across processes, such as
    :func:`request_key`; never ``hash()`` of a string) with backoff to shorter contexts and
    unigrams; ties go to the most recent continuation, so proposals are deterministic.

    ``n`` >= 1 is the order (contexts of up to ``n - 1`` keys), ``top_k`` >= 1 the number of
    proposals (ValueError otherwise). At most ``n`` table entries per observation. Thread-safe.
    """

    def __init__(self, n: int = 3, top_k: int = 3) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
        self.n = n
        self.top_k = top_k
        self._lock = threading.Lock()
        # context (tuple of 1..n-1 keys) -> next key -> [count, index of its last occurrence]
        self._next: dict[tuple, dict[Hashable, list[int]]] = {}
        self._unigram: dict[Hashable, list[int]] = {}
        self._history: deque = deque(maxlen=max(n - 1, 1))
        self._t = 0
        self._predicted = self._top1 = self._topk = 0

    def _predict_locked(self) -> list:
        out: list = []
        chosen: set = set()
        hist = tuple(self._history) if self.n > 1 else ()
        tables = [self._next.get(hist[len(hist) - m:]) for m in range(len(hist), 0, -1)]
        tables.append(self._unigram)
        for table in tables:
            if not table:
                continue
            need = self.top_k - len(out)
            ranked = heapq.nlargest(need + len(chosen), table.items(),
                                    key=lambda kv: (kv[1][0], kv[1][1]))
            for key, _ in ranked:
                if key not in chosen:
                    out.append(key)
                    chosen.add(key)
                    if len(out) == self.top_k:
                        return out
        return out

    def predict(self) -> list:
        """The up to ``top_k`` keys most likely to come next, most likely first; only keys already
        observed are ever proposed."""
        with self._lock:
            return self._predict_locked()

    def observe(self, key: Hashable) -> list:
        """Record that ``key`` was requested; returns the prediction that was made for it (the
        list ``predict()`` gave just before), after scoring it. Raises TypeError if ``key`` is
        not hashable."""
        hash(key)
        with self._lock:
            proposal = self._predict_locked()
            if proposal:
                self._predicted += 1
                self._top1 += proposal[0] == key
                self._topk += key in proposal
            t = self._t
            self._t += 1
            hist = tuple(self._history) if self.n > 1 else ()
            for m in range(1, len(hist) + 1):
                entry = self._next.setdefault(hist[len(hist) - m:], {}).setdefault(key, [0, 0])
                entry[0] += 1
                entry[1] = t
            entry = self._unigram.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] = t
            if self.n > 1:
                self._history.append(key)
            return proposal

    def observe_all(self, keys: Iterable[Hashable]) -> None:
        """``observe`` each key in order."""
        for key in keys:
            self.observe(key)

    @property
    def accuracy(self) -> PredictionAccuracy:
        """A snapshot of the hit counts so far (see :class:`PredictionAccuracy`)."""
        with self._lock:
            return PredictionAccuracy(self._t, self._predicted, self._top1, self._topk, self.top_k)

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` has been observed."""
        with self._lock:
            return key in self._unigram

    def __len__(self) -> int:
        """Distinct keys observed."""
        with self._lock:
            return len(self._unigram)


def request_key(namespace: Namespace, tokens: Sequence[int] | np.ndarray, chunk_tokens: int = 128) -> str | None:
    """The predictor's key of a request: the hex ``storeback.chunk_key`` of its first chunk
    (None and ValueError as there), the same in every process and known before the walk."""
    key = chunk_key(namespace, tokens, chunk_tokens)
    return None if key is None else key.hex()


class Prefetcher:
    """Predicts the next requests and decodes their stored fragments into a RAM tier ahead of time.

    Args:
        cache: the read-through RAM tier (``FragmentCache``) the request path reads.
        n, top_k: the :class:`NgramPredictor`'s order and proposals.
        max_keys: request keys whose last tokens are remembered (int32, at most the context
            length each; least recently seen dropped first).
        chunk_tokens: the grid of :func:`request_key`.

    After each answer (:meth:`after_answer`), a daemon thread walks the store with the tokens
    last seen under each predicted key, most likely first, and decodes (``store.get``: verified)
    every matched fragment the tier lacks in the store's version; a new prediction replaces the
    work not started. Its store errors are logged, never raised. ValueError: a bad number.
    """

    def __init__(self, cache: FragmentCache, namespace: Namespace, *, n: int = 3, top_k: int = 3,
                 max_keys: int = 256, chunk_tokens: int = 128) -> None:
        if not isinstance(max_keys, int) or max_keys < 1:
            raise ValueError(f"max_keys must be an int >= 1, got {max_keys!r}")
        self.cache = cache
        self.store = cache.store
        self.namespace = namespace
        self.predictor = NgramPredictor(n=n, top_k=top_k)
        self.ram = cache.ram
        self.max_keys = max_keys
        self.chunk_tokens = chunk_tokens
        self._cond = threading.Condition(threading.Lock())
        self._tokens: OrderedDict[str, np.ndarray] = OrderedDict()  # request key -> last tokens
        self._pending: list[np.ndarray] = []  # token sequences still to prefetch, next first
        self._busy = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._prefetched = self._prefetched_bytes = self._errors = 0

    # -- request thread -----------------------------------------------------------------

    def after_answer(self, prompt: Sequence[int], answer: Sequence[int]) -> list:
        """:meth:`after_request` of a request's prompt tokens and answer tokens, keyed by
        :func:`request_key` of the prompt (``chunk_tokens``)."""
        return self.after_request(request_key(self.namespace, prompt, self.chunk_tokens), [*prompt, *answer])

    def after_request(self, key: str | None, tokens: Sequence[int] | np.ndarray) -> list:
        """Record a finished request: ``key`` (:func:`request_key`; None records nothing) and
        its tokens (prompt + generated), then queue the prefetch of the predicted next keys.
        Returns the predicted keys (most likely first); cheap (the prefetch thread works); none after :meth:`close`."""
        if key is None:
            return []
        self.predictor.observe(key)
        predicted = self.predictor.predict()
        with self._cond:
            if self._stop:
                return predicted
            self._tokens[key] = np.array(tokens, dtype=np.int32)
            self._tokens.move_to_end(key)
            while len(self._tokens) > self.max_keys:
                self._tokens.popitem(last=False)
            self._pending = [self._tokens[k] for k in predicted if k in self._tokens]
            if self._pending and self._thread is None:
                self._thread = threading.Thread(target=self._work, name="edgesync-prefetch", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return predicted

    def lookup(self, key: bytes) -> "KVFragment | None":
        """The decoded fragment under store key ``key`` from the RAM tier while the store still
        holds that version live (``FragmentCache.cached``), else None (a stale entry is
        dropped). Raises ``StoreError`` when the store fails."""
        return self.cache.cached(key, self.store.lifecycle(key), self.store.clock())

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no prefetch work is queued or running; True when idle, False when
        ``timeout`` seconds passed first (None: wait as long as it takes)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._stop or (not self._pending and not self._busy), timeout)

    def stats(self) -> dict:
        """JSON-able counters: the predictor's (:class:`PredictionAccuracy`: ``observed``,
        ``predictions``, ``top1``, ``topk``, ``top_k``), the RAM tier's (:class:`RamTierStats`,
        including the request path's own reads), ``prefetched`` fragments decoded and their
        ``prefetched_bytes`` (raw), ``stale`` (``FragmentCache.stale``) and ``errors`` in the
        prefetch thread."""
        acc = self.predictor.accuracy
        ram = self.ram.stats()
        with self._cond:
            own = dict(prefetched=self._prefetched, prefetched_bytes=self._prefetched_bytes,
                       stale=self.cache.stale, errors=self._errors)
        return dict(observed=acc.observed, predictions=acc.predicted, top_k=acc.top_k, top1=acc.top1,
                    topk=acc.topk, hits=ram.hits, misses=ram.misses, bytes=ram.bytes,
                    max_bytes=ram.max_bytes, entries=ram.entries, evictions=ram.evictions, **own)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the prefetch thread (it finishes at most the fragment it is decoding; waits up
        to ``timeout`` seconds) and empty the RAM tier. Idempotent."""
        with self._cond:
            self._stop = True
            self._pending = []
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("prefetch thread still running after %.1f s", timeout)
        self.ram.clear()

    # -- prefetch thread ----------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                while not self._pending and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                tokens = self._pending.pop(0)
                self._busy = True
            try:
                self._prefetch(tokens)
            except (StoreError, OSError, ValueError) as exc:
                with self._cond:
                    self._errors += 1
                log.warning("prefetch failed: %s", exc)
            except Exception:  # keep the thread alive; the request path never depends on it
                with self._cond:
                    self._errors += 1
                log.exception("prefetch failed")

    def _prefetch(self, tokens: np.ndarray) -> None:
        """Decode the fragments of the store's longest prefix of ``tokens`` into the tier."""
        match = self.store.prefix_walk(self.namespace, tokens)
        keys = [key for span in match.spans for key in span.keys]
        records = self.cache.records(keys) if keys else {}
        for key in keys:
            if self._stop:
                return
            life = records[key]
            if life is None:
                continue
            held = self.ram.peek(key)
            if held is not None and held.created_at == life.created_at:
                continue
            # None: absent, or corrupt (store.get logs and removes it). copy: decoded with the
            # store's lock released, so the request thread never waits for it
            frag = self.store.get(key, copy=True)
            if frag is None:
                continue
            self.cache.put(key, frag, life)
            if key in self.ram:  # not when it alone exceeds the budget
                with self._cond:
                    self._prefetched += 1
                    self._prefetched_bytes += frag.raw_nbytes
