"""The store-back (``request/storeback.py``) against the size budget: a context whose KV cannot
fit is refused before its KV is extracted, with one warning naming both sizes, and nothing is
written; the answer is unaffected. Real stores (LMDB in tmp dirs) with the fake adapter of
tests/fake_adapter.py (one token per character, fake KV of any geometry), and the real SmolLM2
for the last test. Prompts of the model test are an app's system prompt
(../shared/workloads/system_prompts.json) and a question.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
from fake_adapter import FakeAdapter, fake_namespace

from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request import storeback
from edgesync_engines.request.storeback import context_kv_bytes
from edgesync_store.core.store import FragmentStore
from edgesync_store.errors import sized
from edgesync_store.schema import chunk_spans

MiB = 1 << 20
LOGGER = "edgesync_engines.request.storeback"


def cfg(**overrides) -> EdgeSyncConfig:
    return EdgeSyncConfig.load({"jobs": False, "semantic": False, **overrides}, environ={})


class CountingAdapter(FakeAdapter):
    """The fake adapter, counting the spans it was asked to extract."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.extracted: list[tuple[int, int]] = []

    def extract_fragments(self, tokens, spans, *args, **kwargs):
        self.extracted.extend(spans)
        return super().extract_fragments(tokens, spans, *args, **kwargs)


def state(store: FragmentStore) -> tuple:
    """What a refused store-back must leave as it was."""
    return (sorted(k for k, _ in store.iterate_lifecycle()), store.used_bytes(), store.fragment_count(),
            (store.path / "data.mdb").stat().st_size)


