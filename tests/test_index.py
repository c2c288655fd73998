"""Tests for edgesync_store.semantic.index (SemanticIndex): real hnswlib, real LMDB FragmentStores in
temp dirs, real MiniLM vectors from the ONNX embedder, real subprocesses. No mocks.

Data: ``qqp_clusters.jsonl`` (../shared/workloads or $EDGESYNC_WORKLOADS), clusters in file
order, their questions in order, duplicates dropped, the first 350 questions (clusters 0-43):
questions 0-299 are indexed by the test process, 300-349 by a child process. Fragment i is a
small valid KVFragment (64 random tokens, 1 layer, 1 KV head of width 8, seeded N(0, 1) f16
K/V, all from ``numpy.random.default_rng(i)``), so each question has a real store key.

The child process is this file run as a script (``python tests/test_index.py child ...``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgesync_store.core.store import FragmentStore
from edgesync_store.schema import KVFragment, Namespace, prefix_hash
from edgesync_store.semantic.index import (
    SIDECAR_HNSW,
    SIDECAR_JSON,
    BackendMismatchError,
    SemanticIndex,
    drop_vectors,
)

pytestmark = [pytest.mark.model]

N_PARENT = 300
N_CHILD = 50
ONNX_ID = "all-MiniLM-L6-v2/onnx-int8"
ST_ID = "all-MiniLM-L6-v2/sentence-transformers"
TINY = Namespace(
    model_fingerprint="cd" * 32,
    engine="test",
    engine_version="0",
    kv_dtype="f16",
    flash_attn=False,
    layout="test",
    n_layer=1,
    n_head_kv=1,
    head_dim=8,
    kernels="test",
)


def tiny_fragment(i: int) -> KVFragment:
    """A valid 64-token fragment, 32 bytes of tokens' KV per token, from seed ``i``."""
    rng = np.random.default_rng(i)
    tokens = rng.integers(0, 49152, size=64, dtype=np.int32)
    k = rng.standard_normal((1, 64, 8)).astype(np.float16)
    v = rng.standard_normal((1, 64, 8)).astype(np.float16)
    return KVFragment(namespace=TINY, token_start=0, token_end=64, layer_start=0, layer_end=1,
                      keys=k, values=v, token_ids=tokens, prefix_hash=prefix_hash([]))


@pytest.fixture(scope="session")
def questions(data_dir) -> list[str]:
    """The first 350 distinct questions of qqp_clusters.jsonl (clusters in file order)."""
    out: list[str] = []
    seen: set[str] = set()
    with open(data_dir / "qqp_clusters.jsonl", encoding="utf-8") as f:
        for line in f:
            for q in json.loads(line)["questions"]:
                if q not in seen:
                    seen.add(q)
                    out.append(q)
            if len(out) >= N_PARENT + N_CHILD:
                break
    return out[: N_PARENT + N_CHILD]


@pytest.fixture(scope="session")
def vectors(questions) -> np.ndarray:
    """ONNX int8 MiniLM vectors of the 350 questions, float32 [350, 384]."""
    from edgesync_store.semantic.embedders import get_embedder

    emb = get_embedder("onnx")
    assert emb.backend_id == ONNX_ID
    return emb.encode(questions)


@pytest.fixture(scope="session")
def fragments() -> list[KVFragment]:
    return [tiny_fragment(i) for i in range(N_PARENT + N_CHILD)]


@pytest.fixture(scope="session")
def keys(fragments) -> list[bytes]:
    return [f.key() for f in fragments]


@pytest.fixture
def store(tmp_path, fragments):
    """A real FragmentStore holding fragments 0-299."""
    s = FragmentStore(tmp_path / "store")
    assert s.put_many(fragments[:N_PARENT]) == N_PARENT
    yield s
    s.close()


@pytest.fixture
def index(store, keys, vectors):
    """A SemanticIndex over ``store`` holding vectors 0-299 (saved to its sidecar)."""
    idx = SemanticIndex(store, ONNX_ID)
    idx.add_many(keys[:N_PARENT], vectors[:N_PARENT])
    idx.save()
    yield idx
    idx.close()


def assert_all_found(idx: SemanticIndex, keys: list[bytes], vectors: np.ndarray) -> None:
    """Every key is its own vector's nearest neighbour, at cosine 1."""
    misses = []
    for i, (key, vec) in enumerate(zip(keys, vectors)):
        top = idx.query(vec, k=1)
        if not top or top[0][0] != key or top[0][1] < 0.9999:
            misses.append((i, top[:1]))
    assert not misses, f"{len(misses)} of {len(keys)} not found as their own nearest neighbour: {misses[:3]}"


