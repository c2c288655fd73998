"""benchmarks/floor.py's parts: the acceptance verdicts and the profile grouping (pure), the
prompt sets, the peak-RSS launcher, and one small run of the in-process measurements on the real
model (real store in a temp dir). No timing is asserted: floor.py reports speed, as ratios."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from edgesync_bench import floor, floor_report
from edgesync_bench.floor_report import group_profile, new_process_figures, partial_bound_ms, verdicts


def _fig(exact=(30.0, 32.0, 34.0), floor_ms=(20.0, 20.0, 20.0), identical=3, n=3, partial=None, new_process=None):
    f = {"prompts": 1, "prompt_tokens": [342], "exact": {"ttft_ms": list(exact), "identical": identical, "n": n},
         "floor": {"ms": list(floor_ms)},
         "partial": partial or {"ttft_ms": [100.0, 120.0], "floor_ms": [20.0, 22.0],
                                "uncovered_prefill_ms": [80.0, 90.0], "uncovered_tokens": [22, 24],
                                "identical": 2, "n": 2},
         "store_back": {"ms": [30.0], "bytes": [6_000_000], "fragments": [3]}}
    if new_process is not None:
        f["new_process"] = new_process
    return {"seed": f}


def _by(rows, start):
    (row,) = [r for r in rows if r["criterion"].startswith(start)]
    return row


def test_exact_over_floor_is_the_ratio_of_medians_and_met_at_the_limit():
    rows = verdicts(_fig(exact=(30.0, 32.0, 40.0), floor_ms=(20.0, 21.0, 25.0)))
    r = _by(rows, "exact-hit TTFT")
    assert r["value"] == pytest.approx(32.0 / 21.0) and r["limit"] == 1.5 and r["met"] is False
    at_limit = _by(verdicts(_fig(exact=(30.0,), floor_ms=(20.0,))), "exact-hit TTFT")
    assert at_limit["value"] == pytest.approx(1.5) and at_limit["met"] is True
    assert _by(rows, "exact hits identical")["met"] is True
    assert _by(verdicts(_fig(identical=2, n=3)), "exact hits identical")["met"] is False


def test_partial_bound_adds_medians_and_five_ms():
    pa = {"ttft_ms": [100.0, 130.0], "floor_ms": [20.0, 30.0], "uncovered_prefill_ms": [70.0, 90.0]}
    assert partial_bound_ms(pa) == pytest.approx(25.0 + 80.0 + 5.0)
    row = _by(verdicts(_fig(partial={**pa, "identical": 2, "n": 2})), "partial-hit TTFT")
    assert row["value"] == pytest.approx(115.0) and row["limit"] == pytest.approx(110.0) and row["met"] is False
    assert partial_bound_ms({"ttft_ms": [1.0]}) is None


def test_new_process_rows_use_the_successful_runs_and_the_rss_slack():
    ok = {"ok": True, "ttft_ms": 60.0, "wall_s": 0.5, "peak_rss_bytes": 300_000_000}
    failed = {"ok": False, "ttft_ms": None, "wall_s": 9.0, "peak_rss_bytes": 10}
    npf = {"warm": [ok, failed], "uncached": [{"ok": True, "wall_s": 1.0, "peak_rss_bytes": 250_000_000}],
           "warm_hit_ttft_ms": [40.0]}
    m = new_process_figures(npf)
    assert m["warm_ttft_ms"] == 60.0 and m["warm_wall_s"] == 0.5 and m["warm_rss_bytes"] == 300_000_000
    rows = verdicts(_fig(new_process=npf))
    assert _by(rows, "new process: first exact hit")["value"] == pytest.approx(1.5)
    assert _by(rows, "new process: first exact hit")["met"] is True
    rss = _by(rows, "new process: peak RSS")
    assert rss["value"] == pytest.approx(300.0) and rss["limit"] == pytest.approx(314.0) and rss["met"] is True
    wall = _by(rows, "new process: wall time")
    assert wall["value"] == pytest.approx(0.5) and wall["met"] is True
    # no figure: no verdict, rather than one invented
    assert _by(verdicts(_fig(exact=(), new_process={"warm": [failed], "uncached": []})),
               "new process: peak RSS")["met"] is None


def test_profile_groups_sum_their_functions_and_leave_the_rest_to_other():
    entries = [("/x/edgesync_engines/request/router.py", "prompt_tokens", 0.020),
               ("/x/edgesync_engines/request/execute.py", "fetched", 0.100),
               ("/x/edgesync_engines/adapters/protocol.py", "inject_fragment", 0.060),
               ("/x/llama_cpp/llama.py", "eval", 0.150),
               ("/x/edgesync_engines/request/storeback.py", "record_hits", 0.010),
               ("/x/edgesync_engines/request/router.py", "generate", 0.400),  # the whole request: no group
               ("/x/other/execute.py", "fetched_not", 0.5)]
    g = group_profile(entries, n_hits=10, total_ms=400.0)
    assert g["tokenize"] == pytest.approx(2.0) and g["fetch"] == pytest.approx(10.0)
    assert g["assemble/inject"] == pytest.approx(6.0) and g["eval"] == pytest.approx(15.0)
    assert g["after first token"] == pytest.approx(1.0) and g["walk"] == 0.0
    assert g["other"] == pytest.approx((400 - 340) / 10) and g["total"] == pytest.approx(40.0)
    with pytest.raises(ValueError):
        group_profile(entries, 0, 1.0)
    text = floor_report.render(_fig(), verdicts(_fig()), {"seed": g})
    assert "exact-hit TTFT p50 / floor p50" in text and "assemble/inject" in text


def test_seed_sets_are_distinct_and_new_prompts_share_a_stored_system_prompt():
    exact, new = floor.seed_prompt_sets(6)
    assert len(exact) == 6 and len(new) == 6
    texts = [json.dumps(m) for m in exact + new]
    assert len(set(texts)) == 12  # a new prompt was never asked before
    systems = {m[0]["content"] for m in exact}
    assert all(m[0]["role"] == "system" and m[0]["content"] in systems for m in new)


def test_doc_prompts_reach_the_size_and_the_new_one_asks_the_next_question():
    def count(messages) -> int:  # stand-in: characters // 4
        return sum(len(m["content"]) for m in messages) // 4

    exact, new = floor.doc_prompt_sets(3, count, target_tokens=1000)
    assert len(exact) == len(new) == 3
    for e, n in zip(exact, new, strict=True):
        assert count(e) >= 1000 and e[0] == n[0]
        passages, q = e[1]["content"].rsplit("\n\nQuestion: ", 1)
        assert n[1]["content"].startswith(passages + "\n\nQuestion: ") and n[1]["content"] != e[1]["content"]
        assert passages.startswith("Passage (")
    with pytest.raises(ValueError, match="--doc-prompts"):
        floor.doc_prompt_sets(100, count, target_tokens=10_000)


def test_launcher_measures_the_childs_own_peak_rss(tmp_path):
    """A child of a big process: the launcher reports the child's peak (~120 MB), not the
    parent's 400 MB that Linux would carry across exec into a child forked directly."""
    ballast = bytearray(400_000_000)
    ballast[::4096] = b"x" * len(ballast[::4096])  # touch every page: resident
    code = "b = bytearray(120_000_000); b[::4096] = b'x' * len(b[::4096])"
    out = tmp_path / "usage.json"
    subprocess.run([sys.executable, "-c", floor.LAUNCHER, str(out), sys.executable, "-c", code], check=True)
    usage = json.loads(out.read_text())
    del ballast
    assert usage["exit"] == 0 and usage["wall_s"] > 0
    assert 120e6 < usage["maxrss_kib"] * 1024 < 300e6


