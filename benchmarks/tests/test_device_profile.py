"""The simulated device profile applies the seed design's constants to records exactly as documented, and
its consistency check flags its 70%-hit / 350 ms fragment-cache claim as not following."""

from __future__ import annotations

import dataclasses

import pytest

from edgesync_bench import device_profile as dp
from edgesync_bench.device_profile import SEED, SEED_TABLE, SeedConstants


def record(system, index, prompt_tokens, tokens_reused=0, hit=None, source=None, lookup_ms=None,
           workload="seed"):
    """A requests.jsonl record with the fields the profile reads (others as the runner writes them)."""
    return {"workload": workload, "system": system, "index": index, "request_id": f"seed-{index}",
            "prompt_key": f"k{index % 4}", "group": "topic-0", "first_seen": index < 4,
            "ttft_ms": 123.0, "total_ms": 456.0, "prompt_tokens": prompt_tokens,
            "tokens_reused": tokens_reused, "hit": hit, "source": source, "bytes_read": 0,
            "tokens": [1, 2], "cpu_s": 0.1, "rss_peak_bytes": 1, "lookup_ms": lookup_ms, "detail": {}}


PROMPTS = [300 + 7 * i for i in range(10)]
# edgesync: 4 misses (lookup ran, found nothing), 3 partial store hits (lookup ran), 3 exact hits
REUSED = [0, 0, 0, 0, 128, 256, 200, None, None, None]


def edgesync_records():
    out = []
    for i, (p, r) in enumerate(zip(PROMPTS, REUSED)):
        if r is None:
            out.append(record("edgesync", i, p, p - 1, "exact", "store", None))
        elif r == 0:
            out.append(record("edgesync", i, p, 0, None, None, 8.5))
        else:
            out.append(record("edgesync", i, p, r, "partial", "store", 9.0))
    return out


def expected_ttft(prompt, reused, lookup, c=SEED, source="store"):
    """The documented formula, written out independently of the module."""
    injected_mb = reused / 128 * 6.0 if source != "context" else 0.0
    return (prompt - reused) * c.prefill_ms_per_token + c.decode_ms_per_token \
        + (c.hnsw_search_ms if lookup else 0.0) + injected_mb * c.inject_ms_per_mb


