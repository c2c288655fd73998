"""Prefetch wired into the router, on the real model and real stores: doc-QA questions over one
passage (../shared/workloads/doc_qa.jsonl through ``workloads.doc_qa_workload``) are served from
the RAM tier with tokens identical to prefetch and the RAM tier off and to an uncached run; a
fragment the store lost after it was prefetched is never served from RAM; the predictor's
accuracy is reported.

The model runs with EDGESYNC_THREADS threads (all cores when unset), in a context of its own.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgesync_bench import workloads
from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request import plan as planning
from edgesync_engines.request.prefetch import NgramPredictor, request_key
from edgesync_engines.request.router import EdgeSync
from edgesync_store.core.store import FragmentStore

pytestmark = [pytest.mark.model]

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model():
    a = LlamaCppAdapter(n_threads=EdgeSyncConfig.load().n_threads)
    yield a
    a.close()


@pytest.fixture(scope="module")
def passages(data_dir):
    """Two doc-QA passages with 3 questions or more (passage order): the first one's first 3
    questions and the second one's first 2 (all the tests send), as chat messages."""
    by_doc: dict[str, list] = {}
    for req in workloads.doc_qa_workload(3, data_dir):
        by_doc.setdefault(req.group, []).append(req.as_messages())
    chosen = [qs for qs in by_doc.values() if len(qs) >= 3][:2]
    assert len(chosen) == 2
    return [chosen[0][:3], chosen[1][:2]]


def config(prefetch: bool, **extra) -> EdgeSyncConfig:
    return EdgeSyncConfig.load({"prefetch": prefetch, "semantic": False, **extra})


def router(model, path, prefetch: bool) -> EdgeSync:
    """Prefetch on (into the default RAM tier), or off with no RAM tier at all; a zstd store,
    whose reads decode (what prefetching saves: an uncompressed store is read in place)."""
    extra = {} if prefetch else {"ram_tier_bytes": 0}
    return EdgeSync(model, store=FragmentStore(path, compression="zstd"), config=config(prefetch, **extra))


def close(es: EdgeSync) -> None:
    es.close()
    es.store.close()  # passed in: the router leaves it open


@pytest.fixture(scope="module")
def uncached(model):
    return EdgeSync(model, store=False, config=config(False))


@pytest.fixture(scope="module")
def reference(uncached, passages):
    """Uncached tokens of every request, by (passage, question) index."""
    return {(p, q): uncached.generate(m, max_tokens=MAX_TOKENS).tokens
            for p, qs in enumerate(passages) for q, m in enumerate(qs)}


def fragments_equal(a, b) -> bool:
    return (a.key() == b.key() and a.token_start == b.token_start and a.token_end == b.token_end
            and np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.keys, b.keys)
            and np.array_equal(a.values, b.values) and a.expires_at == b.expires_at
            and a.hit_count == b.hit_count and a.last_hit_at == b.last_hit_at)


def test_doc_qa_is_served_from_ram_and_identical(model, passages, reference, tmp_path):
    """Questions 2 and 3 over one passage inject fragments decoded ahead of time, and answer
    with the tokens of prefetch off and of an uncached run; RAM copies equal the store's."""
    qs = passages[0]
    on = router(model, tmp_path / "on", prefetch=True)
    off = router(model, tmp_path / "off", prefetch=False)
    try:
        first = on.generate(qs[0], max_tokens=MAX_TOKENS)
        assert first.hit == "miss" and first.ram_tier_hits == 0 and first.fragments_written >= 2
        assert on.prefetcher.wait_idle(120)
        held = on.prefetcher.ram.keys()
        assert len(held) == first.fragments_written  # the whole stored chain of question 1
        for key in held:
            assert fragments_equal(on.prefetcher.ram.peek(key), on.store.get(key))
        results = [first]
        for m in qs[1:]:
            r = on.generate(m, max_tokens=MAX_TOKENS)
            assert on.prefetcher.wait_idle(120)
            results.append(r)
        off_results = [off.generate(m, max_tokens=MAX_TOKENS) for m in qs]
        for q, (r, r_off) in enumerate(zip(results, off_results)):
            assert r.tokens == r_off.tokens == reference[(0, q)]
            assert r.tokens_reused == r_off.tokens_reused
        for r in results[1:]:
            assert r.hit == "partial" and r.tokens_reused >= 128
            assert r.ram_tier_hits > 0
            assert r.to_dict()["ram_tier_hits"] == r.ram_tier_hits
        stats = on.prefetch_stats()
        assert stats["hits"] == sum(r.ram_tier_hits for r in results)
        assert 0 < stats["bytes"] <= stats["max_bytes"] == on.config.ram_tier_bytes
        assert stats["entries"] == len(on.prefetcher.ram) and stats["stale"] == 0
        # one passage: every request has the same key, so each prediction after the first is right
        keys = [request_key(on.namespace, on.prompt_tokens(m)) for m in qs]
        assert len(set(keys)) == 1
        repeats = sum(keys[i] == keys[i - 1] for i in range(1, len(keys)))
        assert stats["predictions"] == len(keys) - 1
        assert stats["top1"] == repeats / (len(keys) - 1)

        # prefetch and RAM tier off: no tier, no hits
        assert off.prefetcher is None and off.prefetch_stats() is None and off.fragment_cache is None
        assert all(r.ram_tier_hits == 0 for r in off_results)
        assert off_results[1].hit == "partial"
    finally:
        close(on)
        close(off)
    assert not on.prefetcher._thread.is_alive()  # close stopped the thread


