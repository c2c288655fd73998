"""Fragment lifecycle: TTL and promotion on an injected clock, the expiry sweep (LMDB and the
HNSW sidecar), the size budget's eviction policy and pins, forgetting a prompt, and the
compactor's dedup and merge rules.

Store-level tests use seeded synthetic K/V (``tests/test_store.make_fragment``: the store and
compactor never look inside the tensors; real-KV identity of merges is tests/test_fragment_groups.py);
request-level tests run the real SmolLM2 through llama.cpp. No test sleeps: the clock is a
``ManualClock``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.router import EdgeSync
from edgesync_store.compactor import Compactor
from edgesync_store.core import codec
from edgesync_store.core.store import FragmentStore
from edgesync_store.lifecycle.merge import split_heads, split_layers
from edgesync_store.semantic.index import SemanticIndex
from edgesync_store.ttl import LIFETIME_LONG, LIFETIME_SHORT, LONG_TTL_SECONDS, ManualClock, sweep
from tests.test_store import make_fragment

MIN = 60.0
T0 = 1_800_000_000.0


def chat(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def config(**kw) -> EdgeSyncConfig:
    return EdgeSyncConfig.load({"jobs": False, "semantic": False, **kw})


@pytest.fixture
def clock():
    return ManualClock(T0)


def fresh(seed: int, clock: ManualClock, **kw):
    """A fragment created now on ``clock`` with the default 30-minute TTL."""
    return make_fragment(seed=seed, created_at=clock(), expires_at=clock() + 30 * MIN, **kw)


# ---------------------------------------------------------------------------------------------
# acceptance 1: TTL, promotion, restart, sweep


@pytest.mark.model
def test_fragment_is_not_served_after_30_minutes(tmp_path, adapter, system_prompts, clock):
    """Served at 29 minutes, never at 30 (walk skips it, even with no sweep in between); the
    request then prefills and answers exactly like an uncached run."""
    store = FragmentStore(tmp_path / "s", clock=clock)
    es = EdgeSync(adapter, store=store, config=config())
    uncached = EdgeSync(adapter, store=False, config=config())
    prompt = chat(system_prompts[3], "What is a good way to learn to cook?")
    first = es.generate(prompt, max_tokens=8)
    assert first.hit == "miss" and first.fragments_written >= 2
    clock.advance(29 * MIN)
    assert es.generate(prompt, max_tokens=8).hit == "exact"  # one hit: still short-term
    clock.advance(1 * MIN)  # 30 minutes after creation: expires_at <= now
    late = es.generate(prompt, max_tokens=8)
    assert late.hit == "miss" and late.tokens_reused == 0
    assert late.tokens == uncached.generate(prompt, max_tokens=8).tokens
    # the expired chain was replaced by fresh fragments, served again
    assert late.fragments_written == first.fragments_written
    assert es.generate(prompt, max_tokens=8).hit == "exact"
    store.close()


def test_fifth_hit_promotes_to_seven_days_and_survives_restart(tmp_path, clock):
    path = tmp_path / "s"
    frag = fresh(1, clock)
    key = frag.key()
    with FragmentStore(path, clock=clock) as store:
        store.put(frag)
        for _ in range(4):
            clock.advance(MIN)
            store.record_hits([key])
        life = store.lifecycle(key)
        assert (life.hit_count, life.lifetime) == (4, LIFETIME_SHORT)
        assert life.expires_at == T0 + 30 * MIN  # hits do not extend the short lifetime
        clock.advance(MIN)
        store.record_hits([key])  # the fifth
        life = store.lifecycle(key)
        assert (life.hit_count, life.lifetime) == (5, LIFETIME_LONG)
        assert life.expires_at == clock() + LONG_TTL_SECONDS
        assert life.last_hit_at == clock()
    with FragmentStore(path, clock=clock) as store:  # a restart: a new environment on the file
        life = store.lifecycle(key)
        assert (life.hit_count, life.lifetime, life.expires_at) == (5, LIFETIME_LONG, T0 + 5 * MIN + LONG_TTL_SECONDS)
        clock.advance(6 * 24 * 3600)  # six days later: long past the short TTL
        assert store.is_live(key)
        assert store.prefix_walk(frag.namespace, frag.token_ids).matched_tokens == 64
        store.record_hits([key])  # a hit in the long lifetime extends it by another 7 days
        assert store.lifecycle(key).expires_at == clock() + LONG_TTL_SECONDS
        clock.advance(LONG_TTL_SECONDS)
        assert not store.is_live(key)
        assert store.prefix_walk(frag.namespace, frag.token_ids).matched_tokens == 0


@pytest.mark.model
def test_promoted_chain_is_served_after_30_minutes(tmp_path, adapter, system_prompts, clock):
    """Five exact hits promote the prompt's fragments; 31 minutes on it is still an exact hit,
    and a restart (a new store object) keeps the promotion."""
    path = tmp_path / "s"
    prompt = chat(system_prompts[4], "Suggest a weekend project for a beginner woodworker.")
    store = FragmentStore(path, clock=clock)
    es = EdgeSync(adapter, store=store, config=config())
    es.generate(prompt, max_tokens=4)
    for _ in range(5):
        assert es.generate(prompt, max_tokens=4).hit == "exact"
    store.close()
    clock.advance(31 * MIN)
    with FragmentStore(path, clock=clock) as store:
        lifetimes = {life.lifetime for _, life in store.iterate_lifecycle()}
        assert lifetimes == {LIFETIME_LONG}
        es = EdgeSync(adapter, store=store, config=config())
        assert es.generate(prompt, max_tokens=4).hit == "exact"


def test_sweep_removes_expired_fragments_from_lmdb_and_sidecar(tmp_path, clock):
    path = tmp_path / "s"
    store = FragmentStore(path, clock=clock)
    old = [fresh(10 + i, clock) for i in range(3)]
    store.put_many(old)
    clock.advance(20 * MIN)
    young = [fresh(20 + i, clock) for i in range(2)]
    store.put_many(young)
    index = SemanticIndex(store, "test/backend")
    rng = np.random.default_rng(0)
    for frag in old + young:
        index.add(frag.key(), rng.standard_normal(384))
    index.save()
    clock.advance(11 * MIN)  # old: 31 minutes, young: 11 minutes
    assert sweep(store, index=None, dry_run=True) == [
        (f.key(), len(store.get_blob(f.key()))) for f in sorted(old, key=lambda f: f.key())
    ]
    gone = sweep(store, index=index)
    assert sorted(k for k, _ in gone) == sorted(f.key() for f in old)
    for frag in old:
        assert not store.contains(frag.key()) and store.lifecycle(frag.key()) is None
        assert frag.key() not in index
    for frag in young:
        assert store.contains(frag.key()) and frag.key() in index
    assert store.used_bytes() == sum(len(store.get_blob(f.key())) for f in young)
    index.close()
    # the sidecar on disk: a new index loads it and holds exactly the young vectors
    reopened = SemanticIndex(store, "test/backend")
    assert len(reopened) == 2 and all(f.key() in reopened for f in young)
    hits = {k for k, _ in reopened.query(rng.standard_normal(384), k=5)}
    assert hits == {f.key() for f in young}
    reopened.close()
    store.close()


# ---------------------------------------------------------------------------------------------
# acceptance 3: the size budget


def test_writing_past_max_bytes_evicts_by_policy(tmp_path, clock):
    """Order: expired first, then short-term least recently used, then long-term; the store
    ends at or under the budget; a pinned fragment is skipped."""
    probe = fresh(0, clock)
    size = len(codec.encode(probe))  # every synthetic fragment encodes to about this
    path = tmp_path / "s"
    store = FragmentStore(path, clock=clock, max_bytes=int(size * 6.5))
    names = {}
    for name, seed in (
        ("expired", 1),
        ("short_old", 2),
        ("long_old", 3),
        ("short_new", 4),
        ("long_new", 5),
        ("short_hit", 6),
    ):
        frag = fresh(seed, clock)
        store.put(frag)
        names[name] = frag.key()
        clock.advance(MIN)
    # promote the two long ones, make one short one recently used, expire one
    for _ in range(5):
        store.record_hits([names["long_old"]])
    clock.advance(MIN)
    for _ in range(5):
        store.record_hits([names["long_new"]])
    store.record_hits([names["short_hit"]])  # used after short_new was created
    life = store.lifecycle(names["expired"])
    life.expires_at = clock() - 1
    store.set_lifecycle(names["expired"], life)
    assert store.used_bytes() <= store.max_bytes

    def write_new(seed):
        clock.advance(MIN)
        frag = fresh(seed, clock)
        assert store.put(frag)
        assert store.used_bytes() <= store.max_bytes
        return frag.key()

    present = lambda: {n for n, k in names.items() if store.contains(k)}  # noqa: E731
    # 6 stored + 1 = 7 > 6.5: eviction frees down to 90% of the budget (5.85 fragments) -> 2 go
    write_new(100)
    assert present() == {"short_new", "long_old", "long_new", "short_hit"}  # expired, then short_old
    with store.pins.pinned([names["short_new"]]):  # a request is injecting it
        write_new(101)
        write_new(102)
    # short_new was next (least recently used short-term) but pinned: short_hit went instead
    assert present() == {"short_new", "long_old", "long_new"}
    usage = sum(len(store.get_blob(k)) for k, _ in store.iterate_lifecycle())
    assert usage == store.used_bytes() <= store.max_bytes
    store.close()


def test_fragment_pinned_by_another_process_is_not_evicted(tmp_path, clock):
    """Pins are open-file-description locks: another process's pin stops this one's eviction."""
    path = tmp_path / "s"
    store = FragmentStore(path, clock=clock, max_bytes=10**9)
    victim = fresh(1, clock)
    store.put(victim)
    others = []
    for i in range(3):
        clock.advance(MIN)
        others.append(fresh(2 + i, clock))
        store.put(others[-1])
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from edgesync_store.core.store import FragmentStore
            s = FragmentStore({str(path)!r}, readonly=False)
            with s.pins.pinned([bytes.fromhex({victim.key().hex()!r})]):
                print("pinned", flush=True)
                sys.stdin.readline()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "pinned"
        assert store.pins.is_pinned(victim.key())
        from edgesync_store.core.eviction import evict_to_budget

        size = len(store.get_blob(victim.key()))
        evicted = [k for k, _ in evict_to_budget(store, max_bytes=size * 3 + size // 2)]
        assert victim.key() not in evicted and store.contains(victim.key())
        assert evicted == [others[0].key()]  # the least recently used that is not pinned
    finally:
        child.communicate("\n", timeout=30)
    assert not store.pins.is_pinned(victim.key())  # the other process let go
    store.close()


@pytest.mark.model
def test_fragment_being_injected_is_not_evicted(tmp_path, adapter, system_prompts, clock):
    """While the router injects a chain (between its reads and llama.cpp taking the buffer),
    another store object on the same directory writes past the budget: the chain survives,
    older fragments are evicted, the answer equals an uncached one."""
    path = tmp_path / "s"
    store = FragmentStore(path, clock=clock, max_bytes=10**9)
    es = EdgeSync(adapter, store=store, config=config())
    old_prompt = chat(system_prompts[5], "How do I start running?")
    prompt = chat(system_prompts[6], "Explain compound interest simply.")
    es.generate(old_prompt, max_tokens=4)
    clock.advance(MIN)
    es.generate(prompt, max_tokens=4)
    chain = {k for k, _ in store.iterate_lifecycle()}
    prompt_keys = set(store.keys_along(es.namespace, es.prompt_tokens(prompt)))
    assert prompt_keys and prompt_keys < chain
    other = FragmentStore(path, clock=clock)  # a second process's view (own lock files)
    real_inject = es.adapter.inject_fragment
    evicted_during, written = [], []

    def inject_while_another_writes(fragments, n_tokens, tokens, **kwargs):
        # test hook around the real injection: the only way to place a write exactly here.
        # The budget holds the chain being injected and the new fragment, nothing more: eviction
        # takes every unpinned fragment (a budget without room for both refuses the write whole)
        clock.advance(MIN)
        new = fresh(500, clock)
        other.max_bytes = sum(store.lifecycle(k).nbytes for k in prompt_keys) + len(codec.encode(new)) + 1024
        assert other.put(new)
        written.append(new.key())
        evicted_during.extend(k for k in chain if not other.contains(k))
        return real_inject(fragments, n_tokens, tokens, **kwargs)

    es.adapter.inject_fragment = inject_while_another_writes
    try:
        result = es.generate(prompt, max_tokens=8)
    finally:
        es.adapter.inject_fragment = real_inject
    assert result.hit == "exact"
    assert set(evicted_during) == chain - prompt_keys  # everything but the injected chain
    assert all(store.contains(k) for k in prompt_keys)
    assert result.tokens == EdgeSync(adapter, store=False, config=config()).generate(prompt, max_tokens=8).tokens
    # once the request is done its fragments are fair game: the budget now takes them
    from edgesync_store.core.eviction import evict_to_budget

    assert {k for k, _ in evict_to_budget(other, max_bytes=1)} == prompt_keys | set(written)
    assert other.used_bytes() == 0
    other.close()
    store.close()


@pytest.mark.model
def test_full_disk_serves_uncached_with_a_warning(tmp_path, adapter, system_prompts):
    """A real fault: the process's file-size limit (RLIMIT_FSIZE) below what the store needs,
    so LMDB's writes fail with EFBIG like on a full disk. The request answers as uncached."""
    path = tmp_path / "s"
    FragmentStore(path).close()
    limit = (path / "data.mdb").stat().st_size + 64 * 1024
    prompt = chat(system_prompts[7], "Give me three tips for better sleep.")
    script = textwrap.dedent(f"""
        import json, logging, resource, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        from edgesync_engines.config import EdgeSyncConfig
        from edgesync_engines.request.router import EdgeSync
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        cfg = EdgeSyncConfig.load({{"jobs": False, "semantic": False, "store_path": {str(path)!r}}})
        with EdgeSync(config=cfg) as es:
            r = es.generate({json.dumps(prompt)}, max_tokens=8)
            print(json.dumps({{"hit": r.hit, "tokens": r.tokens, "written": r.fragments_written}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["hit"] == "miss" and row["written"] == 0
    assert "could not store fragments, serving uncached" in proc.stderr
    assert row["tokens"] == EdgeSync(adapter, store=False, config=config()).generate(prompt, max_tokens=8).tokens
    with FragmentStore(path) as store:  # still opens, empty, and takes writes again
        assert store.stats().fragments == 0 and store.used_bytes() == 0
        assert store.put(make_fragment(seed=3))


# ---------------------------------------------------------------------------------------------
# acceptance 7: forget


@pytest.mark.model
def test_forget_makes_the_prompt_a_miss(tmp_path, adapter, system_prompts):
    store = FragmentStore(tmp_path / "s")
    es = EdgeSync(adapter, store=store, config=config())
    prompt = chat(system_prompts[0], "How do I repot a houseplant?")
    sibling = chat(system_prompts[0], "Which houseplants survive low light?")  # shares the system prompt
    unrelated = chat(system_prompts[1], "Plan a cheap weekend in Lisbon.")
    for p in (prompt, sibling, unrelated):
        es.generate(p, max_tokens=4)
    assert es.generate(prompt, max_tokens=4).hit == "exact"
    unrelated_keys = set(store.keys_along(es.namespace, es.prompt_tokens(unrelated)))
    removed = es.forget(prompt)
    assert removed >= 3  # its own chain and the sibling's chunk of the shared system prompt
    assert store.keys_along(es.namespace, es.prompt_tokens(prompt)) == []
    again = es.generate(prompt, max_tokens=4)
    assert again.hit == "miss" and again.tokens_reused == 0
    # the unrelated prompt's fragments are untouched
    assert all(store.contains(k) for k in unrelated_keys)
    assert es.forget(chat(system_prompts[2], "Never asked.")) == 0
    store.close()


# ---------------------------------------------------------------------------------------------
# the compactor's rules (store level)


def test_dedup_drops_a_shorter_prefix_duplicate_only_when_nothing_continues_it(tmp_path, clock):
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 49152, size=400, dtype=np.int32)
    long = make_fragment(tokens, start=128, end=300, seed=1, created_at=clock(), expires_at=clock() + 1800)
    short = kv_prefix_of(long, 200)
    lone = make_fragment(rng.integers(0, 49152, size=400, dtype=np.int32), start=0, end=64, seed=2,
                         created_at=clock(), expires_at=clock() + 1800)
    with FragmentStore(tmp_path / "s", clock=clock) as store:
        head0 = make_fragment(tokens, start=0, end=128, seed=3, created_at=clock(), expires_at=clock() + 1800)
        store.put_many([head0, long, short, lone])
        for _ in range(3):
            store.record_hits([short.key()])
        for _ in range(2):
            store.record_hits([long.key()])
        report = Compactor(store).run(do_reclaim=False)
        assert report.deduplicated == 1
        assert not store.contains(short.key()) and store.contains(long.key())
        life = store.lifecycle(long.key())
        assert (life.hit_count, life.lifetime) == (5, LIFETIME_LONG)  # 3 + 2 hits: promoted
        # the shorter prefix is still served by the longer fragment
        match = store.prefix_walk(long.namespace, tokens[:200])
        assert match.matched_tokens == 200

        # with a fragment continuing after the short one's end, it must stay: another prompt
        # shares tokens[:200] and goes on differently; its chain steps on the short fragment
        other = np.concatenate([tokens[:200], rng.integers(0, 49152, size=100, dtype=np.int32)])
        short2 = kv_prefix_of(long, 200)
        child = make_fragment(other, start=200, end=264, seed=4, created_at=clock(), expires_at=clock() + 1800)
        store.put_many([short2, child])
        assert store.prefix_walk(long.namespace, other[:265]).matched_tokens == 264
        assert Compactor(store).run(do_reclaim=False).deduplicated == 0
        assert store.contains(short2.key())
        assert store.prefix_walk(long.namespace, other[:265]).matched_tokens == 264


def kv_prefix_of(frag, end: int):
    """The fragment of ``frag``'s first ``end - token_start`` tokens, with the same K/V rows
    (what an engine computes for that prefix: KV at a position depends on the tokens up to it)."""
    from edgesync_store.schema import KVFragment

    n = end - frag.token_start
    return KVFragment(namespace=frag.namespace, token_start=frag.token_start, token_end=end,
                      layer_start=0, layer_end=frag.namespace.n_layer, keys=frag.keys[:, :n].copy(),
                      values=frag.values[:, :n].copy(), token_ids=frag.token_ids[:n], prefix_hash=frag.prefix_hash,
                      created_at=frag.created_at, expires_at=frag.expires_at)


def test_compactor_merges_layer_and_head_groups_into_the_whole_chunk(tmp_path, clock):
    whole_a = fresh(30, clock)
    whole_b = make_fragment(seed=31, start=0, end=64, created_at=clock(), expires_at=clock() + 1800)
    halves = split_layers(whole_a, 15)
    heads = split_heads(whole_b, 2)
    grid = [h for part in split_layers(make_fragment(seed=32, created_at=clock(), expires_at=clock() + 1800), 10)
            for h in split_heads(part, 1)]  # 3 layer groups x 3 head groups
    with FragmentStore(tmp_path / "s", clock=clock) as store:
        store.put_many(halves + heads + grid)
        for _ in range(2):
            store.record_hits([f.key() for f in halves])
        assert store.stats().fragments == 2 + 2 + 9
        dry = Compactor(store).run(dry_run=True, do_reclaim=False)
        assert dry.merged_heads == 4 and store.stats().fragments == 13  # nothing changed
        report = Compactor(store).run(do_reclaim=False)
        assert report.merged_heads == 4  # whole_b's heads and the grid's three layer groups
        assert report.merged_layers == 2  # whole_a's halves and the grid's layer groups
        assert store.stats().fragments == 3
        for frag in (whole_a, whole_b):
            got = store.get(frag.key())  # the merged fragment has the whole chunk's key
            assert got is not None and np.array_equal(got.keys, frag.keys) and np.array_equal(got.values, frag.values)
        assert store.lifecycle(whole_a.key()).hit_count == 2  # parts hit together: not summed
        assert store.used_bytes() == sum(len(store.get_blob(k)) for k, _ in store.iterate_lifecycle())


def test_overlapping_groups_are_not_merged(tmp_path, clock):
    frag = fresh(40, clock)
    a = split_layers(frag, 20)[0]  # layers [0, 20)
    b = split_layers(frag, 15)[1]  # layers [15, 30): overlaps a
    with FragmentStore(tmp_path / "s", clock=clock) as store:
        store.put_many([a, b])
        report = Compactor(store).run(do_reclaim=False)
        assert report.merged_layers == 0 and store.stats().fragments == 2
        assert store.prefix_walk(frag.namespace, frag.token_ids).matched_tokens == 64  # still served


def test_compaction_reclaims_freed_pages(tmp_path, clock):
    path = tmp_path / "s"
    with FragmentStore(path, clock=clock) as store:
        frags = [
            make_fragment(seed=50 + i, kind="bits", created_at=clock(), expires_at=clock() + 60) for i in range(12)
        ]
        keep = make_fragment(seed=99, kind="bits", created_at=clock(), expires_at=clock() + 3600)
        store.put_many(frags + [keep])
        before = (path / "data.mdb").stat().st_size
        clock.advance(120)
        report = Compactor(store).run()
        assert report.expired == 12
        assert report.reclaim["reclaimed"] is True
        after = (path / "data.mdb").stat().st_size
        assert after < before / 4
        assert report.bytes_reclaimed == report.reclaim["file_bytes_before"] - after >= before - after - 65536
        got = store.get(keep.key())  # the store is usable on the rewritten file
        assert got is not None and got.keys.tobytes() == keep.keys.tobytes()  # bit patterns: NaNs too
        assert store.put(make_fragment(seed=200, created_at=clock(), expires_at=clock() + 60))
    with FragmentStore(path, clock=clock) as store:
        assert store.stats().fragments == 2 and store.stats().dropped_corrupt == 0


def test_reclaim_is_deferred_while_another_process_has_the_store_open(tmp_path, clock):
    path = tmp_path / "s"
    with FragmentStore(path, clock=clock) as store:
        store.put_many(
            [make_fragment(seed=60 + i, kind="bits", created_at=clock(), expires_at=clock() + 60) for i in range(8)]
        )
        clock.advance(120)
        other = FragmentStore(path)  # holds the shared open lock like another process
        report = Compactor(store).run(force_reclaim=True)
        assert report.expired == 8 and report.reclaim["reclaimed"] is False
        assert "another process" in report.reclaim["reason"]
        other.close()
        assert Compactor(store).run(force_reclaim=True).reclaim["reclaimed"] is True


@pytest.mark.model
def test_fragments_merged_between_walk_and_read_are_found_again(tmp_path, adapter, system_prompts):
    """Another process's compaction merges the prompt's layer halves right after this
    request's walk (a test hook on the walk places it there): the halves the walk found are
    gone, the router walks again and injects the merged fragments: still an exact hit."""
    path = tmp_path / "s"
    store = FragmentStore(path)
    es = EdgeSync(adapter, store=store, config=config(layers_per_fragment=15))
    prompt = chat(system_prompts[2], "What should a first aid kit contain?")
    es.generate(prompt, max_tokens=4)
    n_halves = store.stats().fragments
    other = FragmentStore(path)
    real_walk = store.prefix_walk
    walks = []

    def walk_then_compact(namespace, tokens, now=None):
        match = real_walk(namespace, tokens, now)
        walks.append(match)
        if len(walks) == 1:
            assert Compactor(other).run(do_reclaim=False).merged_layers == n_halves // 2
        return match

    store.prefix_walk = walk_then_compact
    try:
        result = es.generate(prompt, max_tokens=8)
    finally:
        del store.prefix_walk
    assert len(walks) == 2 and result.hit == "exact"
    assert store.stats().fragments == n_halves // 2
    assert result.tokens == EdgeSync(adapter, store=False, config=config()).generate(prompt, max_tokens=8).tokens
    other.close()
    store.close()
