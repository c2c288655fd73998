"""The read-through RAM tier (``request/fragment_cache.py``) on the real SmolLM2 and real stores:
what a request stored, or read from the store, is injected from RAM next time with nothing read
from the store and the tokens of an uncached run; a fragment the store forgot, lost (another
process's eviction or compaction between the walk and the injection) or let expire after it was
kept in RAM is not served from RAM, and the request prefills what it lacks with identical
tokens; the tier never holds more than its budget, and a fragment or a chain larger than it
bypasses it, evicting nothing. The tier keeps what a read decodes into memory of its own: these
tests use zstd stores (``compression="zstd"``); a store of uncompressed blobs (the default) is
read in place, and its fragments are not kept (the last model test). The first tests need no
model: fragments of SmolLM2's geometry in a real store.

Prompts are an app's system prompt (../shared/workloads/system_prompts.json) and a question.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from fragments import SMOL

from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request import plan as planning
from edgesync_engines.request.fragment_cache import FragmentCache
from edgesync_engines.request.ramtier import RamTier
from edgesync_engines.request.router import EdgeSync
from edgesync_store.core.store import FragmentStore
from edgesync_store.schema import KVFragment, prefix_hash
from edgesync_store.ttl import ManualClock, TTLPolicy

MiB = 1 << 20

MAX_TOKENS = 8
QUESTION = "How should I plan a week of revision?"


def chat(system: str, user: str = QUESTION) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def config(**extra) -> EdgeSyncConfig:
    return EdgeSyncConfig.load({"semantic": False, "jobs": False, **extra})


@pytest.fixture(scope="module")
def adapter():
    """SmolLM2 with EDGESYNC_THREADS threads (all cores when unset), in a context of its own."""
    a = LlamaCppAdapter(n_threads=EdgeSyncConfig.load().n_threads)
    yield a
    a.close()


@pytest.fixture(scope="module")
def uncached(adapter):
    es = EdgeSync(adapter, store=False, config=config())
    cache: dict[str, list[int]] = {}

    def tokens(messages) -> list[int]:
        key = repr(messages)
        if key not in cache:
            cache[key] = es.generate(messages, max_tokens=MAX_TOKENS).tokens
        return cache[key]

    return tokens


def open_router(adapter, store: FragmentStore, **extra) -> EdgeSync:
    return EdgeSync(adapter, store=store, config=config(**extra))


def walk_then_delete(es: EdgeSync, victim: bytes):
    """``planning.walk`` that deletes ``victim`` from the store once it has walked: what another
    process's eviction or compaction does between the walk and the injection (a fake for that
    race, which cannot be timed otherwise)."""
    real_walk = planning.walk

    def walk(store_, namespace, toks):
        found = real_walk(store_, namespace, toks)
        es.store.delete(victim)
        return found

    return walk


def smol_chain(n: int, span: int = 128, seed: int = 0) -> list[KVFragment]:
    """``n`` consecutive fragments of ``span`` tokens with SmolLM2's KV geometry (22.5 KiB a
    token: 2.8 MiB at 128 tokens), one chain from position 0, seeded random K and V."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 49152, size=n * span, dtype=np.int32)
    shape = (SMOL.n_layer, span, SMOL.n_head_kv * SMOL.head_dim)
    now = time.time()
    return [KVFragment(namespace=SMOL, token_start=i * span, token_end=(i + 1) * span, layer_start=0,
                       layer_end=SMOL.n_layer, layer_stride=1, head_start=0, head_end=SMOL.n_head_kv,
                       keys=rng.standard_normal(shape).astype(np.float16),
                       values=rng.standard_normal(shape).astype(np.float16),
                       token_ids=tokens[i * span:(i + 1) * span], prefix_hash=prefix_hash(tokens[:i * span]),
                       created_at=now, expires_at=now + 3600)
            for i in range(n)]