def test_seed_constants_are_the_seeds():
    assert (SEED.prefill_ms_per_token, SEED.decode_ms_per_token, SEED.hnsw_search_ms, SEED.inject_ms_per_mb,
            SEED.fragment_mb, SEED.fragment_tokens) == (6.8, 18.4, 3.2, 0.029, 6.0, 128)
    assert SEED.kv_bytes_per_token == 46_875
    assert [row.system for row in SEED_TABLE] == ["no cache", "naive string cache", "fragment cache"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        SEED.prefill_ms_per_token = 1.0  # frozen


def test_simulated_ttft_matches_the_formula_per_request():
    recs = [record("no-cache", i, p) for i, p in enumerate(PROMPTS)] + edgesync_records()
    sim = dp.simulate(recs)
    assert set(sim["systems"]) == {"no-cache", "edgesync"}

    nc = sim["systems"]["no-cache"]
    want_nc = [p * 6.8 + 18.4 for p in PROMPTS]
    assert [q["ttft_ms"] for q in nc["per_request"]] == pytest.approx(want_nc)
    assert nc["ttft_ms"]["mean"] == pytest.approx(sum(want_nc) / 10)
    assert nc["hit_rate"] == 0
    assert nc["prefill_work_pct"] == pytest.approx(100) and nc["kv_traffic_pct"] == pytest.approx(100)

    es = sim["systems"]["edgesync"]
    want_es = []
    for p, r in zip(PROMPTS, REUSED):
        if r is None:
            want_es.append(expected_ttft(p, p - 1, lookup=False))
        else:
            want_es.append(expected_ttft(p, r, lookup=True, source="store" if r else None))
    assert [q["ttft_ms"] for q in es["per_request"]] == pytest.approx(want_es)
    # one exact hit by hand: 1 token prefilled + decode + injection of (p-1)/128 fragments of 6 MB
    p = PROMPTS[9]
    assert es["per_request"][9]["ttft_ms"] == pytest.approx(6.8 + 18.4 + (p - 1) / 128 * 6.0 * 0.029)
    assert es["ttft_ms"]["mean"] == pytest.approx(sum(want_es) / 10)
    s = sorted(want_es)
    assert es["ttft_ms"]["p50"] == pytest.approx((s[4] + s[5]) / 2)
    assert es["hit_rate"] == pytest.approx(0.6) and es["exact_rate"] == pytest.approx(0.3)
    assert es["semantic_lookups"] == 7

    reused = sum(r if r is not None else p - 1 for p, r in zip(PROMPTS, REUSED))
    assert es["prefilled_tokens"] == sum(PROMPTS) - reused
    assert es["prefill_work_pct"] == pytest.approx(100 * (sum(PROMPTS) - reused) / sum(PROMPTS))
    # injecting moves as many KV bytes as prefilling writes: KV traffic stays at 100%
    assert es["kv_traffic_pct"] == pytest.approx(100)
    assert es["injected_mb"] == pytest.approx(reused / 128 * 6.0)
    assert "not simulated" in es["energy"] and "not simulated" in sim["energy"]


def test_naive_string_hits_cost_nothing_and_other_records_are_ignored():
    recs = [record("naive-string", 0, 320), record("naive-string", 1, 320, 320, "exact", "answer"),
            record("edgesync-warm", 0, 320, 319, "exact", "store"), record("no-cache", 0, 320, workload="chat")]
    sim = dp.simulate(recs)
    assert set(sim["systems"]) == {"naive-string"}
    ns = sim["systems"]["naive-string"]
    assert [q["ttft_ms"] for q in ns["per_request"]] == pytest.approx([320 * 6.8 + 18.4, dp.NAIVE_HIT_MS])
    assert ns["prefill_work_pct"] == pytest.approx(50) and ns["kv_traffic_pct"] == pytest.approx(50)


def test_context_reuse_is_not_injected_and_bad_reuse_is_refused():
    r = record("llama-ram", 0, 200, 150, "partial", "context")
    assert dp.simulated_ttft(r)["ttft_ms"] == pytest.approx(50 * 6.8 + 18.4)
    with pytest.raises(ValueError):
        dp.simulated_ttft(record("edgesync", 0, 10, 11))


def test_other_constants_are_applied():
    c = SeedConstants(prefill_ms_per_token=1.0, decode_ms_per_token=2.0, hnsw_search_ms=0.5,
                      inject_ms_per_mb=10.0, fragment_mb=1.0, fragment_tokens=64)
    t = dp.simulated_ttft(record("edgesync", 0, 200, 128, "partial", "store", 3.0), c)
    assert t["ttft_ms"] == pytest.approx(72 * 1.0 + 2.0 + 0.5 + 2 * 10.0)


def test_consistency_flags_the_fragment_cache_claim():
    rows = dp.consistency_checks()
    assert all(set(r) == {"claim", "implied", "holds", "why"} and isinstance(r["holds"], bool) for r in rows)

    # the verdict, computed here from the constants and the published table
    nc = next(r for r in SEED_TABLE if r.system == "no cache")
    fc = next(r for r in SEED_TABLE if r.system == "fragment cache")
    prompt = (nc.ttft_ms - SEED.decode_ms_per_token) / SEED.prefill_ms_per_token
    hit_ms = SEED.decode_ms_per_token + SEED.hnsw_search_ms + prompt / 128 * 6.0 * SEED.inject_ms_per_mb
    bound = (1 - fc.hit_rate) * (nc.ttft_ms + SEED.hnsw_search_ms) + fc.hit_rate * hit_ms
    assert (1 - fc.hit_rate) * nc.ttft_ms > fc.ttft_ms  # the misses alone exceed 350 ms
    expected_holds = fc.ttft_ms >= bound
    assert expected_holds is False

    row = next(r for r in rows if r["claim"].startswith("fragment cache: TTFT"))
    assert row["holds"] is expected_holds
    assert f"{bound:,.0f}" in row["implied"] and "540" in row["why"]
    needed = next(r for r in rows if r["claim"].startswith(f"fragment cache: {fc.hit_rate:.0%} hits give"))
    assert needed["holds"] is False
    # the naive string cache's TTFT does follow from its hit rate
    naive = next(r for r in rows if r["claim"].startswith("naive string cache: TTFT"))
    assert naive["holds"] is True
    # the prompt length the no-cache TTFT implies
    assert f"{prompt:,.0f}-token" in rows[0]["implied"]


def test_render_markdown_puts_simulated_beside_published():
    recs = [record("no-cache", i, p) for i, p in enumerate(PROMPTS)] + edgesync_records()
    md = dp.render_markdown(dp.simulate(recs))
    assert "simulated (seed constants, our request stream and our router's decisions)" in md
    assert "seed published" in md and "| no-cache | 10 |" in md and "fragment cache" in md
    assert "not simulated" in md and "**no**" in md
