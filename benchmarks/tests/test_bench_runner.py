"""The benchmark runner's parts: figures from records, the worker protocol on the real model,
and no cache as the token-identity reference for EdgeSync.

The runner itself is a benchmark (``make bench``), not a test; these check what its report
rests on.
"""

from __future__ import annotations

import statistics

import pytest

from edgesync_bench.bench_workloads import seed_requests
from edgesync_bench.figures import percentile, storage_figures, summarize, targets
from edgesync_bench.runner import Lane
from edgesync_bench.systems import make_system


def _rec(i, system="edgesync", key=None, ttft=100.0, hit=None, reused=0, n=300, tokens=(1, 2), first=True):
    return {"workload": "seed", "system": system, "index": i, "request_id": f"seed-{i:04d}",
            "prompt_key": key or f"p{i}", "group": "topic-0", "first_seen": first, "ttft_ms": ttft,
            "total_ms": ttft + 50, "prompt_tokens": n, "tokens_reused": reused, "hit": hit,
            "source": "store" if reused else None, "bytes_read": 1000 if reused else 0, "tokens": list(tokens),
            "cpu_s": 0.5, "rss_peak_bytes": 10 + i, "lookup_ms": None, "detail": {}}


def test_percentile_matches_statistics():
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    assert percentile(xs, 50) == statistics.median(xs)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 9.0
    assert percentile([], 50) is None


def test_summarize_splits_first_seen_and_repeats_and_scores_identity():
    ref = [_rec(i, "no-cache", ttft=1000.0 + i) for i in range(6)]
    es = [_rec(0, ttft=900.0), _rec(1, ttft=800.0),
          _rec(2, key="p0", ttft=60.0, hit="exact", reused=299, first=False),
          _rec(3, key="p1", ttft=70.0, hit="exact", reused=299, first=False),
          _rec(4, ttft=300.0, hit="partial", reused=200),
          _rec(5, ttft=500.0, tokens=(9,))]
    s = summarize(es, ref)
    assert s["n"] == 6 and s["hits"] == {"exact": 2, "partial": 1, "miss": 3}
    assert s["first_seen_ttft_ms"]["mean"] == pytest.approx((900 + 800 + 300 + 500) / 4)
    assert s["repeat_ttft_ms"]["mean"] == pytest.approx(65.0)
    assert s["exact_hit_ttft_ms"] == pytest.approx(65.0)
    assert s["not_prefilled_share"] == pytest.approx((299 + 299 + 200) / 1800)
    assert s["identity"] == pytest.approx(5 / 6) and s["identity_n"] == 6
    assert s["peak_rss_bytes"] == 15


def test_storage_figures_amortise_shared_prefixes_over_prompts():
    recs = [_rec(0, key="a", n=301), _rec(1, key="b", n=201), _rec(2, key="a", n=301, first=False)]
    stats = {"kv_bytes_per_token": 100, "store_disk_bytes": 20_000,
             "store": {"fragments": 3, "compressed_bytes": 15_000, "raw_bytes": 45_000}}
    st = storage_figures(recs, stats)
    raw = (300 * 100 + 200 * 100) / 2
    assert st["cached_prompts"] == 2 and st["raw_f16_kv_per_prompt"] == raw
    assert st["disk_bytes_per_prompt"] == 10_000 and st["vs_raw_f16"] == pytest.approx(10_000 / raw)
    assert st["fragment_compression"] == pytest.approx(1 / 3)
    rows = targets({("seed", "edgesync"): summarize(recs)}, {("seed", "edgesync"): st})
    bytes_row = rows[-1]
    assert bytes_row["value"] == pytest.approx(10_000 / raw) and bytes_row["met"] is True
    assert rows[0]["met"] is None  # no no-cache run: the ratio is missing, not invented


@pytest.fixture(scope="module")
def seed_prompts():
    reqs = seed_requests(40)
    seen, out = set(), []
    for r in reqs:  # four distinct prompts over two app system prompts
        if r.prompt_key not in seen and len(out) < 4:
            seen.add(r.prompt_key)
            out.append(list(r.messages))
    return out


