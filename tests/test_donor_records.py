"""Donor records written without a vector (the default mode) and the catch-up that embeds them
later: a real FragmentStore (LMDB in a tmp dir), the real store-back over the fake adapter of
tests/fake_adapter.py (one token per character: its KV is fake, the records and keys are
real), real hnswlib and the real int8 ONNX MiniLM-L6-v2, real child processes.

Questions come from ../shared/workloads/qqp_clusters.jsonl (the first 40 distinct ones).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fake_adapter import FakeAdapter

from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request import storeback
from edgesync_engines.request.prompt_text import embed_text_for
from edgesync_engines.request.semantic_lookup import SemanticLookup
from edgesync_store.compactor import Compactor
from edgesync_store.core.store import FragmentStore
from edgesync_store.semantic.donors import (
    embed_unindexed,
    get_donor,
    iterate_donors,
    pending_generation,
    unindexed_keys,
)
from edgesync_store.semantic.index import SemanticIndex
from edgesync_store.semantic.vectors import VectorTable
from edgesync_store.ttl import ManualClock

SYSTEM = "You are a helpful assistant who answers briefly and precisely. " * 2
ONNX_ID = "all-MiniLM-L6-v2/onnx-int8"


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def cfg(**overrides) -> EdgeSyncConfig:
    return EdgeSyncConfig.load({"jobs": False, **overrides}, environ={})


@pytest.fixture(scope="module")
def questions(data_dir) -> list[str]:
    out: list[str] = []
    for line in (data_dir / "qqp_clusters.jsonl").read_text().splitlines():
        for q in json.loads(line)["questions"]:
            if q not in out:
                out.append(q)
        if len(out) >= 40:
            return out[:40]
    raise AssertionError("qqp_clusters.jsonl: fewer than 40 questions")


@pytest.fixture(scope="module")
def embedder():
    from edgesync_store.semantic.embedders import get_embedder

    return get_embedder("onnx").load()


@pytest.fixture
def store(tmp_path):
    with FragmentStore(tmp_path / "store", clock=ManualClock(1_000_000.0)) as s:
        yield s


def store_back(store, adapter, prompt, config, *, donor=True) -> tuple[bytes, list[int], int]:
    """Store a prompt (raw text or chat messages) as the router does after an answer; returns
    (donor key, tokens, fragments written)."""
    tokens = adapter.tokenize(prompt if isinstance(prompt, str) else adapter.apply_chat_template(prompt))
    adapter.prefill(tokens)  # the answer's prefill: store-back extracts from the live sequence
    written = storeback.store_new(store, adapter, tokens, config, donor_prompt=prompt if donor else None)
    return storeback.donor_key(adapter.namespace, tokens, config), tokens, written


def test_the_record_goes_with_the_fragments_and_a_repeat_writes_nothing(store):
    adapter, config = FakeAdapter(), cfg()
    messages = chat("How do I improve my English pronunciation quickly?")
    key, tokens, written = store_back(store, adapter, messages, config)
    assert written == 2 and store.contains(key)
    record = get_donor(store, key)
    assert list(record.tokens) == tokens and record.text == embed_text_for(messages)
    assert record.namespace_digest == adapter.namespace.digest()
    assert pending_generation(store) == 1 and unindexed_keys(store) == [key]
    assert [k for k, _ in iterate_donors(store)] == [key]  # the counter is not a record

    assert store_back(store, adapter, messages, config)[2] == 0  # an exact repeat
    assert pending_generation(store) == 1  # nothing written


def test_a_prompt_stored_without_its_record_gets_it_when_served_again(store):
    """A store written before records came with the fragments (or by a process with
    ``semantic`` off) has chains without records; the next store-back adds the record alone."""
    adapter, config = FakeAdapter(), cfg()
    messages = chat("What is the best way to learn to cook at home?")
    key, _, written = store_back(store, adapter, messages, config, donor=False)
    assert written == 2 and get_donor(store, key) is None and pending_generation(store) == 0
    assert store_back(store, adapter, messages, config)[2] == 0
    assert get_donor(store, key) is not None and pending_generation(store) == 1
    assert not store.put_donor(key, b"x" * 40)  # it has one: never replaced


def test_records_without_a_vector_go_with_their_fragment(store):
    """Delete, forget, expiry and eviction drop a record that has no vector, like one that
    has: the store deletes records with their fragment in the same transaction."""
    adapter, config = FakeAdapter(), cfg(ttl_seconds=60.0)
    prompts = [f"{i}: how do magnets work, and why do they pull iron but not wood? " * 4 for i in range(4)]
    keys = [store_back(store, adapter, p, config)[0] for p in prompts]  # four disjoint chains
    assert unindexed_keys(store) == sorted(keys)
    store.delete(keys[0])
    assert get_donor(store, keys[0]) is None
    assert store.forget_tokens(adapter.namespace, adapter.tokenize(prompts[1])) == 2
    assert get_donor(store, keys[1]) is None and get_donor(store, keys[2]) is not None
    store.clock.advance(61.0)
    from edgesync_store.ttl import sweep

    assert keys[2].hex() in {k.hex() for k, _ in sweep(store)} and get_donor(store, keys[2]) is None
    assert list(iterate_donors(store)) == [] and unindexed_keys(store) == []

    path = store.path.parent / "small"
    with FragmentStore(path, max_bytes=1 << 30) as small:
        first = store_back(small, adapter, ("Which planet has the most moons, and why? " * 8)[:340], config)[0]
        used = small.used_bytes()
    with FragmentStore(path, max_bytes=int(used * 1.2)) as small:  # room for one such prompt, not two
        second = store_back(small, adapter, ("A second, unrelated question about rivers. " * 8)[:340], config)[0]
        assert small.contains(second) and not small.contains(first)  # evicted to fit the budget
        assert get_donor(small, first) is None and [k for k, _ in iterate_donors(small)] == [second]


def test_a_record_moved_by_compaction_without_a_vector_is_pending_again(store):
    """Dedup replaces a prompt's last fragment by a longer one holding its tokens: the record
    moves to the longer fragment's key, still without a vector, and the pending counter says
    so (an index that caught up before sees it)."""
    adapter, config = FakeAdapter(), cfg()
    short = "How do I train for a marathon? I run twice a week and want to finish in four hours. " * 3
    key, short_tokens, _ = store_back(store, adapter, short, config)  # chunks [0, 128) [128, n - 1)
    long_key, long_tokens, _ = store_back(store, adapter, short + "What should I eat?", config, donor=False)
    assert long_tokens[:len(short_tokens)] == short_tokens
    before = pending_generation(store)
    Compactor(store).run()
    assert not store.contains(key) and store.contains(long_key)  # the shorter twin was dropped
    moved = get_donor(store, long_key)
    assert moved is not None and list(moved.tokens) == short_tokens
    assert pending_generation(store) == before + 1 and unindexed_keys(store) == [long_key]


@pytest.mark.model
def test_embed_unindexed_embeds_each_record_once_and_skips_a_fragment_deleted_meanwhile(store, questions, embedder):
    adapter, config = FakeAdapter(), cfg()
    keys = [store_back(store, adapter, chat(q), config)[0] for q in questions[:20]]
    victim = sorted(keys)[5]
    calls = []

    def encode(texts):
        if not calls:
            store.delete(victim)  # another process evicts it while the first batch is encoded
        calls.append(len(texts))
        return embedder.encode(texts)

    with SemanticIndex(store, ONNX_ID) as index:
        assert embed_unindexed(store, index, encode, batch=8) == 19
        assert calls == [8, 8, 4] and victim not in index and len(index) == 19
        assert unindexed_keys(store) == [] and embed_unindexed(store, index, encode) == 0
        for q, key in list(zip(questions, keys))[::4]:
            if key != victim:
                assert index.query(embedder.encode([q])[0], k=1)[0][0] == key


CATCH_UP_CHILD = """
import sys
from edgesync_store.core.store import FragmentStore
from edgesync_store.semantic.donors import embed_unindexed
from edgesync_store.semantic.embedders import get_embedder
from edgesync_store.semantic.index import SemanticIndex
with FragmentStore(sys.argv[1]) as store:
    with SemanticIndex(store, get_embedder("onnx").backend_id, autosave=False) as index:
        print(embed_unindexed(store, index, get_embedder("onnx").encode, batch=4))
