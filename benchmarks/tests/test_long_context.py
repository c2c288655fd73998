"""benchmarks/long_context.py's pure logic: sizes and their plan, the long doc-QA prompts, the
follow-up turn, the time prediction, ratios and identity of a size's figures, the tables, the
plot's series and the JSON shape; the page-cache helpers and the slot file's token header on
small files. No model is loaded and no timing is asserted."""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
import pytest

from edgesync_bench import long_context as lc
from edgesync_bench.workloads import DOC_QA_SYSTEM_PROMPT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- sizes -------------------------------------------------------------------------------------------

def test_sizes_parse_and_label():
    assert lc.parse_size("8K") == 8192 and lc.parse_size(" 1k ") == 1024 and lc.parse_size("1000") == 1000
    assert lc.size_label(32768) == "32K" and lc.size_label(1000) == "1000"
    assert lc.parse_sizes("4K,1K,1024,2K") == (1024, 2048, 4096)
    for bad in ("", "K", "abc", "32"):
        with pytest.raises(ValueError):
            lc.parse_size(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        lc.parse_sizes("1K,x")


def test_limits_and_models_parse():
    assert lc.parse_limit("gemma3-270m=16K") == ("gemma3-270m", 16384)
    for bad in ("gemma=16K", "smollm2", "smollm2=", "smollm2=lots"):
        with pytest.raises(argparse.ArgumentTypeError):
            lc.parse_limit(bad)
    assert lc.parse_models("llama-3.2-1b,smollm2,smollm2") == ("llama-3.2-1b", "smollm2")
    with pytest.raises(argparse.ArgumentTypeError):
        lc.parse_models("smollm2,gpt")


def test_size_plan_stops_at_the_limit_and_fits_the_trained_context():
    run, cut = lc.size_plan(lc.SIZES, 8192, 8192)
    assert [p["label"] for p in run] == ["1K", "2K", "4K", "8K"]
    assert run[0] == {"label": "1K", "target": 1024, "n_ctx": 1024 + lc.CTX_MARGIN}
    assert run[-1]["target"] == 8192 - lc.CTX_MARGIN and run[-1]["n_ctx"] == 8192  # SmolLM2's 8K fits its context
    assert [c["label"] for c in cut] == ["16K", "32K"] and "limit" in cut[0]["reason"]
    # a limit above the trained context: the next size would repeat the largest prompt, so it is cut
    run, cut = lc.size_plan([4096, 8192, 16384], 8192, 32768)
    assert [p["label"] for p in run] == ["4K", "8K"] and [c["label"] for c in cut] == ["16K"]
    assert "trained context" in cut[0]["reason"]
    run, _ = lc.size_plan([32768], 131072, 32768)
    assert run == [{"label": "32K", "target": 32768, "n_ctx": 32768 + lc.CTX_MARGIN}]
    run, cut = lc.size_plan([1024, 2048], None, 32768)  # no trained context in the header: the sizes as asked
    assert [p["target"] for p in run] == [1024, 2048] and not cut


def test_models_table_and_quick_defaults():
    by = {m.name: m for m in lc.MODELS}
    assert by["smollm2"].limit == 8192 and by["gemma3-270m"].limit == 32768
    assert by["llama-3.1-8b-kv"].random_weights and by["llama-3.1-8b-kv"].limit == 32768
    assert not by["llama-3.2-1b"].default and not by["smollm2"].random_weights
    quick = lc.resolve_args(lc.build_parser().parse_args(["--quick"]))
    assert quick.models == ("smollm2",) and quick.sizes == (1024, 2048, 4096) and quick.peer_size == 2048
    assert quick.budget_min == 10 and quick.plot is None and quick.peers == lc.PEER_SYSTEMS
    full = lc.resolve_args(lc.build_parser().parse_args(["--peers", "none", "--limit", "gemma3-270m=8K"]))
    assert full.models == ("smollm2", "gemma3-270m", "llama-3.1-8b-kv") and full.sizes == lc.SIZES
    assert full.peers == () and full.plot == lc.DEFAULT_PLOT and full.budget_min == 45
    assert dict(full.limit) == {"gemma3-270m": 8192}
    with pytest.raises(SystemExit):
        lc.resolve_args(lc.build_parser().parse_args(["--peers", "edgesync,ollama"]))


# -- prompts -----------------------------------------------------------------------------------------

def _rows(n=12, words=50):
    return [{"title": f"T{i}", "context": " ".join(f"w{i}_{j}" for j in range(words)),
             "questions": [f"first question of {i}?", f"second question of {i}?"][: 1 if i % 5 == 4 else 2]}
            for i in range(n)]


def _count(messages):
    """A stand-in tokenizer: a token per whitespace-separated word of every message."""
    return sum(len(m["content"].split()) for m in messages)


def test_passage_order_is_random_0():
    assert lc.passage_order(181) == random.Random(0).sample(range(181), 181)
    assert lc.passage_order(10) == lc.passage_order(10)


def test_doc_prompts_fill_each_size_with_whole_passages_then_a_cut_one():
    rows = _rows()
    out = lc.doc_prompts(rows, _count, [130, 260, 30])
    assert set(out) == {130, 260}  # 30: not even the first passage fits
    for target, p in out.items():
        assert _count(p["q1"]) == p["tokens"] <= target
        assert p["tokens"] >= target - 3  # the cut passage fills the rest, word by word
        system, user = p["q1"]
        assert system == {"role": "system", "content": DOC_QA_SYSTEM_PROMPT}
        assert user["content"].startswith("Passage (")
        first = next(r for r in (rows[i] for i in lc.passage_order(len(rows))) if len(r["questions"]) >= 2)
        assert user["content"].endswith(f"Question: {first['questions'][0]}")
        assert user["content"].startswith(f"Passage ({first['title']}):")
        assert p["q2"][1]["content"].endswith(f"Question: {first['questions'][1]}")
        assert p["q1"][1]["content"].rsplit("\n\n", 1)[0] == p["q2"][1]["content"].rsplit("\n\n", 1)[0]
        assert p["filled"] and p["cut_words"] > 0
    small, large = out[130]["q1"][1]["content"], out[260]["q1"][1]["content"]
    whole = small.split("\n\n")[: out[130]["passages"]]
    assert large.split("\n\n")[: out[130]["passages"]] == whole  # the same passages, in the same order


def test_doc_prompts_when_the_data_runs_out():
    rows = _rows(n=3)
    (p,) = lc.doc_prompts(rows, _count, [10_000]).values()
    assert p["passages"] == 3 and not p["filled"] and p["cut_words"] == 0 and p["tokens"] < 10_000
    with pytest.raises(ValueError):
        lc.doc_prompts([{**r, "questions": ["only one?"]} for r in rows], _count, [100])


def test_follow_up_and_scenario_prompts():
    p = lc.doc_prompts(_rows(), _count, [200])[200]
    turn = lc.follow_up(p["q1"], "An answer.", p["q2"])
    assert turn[:2] == p["q1"] and turn[2] == {"role": "assistant", "content": "An answer."}
    assert turn[3]["role"] == "user" and turn[3]["content"].startswith("Question: ")
    assert "Passage" not in turn[3]["content"]
    assert lc.scenario_prompts("q1-again", p, {}) == p["q1"] and lc.scenario_prompts("q2", p, {}) == p["q2"]
    assert lc.scenario_prompts("follow-up", p, {"q1": "An answer."}) == turn
    assert lc.SCENARIO == ("q1", "restart", "q2", "q1-again", "restart", "follow-up")


def test_predict_seconds_grows_faster_than_the_tokens():
    assert lc.predict_seconds([], 2048) is None
    assert lc.predict_seconds([(1000, 10.0), (2000, 30.0)], 4000) == pytest.approx(30.0 * 2 ** lc.GROWTH)
    assert lc.predict_seconds([(1000, 10.0)], 2000, growth=1.0) == pytest.approx(20.0)


def test_predict_peer_seconds_counts_prefills_and_starts():
    every = lc.predict_peer_seconds(10.0, 2.0, lc.PEER_SYSTEMS)
    assert every == pytest.approx((3 + 1 + 3) * 10.0 + 9 * 2.0)
    assert lc.predict_peer_seconds(10.0, 2.0, ("edgesync",)) == pytest.approx(4 * 10.0 + 3 * 2.0)
    assert lc.predict_peer_seconds(10.0, 2.0, ()) == 0


# -- figures -----------------------------------------------------------------------------------------

def _proc(ttft, rss=300 * 2**20, tokens=(1, 2, 3), **extra):
    return {"ttft_ms": ttft, "peak_rss_bytes": rss, "tokens": list(tokens), "launch_to_first_token_s": 2.5,
            "resident_before_bytes": 20 * 2**20, **extra}


def _fig(label="1K", n=1000, miss=4000.0, floor=20.0, warm=(40.0, 44.0), dropped=(90.0, 80.0), differ=False):
    return {"label": label, "prompt_tokens": n, "target": n, "n_ctx": n + 256,
            "uncached": {"ttft_ms": miss * 0.98, "tokens": [1, 2, 3]}, "miss": {"ttft_ms": miss, "tokens": [1, 2, 3]},
            "floor": {"last_token_ms": floor - 2.0, "copy_ms": 2.0, "floor_ms": floor},
            "new_process": {"warm": [_proc(t) for t in warm],
                            "dropped": [_proc(t, tokens=(1, 2, 4) if differ and i else (1, 2, 3))
                                        for i, t in enumerate(dropped)]},
            "llama_server": {"peak_rss_bytes": 200 * 2**20, "restore_ms": 9.0, "equals_miss": True, "cache_n": n - 1,
                             "prompt_n": 1},
            "bytes": {"store_dir_per_token": 23_200.0, "fragments_per_token": 23_040.0, "state_per_token": 23_050.0,
                      "kv_f16_per_token": 23_040}}


def test_size_ratios_against_the_floor_and_llama_server():
    r = lc.size_ratios(_fig())
    assert r["hit_warm_over_floor"] == pytest.approx([2.0, 2.2])
    assert r["hit_dropped_over_floor"] == pytest.approx([4.5, 4.0])
    assert r["miss_over_hit"] == pytest.approx(100.0)
    assert r["hit_rss_over_llama_server"] == pytest.approx(1.5)
    assert r["store_dir_over_kv"] == pytest.approx(23_200 / 23_040) and r["fragments_over_kv"] == pytest.approx(1.0)
    empty = lc.size_ratios({})
    assert empty["miss_over_hit"] is None and empty["hit_warm_over_floor"] == []


def test_identity_counts_hits_equal_to_the_miss_and_the_uncached_run():
    assert lc.identity(_fig()) == {"miss_equals_uncached": True, "hits_equal_miss": 4, "hits_equal_uncached": 4,
                                   "hits": 4, "hit_processes": 4}
    assert lc.identity(_fig(differ=True))["hits_equal_miss"] == 3
    assert lc.identity({"new_process": {"warm": [{"ok": False}]}})["hits"] == 0


def _report():
    figs = [_fig("1K", 1000, 4000.0, 20.0), _fig("2K", 2040, 9000.0, 25.0)]
    for f in figs:
        f["identity"], f["ratios"] = lc.identity(f), lc.size_ratios(f)
    peers = {"label": "2K", "prompt_tokens": 2040, "n_ctx": 2296, "systems": {
        "edgesync": {"startup_s": [1.5, 1.6, 1.6], "steps": [
            {"step": s, "ttft_ms": t, "restore_ms": None, "identical": True, "prompt_tokens_reported": 2040}
            for s, t in (("q1", 9000.0), ("q2", 600.0), ("q1-again", 400.0), ("follow-up", 380.0))],
            "disk_bytes_per_token": 40_000.0, "peak_rss_bytes": 400 * 2**20, "error": None},
        "llama-server-slots": {"startup_s": [0.3, 0.3, 0.3], "steps": [
            {"step": "q1", "ttft_ms": 8000.0, "restore_ms": None, "identical": False},
            {"step": "q2", "ttft_ms": 700.0, "restore_ms": 25.0, "identical": True},
            {"step": "q1-again", "ttft_ms": 500.0, "restore_ms": None, "identical": False, "equals_own_q1": True}],
            "disk_bytes_per_token": 24_000.0, "peak_rss_bytes": 200 * 2**20, "error": "RuntimeError: gone"},
        "hearth": {"startup_s": [], "steps": [], "error": "did not start"}}}
    return {"models": {"smollm2": {"random_weights": False, "facts": {"file": "SmolLM2.gguf"}, "sizes": figs,
                                   "cut": [{"label": "4K", "reason": "predicted 9.0 min > 2.0 min left"}],
                                   "skipped": None, "peers": peers},
                       "llama-3.1-8b-kv": {"random_weights": True, "sizes": [], "cut": [],
                                           "skipped": "llama-3.1-8b-kv is not built yet"},
                       "llama-3.2-1b": {"random_weights": True, "facts": {"file": "shape.gguf"},
                                        "sizes": [_fig("1K", 1010)], "cut": [], "skipped": None}},
            "meta": {"threads": 2}}


def test_render_says_random_weights_skips_cuts_and_peers():
    text = lc.render(_report())
    assert "## smollm2: SmolLM2.gguf\n" in text
    assert "## llama-3.1-8b-kv: ?, RANDOM WEIGHTS" in text and "skipped: llama-3.1-8b-kv is not built yet" in text
    assert "## llama-3.2-1b: shape.gguf, RANDOM WEIGHTS" in text
    assert "4K: not run, predicted 9.0 min > 2.0 min left" in text
    assert "### Peers at 2K (2,040 tokens)" in text
    m = _report()["models"]["smollm2"]
    rows = {line.split(" | ")[0]: line for line in lc.ttft_table(m).splitlines()}
    assert "| 1K | 1,000 | 3920 / 4000 | 40, 44 | 90, 80 | 2.50, 2.50 / 2.50, 2.50 | 18.0 + 2.0 = 20.0 | " \
           "2.0x, 2.2x / 4.5x, 4.0x | 100x | 4 / 4 of 4 |" == rows["| 1K"]
    assert rows["| 2K"].startswith("| 2K | 2,040 | 8820 / 9000 |")
    rows = {line.split(" | ")[0]: line for line in lc.resource_table(m).splitlines()}
    assert rows["| 1K"] == ("| 1K | 300, 300 | 200, 9 (reused 999 of 1,000 tokens) | 1.50 | "
                            "23,200 / 23,040 / 23,050 / 23,040 | 1.01 | 20, 20 / 20, 20 |")
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert rows["| edgesync"] == ("| edgesync | 1.50 / 1.60 / 1.60 | 9000 | 600 | 400 | 380 | 4 of 4 | 2,040 | "
                                  "40,000 | 400 |")
    assert "700 (restore 25)" in rows["| llama-server-slots"] and "1 of 3 (q1 again = its own q1: yes)" in \
        rows["| llama-server-slots"] and rows["| llama-server-slots"].endswith("error: RuntimeError: gone")
    assert rows["| hearth"].startswith("| hearth | did not start |")


def test_series_and_json_shape():
    report = _report()
    lines = lc.series(report)
    by = {(s["model"], s["kind"]): s["points"] for s in lines}
    assert by[("smollm2", "miss")] == [(1000, 4000.0), (2040, 9000.0)]
    assert by[("smollm2", "hit (new process)")] == [(1000, 40.0), (2040, 40.0)]
    assert by[("smollm2", "hit, page cache dropped")] == [(1000, 90.0), (2040, 90.0)]
    assert by[("smollm2", "floor")] == [(1000, 20.0), (2040, 25.0)]
    assert ("llama-3.2-1b (random weights)", "miss") in by
    assert not any(m.startswith("llama-3.1-8b-kv") for m, _ in by)
    back = json.loads(json.dumps(report))
    size = back["models"]["smollm2"]["sizes"][0]
    for key in ("uncached", "miss", "floor", "new_process", "llama_server", "bytes", "identity", "ratios"):
        assert key in size
    assert set(size["new_process"]) == {"warm", "dropped"}


def test_the_plot_is_a_png(tmp_path):
    out = lc_plot(tmp_path / "lc.png", lc.series(_report()))
    assert out.read_bytes()[:8] == PNG_MAGIC
    empty = lc_plot(tmp_path / "empty.png", [])
    assert empty.read_bytes()[:8] == PNG_MAGIC


def lc_plot(path, series):
    from edgesync_bench.plots import ttft_against_prompt_tokens

    return ttft_against_prompt_tokens(series, path, title="test")


# -- files -------------------------------------------------------------------------------------------

def test_page_cache_helpers_on_small_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "data.mdb").write_bytes(b"x" * 100_000)
    (tmp_path / "sub" / "lock.mdb").write_bytes(b"y" * 10)
    assert lc.warm_page_cache(tmp_path) == 100_010
    resident = lc.resident_bytes(tmp_path)
    assert resident is None or 0 <= resident <= 100_010 + 2 * 65536
    assert lc.drop_page_cache(tmp_path) == 2


