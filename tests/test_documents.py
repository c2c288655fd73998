"""Documents on the request path (``request/documents.py``, ``router.py``, ``blend.py``)
with the real SmolLM2 model, real LMDB stores in temp dirs and the real MiniLM embedder.

Data: passages (``context``) and questions of rows 0-5 of ``doc_qa.jsonl``, as named in each
test.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys

import pytest

from edgesync_engines.adapters.protocol import ContextOverflowError
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.router import EdgeSync
from tests.llama_counts import chat, llama_prefilled

pytestmark = [pytest.mark.model]

SYSTEM = "Answer the question using the documents. Reply briefly."
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def rows(data_dir) -> list[dict]:
    with open(data_dir / "doc_qa.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line, _ in zip(f, range(6))]


def _config() -> EdgeSyncConfig:
    return dataclasses.replace(EdgeSyncConfig.load(), semantic=False, jobs=False, prefetch=False)


@pytest.fixture()
def config() -> EdgeSyncConfig:
    return _config()


@pytest.fixture(scope="module")
def six_documents(adapter, rows, tmp_path_factory):
    """A store holding the six passages as documents (KV, records, vectors), each with its row's
    ``doc_id`` as source, added once for the module. Tests that use it work on a copy."""
    store = tmp_path_factory.mktemp("six") / "store"
    with EdgeSync(model=adapter, store=store, config=_config()) as es:
        assert len(es.add_documents([{"text": r["context"], "source": r["doc_id"]} for r in rows])) == 6
    return store


def copy_of(store, tmp_path):
    """A copy of the store directory ``store`` under ``tmp_path``, to write to."""
    return shutil.copytree(store, tmp_path / "copy")


def uncached(adapter, config, messages, docs):
    return EdgeSync(model=adapter, store=False, config=config).generate(messages, documents=docs,
                                                                        max_tokens=MAX_TOKENS)


def test_exact_mode_with_documents_is_token_identical_and_stores_them(adapter, config, rows, tmp_path):
    docs = [rows[i]["context"] for i in (2, 0, 1)]
    messages = chat(SYSTEM, rows[0]["questions"][0])
    reference = uncached(adapter, config, messages, docs)
    with EdgeSync(model=adapter, store=tmp_path / "s", config=config) as es:
        first = es.generate(messages, documents=docs, max_tokens=MAX_TOKENS)
        assert (first.documents_computed, len(es.list_documents())) == (3, 3)
        second = es.generate(messages, documents=docs, max_tokens=MAX_TOKENS)
        prompt, _ = es.document_prompt(messages, docs)
    assert first.tokens == second.tokens == reference.tokens
    assert not first.approximate and first.hit == "miss"
    assert second.hit == "exact" and second.tokens_reused == second.prompt_tokens - 1
    assert second.documents_computed == 0 and second.documents == prompt.document_ids
    assert reference.prompt_tokens == len(prompt.tokens) == first.prompt_tokens


@pytest.mark.parametrize("share", [0.15, 1.0])
def test_blend_places_stored_documents_and_recomputes_its_share(adapter, config, rows, six_documents, tmp_path,
                                                               share):
    docs = [rows[i]["context"] for i in (1, 3, 0)]
    messages = chat(SYSTEM, rows[3]["questions"][1])
    with EdgeSync(model=adapter, store=copy_of(six_documents, tmp_path), config=config) as es:
        assert all(es.documents.kv_stored(rec) for rec in es.add_documents(docs))
        es.config = dataclasses.replace(config, blend_recompute=share)
        prompt, _ = es.document_prompt(messages, docs)
        adapter.reset_perf()
        result = es.generate(messages, documents=docs, max_tokens=MAX_TOKENS, reuse="blend")
        perf = adapter.perf_counts()
    lens = [len(rec.tokens) for rec, _ in prompt.pieces]
    seps = prompt.question_start - prompt.head_len - sum(lens)
    recomputed = seps + sum(min(n, math.ceil(share * n)) for n in lens)
    assert result.approximate and result.blend_refusal is None and result.documents_computed == 0
    assert result.recomputed_tokens == recomputed
    assert result.blended_tokens == sum(lens) + seps - recomputed
    assert result.tokens_reused == result.blended_tokens  # the head is under 64 tokens: prefilled
    # llama.cpp evaluated the head, the recomputed runs and the question: nothing else
    assert llama_prefilled(perf, result.tokens, MAX_TOKENS) == result.prompt_tokens - result.blended_tokens
    if share == 1.0:
        assert result.blended_tokens == 0
        assert result.tokens == uncached(adapter, config, messages, docs).tokens


def test_a_second_process_blends_the_documents_the_first_added(adapter, config, rows, tmp_path):
    """The first process has no semantic extra (its packages blocked, as in a core install): it
    stores the documents for exact reuse with one warning, and the second process, which has
    the extra, embeds them at its first retrieve=."""
    store = tmp_path / "shared"
    docs = [{"text": rows[i]["context"], "title": rows[i]["title"]} for i in (4, 5)]
    code = ("import sys, json; sys.modules['onnxruntime'] = sys.modules['hnswlib'] = None;"
            "from edgesync_engines.request.router import EdgeSync;"
            "from edgesync_engines.config import EdgeSyncConfig; import dataclasses;"
            "c = dataclasses.replace(EdgeSyncConfig.load(), semantic=False, jobs=False);"
            "es = EdgeSync(store=sys.argv[1], config=c); es.add_documents(json.loads(sys.argv[2])); es.close()")
    child = subprocess.run([sys.executable, "-c", code, str(store), json.dumps(docs)], check=True, timeout=600,
                           capture_output=True, text=True)
    assert child.stderr.count("not embedded for retrieve=") == 1 and "'semantic' extra" in child.stderr
    messages = chat(SYSTEM, rows[5]["questions"][0])
    with EdgeSync(model=adapter, store=store, config=config) as es:
        listed = es.list_documents()
        assert sorted(r.title for r in listed) == sorted(d["title"] for d in docs)
        assert [len(r.vectors) for r in listed] == [0, 0]
        assert es.documents.retrieve(rows[5]["questions"][0], 1)[0][0].title == rows[5]["title"]
        assert all(len(r.vectors) for r in es.list_documents())
        result = es.generate(messages, documents=docs, max_tokens=MAX_TOKENS, reuse="blend")
        prompt, _ = es.document_prompt(messages, docs)
        # remove_documents makes the next request compute them again
        assert es.remove_documents([listed[0].doc_id[:12], listed[1]]) == 2
        assert es.list_documents() == [] and es.store.keys_along(es.namespace, listed[0].chain) == []
        again = es.generate(messages, documents=docs, max_tokens=MAX_TOKENS, reuse="blend")
        with pytest.raises(KeyError, match="no stored document"):
            es.remove_documents(["deadbeefdeadbeef"])
    lens = [len(rec.tokens) for rec, _ in prompt.pieces]
    assert result.documents_computed == 0
    assert result.recomputed_tokens == (prompt.question_start - prompt.head_len - sum(lens)) + sum(
        math.ceil(config.blend_recompute * n) for n in lens)
    assert again.documents_computed == 2 and again.recomputed_tokens == result.recomputed_tokens


def test_forget_with_documents_makes_the_next_request_a_miss(adapter, config, rows, tmp_path):
    docs = [rows[0]["context"], rows[2]["context"]]
    messages = chat(SYSTEM, rows[2]["questions"][0])
    with EdgeSync(model=adapter, store=tmp_path / "s", config=config) as es:
        es.generate(messages, documents=docs, max_tokens=MAX_TOKENS)
        assert es.generate(messages, documents=docs, max_tokens=MAX_TOKENS).hit == "exact"
        assert es.forget(messages, documents=docs) > 0
        after = es.generate(messages, documents=docs, max_tokens=MAX_TOKENS)
    assert (after.hit, after.tokens_reused, after.documents_computed) == ("miss", 0, 2)


def test_retrieve_finds_the_gold_passage_by_meaning(adapter, config, rows, six_documents, tmp_path):
    with EdgeSync(model=adapter, store=tmp_path / "s", config=config) as es:
        with pytest.raises(ValueError, match="holds no documents"):
            es.generate(chat(SYSTEM, "Who?"), retrieve=2)
    with EdgeSync(model=adapter, store=copy_of(six_documents, tmp_path), config=config) as es:
        records = es.add_documents([{"text": r["context"], "source": r["doc_id"]} for r in rows])  # the stored ones
        assert [r.source for r in records] == [r["doc_id"] for r in rows]
        found = 0
        for i, row in enumerate(rows):
            # row 0 in the default (exact) mode; the others blend the retrieved passages, which
            # are stored, so that only their recomputed share is prefilled
            result = es.generate(chat(SYSTEM, row["questions"][0]), retrieve=3, max_tokens=4,
                                 reuse="exact" if i == 0 else "blend")
            assert result.approximate == (i > 0)
            assert len(result.documents) == 3
            assert result.retrieval_scores == sorted(result.retrieval_scores, reverse=True)
            found += records[i].doc_id in result.documents
    assert found >= 5  # recall@3 over 6 questions on 6 passages


def test_bad_documents_get_clear_errors(adapter, config, rows, tmp_path):
    messages = chat(SYSTEM, "What is it?")
    with EdgeSync(model=adapter, store=tmp_path / "s", config=config) as es:
        with pytest.raises(ValueError, match=r"documents\[0\]: \d+ tokens do not fit the context of 4096"):
            es.generate(messages, documents=["word " * 5000])
        with pytest.raises(ValueError, match=r"documents\[1\]: the text is empty"):
            es.generate(messages, documents=["fine", "  "])
        with pytest.raises(ValueError, match=r"documents\[0\]: a dict needs a string 'text'"):
            es.add_documents([{"title": "no text"}])
        with pytest.raises(ContextOverflowError, match="does not fit the context of 4096"):
            es.generate(messages, documents=[rows[0]["context"] * 6] * 3, max_tokens=8)
        with pytest.raises(ValueError, match="ending with the user's question"):
            es.generate(messages + [{"role": "assistant", "content": "x"}], documents=["a doc"])
        with pytest.raises(ValueError, match="either documents= or retrieve="):
            es.generate(messages, documents=["a"], retrieve=1)
        with pytest.raises(ValueError, match="reuse: 'mix'"):
            es.generate(messages, documents=["a"], reuse="mix")
        assert es.list_documents() == []


def test_blend_on_a_sliding_window_model_runs_exact_with_its_reason(config, rows, tmp_path):
    from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
    from edgesync_engines.adapters.model_files import gemma3_model_path

    gemma = LlamaCppAdapter(gemma3_model_path(), n_ctx=2048)
    try:
        docs = [rows[1]["context"]]
        messages = chat(SYSTEM, rows[1]["questions"][0])
        reference = uncached(gemma, config, messages, docs)
        with EdgeSync(model=gemma, store=tmp_path / "g", config=config) as es:
            result = es.generate(messages, documents=docs, max_tokens=MAX_TOKENS, reuse="blend")
    finally:
        gemma.close()
    assert "sliding-window" in result.blend_refusal and not result.approximate
    assert result.tokens == reference.tokens and result.recomputed_tokens == 0


def test_compaction_keeps_a_documents_kv_usable(adapter, config, rows, tmp_path):
    """A prompt with no system message starts with the document's chain (the chat header, then
    the document): compaction's dedup replaces the document's last chunk by the prompt's longer
    one. The document still counts as stored and blends without being computed again."""
    from edgesync_store.compactor import Compactor

    doc = rows[4]["context"]
    messages = [{"role": "user", "content": rows[4]["questions"][0]}]
    with EdgeSync(model=adapter, store=tmp_path / "s", config=config) as es:
        es.add_documents([doc])
        es.generate(messages, documents=[doc], max_tokens=MAX_TOKENS)
        report = Compactor(es.store).run(do_reclaim=False)
        (rec,) = es.list_documents()
        assert es.documents.kv_stored(rec)
        result = es.generate(messages, documents=[doc], max_tokens=MAX_TOKENS, reuse="blend")
    assert report.deduplicated >= 1
    assert result.documents_computed == 0 and result.blended_tokens > 0


def test_a_single_string_is_one_document(adapter, config, rows, tmp_path):
    with EdgeSync(model=adapter, store=tmp_path / "s", config=config) as es:
        (rec,) = es.add_documents(rows[3]["context"])
        assert rec.text == rows[3]["context"]
        assert es.remove_documents(rec.doc_id[:10]) == 1
