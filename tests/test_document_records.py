"""Document records (``edgesync_store/documents/records.py``), the document lifetime
(``ttl.LIFETIME_DOCUMENT``) and the retrieval index (``documents/retrieval.py``), on a real
LMDB store in a temp dir. Fragments are random KV in SmolLM2's geometry (no model needed);
the embeddings are random unit vectors (retrieval by meaning is tested with the real embedder
in ``test_documents.py``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgesync_store.core.eviction import eviction_order
from edgesync_store.core.store import FragmentStore
from edgesync_store.documents import records
from edgesync_store.documents.records import DocumentRecord
from edgesync_store.documents.retrieval import DocumentIndex, keep_as_document
from edgesync_store.schema import KVFragment, prefix_hash
from edgesync_store.ttl import LIFETIME_DOCUMENT, LIFETIME_LONG, Lifecycle, ManualClock, TTLPolicy, sweep
from tests.fragments import SMOL


def fragment(tokens: np.ndarray, start: int, now: float, seed: int) -> KVFragment:
    rng = np.random.default_rng(seed)
    n = len(tokens)
    shape = (SMOL.n_layer, n, SMOL.n_head_kv * SMOL.head_dim)
    return KVFragment(namespace=SMOL, token_start=start, token_end=start + n, layer_start=0,
                      layer_end=SMOL.n_layer, layer_stride=1, head_start=0, head_end=SMOL.n_head_kv,
                      keys=rng.standard_normal(shape).astype(np.float16),
                      values=rng.standard_normal(shape).astype(np.float16), token_ids=tokens.astype(np.int32),
                      prefix_hash=prefix_hash([]), created_at=now, expires_at=now + 1800)


def record(tokens, title="t", vectors=None) -> DocumentRecord:
    return DocumentRecord(SMOL.digest(), np.asarray(tokens, np.int32), np.zeros(0, np.int32), title, "src/a.txt",
                          "some text", 1_800_000_000.0,
                          np.zeros((0, 384), np.float32) if vectors is None else vectors)


def unit(rng, n) -> np.ndarray:
    v = rng.standard_normal((n, 384)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_a_record_round_trips_through_lmdb_with_its_vectors(tmp_path):
    rng = np.random.default_rng(0)
    rec = record(range(100, 180), vectors=unit(rng, 3))
    with FragmentStore(tmp_path / "s") as store:
        assert records.documents_generation(store) == 0
        key = records.put_document(store, rec)
        assert key == rec.key == records.document_key(SMOL.digest(), list(range(100, 180)))
        got = records.get_document(store, key)
        assert records.documents_generation(store) == 1
    assert got.title == "t" and got.source == "src/a.txt" and got.text == "some text"
    assert got.tokens.tolist() == list(range(100, 180)) and got.header.tolist() == []
    np.testing.assert_array_equal(got.vectors, rec.vectors)
    assert got.doc_id == key.hex() and len(got.doc_id) == 64


def test_the_repr_names_the_document_without_its_contents():
    rng = np.random.default_rng(1)
    rec = DocumentRecord(SMOL.digest(), np.arange(100, 180, dtype=np.int32), np.zeros(0, np.int32), "manual",
                         "src/a.txt", "a secret body " * 50, 1_800_000_000.0, unit(rng, 3))
    text = repr(rec)
    assert f"doc_id='{rec.doc_id[:16]}...'" in text and "'manual'" in text and "tokens=80" in text
    assert "windows=3" in text and "secret" not in text and "array" not in text and len(text) < 200
    long = DocumentRecord(rec.namespace_digest, rec.tokens, rec.header, "T" * 10_000, "S" * 5_000, "x", 0.0)
    assert len(repr(long)) < 250


def test_the_key_depends_on_the_namespace_and_every_token():
    a = records.document_key(SMOL.digest(), [1, 2, 3])
    assert a != records.document_key(SMOL.digest(), [1, 2, 4])
    assert a != records.document_key(b"\1" * 32, [1, 2, 3])


def test_a_malformed_record_is_ignored_and_listing_goes_on(tmp_path):
    with FragmentStore(tmp_path / "s") as store:
        good = records.put_document(store, record(range(64)))
        db = store.named_db(records.DOCUMENTS_DB)
        store.transact(lambda txn: txn.put(b"\7" * 32, SMOL.digest() + b"\x05\x00", db=db), write=True)
        listed = list(records.iterate_documents(store, SMOL.digest()))
        assert [r.key for r in listed] == [good]
        assert records.get_document(store, b"\7" * 32) is None
        assert records.delete_document(store, good) and not records.delete_document(store, good)
        assert list(records.iterate_documents(store)) == []


def test_document_fragments_survive_the_ttl_and_are_evicted_last(tmp_path):
    clock = ManualClock()
    with FragmentStore(tmp_path / "s", clock=clock, policy=TTLPolicy(ttl_seconds=60)) as store:
        now = clock()
        doc, other = fragment(np.arange(64), 0, now, 1), fragment(np.arange(64, 128), 0, now, 2)
        assert store.put_many([doc, other]) == 2
        assert keep_as_document(store, [doc.key()]) == 1
        assert keep_as_document(store, [doc.key()]) == 0  # already there
        life = store.lifecycle(doc.key())
        assert life.lifetime == LIFETIME_DOCUMENT and math.isinf(life.expires_at)
        store.record_hits([doc.key()] * 1, now=now)
        store.record_hits([doc.key()], now=now)
        assert store.lifecycle(doc.key()).lifetime == LIFETIME_DOCUMENT
        clock.advance(3600)
        gone = {k for k, _ in sweep(store)}
        assert gone == {other.key()}
        assert store.is_live(doc.key())
    rows = [(b"a", Lifecycle(expires_at=math.inf, created_at=5, lifetime=LIFETIME_DOCUMENT)),
            (b"b", Lifecycle(expires_at=1e12, created_at=1, lifetime=LIFETIME_LONG)),
            (b"c", Lifecycle(expires_at=1e12, created_at=9))]
    assert [k for k, _ in eviction_order(rows, now=10)] == [b"c", b"b", b"a"]


def test_the_index_finds_the_nearest_document_and_follows_other_writers(tmp_path):
    rng = np.random.default_rng(1)
    recs = [record(range(i * 100, i * 100 + 70), title=f"d{i}", vectors=unit(rng, 2)) for i in range(5)]
    with FragmentStore(tmp_path / "s") as store:
        for r in recs[:4]:
            records.put_document(store, r)
        index = DocumentIndex(store, SMOL.digest())
        hits = index.search(recs[2].vectors[1], 3)
        assert hits[0][0] == recs[2].key and hits[0][1] == pytest.approx(1.0, abs=1e-5)
        assert len({k for k, _ in hits}) == 3 and [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)
        records.put_document(store, recs[4])  # as another process would: the counter moves
        assert index.search(recs[4].vectors[0], 1)[0][0] == recs[4].key
        records.delete_document(store, recs[4].key)
        assert recs[4].key not in {k for k, _ in index.search(recs[4].vectors[0], 5)}
        assert DocumentIndex(store, b"\2" * 32).search(recs[0].vectors[0], 3) == []


def test_clearing_the_store_empties_the_documents_too(tmp_path):
    with FragmentStore(tmp_path / "s") as store:
        records.put_document(store, record(range(80)))
        store.drop_all()
        assert list(records.iterate_documents(store)) == []