def test_an_entry_larger_than_the_budget_is_rejected_and_evicts_nothing():
    """The LRU refuses an entry larger than its whole budget without evicting anything; a new
    version of a held key that is too large drops the old version (it must not be served)."""
    tier = RamTier(10 * MiB)
    for i in range(3):
        assert tier.put(i, object(), nbytes=3 * MiB)
    assert not tier.put("big", object(), nbytes=11 * MiB)
    stats = tier.stats()
    assert tier.keys() == [0, 1, 2] and stats.bytes == 9 * MiB and stats.rejected == 1 and stats.evictions == 0
    assert not tier.put(1, object(), nbytes=11 * MiB) and tier.keys() == [0, 2] and tier.bytes == 6 * MiB


def test_a_chain_larger_than_the_budget_bypasses_the_tier(tmp_path):
    """An 8 MiB tier over a real zstd store holds a 2.8 MiB chain. A chain of four 2.8 MiB
    fragments (11.2 MiB), read as the injector reads (``records`` of the chain, then ``put`` of
    each decoded fragment), is served as decoded but neither staged nor kept, and evicts
    nothing; its store-back (``keep_stored``) neither. A chain that fits is kept after it; a
    lone fragment larger than the tier is returned unstaged and rejected, nothing evicted."""
    staged = []

    def stage(frag: KVFragment) -> KVFragment:  # counts the staging copies
        staged.append(frag.key())
        return frag

    small, big, other = smol_chain(2, span=64, seed=1), smol_chain(4, seed=2), smol_chain(1, seed=3)
    keys = {name: [f.key() for f in chain] for name, chain in (("small", small), ("big", big), ("other", other))}
    with FragmentStore(tmp_path / "s", compression="zstd") as store:
        assert store.put_many(small + big + other) == 7
        cache = FragmentCache(store, 8 * MiB, stage)

        def read(name: str) -> list[KVFragment]:
            records = cache.records(keys[name])
            return [cache.put(k, store.get(k), records[k]) for k in keys[name]]

        read("small")
        assert cache.ram.keys() == keys["small"] and staged == keys["small"]
        assert [f.key() for f in read("big")] == keys["big"]  # served, as decoded
        stats = cache.ram.stats()
        assert cache.ram.keys() == keys["small"] and staged == keys["small"] and cache.bypassed == 4
        assert stats.evictions == stats.rejected == 0 and stats.bytes == 2 * 64 * 30 * 192 * 2 * 2
        assert cache.keep_stored(big) == 0 and cache.ram.keys() == keys["small"] and cache.bypassed == 8
        read("other")  # judged on its own: it fits, and is kept
        assert cache.ram.keys() == keys["small"] + keys["other"] and cache.ram.bytes <= 8 * MiB
        assert cache.keep_stored(small) == 2 and cache.ram.stats().evictions == 0

        tiny = FragmentCache(store, 2 * MiB, stage)
        frag = store.get(keys["other"][0])
        assert tiny.put(keys["other"][0], frag, store.lifecycle(keys["other"][0])) is frag
        assert len(tiny.ram) == 0 and tiny.ram.stats().rejected == 1 and staged.count(keys["other"][0]) == 1