def store_back(store, adapter, text: str, config) -> int:
    tokens = adapter.tokenize(text)
    adapter.prefill(tokens)  # the answer's prefill: store-back extracts from the live sequence
    return storeback.store_new(store, adapter, tokens, config, donor_prompt=text)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_context_kv_bytes_of_the_models_users_run():
    """2 x layers x KV heads x head size x 2 bytes a token in f16: Llama-3.1-8B 128 KiB, so
    32,768 tokens are 4 GiB; SmolLM2-135M 22.5 KiB; q8_0 34 bytes for 32 values (0.53x)."""
    llama8b = fake_namespace(n_layer=32, n_head_kv=8, head_dim=128)
    assert context_kv_bytes(llama8b, 1) == 128 * 1024
    assert context_kv_bytes(llama8b, 32768) == 4_294_967_296
    assert context_kv_bytes(fake_namespace(n_layer=30, n_head_kv=3, head_dim=64), 1) == 23040
    assert context_kv_bytes(replace(llama8b, kv_dtype="q8_0"), 1) == 2 * 32 * 8 * (128 // 32 * 34) == 69_632


def test_a_32k_context_of_an_8b_model_over_the_budget_is_refused_before_extraction(tmp_path, caplog):
    """The issue's shape: 32,768 tokens of Llama-3.1-8B's KV (4 GiB) against a 1 GiB budget.
    Refused before any KV is extracted (nothing of 4 GiB is allocated), one warning naming
    both sizes, human-readable and exact; nothing written."""
    adapter = CountingAdapter(fake_namespace(n_layer=32, n_head_kv=8, head_dim=128), n_ctx=40_000)
    text = "".join(chr(0x4E00 + i % 20_000) for i in range(32_769))  # 32,769 tokens: a grid of 32,768
    assert chunk_spans(32_768, 128)[-1][1] == 32_768
    with FragmentStore(tmp_path / "s", max_bytes=1 << 30) as store:
        before = state(store)
        caplog.set_level(logging.DEBUG, logger=LOGGER)
        assert store_back(store, adapter, text, cfg()) == 0
        assert adapter.extracted == [] and state(store) == before
        (message,) = warnings_of(caplog)
        assert "4.0 GiB (4294967296 bytes)" in message and "1.0 GiB (1073741824 bytes)" in message
        assert "32768 tokens" in message and "not storing this context" in message


def test_a_context_over_a_budget_of_a_few_mb_stores_nothing_and_warns_once(tmp_path, caplog):
    """A budget of 4 MiB over KV of 2 KiB a token: a 1,000-token prompt (2 MiB) is stored; a
    3,000-token one (5.9 MiB) is refused before extraction, with one warning naming both
    sizes; the store (fragments, bytes, index, file) is as it was, and the first prompt's chain
    is still there (nothing evicted). The same context refused again, or grown by an idle
    store-back, is logged at DEBUG only."""
    ns = fake_namespace(n_layer=4, n_head_kv=2, head_dim=64)
    assert context_kv_bytes(ns, 1) == 2048
    adapter, config = CountingAdapter(ns), cfg()
    small, big = "a" * 1000, "".join(chr(0x100 + i % 500) for i in range(3001))
    with FragmentStore(tmp_path / "s", max_bytes=4 * MiB) as store:
        assert store_back(store, adapter, small, config) == 8  # 7 chunks of 128 tokens and one of 103
        before, extracted = state(store), len(adapter.extracted)
        caplog.set_level(logging.DEBUG, logger=LOGGER)
        assert store_back(store, adapter, big, config) == 0
        assert len(adapter.extracted) == extracted and state(store) == before
        (message,) = warnings_of(caplog)
        kv = context_kv_bytes(ns, chunk_spans(3000, 128)[-1][1])
        assert kv == 3000 * 2048 and sized(kv) in message and sized(4 * MiB) in message
        assert "5.9 MiB (6144000 bytes)" in message and "4.0 MiB (4194304 bytes)" in message
        caplog.clear()
        assert store_back(store, adapter, big, config) == 0  # the same context again
        tokens = adapter.tokenize(big)
        assert storeback.store_new(store, adapter, tokens, config, spans=[(2944, 3000)]) == 0  # an idle step
        assert warnings_of(caplog) == [] and sum(r.name == LOGGER and r.levelno == logging.DEBUG
                                                 for r in caplog.records) == 2
        assert state(store) == before
        assert storeback.donor_key(ns, adapter.tokenize(small), config) in {k for k, _ in store.iterate_lifecycle()}


def test_blobs_the_store_refuses_write_nothing_and_warn_once(tmp_path, caplog):
    """KV of 64 bytes a token (the fake's own geometry) fits a 40,000-byte budget, but its
    fragments' blobs (token IDs and heads added) do not: the store refuses the batch
    (StoreBudgetError) before writing or evicting, and the store-back logs one warning naming
    both sizes; the request is not failed."""
    adapter, config = CountingAdapter(), cfg()
    text = "".join(chr(0x100 + i % 500) for i in range(601))
    assert context_kv_bytes(adapter.namespace, 600) == 38_400
    with FragmentStore(tmp_path / "s", max_bytes=40_000) as store:
        before = state(store)
        caplog.set_level(logging.WARNING, logger=LOGGER)
        assert store_back(store, adapter, text, config) == 0
        assert adapter.extracted and state(store) == before
        (message,) = warnings_of(caplog)
        assert "its fragments take" in message and sized(40_000) in message


@pytest.mark.model
def test_a_budget_smaller_than_one_prompt_answers_identically_and_stores_nothing(adapter, system_prompts, tmp_path,
                                                                                  caplog):
    """SmolLM2 (22.5 KiB of KV a token) with a 1 MiB store: a prompt of a few hundred tokens
    cannot fit. Its answer equals an uncached run's, twice (a miss both times), nothing is
    stored, and one warning names the context's KV and the budget."""
    from edgesync_engines.request.router import EdgeSync

    messages = [{"role": "system", "content": system_prompts[0]},
                {"role": "user", "content": "How should I plan a week of revision?"}]
    uncached = EdgeSync(adapter, store=False, config=cfg()).generate(messages, max_tokens=8)
    with FragmentStore(tmp_path / "s", max_bytes=MiB) as store:
        es = EdgeSync(adapter, store=store, config=cfg())
        try:
            caplog.set_level(logging.DEBUG, logger=LOGGER)
            results = [es.generate(messages, max_tokens=8) for _ in range(2)]
            n_tokens = len(es.prompt_tokens(messages))
        finally:
            es.close()
        for r in results:
            assert r.tokens == uncached.tokens and r.hit == "miss" and r.fragments_written == 0
        assert store.fragment_count() == 0 and store.used_bytes() == 0
        (message,) = warnings_of(caplog)
        kv = context_kv_bytes(adapter.namespace, chunk_spans(n_tokens - 1, 128)[-1][1])
        assert kv > MiB and sized(kv) in message and sized(MiB) in message


def test_write_batches_cut_spans_in_order_at_the_byte_limit():
    ns = fake_namespace(n_layer=4, n_head_kv=2, head_dim=64)  # 2 KiB a token
    spans = chunk_spans(1000, 128)  # 7 x 128 tokens (256 KiB each), then 104
    assert storeback.write_batches(ns, spans, 512 << 10) == [spans[0:2], spans[2:4], spans[4:6], spans[6:8]]
    assert storeback.write_batches(ns, spans, 100 << 10) == [[s] for s in spans]  # a span over the limit alone
    assert storeback.write_batches(ns, spans) == [spans]
    assert storeback.write_batches(ns, []) == []


def test_a_long_context_is_extracted_and_written_a_batch_at_a_time(tmp_path, monkeypatch):
    """With batches of two chunks, a 1,000-token store-back extracts two spans at a time and
    writes the same fragments, and the same donor record, as one batch does."""
    ns = fake_namespace(n_layer=4, n_head_kv=2, head_dim=64)
    text, config = "b" * 1000, cfg()
    with FragmentStore(tmp_path / "one") as one:
        assert store_back(one, CountingAdapter(ns), text, config) == 8
        whole = sorted(k for k, _ in one.iterate_lifecycle())
    calls = []
    monkeypatch.setattr(storeback, "WRITE_BATCH_BYTES", 512 << 10)
    adapter = CountingAdapter(ns)
    original = adapter.extract_fragments
    monkeypatch.setattr(adapter, "extract_fragments", lambda tokens, spans, **kw: calls.append(spans) or
                        original(tokens, spans, **kw))
    with FragmentStore(tmp_path / "batched") as batched:
        assert store_back(batched, adapter, text, config) == 8
        assert [len(c) for c in calls] == [2, 2, 2, 2]
        assert sorted(k for k, _ in batched.iterate_lifecycle()) == whole
