"""``edgesync fidelity`` and ``edgesync_bench.fidelity`` on real data, the real embedder and the
real model. No mocks.

Data: ``qqp_pairs_labelled.jsonl`` of the shared workloads, its first 400 rows (file order) for
the shares, rows 0-59 for the command; system prompt: entry 0 of ``system_prompts.json``.
Embedder: the int8 ONNX all-MiniLM-L6-v2 (the router's default). Model: SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edgesync_bench import fidelity, fidelity_vectors
from edgesync_bench.workloads import WorkloadDataError
from edgesync_engines.app import cli
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.prompt_text import embed_text_for
from edgesync_engines.request.router import EdgeSync
from edgesync_store.semantic.embedders import get_embedder

ROOT = Path(__file__).resolve().parents[2]
N_SUBSET = 400
# Measured with the int8 ONNX embedder on rows 0-399 (195 duplicates, 205 non-duplicates):
# (duplicates served, non-duplicates served) per threshold. No cosine lies within 4e-5 of a
# threshold, so float noise (1e-7 between batch and single encodes) cannot move a pair.
SUBSET_SERVED = {0.75: (168, 58), 0.80: (148, 45), 0.85: (115, 29), 0.90: (80, 13), 0.95: (40, 5)}
DUP_PAIR, NONDUP_PAIR = 12, 45  # cosine 0.986 (duplicate) and 0.947 (not a duplicate)


@pytest.fixture(scope="module")
def pairs():
    return fidelity.load_pairs()


@pytest.fixture(scope="module")
def embedder():
    return get_embedder("onnx")


@pytest.fixture(scope="module")
def subset_sims(pairs, embedder, tmp_path_factory):
    return fidelity.pair_similarities(pairs[:N_SUBSET], embedder, cache_dir=tmp_path_factory.mktemp("vectors"))


@pytest.fixture(scope="module")
def system_prompt():
    app, text = fidelity.load_system_prompt(0)
    assert app == "StudyBuddy"
    return text


def test_load_pairs_reads_the_labelled_file(pairs, tmp_path):
    assert len(pairs) == 3000
    assert sum(p.duplicate for p in pairs) == 1507  # not 1,500 as the README and DESIGN.md 2.5 say
    assert [p.index for p in pairs[:3]] == [0, 1, 2]
    assert pairs[0].a == "What are the '00s and the '10s decades called?" and pairs[0].duplicate is False
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": "x", "b": "y", "duplicate": true}\n{"a": "x", "b": 3, "duplicate": false}\n')
    with pytest.raises(WorkloadDataError, match="line 2"):
        fidelity.load_pairs(bad)
    with pytest.raises(WorkloadDataError, match="cannot read"):
        fidelity.load_pairs(tmp_path / "missing.jsonl")


def test_a_workloads_directory_without_the_pairs_says_which_file_and_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGESYNC_WORKLOADS", str(tmp_path))
    for load, name in ((fidelity.load_pairs, "qqp_pairs_labelled"), (fidelity.load_system_prompt, "system_prompts")):
        with pytest.raises(WorkloadDataError, match=rf"{name}\.jsonl?' does not exist; set the EDGESYNC_WORKLOADS"):
            load()


@pytest.mark.model
def test_similarities_are_the_routers_cosines(pairs, embedder, subset_sims):
    assert subset_sims.shape == (N_SUBSET,) and subset_sims.dtype == np.float32
    # independently: each pair embedded on its own, as the router embeds one chat request
    for p in pairs[:N_SUBSET:40]:
        va, vb = (embedder.encode([embed_text_for([{"role": "system", "content": "sys"},
                                                    {"role": "user", "content": q}])])[0] for q in (p.a, p.b))
        assert float(va @ vb) == pytest.approx(float(subset_sims[p.index]), abs=1e-5)


@pytest.mark.model
def test_threshold_shares_on_the_first_400_pairs(pairs, subset_sims):
    dup = [p.duplicate for p in pairs[:N_SUBSET]]
    rows = fidelity.threshold_shares(subset_sims, dup, fidelity.DEFAULT_THRESHOLDS)
    assert [r.threshold for r in rows] == [0.75, 0.80, 0.85, 0.90, 0.95]
    for r in rows:
        assert (r.n_dup, r.n_nondup) == (195, 205)
        assert (r.dup_served, r.nondup_served) == SUBSET_SERVED[r.threshold]
        assert r.dup_share == r.dup_served / 195 and r.nondup_share == r.nondup_served / 205
        assert r.precision == r.dup_served / (r.dup_served + r.nondup_served)
    # DESIGN.md 2.5 on all 3,000 pairs: 88% / 29% at 0.75; this subset agrees within sampling
    assert rows[0].dup_share == pytest.approx(0.88, abs=0.03) and rows[0].nondup_share == pytest.approx(0.29, abs=0.03)
    assert rows[-1].precision > rows[0].precision
    with pytest.raises(ValueError, match="both"):
        fidelity.threshold_shares(subset_sims[:3], [True] * 3, [0.9])


@pytest.mark.model
def test_vector_cache_is_reused_and_survives_corruption(embedder, tmp_path):
    texts = ["How do I learn Python?", "How can I learn Python quickly?", "What is the capital of Peru?"]
    seen = []
    first = fidelity_vectors.embed_texts(texts, embedder, tmp_path, progress=lambda *a: seen.append(a))
    assert seen[-1] == ("embed", 3, 3)
    (npy,) = tmp_path.glob("*.npy")
    t0 = time.perf_counter()
    assert np.array_equal(fidelity_vectors.embed_texts(texts, embedder, tmp_path), first)
    assert time.perf_counter() - t0 < 0.5  # loaded, not encoded
    npy.write_bytes(b"not an array")
    assert np.array_equal(fidelity_vectors.embed_texts(texts, embedder, tmp_path), first)
    assert np.load(npy, allow_pickle=False).shape == (3, 384)  # rewritten
    assert fidelity_vectors.embed_texts(texts[:2], embedder, tmp_path).shape == (2, 384)  # other texts, other key
    assert len(list(tmp_path.glob("*.npy"))) == 2


@pytest.mark.model
def test_draw_samples_are_seeded_uniform_and_shared(subset_sims):
    draws = fidelity.draw_samples(subset_sims, fidelity.DEFAULT_THRESHOLDS, 8, seed=0)
    assert draws == fidelity.draw_samples(subset_sims, fidelity.DEFAULT_THRESHOLDS, 8, seed=0)
    assert draws != fidelity.draw_samples(subset_sims, fidelity.DEFAULT_THRESHOLDS, 8, seed=1)
    for t, idx in draws.items():
        assert len(idx) == 8 == len(set(idx))
        assert all(subset_sims[i] >= t for i in idx)
    assert draws[0.75] == [150, 6, 4, 62, 36, 299, 185, 279]
    assert len({i for idx in draws.values() for i in idx}) == 15  # 40 draws, 15 model runs
    every = fidelity.draw_samples(subset_sims, [0.95], 100)[0.95]  # fewer hits than n: all of them
    assert len(every) == 45 and set(every) == {i for i in range(N_SUBSET) if subset_sims[i] >= 0.95}


def test_rouge_l_values():
    assert fidelity.rouge_l("the cat sat on the mat", "the cat sat") == pytest.approx(2 / 3)
    assert fidelity.rouge_l("The cat sat.", "the cat sat") == 1.0  # lower-cased words
    assert fidelity.rouge_l("alpha beta", "gamma delta") == 0.0
    assert fidelity.rouge_l("", "") == 1.0


@pytest.mark.model
def test_run_pair_serves_the_donor_and_reports_it(adapter, pairs, subset_sims, system_prompt):
    """Above its threshold a paraphrase gets the donor's answer; below it, its own (token-exact
    prefix reuse only, so the uncached answer exactly)."""
    cfg = fidelity.approximate_config(0.9, EdgeSyncConfig.load({}))
    baseline = EdgeSync(adapter, store=False, config=cfg)
    for i in (DUP_PAIR, NONDUP_PAIR):
        rec = fidelity.run_pair(baseline, pairs[i], subset_sims[i], system_prompt, cfg, max_tokens=8)
        assert (rec.pair_index, rec.duplicate) == (i, i == DUP_PAIR)
        assert rec.served and rec.approximate and rec.hit == "exact"
        assert rec.router_similarity == pytest.approx(float(subset_sims[i]), abs=1e-4)
        assert rec.prompt_tokens > 300 and rec.approx_ttft_ms < rec.uncached_ttft_ms
        assert rec.equals_donor_answer  # the mode answers the donor's prompt
        if i == DUP_PAIR:  # the reference is b's answer without any store
            alone = baseline.generate(fidelity.messages_for(system_prompt, pairs[i].b), max_tokens=8)
            assert rec.uncached_tokens == alone.tokens and len(alone.tokens) == 8
        assert rec.identical == (rec.approx_tokens == rec.uncached_tokens)
        assert rec.rouge_l == (1.0 if rec.identical else fidelity.rouge_l(rec.approx_text, rec.uncached_text))
    # measured: neither pair's answer survives (greedy answers to the donor's wording differ)
    assert not rec.identical and rec.common_prefix == 0
    strict = fidelity.approximate_config(0.99, EdgeSyncConfig.load({}))
    rec = fidelity.run_pair(baseline, pairs[NONDUP_PAIR], subset_sims[NONDUP_PAIR], system_prompt, strict, max_tokens=8)
    assert not rec.served and not rec.approximate and rec.hit == "partial"
    assert rec.identical and rec.rouge_l == 1.0


def _cli(*args: str) -> subprocess.CompletedProcess:
    keep = {"EDGESYNC_MODEL", "EDGESYNC_WORKLOADS", "EDGESYNC_THREADS", "EDGESYNC_FINGERPRINT_CACHE"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGESYNC_") or k in keep}
    env["COLUMNS"] = "200"  # whole words in the table, whatever width the runner's terminal says
    return subprocess.run([sys.executable, "-m", "edgesync_engines.app.cli", "fidelity", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


def _refusal(capsys, *args: str) -> tuple[int, str]:
    """Exit status and stderr of ``edgesync fidelity ARGS`` run through the command's entry
    point in this process: for refusals, which stop before any data or model is loaded."""
    capsys.readouterr()
    try:
        status = cli.main(["fidelity", *args])
    except SystemExit as exc:  # argparse's own refusals
        status = exc.code
    return status, capsys.readouterr().err


@pytest.mark.model
def test_command_json_and_table(pairs, tmp_path, capsys):
    small = tmp_path / "pairs60.jsonl"
    small.write_text("".join(json.dumps({"a": p.a, "b": p.b, "duplicate": p.duplicate}) + "\n" for p in pairs[:60]))
    out = tmp_path / "fid.json"
    proc = _cli("--pairs", str(small), "--sample", "1", "--max-tokens", "4", "--thresholds", "0.95,0.9",
                "--no-vector-cache", "--json", "--json-out", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc == json.loads(out.read_text())
    assert (doc["n_pairs"], doc["n_dup"], doc["vector_cache"]) == (60, sum(p.duplicate for p in pairs[:60]), None)
    assert [r["threshold"] for r in doc["thresholds"]] == [0.9, 0.95]
    # rows 0-59 at >= 0.90: duplicates 4, 12, 19, 21, 48 and non-duplicates 32, 45; at 0.95: 4, 12, 21
    # (48 scores 0.9499)
    assert [(r["dup_served"], r["nondup_served"]) for r in doc["thresholds"]] == [(5, 2), (3, 0)]
    # seed 0 draws pair 12 (a duplicate at 0.986) for both thresholds: one model run
    for row in doc["thresholds"]:
        s = row["sample"]
        assert (s["n"], s["served"], s["duplicates"], s["pair_indices"]) == (1, 1, 1, [DUP_PAIR])
        assert s["identical_share"] in (0.0, 1.0) and s["mean_rouge_l"] == doc["samples"][0]["rouge_l"]
    (r,) = doc["samples"]
    assert r["pair_index"] == DUP_PAIR and r["approximate"] and r["equals_donor_answer"]
    assert len(r["approx_tokens"]) == 4 and 0 <= r["rouge_l"] <= 1
    assert doc["sample_settings"]["model"].endswith(".gguf") and doc["sample_settings"]["app"] == "StudyBuddy"

    table = _cli("--pairs", str(small), "--sample", "0", "--no-vector-cache")
    assert table.returncode == 0, table.stderr
    for word in ("threshold", "dup served", "non-dup served", "precision", "identical greedy", "ROUGE-L", "0.95"):
        assert word in table.stdout
    assert "0.714" in table.stdout and "1.000" in table.stdout  # precision at 0.90 (5 / 7) and 0.95

    status, err = _refusal(capsys, "--pairs", str(tmp_path / "none.jsonl"), "--sample", "0")
    assert status == 2 and err.startswith("error: cannot read")
    status, err = _refusal(capsys, "--thresholds", "0.9,1.5")
    assert status == 2 and "thresholds must be in (0, 1]" in err