def test_slot_file_tokens_and_stored_bytes(tmp_path):
    path = tmp_path / lc.SLOT_FILE
    header = np.array([0x67677371, 2, 4], dtype=np.uint32)
    tokens = np.array([1, 49151, 7, 2], dtype=np.int32)
    path.write_bytes(header.tobytes() + tokens.tobytes() + b"\0" * 64)
    assert lc.tokens_of_slot(path, 4) == [1, 49151, 7, 2]
    with pytest.raises(ValueError):
        lc.tokens_of_slot(path, 5)
    (tmp_path / "server.log").write_text("log" * 100)
    (tmp_path / "manifest.json").write_text("{}")
    assert lc.stored_file_bytes(tmp_path) == path.stat().st_size
    assert lc.stored_file_bytes(tmp_path / "missing") == 0


def test_template_args_for_a_gguf_without_a_chat_template():
    assert lc.template_args({"chat_template": True, "builtin_template": None}) == []
    assert lc.template_args({"chat_template": False, "builtin_template": "gemma"}) == [
        "--no-jinja", "--chat-template", "gemma"]


def test_an_unbuilt_shape_is_skipped_with_the_command_that_builds_it(monkeypatch, tmp_path):
    monkeypatch.setattr(lc, "shaped_path", lambda shape: tmp_path / f"{shape}.gguf")
    spec = next(m for m in lc.MODELS if m.name == "llama-3.1-8b-kv")
    path, why = lc.resolve_model(spec)
    assert path is None and "not built yet" in why and "python tools/shaped_gguf.py llama-3.1-8b-kv" in why
    said = []
    m = lc.run_model(spec, argparse.Namespace(), tmp_path, 60.0, said.append, False)
    assert m["skipped"] == why and m["random_weights"] and m["sizes"] == [] and "skipped" in said[0]