@pytest.mark.model
def test_a_repeat_is_served_from_ram_with_nothing_read_from_the_store(adapter, system_prompts, uncached, tmp_path):
    """Miss (its store-back keeps the chain in RAM too), then hits from RAM alone: every
    fragment, 0 bytes read, across the promotion to the long lifetime (5 hits: the expiry
    moves, the version stays). A second router on the same store starts with an empty tier:
    its first hit reads the chain from the store and keeps it, its next ones read nothing."""
    m = chat(system_prompts[0])
    store = FragmentStore(tmp_path / "s", compression="zstd")
    es = open_router(adapter, store)
    other = None
    try:
        first = es.generate(m, max_tokens=MAX_TOKENS)
        assert first.hit == "miss" and first.fragments_written == 3 and first.bytes_read == 0
        keys = es.store.keys_along(es.namespace, es.prompt_tokens(m))
        assert len(keys) == 3 and all(k in es.fragment_cache.ram for k in keys)  # kept at the store-back
        repeats = [es.generate(m, max_tokens=MAX_TOKENS) for _ in range(6)]
        for r in repeats:
            assert r.hit == "exact" and r.tokens_reused == first.prompt_tokens - 1
            assert r.ram_tier_hits == 3 and r.bytes_read == 0
        assert es.store.lifecycle(keys[0]).lifetime == "long"
        for r in (first, *repeats):
            assert r.tokens == uncached(m)
        stats = es.fragment_cache.ram.stats()
        assert stats.hits == 3 * len(repeats) and stats.entries == 3
        assert stats.bytes == sum(es.store.get(k).raw_nbytes for k in keys) <= stats.max_bytes

        other = open_router(adapter, store)
        read = other.generate(m, max_tokens=MAX_TOKENS)
        assert read.hit == "exact" and read.ram_tier_hits == 0 and read.tokens == uncached(m)
        assert read.bytes_read == sum(es.store.lifecycle(k).nbytes for k in keys) > 0
        again = other.generate(m, max_tokens=MAX_TOKENS)
        assert again.ram_tier_hits == 3 and again.bytes_read == 0 and again.tokens == uncached(m)
        for key in keys:  # what RAM holds (kept at the store-back, or read) is what the store holds
            stored = es.store.get(key)
            for held in (es.fragment_cache.ram.peek(key), other.fragment_cache.ram.peek(key)):
                assert np.array_equal(held.keys.view(np.uint16), stored.keys.view(np.uint16))
                assert np.array_equal(held.values.view(np.uint16), stored.values.view(np.uint16))
                assert held.created_at == stored.created_at == es.store.lifecycle(key).created_at
        assert es.fragment_cache.stale == 0

        assert es.forget(m) == 3
        assert len(es.fragment_cache.ram) == 0  # forget empties the tier
        after = es.generate(m, max_tokens=MAX_TOKENS)
        assert after.hit == "miss" and after.ram_tier_hits == 0 and after.tokens == uncached(m)
    finally:
        if other is not None:
            other.close()
        es.close()
        store.close()


@pytest.mark.model
def test_a_fragment_deleted_after_the_walk_is_not_served_from_ram(adapter, system_prompts, uncached, tmp_path,
                                                                  monkeypatch):
    """The store loses the chain's second fragment between the walk and the injection (what
    another process's eviction or compaction does): RAM serves the first only, drops the
    other, and the request prefills the rest with identical tokens."""
    m = chat(system_prompts[1])
    store = FragmentStore(tmp_path / "s", compression="zstd")
    es = open_router(adapter, store)
    try:
        es.generate(m, max_tokens=MAX_TOKENS)  # stored, and kept in RAM
        tokens = es.prompt_tokens(m)
        match = es.store.prefix_walk(es.namespace, tokens)
        victim = match.spans[1].keys[0]
        old_version = es.fragment_cache.ram.peek(victim).created_at
        monkeypatch.setattr(planning, "walk", walk_then_delete(es, victim))
        r = es.generate(m, max_tokens=MAX_TOKENS)
        monkeypatch.undo()
        assert r.hit == "partial" and r.tokens_reused == 128 and r.ram_tier_hits == 1 and r.bytes_read == 0
        assert r.tokens == uncached(m)
        assert es.fragment_cache.stale == 1
        # the request stored the lost chunk again, and kept that new version in RAM
        life = es.store.lifecycle(victim)
        assert life.created_at != old_version and es.fragment_cache.ram.peek(victim).created_at == life.created_at
    finally:
        es.close()
        store.close()