@pytest.mark.model
def test_one_small_run_on_the_real_model(tmp_path):
    """Two seed prompts (one a miss, one a partial hit of the first's system prompt), two
    interleaved rounds of exact hits with the floor after each, one new prompt asked four times
    as a partial hit: every hit is exact or partial as planned and token-identical to the
    uncached run, the floor runs on the state the hit left, and the store-back bytes add up to
    what the store holds."""
    exact, new = floor.seed_prompt_sets(8)
    # three prompts of one app: the second and third reuse the first's system prompt
    same = [m for m in exact + new if m[0]["content"] == exact[0][0]["content"]]
    assert len(same) >= 3
    bench = floor.Bench(tmp_path, threads=None, max_tokens=8, repeats=2)
    try:
        fig = bench.workload("seed", same[:2], same[2:3])
        total = floor.stored_bytes(bench.es)
    finally:
        bench.close()
    ex, pa, sb = fig["exact"], fig["partial"], fig["store_back"]
    assert fig["first_hits"] == ["miss", "partial"]
    assert ex["hits"] == {"exact": 4} and ex["identical"] == ex["n"] == 4
    assert len(fig["floor"]["ms"]) == 4 and all(ms > 0 for ms in fig["floor"]["ms"])
    # asked once, then three more times with what its store-back added deleted: partial each time
    assert pa["asks_per_prompt"] == 4 and pa["hits"] == {"partial": 4} and pa["identical"] == 4
    # the three repeats are timed, each with its bound measured right after it
    assert len(pa["ttft_ms"]) == len(pa["floor_ms"]) == len(pa["uncovered_prefill_ms"]) == 3
    assert pa["uncovered_tokens"] == [pa["prompt_tokens"][0] - 1 - pa["tokens_reused"][0]]
    assert 64 <= pa["tokens_reused"][0] < pa["prompt_tokens"][0] - 1
    assert sb["kind"] == ["first", "first", "partial"] and sb["fragments"][0] >= 2
    assert sum(sb["bytes"]) == total and sb["bytes"][0] > sb["bytes"][1] > 0
    assert sb["disk_bytes_delta"] > 0
