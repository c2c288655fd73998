"""The rag measurement's core on the real model: 2 requests, a corpus of just their documents
(each cut to its first words, so that the test's dozen prefills stay short).

Checks the report's structure and the values that must hold whatever the machine's speed:
full prefill is identical to itself, blend at share 1.0 recomputes every document and separator
token, every row ran the requests it should, and retrieval finds the passages it was given.
"""

from __future__ import annotations

import dataclasses

import pytest

from edgesync_bench import rag_fidelity
from edgesync_bench.rag_workload import rag_workload
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.router import EdgeSync

pytestmark = [pytest.mark.model]

WORDS = 70
"""Words kept of each document: about 90 tokens, over the 64 a stored fragment needs."""


def _short(doc: dict) -> dict:
    return {**doc, "text": " ".join(doc["text"].split()[:WORDS])}


@pytest.fixture(scope="module")
def rag_report(adapter, tmp_path_factory):
    requests = [dataclasses.replace(r, documents=tuple(_short(d) for d in r.documents)) for r in rag_workload(2)]
    corpus = list({d["source"]: d for req in requests for d in req.documents}.values())
    cfg = EdgeSyncConfig.load()
    es = EdgeSync(model=adapter, store=tmp_path_factory.mktemp("rag") / "store", config=cfg)
    stages: dict[str, list[tuple[int, int]]] = {}
    try:
        doc = rag_fidelity.run_rag(es, requests, corpus, shares=[1.0], curve_limit=1, max_tokens=8,
                                   progress=lambda s, d, t: stages.setdefault(s, []).append((d, t)))
        # document and separator tokens of each request's prompt: what share 1.0 must recompute
        spans = [p.question_start - p.head_len
                 for p, _ in (es.document_prompt(r.as_messages(), documents=[dict(d) for d in r.documents])
                              for r in requests)]
    finally:
        es.close()
    return doc, corpus, stages, spans


def test_report_structure_and_counts(rag_report):
    doc, corpus, stages, _ = rag_report
    assert doc["settings"]["requests"] == 2 and doc["settings"]["curve_requests"] == 1
    assert doc["settings"]["shares"] == [0.15, 1.0]
    # the two requests' 8 documents, one passage shared: 7 distinct
    assert doc["corpus"]["documents"] == len(corpus) == 7
    assert doc["corpus"]["store_bytes"] > 0 and doc["corpus"]["document_tokens"] > 7 * 64
    rows = {r["label"]: r for r in doc["systems"]}
    assert list(rows) == ["full-prefill", "noise-floor", "prefix-only", "blend@0.15", "blend@1"]
    # the default share runs on every request, the curve's other shares on the first only
    assert [rows[k]["n"] for k in rows] == [2, 2, 2, 2, 1]
    assert len(doc["records"]) == 9
    assert stages["requests"][-1] == (2, 2) and stages["corpus"][-1] == (7, 7)
    for row in rows.values():
        assert row["ttft_mean_ms"] > 0 and 0 <= row["f1"] <= 1 and 0 <= row["rouge_l"] <= 1
        assert row["f1_full_same"] is not None


def test_values_that_must_hold(rag_report):
    doc, _, _, spans = rag_report
    rows = {r["label"]: r for r in doc["systems"]}
    full = rows["full-prefill"]
    assert full["identical"] == 2 and full["identical_share"] == 1.0 and full["rouge_l"] == 1.0
    assert full["ttft_vs_full"] == 1.0 and full["f1_delta"] == 0.0 and full["tokens_reused_mean"] == 0
    blend1 = [r for r in doc["records"] if r["system"] == "blend" and r["share"] == 1.0]
    assert len(blend1) == 1 and blend1[0]["approximate"] and blend1[0]["blend_refusal"] is None
    assert blend1[0]["recomputed_tokens"] == spans[blend1[0]["index"]]
    assert blend1[0]["blended_tokens"] == 0
    default = [r for r in doc["records"] if r["system"] == "blend" and r["share"] == 0.15]
    assert all(0 < r["recomputed_tokens"] < spans[r["index"]] and r["blended_tokens"] > 0 for r in default)
    assert rows["blend@0.15"]["fallbacks"] == 0
    assert doc["retrieval"]["n"] == 2 and doc["retrieval"]["recall@3"] >= doc["retrieval"]["recall@1"]