@pytest.mark.model
def test_a_fragment_expired_after_the_walk_is_not_served(adapter, system_prompts, uncached, tmp_path, monkeypatch):
    """The clock passes the chain's expiry between the walk and the injection: nothing is
    served (from RAM or the store), the request prefills and answers identically."""
    m = chat(system_prompts[2])
    clock = ManualClock()
    store = FragmentStore(tmp_path / "s", clock=clock, policy=TTLPolicy(ttl_seconds=600), compression="zstd")
    es = open_router(adapter, store, ttl_seconds=600)
    try:
        es.generate(m, max_tokens=MAX_TOKENS)
        es.generate(m, max_tokens=MAX_TOKENS)
        assert len(es.fragment_cache.ram) == 3
        real_walk = planning.walk

        def walk_then_expire(store_, namespace, toks):
            found = real_walk(store_, namespace, toks)
            clock.advance(601)
            return found

        monkeypatch.setattr(planning, "walk", walk_then_expire)
        r = es.generate(m, max_tokens=MAX_TOKENS)
        monkeypatch.undo()
        assert r.hit == "miss" and r.tokens_reused == 0 and r.ram_tier_hits == 0
        assert r.tokens == uncached(m)
        assert es.fragment_cache.stale >= 1
    finally:
        es.close()
        store.close()


@pytest.mark.model
def test_the_tier_stays_within_its_budget(adapter, system_prompts, uncached, tmp_path):
    """A budget of four full 128-token fragments (2.95 MB each in f16: one prompt's chain of
    about 350 tokens fits, two do not) over three prompts: held bytes never pass it, the least
    recently used go, the third request of each prompt is served from RAM, and answers stay
    identical; a budget smaller than one fragment holds nothing (the chains bypass it)."""
    ns = adapter.namespace
    one = 128 * ns.n_layer * ns.n_head_kv * ns.head_dim * 2 * 2
    prompts = [chat(p) for p in system_prompts[3:6]]
    for budget in (4 * one, one // 2):
        store = FragmentStore(tmp_path / f"s{budget}", compression="zstd")
        es = open_router(adapter, store, ram_tier_bytes=budget)
        try:
            for m in prompts if budget > one else prompts[:1]:
                rs = [es.generate(m, max_tokens=MAX_TOKENS) for _ in range(3)]
                for r in rs:
                    assert r.tokens == uncached(m)
                    assert es.fragment_cache.ram.bytes <= budget
                assert rs[1].ram_tier_hits == rs[2].ram_tier_hits == (3 if budget > one else 0)
            stats = es.fragment_cache.ram.stats()
            if budget > one:
                assert stats.evictions > 0 and stats.hits == 6 * len(prompts)
            else:  # every chain is larger than the budget: it bypasses the tier
                assert stats.entries == 0 and stats.puts == 0 and stats.hits == 0 and es.fragment_cache.bypassed > 0
        finally:
            es.close()
            store.close()


@pytest.mark.model
def test_an_uncompressed_store_is_read_in_place_and_not_kept_in_ram(adapter, system_prompts, uncached, tmp_path,
                                                                     monkeypatch):
    """The default store (``compression="none"``): the store-back keeps nothing in RAM, each
    repeat reads the chain from the store in place (its blob bytes counted, no RAM tier hit)
    with the tokens of an uncached run; a fragment deleted between the walk and the read
    leaves the first span only, and the request prefills the rest identically."""
    m = chat(system_prompts[6])
    store = FragmentStore(tmp_path / "s")
    es = open_router(adapter, store)
    try:
        assert store.serves_in_place
        first = es.generate(m, max_tokens=MAX_TOKENS)
        keys = es.store.keys_along(es.namespace, es.prompt_tokens(m))
        assert first.hit == "miss" and len(keys) == 3 and len(es.fragment_cache.ram) == 0
        for _ in range(2):
            r = es.generate(m, max_tokens=MAX_TOKENS)
            assert r.hit == "exact" and r.tokens_reused == first.prompt_tokens - 1 and r.ram_tier_hits == 0
            assert r.bytes_read == sum(es.store.lifecycle(k).nbytes for k in keys) > 0
            assert r.tokens == uncached(m)
        assert len(es.fragment_cache.ram) == 0
        victim = es.store.prefix_walk(es.namespace, es.prompt_tokens(m)).spans[1].keys[0]
        monkeypatch.setattr(planning, "walk", walk_then_delete(es, victim))
        r = es.generate(m, max_tokens=MAX_TOKENS)
        monkeypatch.undo()
        assert r.hit == "partial" and r.tokens_reused == 128 and r.tokens == uncached(m)
    finally:
        es.close()
        store.close()