def child(argv: list[str]) -> None:
    """Child process: store fragments ``first..first+n-1`` and add their vectors (rows
    ``first..first+n-1`` of a .npy file), one LMDB transaction per vector, without saving the
    sidecar; ``log_keep`` entries of change log kept."""
    store_dir, npy, first, n, log_keep = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    vecs = np.load(npy, allow_pickle=False)
    with FragmentStore(store_dir) as s:
        idx = SemanticIndex(s, ONNX_ID, autosave=False, log_keep=log_keep)
        frags = [tiny_fragment(first + j) for j in range(n)]
        s.put_many(frags)
        for j, frag in enumerate(frags):
            idx.add(frag.key(), vecs[first + j])
        idx.close()
    print("added", n)


def start_child(store: FragmentStore, tmp_path: Path, vectors: np.ndarray, first: int = N_PARENT,
                n: int = N_CHILD, log_keep: int = 100_000) -> subprocess.Popen:
    npy = tmp_path / "vectors.npy"
    if not npy.exists():
        np.save(npy, vectors, allow_pickle=False)
    return subprocess.Popen(
        [sys.executable, __file__, "child", str(store.path), str(npy), str(first), str(n), str(log_keep)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def wait_child(proc: subprocess.Popen, n: int) -> None:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.strip() == f"added {n}"


def run_child(store: FragmentStore, tmp_path: Path, vectors: np.ndarray, log_keep: int = 100_000) -> None:
    wait_child(start_child(store, tmp_path, vectors, log_keep=log_keep), N_CHILD)


# -- tests ------------------------------------------------------------------------------------


def test_every_item_is_its_own_nearest_neighbour(index, keys, vectors):
    assert len(index) == N_PARENT
    assert_all_found(index, keys[:N_PARENT], vectors[:N_PARENT])
    top = index.query(vectors[0], k=8)
    assert len(top) == 8 and all(isinstance(s, float) for _, s in top)
    assert [s for _, s in top] == sorted((s for _, s in top), reverse=True)
    # the stored vector is the unit vector that was given
    np.testing.assert_allclose(index.vector(keys[0]), vectors[0], atol=1e-6)


def test_neighbours_are_paraphrases(index, keys, vectors, questions):
    """'How can I improve my English Language?' (question 0, cluster 0) has other cluster-0
    questions about improving one's English among its 3 nearest other items."""
    near = [keys.index(k) for k, _ in index.query(vectors[0], k=4)[1:]]
    assert any("English" in questions[i] for i in near), [questions[i] for i in near]


def test_query_matches_exact_search(index, keys, vectors):
    """At 300 items, ef 100 gives the exact top 5 (brute force over the same vectors)."""
    mat = vectors[:N_PARENT]
    for q in range(N_PARENT, N_PARENT + 20):  # the child's questions, not in the index
        exact = np.argsort(-(mat @ vectors[q]))[:5]
        got = index.query(vectors[q], k=5)
        assert [keys.index(k) for k, _ in got] == list(exact)
        np.testing.assert_allclose([s for _, s in got], mat[exact] @ vectors[q], atol=1e-5)


@pytest.mark.parametrize("damage", ["deleted", "truncated", "garbage", "json_deleted", "json_garbage"])
def test_damaged_sidecar_is_rebuilt(damage, store, index, keys, vectors, caplog):
    index.close()
    hnsw, meta = store.path / SIDECAR_HNSW, store.path / SIDECAR_JSON
    if damage == "deleted":
        hnsw.unlink()
        meta.unlink()
    elif damage == "truncated":
        data = hnsw.read_bytes()
        hnsw.write_bytes(data[: len(data) // 3])
    elif damage == "garbage":
        hnsw.write_bytes(np.random.default_rng(0).bytes(hnsw.stat().st_size))
    elif damage == "json_deleted":
        meta.unlink()
    else:
        meta.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="edgesync_store.semantic"):
        idx = SemanticIndex(store, ONNX_ID)
    assert any("rebuilding" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert len(idx) == N_PARENT
    assert_all_found(idx, keys[:N_PARENT], vectors[:N_PARENT])
    # the rebuilt graph was saved: the next open loads it without a warning
    idx.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgesync_store.semantic"):
        idx = SemanticIndex(store, ONNX_ID)
    assert not caplog.records
    assert len(idx) == N_PARENT
    idx.close()


def test_stale_sidecar_after_another_process_wrote(store, index, keys, vectors, tmp_path):
    """The child adds 50 fragments + vectors and does not save the sidecar; a new index loads
    the old sidecar and catches up with LMDB on open."""
    index.close()
    saved_generation = json.loads((store.path / SIDECAR_JSON).read_text())["generation"]
    run_child(store, tmp_path, vectors)
    assert json.loads((store.path / SIDECAR_JSON).read_text())["generation"] == saved_generation
    with SemanticIndex(store, ONNX_ID) as idx:
        assert len(idx) == N_PARENT + N_CHILD
        assert idx.generation == saved_generation + N_CHILD
        assert_all_found(idx, keys, vectors)


@pytest.mark.parametrize("log_keep", [100_000, 10])
def test_open_index_catches_up_before_query(log_keep, index, store, keys, vectors, tmp_path, caplog):
    """The index stays open while the child writes; the next query sees the new generation
    and replays the change log (or, when the child kept only 10 log entries, reconciles with
    the whole of LMDB)."""
    before = index.generation
    run_child(store, tmp_path, vectors, log_keep=log_keep)
    assert len(index) == N_PARENT  # nothing read yet
    with caplog.at_level(logging.DEBUG, logger="edgesync_store.semantic"):
        top = index.query(vectors[N_PARENT + 7], k=1)
    reconciled = any("reconciling" in r.getMessage() for r in caplog.records)
    assert reconciled == (log_keep == 10)
    assert top[0][0] == keys[N_PARENT + 7] and top[0][1] > 0.9999
    assert index.generation == before + N_CHILD
    assert len(index) == N_PARENT + N_CHILD
    assert_all_found(index, keys, vectors)


def test_two_processes_add_at_once(index, store, keys, vectors, tmp_path):
    """Two children add 25 vectors each at the same time: labels are allocated in LMDB write
    transactions, so none collides and the parent finds all 350."""
    a = start_child(store, tmp_path, vectors, first=N_PARENT, n=25)
    b = start_child(store, tmp_path, vectors, first=N_PARENT + 25, n=25)
    wait_child(a, 25)
    wait_child(b, 25)
    assert_all_found(index, keys, vectors)
    labels = [int.from_bytes(bytes(v[:8]), "little") for v in _raw_vectors(store)]
    assert sorted(labels) == list(range(N_PARENT + N_CHILD))


def _raw_vectors(store: FragmentStore) -> list[bytes]:
    db = store.named_db(b"emb_vectors")
    return store.transact(lambda txn: [bytes(v) for _, v in txn.cursor(db=db)])


def test_threads_query_while_adding_and_removing(index, store, fragments, keys, vectors):
    """Queries in two threads while a third adds 50 vectors and a fourth removes 50."""
    store.put_many(fragments[N_PARENT:])
    errors: list[BaseException] = []
    stop = threading.Event()

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
        return run

    def query_loop():
        i = 0
        while not stop.is_set():
            res = index.query(vectors[i % 250 + 50], k=3)
            assert res and res[0][1] > 0.5
            i += 1

    def add_loop():
        for i in range(N_PARENT, N_PARENT + N_CHILD):
            index.add(keys[i], vectors[i])

    def remove_loop():
        for i in range(50):
            assert index.remove(keys[i])

    workers = [threading.Thread(target=guard(f)) for f in (query_loop, query_loop)]
    writers = [threading.Thread(target=guard(f)) for f in (add_loop, remove_loop)]
    for t in workers + writers:
        t.start()
    for t in writers:
        t.join(60)
    stop.set()
    for t in workers:
        t.join(60)
    assert not errors, errors
    assert len(index) == N_PARENT
    assert_all_found(index, keys[50:], vectors[50:])


def test_rebuild_gives_same_neighbours(index, keys, vectors):
    queries = vectors[N_PARENT : N_PARENT + 30]
    before = [[k for k, _ in index.query(q, k=5)] for q in queries]
    seen = []
    assert index.rebuild(progress=lambda done, total: seen.append((done, total))) == N_PARENT
    assert seen and seen[-1] == (N_PARENT, N_PARENT)
    after = [[k for k, _ in index.query(q, k=5)] for q in queries]
    assert after == before
    # and a fresh process-like reopen from the saved rebuild agrees too
    index.close()
    with SemanticIndex(index.store, ONNX_ID) as again:
        assert [[k for k, _ in again.query(q, k=5)] for q in queries] == before


def test_removed_fragment_is_not_returned(index, store, keys, vectors):
    # removed through the index
    assert index.remove(keys[3]) is True
    assert index.remove(keys[3]) is False
    assert keys[3] not in [k for k, _ in index.query(vectors[3], k=10)]
    assert index.vector(keys[3]) is None
    # the fragment deleted from the store alone: the query notices and drops its vector
    assert store.delete(keys[4])
    assert keys[4] not in [k for k, _ in index.query(vectors[4], k=10)]
    assert index.vector(keys[4]) is None
    # deleted from the store, found by sync()
    assert store.delete(keys[5])
    assert index.sync() == (0, 1)
    assert keys[5] not in index and index.vector(keys[5]) is None
    assert len(index) == N_PARENT - 3
    # still absent after save + reopen (the sidecar records deleted labels)
    index.close()
    with SemanticIndex(store, ONNX_ID) as idx:
        for i in (3, 4, 5):
            assert keys[i] not in [k for k, _ in idx.query(vectors[i], k=10)]
        assert_all_found(idx, keys[6:N_PARENT], vectors[6:N_PARENT])
        # a removed vector added again gets a new label and is found again (slot reuse)
        idx.add(keys[3], vectors[3])
        assert idx.query(vectors[3], k=1)[0][0] == keys[3]


def test_add_requires_a_stored_fragment(index, keys, vectors):
    with pytest.raises(KeyError, match="no fragment"):
        index.add(keys[N_PARENT], vectors[N_PARENT])
    with pytest.raises(ValueError, match="shape"):
        index.add(keys[0], vectors[0][:100])
    with pytest.raises(ValueError):
        index.add(keys[0], np.zeros(384, np.float32))
    gen = index.generation
    assert index.add(keys[0], vectors[0] * 3.0) == index.add(keys[0], vectors[0])  # same unit vector: no-op
    assert index.generation == gen


def test_other_backend_raises(index, store, keys, vectors):
    index.close()
    with pytest.raises(BackendMismatchError) as err:
        SemanticIndex(store, ST_ID)
    assert ONNX_ID in str(err.value) and ST_ID in str(err.value)
    with pytest.raises(BackendMismatchError):
        SemanticIndex(store, ONNX_ID, dim=128)
    # after dropping the vectors the store may be re-embedded by the other backend
    assert drop_vectors(store) == N_PARENT
    with SemanticIndex(store, ST_ID) as idx:
        assert len(idx) == 0
        idx.add(keys[0], vectors[0])
    with pytest.raises(BackendMismatchError):
        SemanticIndex(store, ONNX_ID)


def test_sidecar_is_written_atomically(index, store):
    hnsw, meta = store.path / SIDECAR_HNSW, store.path / SIDECAR_JSON
    inode = hnsw.stat().st_ino
    index.save()
    assert hnsw.stat().st_ino != inode  # replaced by rename, not rewritten in place
    names = sorted(os.listdir(store.path))
    assert not [n for n in names if n.endswith(".tmp")], names
    info = json.loads(meta.read_text())
    assert info["hnsw_bytes"] == hnsw.stat().st_size
    assert info["hnsw_sha256"] == hashlib.sha256(hnsw.read_bytes()).hexdigest()
    assert info["backend_id"] == ONNX_ID and info["dim"] == 384 and info["count"] == N_PARENT
    for path in (hnsw, meta):
        assert path.stat().st_mode & 0o077 == 0  # it derives from users' prompts


def test_graph_grows_past_its_initial_capacity(tmp_path, vectors):
    """1,500 fragments (more than the initial 1,024 slots), vectors are the 350 questions
    plus seeded noise, found as their own nearest neighbours."""
    frags = [tiny_fragment(10_000 + i) for i in range(1500)]
    rng = np.random.default_rng(1)
    vecs = np.concatenate([vectors, vectors[rng.integers(0, 350, 1150)] + rng.normal(0, 0.05, (1150, 384))])
    vecs = (vecs / np.linalg.norm(vecs, axis=1, keepdims=True)).astype(np.float32)
    with FragmentStore(tmp_path / "big") as s:
        s.put_many(frags)
        fkeys = [f.key() for f in frags]
        with SemanticIndex(s, ONNX_ID) as idx:
            t = time.perf_counter()
            idx.add_many(fkeys[:1000], vecs[:1000])
            for j in range(1000, 1500, 100):
                idx.add_many(fkeys[j : j + 100], vecs[j : j + 100])
            assert len(idx) == 1500
            assert_all_found(idx, fkeys[::7], vecs[::7])
            assert time.perf_counter() - t < 30


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "child":
    child(sys.argv[2:])
