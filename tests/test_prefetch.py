"""NgramPredictor (next-request prediction with backoff) and RamTier (bounded LRU), with no
model and no store: deterministic sequences, hypothesis properties, and real threads."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgesync_engines.request.prefetch import NgramPredictor, PredictionAccuracy
from edgesync_engines.request.ramtier import RamTier


class Frag:
    """Stands in for a decoded KVFragment: only its raw_nbytes matters to the tier."""

    def __init__(self, raw_nbytes: int) -> None:
        self.raw_nbytes = raw_nbytes


# ---------------------------------------------------------------- NgramPredictor, by hand

def test_empty_predictor_predicts_nothing():
    p = NgramPredictor()
    assert p.predict() == []
    assert p.accuracy == PredictionAccuracy(0, 0, 0, 0, 3)
    assert p.accuracy.top1 is None and p.accuracy.topk is None


def test_cycle_is_learned_after_one_pass():
    p = NgramPredictor(n=3, top_k=3)
    made = [p.observe(k) for k in "ABC" * 5]
    assert made[:4] == [[], ["A"], ["B", "A"], ["C", "B", "A"]]  # unigram, most recent first
    # from the second B on, the context's continuation comes first; unigrams fill the rest
    assert made[4] == ["B", "A", "C"]
    assert [m[0] for m in made[4:]] == list("BCABCABCABC")
    assert all(len(m) == 3 for m in made[3:])
    acc = p.accuracy
    assert (acc.observed, acc.predicted, acc.top1_hits, acc.topk_hits) == (15, 14, 11, 12)
    assert acc.top1 == pytest.approx(11 / 14) and acc.topk == pytest.approx(12 / 14)
    assert p.predict() == ["A", "C", "B"]  # (B, C) -> A; then C, B by recency (5 each)


def test_longest_context_wins_over_shorter_ones():
    # after "X A" comes B, after "Y A" comes C; A alone was followed by C more often
    p = NgramPredictor(n=3, top_k=3)
    p.observe_all(["X", "A", "B", "Y", "A", "C", "Z", "A", "C", "X", "A"])
    assert p.predict() == ["B", "C", "A"]  # (X,A)->B; then (A,)->C; then unigram fill (A: 4)
    p2 = NgramPredictor(n=2, top_k=3)  # bigram only: sees A->C twice, A->B once
    p2.observe_all(["X", "A", "B", "Y", "A", "C", "Z", "A", "C", "X", "A"])
    assert p2.predict() == ["C", "B", "A"]


def test_backoff_when_context_is_unseen():
    p = NgramPredictor(n=3, top_k=3)
    p.observe_all(["A", "B", "A", "B", "A", "C", "D", "B"])
    # context (D, B) never seen; (B,) was followed by A twice; then unigram: A:3, B:3 (B more
    # recent), C:1, D:1 -> B comes first among the unigram fill, A already chosen
    assert p.predict() == ["A", "B", "D"]
    p.observe("Q")  # a brand-new key: no context at all contains it
    assert p.predict() == ["B", "A", "Q"]  # unigram only: B (3, more recent), A (3), Q/D/C (1)


def test_ties_broken_by_recency_not_key_order():
    p = NgramPredictor(n=2, top_k=2)
    p.observe_all(["S", "z", "S", "a", "S", "m"])  # S followed once each by z, a, m
    p.observe("S")
    assert p.predict() == ["m", "a"]  # equal counts: most recent continuation first
    p.observe("z")  # now z follows S twice: count beats recency
    p.observe("S")
    assert p.predict() == ["z", "m"]


def test_unhashable_keys_and_bad_parameters_raise():
    with pytest.raises(ValueError, match="n must be"):
        NgramPredictor(n=0)
    with pytest.raises(ValueError, match="top_k must be"):
        NgramPredictor(top_k=0)
    with pytest.raises(TypeError):
        NgramPredictor().observe(["not", "hashable"])


def test_unigram_order_and_bytes_keys():
    p = NgramPredictor(n=1, top_k=2)
    p.observe_all([b"\x01", b"\x02", b"\x02", b"\x03"])
    assert p.predict() == [b"\x02", b"\x03"]
    assert len(p) == 3 and b"\x01" in p and b"\x04" not in p


# ---------------------------------------------------------------- NgramPredictor, properties

keys = st.sampled_from(list("ABCDEFG")) | st.integers(0, 5)


@settings(max_examples=150, deadline=None)
@given(seq=st.lists(keys, max_size=60), n=st.integers(1, 4), top_k=st.integers(1, 5))
def test_predictions_are_bounded_distinct_and_seen(seq, n, top_k):
    p = NgramPredictor(n=n, top_k=top_k)
    seen: set = set()
    hits1 = hitsk = 0
    for key in seq:
        pred = p.predict()
        assert len(pred) <= top_k
        assert len(set(pred)) == len(pred)
        assert set(pred) <= seen
        assert len(pred) == min(top_k, len(seen))  # unigram fill always reaches top_k if it can
        assert p.observe(key) == pred
        hits1 += bool(pred) and pred[0] == key
        hitsk += key in pred
        seen.add(key)
    acc = p.accuracy
    assert (acc.observed, acc.predicted) == (len(seq), max(len(seq) - 1, 0))
    assert (acc.top1_hits, acc.topk_hits) == (hits1, hitsk)
    assert p.predict() == p.predict()  # deterministic, and predicting changes nothing


@settings(max_examples=50, deadline=None)
@given(seq=st.lists(keys, min_size=1, max_size=40))
def test_unigram_predictor_ranks_by_count_then_recency(seq):
    p = NgramPredictor(n=1, top_k=10)
    p.observe_all(seq)
    counts = Counter(seq)
    last = {k: i for i, k in enumerate(seq)}
    assert p.predict() == sorted(counts, key=lambda k: (counts[k], last[k]), reverse=True)[:10]


# ---------------------------------------------------------------- RamTier

def test_ram_tier_lru_eviction_and_counters():
    t = RamTier(100)
    assert t.put("a", Frag(40)) and t.put("b", Frag(40))
    assert t.get("a").raw_nbytes == 40  # a becomes most recent
    assert t.put("c", b"x" * 30, nbytes=30)  # 110 > 100: evict b (least recently used)
    assert t.keys() == ["a", "c"] and "b" not in t and t.bytes == 70
    assert t.get("b") is None and t.get("b", "gone") == "gone"
    assert "a" in t  # does not touch order or counters
    assert t.keys() == ["a", "c"]
    s = t.stats()
    assert (s.hits, s.misses, s.puts, s.rejected, s.evictions, s.bytes, s.entries) == (
        1, 2, 3, 0, 1, 70, 2)
    assert s.hit_rate == pytest.approx(1 / 3)


def test_ram_tier_replace_oversize_discard_clear():
    t = RamTier(100)
    t.put("a", Frag(60))
    t.put("a", Frag(10))  # replacing frees the old size
    assert t.bytes == 10 and len(t) == 1
    assert t.put("a", Frag(101)) is False  # alone over budget: rejected, old entry dropped
    assert "a" not in t and t.bytes == 0
    assert t.put("b", Frag(100)) and t.bytes == 100  # exactly the budget fits
    assert t.discard("b") and not t.discard("b") and t.bytes == 0
    t.put("c", Frag(5))
    t.clear()
    s = t.stats()
    assert (s.puts, s.rejected, s.evictions, s.bytes, s.entries) == (4, 1, 0, 0, 0)
    assert RamTier(0).put("z", Frag(1)) is False
    assert RamTier(0).put("z", Frag(0)) is True


def test_ram_tier_bad_sizes_raise():
    t = RamTier(10)
    with pytest.raises(TypeError, match="raw_nbytes"):
        t.put("a", object())
    with pytest.raises(ValueError):
        t.put("a", object(), nbytes=-1)
    with pytest.raises(ValueError):
        t.put("a", object(), nbytes=2.5)
    with pytest.raises(ValueError):
        RamTier(-1)
    assert len(t) == 0


ops = st.lists(st.tuples(st.sampled_from(["put", "get"]), st.integers(0, 9),
                         st.integers(0, 60)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(budget=st.integers(0, 150), ops=ops)
def test_ram_tier_matches_a_reference_lru(budget, ops):
    t = RamTier(budget)
    ref: OrderedDict = OrderedDict()  # key -> size, least recently used first
    hits = misses = 0
    for op, key, size in ops:
        if op == "put":
            ref.pop(key, None)
            stored = t.put(key, Frag(size))
            assert stored == (size <= budget)
            if stored:
                ref[key] = size
                while sum(ref.values()) > budget:
                    ref.popitem(last=False)
        else:
            got = t.get(key)
            if key in ref:
                ref.move_to_end(key)
                hits += 1
                assert got.raw_nbytes == ref[key]
            else:
                misses += 1
                assert got is None
        assert t.bytes <= budget
        assert t.keys() == list(ref)
        assert t.bytes == sum(ref.values())
    s = t.stats()
    assert (s.hits, s.misses) == (hits, misses)


def test_ram_tier_threads_counters_add_up():
    t = RamTier(10_000)
    n_threads, n_ops = 4, 2_000
    over_budget: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(n_threads * 2 + 1)
    done = threading.Event()

    def writer(w):
        start.wait()
        for i in range(n_ops):
            t.put((w, i % 50), Frag(100 + (i % 7) * 50))

    def reader(r):
        start.wait()
        for i in range(n_ops):
            t.get((r % n_threads, (i * 7) % 50))

    def watcher():
        start.wait()
        while not done.is_set():
            b = t.bytes
            if b > t.max_bytes:
                over_budget.append(b)

    def guard(fn, *a):
        try:
            fn(*a)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=guard, args=(writer, w)) for w in range(n_threads)]
    threads += [threading.Thread(target=guard, args=(reader, r)) for r in range(n_threads)]
    watch = threading.Thread(target=guard, args=(watcher,))
    for th in threads + [watch]:
        th.start()
    for th in threads:
        th.join(timeout=60)
    done.set()
    watch.join(timeout=60)
    assert errors == [] and over_budget == []
    s = t.stats()
    assert s.hits + s.misses == n_threads * n_ops
    assert s.puts == n_threads * n_ops and s.rejected == 0
    assert s.bytes <= 10_000 and s.bytes == sum(t.get(k).raw_nbytes for k in t.keys())
    # every stored entry is held, was evicted, or was replaced by a put of the same key
    replaced = s.puts - s.evictions - s.entries
    assert 0 <= replaced < s.puts and s.evictions > 0


def test_predictor_threads_count_every_observation():
    p = NgramPredictor(n=3, top_k=3)
    barrier = threading.Barrier(4)

    def run(w):
        barrier.wait()
        for i in range(1_000):
            p.observe(f"{w}-{i % 10}")
            p.predict()

    threads = [threading.Thread(target=run, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    acc = p.accuracy
    assert acc.observed == 4_000 and acc.predicted == 3_999
    assert len(p) == 40