"""


@pytest.mark.model
def test_two_processes_catch_up_the_same_store_at_once(store, questions):
    """Two processes embed the same 40 pending records at the same time: every record ends up
    with exactly one vector, labels never collide, nothing is left pending."""
    adapter, config = FakeAdapter(), cfg()
    keys = {store_back(store, adapter, chat(q), config)[0] for q in questions}
    procs = [subprocess.Popen([sys.executable, "-c", CATCH_UP_CHILD, str(store.path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    added = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        added.append(int(out.strip()))
    assert sum(added) >= len(keys) and unindexed_keys(store) == []
    table = VectorTable(store)
    assert table.count() == len(keys)
    live, _, gone, _ = table.scan(lambda label: False)
    assert set(live.values()) == keys and gone == [] and len(live) == len(keys)


@pytest.mark.model
def test_the_lookup_loads_nothing_until_asked_then_catches_up_and_follows_the_counter(store, questions):
    """A SemanticLookup is created empty; loading it starts the background catch-up; a record
    another process writes later is embedded once a lookup sees the counter move."""
    adapter, config = FakeAdapter(), cfg(reuse="semantic")
    keys = [store_back(store, adapter, chat(q), config)[0] for q in questions[:6]]
    lookup = SemanticLookup(store, config)
    assert lookup.embedder is None and lookup.index_if_ready() is None and lookup.wait_caught_up(0)
    assert lookup.wait_ready() and lookup.wait_caught_up(timeout=120)
    index = lookup.index_if_ready()
    assert all(k in index for k in keys) and unindexed_keys(store) == []

    later, tokens, _ = store_back(store, adapter, chat(questions[6]), config)  # as another process would
    assert later not in index
    found = lookup.nominate(chat(questions[6]), adapter.namespace)  # sees what is indexed meanwhile
    assert found is not None and lookup.wait_caught_up(timeout=120)
    assert later in index and lookup.catch_up() == 0
    again = lookup.nominate(chat(questions[6]), adapter.namespace)
    assert again.donors[0].key == later and again.similarity == pytest.approx(1.0, abs=1e-3)
    assert list(again.donors[0].tokens) == tokens
    lookup.close()
    assert lookup.catch_up() == 0  # closed: off