def test_prefetch_is_off_by_default_and_needs_the_ram_tier(model, tmp_path, monkeypatch):
    monkeypatch.delenv("EDGESYNC_PREFETCH", raising=False)
    monkeypatch.delenv("EDGESYNC_RAM_TIER_BYTES", raising=False)
    cfg = EdgeSyncConfig.load()
    assert cfg.prefetch is False and cfg.ram_tier_bytes == 64 * 1024 * 1024
    es = EdgeSync(model, store=FragmentStore(tmp_path / "s"), config=EdgeSyncConfig.load({"semantic": False}))
    try:
        assert es.prefetcher is None and es.prefetch_stats() is None
        assert es.fragment_cache.ram.max_bytes == 64 * 1024 * 1024  # the RAM tier is on without prefetch
    finally:
        close(es)
    env = {"EDGESYNC_PREFETCH": "1", "EDGESYNC_RAM_TIER_BYTES": "1M"}
    cfg = EdgeSyncConfig.load(environ=env)
    assert cfg.prefetch is True and cfg.ram_tier_bytes == 1 << 20
    assert EdgeSyncConfig.load(environ={"EDGESYNC_RAM_TIER_BYTES": "0"}).ram_tier_bytes == 0
    with pytest.raises(ValueError, match="prefetch: needs the RAM tier"):
        EdgeSyncConfig.load({"prefetch": True, "ram_tier_bytes": 0})
    with pytest.raises(ValueError, match="ram_tier_bytes"):
        EdgeSyncConfig.load({"ram_tier_bytes": -1})
    with pytest.raises(ValueError, match="EDGESYNC_RAM_TIER_BYTES"):
        EdgeSyncConfig.load(environ={"EDGESYNC_RAM_TIER_BYTES": "-5"})


def test_fragment_gone_from_store_is_not_served_from_ram(model, passages, reference, tmp_path, monkeypatch):
    """A prefetched fragment deleted between the walk and the injection (another process) is
    not injected from RAM: the request injects only what precedes it and answers identically.
    One deleted and stored again (a new version: another ``created_at``) is not served either."""
    qs = passages[0]
    on = router(model, tmp_path / "on", prefetch=True)
    try:
        on.generate(qs[0], max_tokens=MAX_TOKENS)
        assert on.prefetcher.wait_idle(120)
        by_start = {on.prefetcher.ram.peek(k).token_start: k for k in on.prefetcher.ram.keys()}
        assert 0 in by_start and 128 in by_start
        victim = by_start[128]
        old_version = on.prefetcher.ram.peek(victim).created_at

        real_walk = planning.walk

        def walk_then_delete(store, namespace, tokens):
            match = real_walk(store, namespace, tokens)
            on.store.delete(victim)  # the walk saw it; the store loses it before injection
            return match

        monkeypatch.setattr(planning, "walk", walk_then_delete)
        # hold the prefetch back until the RAM tier's versions are checked
        held_back = []
        monkeypatch.setattr(on.prefetcher, "after_request", lambda key, tokens: held_back.append((key, tokens)))
        r = on.generate(qs[1], max_tokens=MAX_TOKENS)
        monkeypatch.undo()
        assert r.ram_tier_hits == 1  # the first chunk only
        assert r.tokens_reused == 128
        assert r.tokens == reference[(0, 1)]
        assert on.prefetch_stats()["stale"] == 1
        # the request stored the victim's chunk again (the same tokens: the same key) and kept
        # that new version in RAM at its store-back, never the stale one
        life = on.store.lifecycle(victim)
        assert life is not None and life.created_at != old_version
        assert on.prefetcher.ram.peek(victim).created_at == life.created_at
        assert len(held_back) == 1
        on.prefetcher.after_request(*held_back[0])

        # replaced under the same key by another write: the RAM copy is stale
        assert on.prefetcher.wait_idle(120)
        first = by_start[0]
        assert first in on.prefetcher.ram
        frag = on.store.get(first)
        on.store.delete(first)
        frag.created_at += 1.0
        assert on.store.put(frag)
        assert on.prefetcher.lookup(first) is None
        assert first not in on.prefetcher.ram
        r3 = on.generate(qs[2], max_tokens=MAX_TOKENS)
        assert r3.tokens == reference[(0, 2)]
        assert r3.tokens_reused >= 128
    finally:
        close(on)


def test_predictor_accuracy_is_reported(model, passages, reference, tmp_path):
    """Two passages interleaved: top-1/top-3 accuracy equal an NgramPredictor(3, 3) run over
    the requests' keys (computed from the prompts), and every answer stays identical."""
    (a0, a1, a2), (b0, b1) = passages
    sequence = [(0, 0, a0), (0, 1, a1), (1, 0, b0), (0, 2, a2), (1, 1, b1)]
    on = router(model, tmp_path / "on", prefetch=True)
    try:
        for p, q, m in sequence:
            r = on.generate(m, max_tokens=MAX_TOKENS)
            assert r.tokens == reference[(p, q)]
            assert on.prefetcher.wait_idle(120)
        keys = [request_key(on.namespace, on.prompt_tokens(m), on.config.chunk_tokens) for _, _, m in sequence]
        assert keys[0] == keys[1] == keys[3] and keys[2] == keys[4] and keys[0] != keys[2]
        expected = NgramPredictor(n=3, top_k=3)
        expected.observe_all(keys)
        stats = on.prefetch_stats()
        assert stats["observed"] == len(sequence)
        assert stats["predictions"] == expected.accuracy.predicted == len(sequence) - 1
        assert stats["top1"] == expected.accuracy.top1
        assert stats["topk"] == expected.accuracy.topk
        assert stats["top_k"] == 3
    finally:
        close(on)
