"""Carrying out a :class:`~edgesync_engines.request.plan.ReusePlan`: pin, fetch, convert, inject.

Any failure (a fragment gone or corrupt, the engine refusing the state) degrades to fewer
tokens or to none, never to an error.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from edgesync_engines.adapters.protocol import InjectionError
from edgesync_engines.adapters.reshape import convert_fragment
from edgesync_engines.request import plan as planning
from edgesync_engines.request.plan import ReusePlan, ReuseSource, SourceKind
from edgesync_store.core.walk import PrefixMatch
from edgesync_store.errors import StoreError
from edgesync_store.schema import MIN_SPAN, Namespace

if TYPE_CHECKING:
    from edgesync_engines.adapters.protocol import EngineAdapter
    from edgesync_engines.request.fragment_cache import FragmentCache
    from edgesync_store.core.backend import FragmentBackend
    from edgesync_store.schema import KVFragment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Injection:
    """What the engine holds once a plan is carried out.

    Attributes:
        source: the source injected (None: nothing was).
        tokens: the sequence to continue: the prompt's, or a donor's served whole.
        reused: tokens injected (the engine's ``n_past``).
        keys: store keys of the fragments injected (their hits are recorded).
        bytes_read: compressed bytes read from the store (RAM tier hits read none).
        ram_tier_hits: fragments taken from the RAM tier.
        donor_ms: milliseconds spent on donors tried whole.
        live: nothing injected: the engine's live sequence already held the ``reused`` tokens.
    """

    source: ReuseSource | None
    tokens: tuple[int, ...]
    reused: int = 0
    keys: tuple[bytes, ...] = ()
    bytes_read: int = 0
    ram_tier_hits: int = 0
    donor_ms: float = 0.0
    live: bool = False

    @property
    def approximate(self) -> bool:
        """A donor's KV whose tokens differ from the prompt's was served whole."""
        return self.source is not None and self.source.kind == SourceKind.DONOR

    @property
    def convertible(self) -> bool:
        """The KV injected was another engine's, converted."""
        return self.source is not None and self.source.kind == SourceKind.CONVERTIBLE

    @property
    def donor(self) -> str | None:
        """Hex key of the donor whose chain was injected (None: none, or nothing injected)."""
        return self.source.donor if self.source is not None and self.reused else None

    @property
    def source_engine(self) -> str | None:
        """The engine whose KV was injected; None on a miss and for a donor served whole."""
        if not self.reused or self.source is None or self.source.kind == SourceKind.DONOR:
            return None
        return self.source.namespace.engine


@dataclass(frozen=True)
class Fetched:
    """What :meth:`Injector.fetched` yields: the chain's fragments in order (up to the first
    one missing or refused), their store keys, the compressed bytes read from the store (none
    for RAM tier hits), the tokens they cover, whether one was missing or refused, and
    ``confirm()``: wait for deferred payload checksums, the keys that failed them."""

    fragments: list
    keys: list
    nbytes: int
    covered: int
    missing: bool
    confirm: Callable[[], list]


class Injector:
    """Injects plans into one engine from one store.

    Args:
        adapter: the engine (the caller holds ``adapter.lock``).
        cache: the RAM tier to read through (None: off, every fragment is read from the store).
    """

    def __init__(self, store: "FragmentBackend", adapter: "EngineAdapter",
                 cache: "FragmentCache | None" = None) -> None:
        self.store = store
        self.adapter = adapter
        self.cache = cache
        self._ram_hits = 0

    def carry_out(self, plan: ReusePlan) -> Injection:
        """Try the plan's sources in order; returns what the engine then holds."""
        self._ram_hits = 0
        donor_ms = 0.0
        for source in plan.sources:
            t0 = time.perf_counter()
            reused, keys, nbytes = self.inject(source)
            if source.kind == SourceKind.DONOR:
                donor_ms += (time.perf_counter() - t0) * 1000
            if reused >= source.required:
                if source.kind == SourceKind.CONVERTIBLE:
                    log.info("injected %d tokens of %s KV, converted for %s", reused, source.namespace.engine,
                             self.adapter.namespace.engine)
                return Injection(source, source.tokens, reused, tuple(keys), nbytes, self._ram_hits, donor_ms)
            if source.kind == SourceKind.DONOR:
                self.adapter.clear_kv_cache()  # the next source starts from an empty sequence
        return Injection(None, plan.prompt, ram_tier_hits=self._ram_hits, donor_ms=donor_ms)

    def inject(self, source: ReuseSource) -> tuple[int, list[bytes], int]:
        """Fetch, verify, convert if needed and inject ``source.match`` up to ``source.limit``
        tokens; return (tokens injected, keys used, compressed bytes read). The fragments are
        pinned from their first read until injected; one gone by then (another process's
        compaction) makes it walk again once, pinned, and take the longer of the two."""
        return self._inject_match(source, source.match, source.limit, 0, retry=True)

    def _inject_match(self, source: ReuseSource, match: PrefixMatch, limit: int, bytes_before: int,
                      retry: bool) -> tuple[int, list[bytes], int]:
        """One attempt of :meth:`inject` with ``match`` verified up to ``limit`` tokens."""
        tokens, namespace = list(source.tokens), source.namespace
        n = len(tokens)
        target = self.adapter.usable_prefix(min(match.matched_tokens, limit), n)
        if target < MIN_SPAN:
            return 0, [], bytes_before
        pinned = [key for span in match.spans if span.token_start < target for key in span.keys]
        with self.store.pins.pinned(pinned):  # eviction in any process skips them meanwhile
            with self.fetched(match, target, defer_checks=True) as got:
                bytes_total, covered = bytes_before + got.nbytes, got.covered
                again = planning.walk(self.store, namespace, tokens) if got.missing and retry else None
                if again is None or again.matched_tokens <= covered:
                    if got.missing:
                        log.warning("a stored fragment was refused or is gone; injecting %d of %d matched tokens",
                                    covered, match.matched_tokens)
                    target = self.adapter.usable_prefix(min(target, covered), n)
                    if target < MIN_SPAN:
                        return 0, [], bytes_total
                    return self._inject_fragments(got, target, tokens, namespace, bytes_total)
        log.info("a fragment went away after the walk (%d tokens read); walking again", covered)
        # the sequence's own tokens: the new walk is verified all along
        return self._inject_match(source, again, again.matched_tokens, bytes_total, retry=False)

    def _inject_fragments(self, got: "Fetched", target: int, tokens: list[int], namespace,
                          nbytes: int) -> tuple[int, list[bytes], int]:
        """Convert and inject ``got``'s fragments up to ``target`` tokens, then wait for their
        checksums; on a refusal or a failed checksum the sequence is cleared, nothing injected."""
        fragments = self._inject_or_clear(got.fragments, target, tokens, namespace)
        if fragments is None:
            got.confirm()
            return 0, [], nbytes
        failed = set(got.confirm())
        if not failed:
            return target, got.keys, nbytes
        # the chain up to the first fragment that failed was verified: inject that much again
        cut = min(f.token_start for f, key in zip(fragments, got.keys) if key in failed)
        kept = [(f, key) for f, key in zip(fragments, got.keys) if f.token_start < cut]
        self.adapter.clear_kv_cache()
        target = self.adapter.usable_prefix(min(target, cut), len(tokens))
        log.warning("%d injected fragment(s) failed their checksum (refused and removed); injecting %d tokens",
                    len(failed), target if target >= MIN_SPAN else 0)
        if target < MIN_SPAN or self._inject_or_clear([f for f, _ in kept], target, tokens) is None:
            return 0, [], nbytes
        return target, [key for _, key in kept], nbytes

    def _inject_or_clear(self, fragments: list, target: int, tokens: list[int],
                         namespace: Namespace | None = None) -> list | None:
        """Inject ``fragments`` (converted when needed) up to ``target`` tokens; None when refused."""
        try:
            if namespace is not None and namespace != self.adapter.namespace:
                fragments = [convert_fragment(f, self.adapter.namespace) for f in fragments]
            self.adapter.inject_fragment(fragments, target, tokens, on_chunk=self._release_mapped)
        except (ValueError, InjectionError) as exc:
            log.warning("injection refused, prefilling from scratch: %s", exc)
            self.adapter.clear_kv_cache()
            return None
        return fragments

    def _release_mapped(self) -> None:
        """Drop this process's pages of the store's map after a chunk of a long injection:
        fragments read in place stay valid (the page cache keeps their bytes), and the hit's
        resident memory does not grow by the whole context."""
        if not self.store.serves_in_place:
            return
        try:
            self.store.release_mapped()
        except StoreError as exc:
            log.debug("could not release the store's mapped pages: %s", exc)

    @contextmanager
    def fetched(self, match: PrefixMatch, target: int, defer_checks: bool = False) -> Iterator["Fetched"]:
        """The spans of ``match`` below ``target`` (pinned by the caller), for the ``with`` block
        (:class:`Fetched`): fragments read in place are valid inside it only; with
        ``defer_checks``, ``confirm()`` before using what was computed from them. With a RAM tier
        the chain's lifecycle records decide what RAM may serve (``FragmentCache``); fragments
        the store decoded into their own arrays are kept there, those served in place are not.
        """
        spans = [span for span in match.spans if span.token_start < target]
        records, now = self._records([key for span in spans for key in span.keys])
        held: dict[bytes, KVFragment | None] = {}
        if records is not None:
            for i, span in enumerate(spans):
                for key in span.keys:
                    life = records[key]
                    frag = self.cache.cached(key, life, now)
                    if frag is not None or life is None or life.expires_at <= now:  # from RAM, or gone
                        held[key] = frag
                        self._ram_hits += frag is not None
                if any(held.get(key, True) is None for key in span.keys):
                    spans = spans[:i + 1]  # the chain ends here: read nothing after it
                    break
        need = [key for span in spans for key in span.keys if key not in held]
        with self.store.reading(need, defer_checks=defer_checks) as got:
            for key, (frag, in_place) in zip(need, got):
                if frag is not None and records is not None and not in_place:
                    frag = self.cache.put(key, frag, records[key])
                held[key] = frag
            yield Fetched(*self._chain(spans, held, set(need), records), confirm=got.confirm)

    def _chain(self, spans, held: dict, read: set, records: dict | None) -> tuple:
        """(fragments, keys, bytes read from the store, tokens covered, missing) of the spans
        in order, up to the first span with a fragment absent or refused."""
        fragments, keys, bytes_read, covered = [], [], 0, 0
        for span in spans:
            got = [held[key] for key in span.keys]
            if any(f is None for f in got):
                log.info("fragment at [%d, %d) was refused or is gone after the walk (%d tokens read)",
                         span.token_start, span.token_end, covered)
                return fragments, keys, bytes_read, covered, True
            fragments.extend(got)
            keys.extend(span.keys)
            if records is None:
                bytes_read += span.compressed_nbytes
            else:
                bytes_read += sum(records[key].nbytes for key in span.keys if key in read)
            covered = span.token_start + span.matched
        return fragments, keys, bytes_read, covered, False

    def _records(self, keys: list[bytes]) -> tuple[dict | None, float]:
        """The lifecycle records of ``keys`` for the RAM tier (None: no tier, or the store
        failed: then every fragment is read from the store) and the time they hold for."""
        if self.cache is None or not keys:
            return None, 0.0
        try:
            return self.cache.records(keys), self.store.clock()
        except StoreError as exc:
            log.warning("RAM tier check failed, reading the store: %s", exc)
            return None, 0.0