@pytest.mark.model
def test_worker_protocol_on_the_real_model(tmp_path, seed_prompts):
    lane = Lane("no-cache", "no-cache", tmp_path / "nc")
    lane.start(1, tmp_path / "logs")
    try:
        n = lane.call({"op": "count", "messages": seed_prompts[0]})
        a = lane.call({"op": "answer", "messages": seed_prompts[0], "max_tokens": 8})
        bad = lane.call({"op": "answer", "messages": [{"role": "nobody"}], "max_tokens": 8})
        unknown = lane.call({"op": "fly"})
        stats = lane.call({"op": "stats"})
    finally:
        lane.close()
    assert n["ok"] and a["ok"] and a["answer"]["prompt_tokens"] == n["n"] > 300
    assert 1 <= len(a["answer"]["tokens"]) <= 8 and a["answer"]["tokens_reused"] == 0
    assert a["cpu_s"] > 0 and a["rss_peak_bytes"] > 50e6
    assert not bad["ok"] and bad["error"] and not unknown["ok"] and "fly" in unknown["message"]
    # SmolLM2-135M: 30 layers x (K, V) x 3 KV heads x 64 x 2 bytes (DESIGN.md 2.2)
    assert stats["ok"] and stats["stats"]["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    with make_system("no-cache") as direct:
        assert direct.answer(seed_prompts[0], max_tokens=8).tokens == a["answer"]["tokens"]


@pytest.mark.model
def test_no_cache_is_token_identical_to_edgesync_uncached_and_warm(tmp_path, seed_prompts):
    """The report's identity column: no cache evaluates the prompt like EdgeSync (last token
    alone), so EdgeSync's cold, hit and uncached answers all equal it."""
    with make_system("no-cache") as nc:
        ref = [nc.answer(m, max_tokens=16).tokens for m in seed_prompts]
    with make_system("edgesync", workdir=tmp_path) as es:
        cold = [es.answer(m, max_tokens=16) for m in seed_prompts]
        again = [es.answer(m, max_tokens=16) for m in seed_prompts]
    assert [a.tokens for a in cold] == ref
    assert [a.tokens for a in again] == ref
    assert all(a.hit == "exact" for a in again)


def test_report_compares_a_partial_system_with_no_cache_on_the_same_requests(tmp_path):
    """naive-string runs only the first 2 of 4 requests: its "vs no cache" divides by no cache's
    mean over those 2 (1,500 ms), not over all 4 (2,500 ms)."""
    from edgesync_bench.bench_report import build_report

    nc = [_rec(i, "no-cache", ttft=1000.0 * (i + 1)) for i in range(4)]
    naive = [_rec(i, "naive-string", ttft=100.0) for i in range(2)]
    rep = build_report(nc + naive, {}, {"sizes": {"seed": 4}}, tmp_path)
    s = rep["summaries"]["seed/naive-string"]
    assert s["no_cache_ttft_mean_same_requests"] == pytest.approx(1500.0)
    assert "| naive-string | 2 |" in rep["markdown"] and f"{100 / 1500:.3f}x" in rep["markdown"]
    assert "too few requests" in rep["markdown"]
    assert (tmp_path / "report.md").read_text() == rep["markdown"]


def test_identity_falls_back_to_no_caches_answer_to_the_same_prompt():
    """EdgeSync runs 4 requests, no cache the first 2: with ``by_prompt`` a later repeat of a
    prompt no cache answered is compared with that answer; a prompt it never saw is left out."""
    ref = [_rec(0, "no-cache", key="a", tokens=(1, 2)), _rec(1, "no-cache", key="b", tokens=(3, 4))]
    es = [_rec(0, key="a", tokens=(1, 2)), _rec(1, key="b", tokens=(3, 4)),
          _rec(2, key="a", tokens=(1, 9), first=False), _rec(3, key="c", tokens=(5, 6))]
    assert summarize(es, ref)["identity_n"] == 2
    s = summarize(es, ref, by_prompt=True)
    assert s["identity_n"] == 3 and s["identity"] == pytest.approx(2 / 3)


def test_targets_compare_edgesync_with_no_cache_on_the_requests_both_ran():
    """No cache ran the first 2 of EdgeSync's 4 requests: the mean-TTFT target divides
    EdgeSync's mean over those 2 (500 ms) by no cache's (1,000 ms), not its mean over 4."""
    from edgesync_bench.figures import group_records

    nc = [_rec(i, "no-cache", ttft=1000.0) for i in range(2)]
    disk = [_rec(i, "llama-disk", ttft=300.0, hit="partial", reused=100) for i in range(2)]
    es = [_rec(0, ttft=900.0), _rec(1, ttft=100.0, hit="exact", reused=299, first=False),
          _rec(2, ttft=10.0, hit="exact", reused=299, first=False), _rec(3, ttft=10.0, hit="exact", reused=299,
                                                                         first=False)]
    recs = nc + disk + es
    groups = group_records(recs)
    summaries = {k: summarize(v) for k, v in groups.items()}
    rows = targets(summaries, {}, groups)
    assert rows[0]["value"] == pytest.approx(500.0 / 1000.0) and rows[0]["requests"] == 2
    assert rows[1]["value"] == pytest.approx(900.0 / 1000.0)  # the one first-seen request among the 2
    assert rows[2]["value"] == pytest.approx(100.0 / 300.0) and rows[2]["requests"] == 2
    assert targets(summaries, {})[0]["value"] == pytest.approx(255.0 / 1000.0)  # without groups: as given


def test_report_divides_edgesyncs_mean_by_no_caches_on_the_same_requests_and_says_what_was_sampled(tmp_path):
    from edgesync_bench.bench_report import build_report

    nc = [_rec(i, "no-cache", ttft=1000.0) for i in range(2)]
    es = [_rec(i, ttft=100.0 * (i + 1)) for i in range(4)]
    sampled = {"seed": {"requests": 4, "distinct_prompts": 4, "no_cache_and_peers_requests": 2,
                        "no_cache_and_peers_distinct_prompts": 2, "selection": "seed_workload(1000)"},
               "doc-qa": {"passages": 2, "questions": 7, "doc_ids": ["d1", "d2"], "selection": "first 2 of 40"}}
    rep = build_report(nc + es, {}, {"sizes": {"seed": 4}, "sampled": sampled}, tmp_path)
    s = rep["summaries"]["seed/edgesync"]
    assert s["same_requests"] == 2 and s["ttft_mean_same_requests"] == pytest.approx(150.0)
    assert f"| {150 / 1000:.3f}x (2) |" in rep["markdown"]
    assert "the first 2 of them (2 distinct prompts) for no cache" in rep["markdown"]
    assert "doc-qa: 2 passages, 7 questions" in rep["markdown"] and "d1, d2" in rep["markdown"]


def test_full_run_sizes_and_which_lanes_stop_at_300(tmp_path):
    from edgesync_bench import bench_workloads as bw
    from edgesync_bench.runner import FULL, Runner

    assert (FULL.seed, FULL.seed_others, FULL.doc_qa_passages, FULL.chat_sessions) == (
        1000, bw.SLOW_SYSTEM_LIMIT, bw.BENCH_DOC_QA_PASSAGES, bw.BENCH_CHAT_SESSIONS)
    runner = Runner(tmp_path, FULL, kv_types=("f16", "q8_0"))
    limits = {lane.label: lane.limit for lane in runner.lanes("seed")}
    assert limits == {"no-cache": 300, "naive-string": 300, "llama-ram": 300, "llama-disk": 300, "edgesync": None,
                      "no-cache@q8_0": 300, "edgesync@q8_0": None}
    assert all(lane.limit is None for lane in runner.lanes("doc-qa"))
    note = runner.sample_note("doc-qa", bw.doc_qa_requests(FULL.doc_qa_passages))
    assert note["passages"] == 10 and note["questions"] == 48 and note["drawn"] == 40


def test_worker_waits_for_a_running_warm_up_and_loads_nothing_otherwise():
    import threading
    import time

    from edgesync_bench.worker import wait_for_warm_up
    from edgesync_engines.request.semantic_lookup import WARM_UP_THREAD

    assert wait_for_warm_up() is False  # no warm-up running: nothing waited for, nothing loaded
    done = []
    t = threading.Thread(target=lambda: (time.sleep(0.2), done.append(1)), name=WARM_UP_THREAD, daemon=True)
    t.start()
    assert wait_for_warm_up() is True and done == [1]
