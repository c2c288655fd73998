"""`edgesync bench --model`, `--kv-type` and `--limit`: the workers run the model and KV type they
are given (real workers on the real SmolLM2 and Gemma 3 270M, short prompts, 4 new tokens), the
report says which, and sets EdgeSync's bytes per cached prompt of each KV type side by side."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from edgesync_bench.bench_report import build_report, kv_suffix
from edgesync_bench.runner import FULL, QUICK, Lane, Sizes, env_kv_types, limited, model_info
from edgesync_bench.systems import KV_TYPES, kv_settings, make_system
from edgesync_engines.adapters.model_files import default_model_path, gemma3_model_path
from edgesync_engines.config import BY_NAME

# Gemma 3 270M: 18 layers x 1 KV head x (K 256 + V 256) x 2 bytes; SmolLM2: 30 x 3 x (64 + 64) x 2
GEMMA_KV_BYTES_PER_TOKEN = 18 * 1 * (256 + 256) * 2
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 3 * (64 + 64) * 2


@pytest.fixture(scope="module")
def prompt(system_prompts):
    return [{"role": "system", "content": system_prompts[0][:450]},
            {"role": "user", "content": "How do I improve my English?"}]


def _lane(tmp_path, label, kind, **kw):
    lane = Lane(label, kind, tmp_path / label, **kw)
    lane.start(1, tmp_path / "logs")
    return lane


def _answers(lane, prompt, n=2):
    out = [lane.call({"op": "answer", "messages": prompt if isinstance(prompt, str) else list(prompt),
                      "max_tokens": 4}) for _ in range(n)]
    stats = lane.call({"op": "stats"})
    lane.close()
    assert all(a["ok"] for a in out) and stats["ok"], (out, stats)
    return [a["answer"] for a in out], stats["stats"]


def test_kv_settings_limits_and_model_info(tmp_path):
    assert kv_settings("f16") == {}  # the default run sets nothing: `make bench` unchanged
    assert kv_settings("q8_0") == {"type_k": KV_TYPES["q8_0"], "type_v": KV_TYPES["q8_0"], "flash_attn": True}
    assert kv_settings("f32")["flash_attn"] is False
    with pytest.raises(ValueError, match="kv_type: 'q9' is not one of f16, f32, q8_0, q4_0"):
        kv_settings("q9")
    assert limited(FULL, None) is FULL and limited(QUICK, 5) == Sizes(5, 5, 2, 2)
    assert limited(FULL, 3) == Sizes(3, 3, 3, 3)
    gemma = model_info(gemma3_model_path())
    assert (gemma["architecture"], gemma["sliding_window"], gemma["name"]) == ("gemma3", 512, "Gemma 3 270m")
    assert model_info(None)["file"] == default_model_path().name
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        model_info(text)
    with pytest.raises(ValueError, match="no such file"):
        model_info(tmp_path / "missing.gguf")


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/model.gguf"], "error: --model /nonexistent/model.gguf: no such file"),
    (["--kv-type", "q9"], "error: argument --kv-type: 'q9': distinct names from f16, f32, q8_0, q4_0"),
])
def test_bench_refuses_a_bad_model_or_kv_type_in_one_line(tmp_path, argv, message):
    proc = subprocess.run([sys.executable, "-m", "edgesync_bench.runner", "--out", str(tmp_path / "out"), *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.model
def test_workers_run_gemma3_when_told(tmp_path, system_prompts):
    """--model reaches every kind of system: no cache and EdgeSync on Gemma 3 answer alike, the
    stats name the model and its KV size; EdgeSync either caches it (a second identical
    request is an exact hit) or serves it uncached saying why (the sliding window). The prompt
    is raw text in Gemma's turn format: this GGUF carries no tokenizer.chat_template."""
    gemma = gemma3_model_path()
    prompt = (f"<start_of_turn>user\n{system_prompts[0][:450]}\n\nHow do I improve my English?<end_of_turn>\n"
              "<start_of_turn>model\n")
    ref, nc = _answers(_lane(tmp_path, "no-cache", "no-cache", model=gemma), prompt, n=1)
    es_answers, es = _answers(_lane(tmp_path, "edgesync", "edgesync", model=gemma,
                                    config={"semantic": False}), prompt)
    assert nc["model"] == es["model"] == gemma.name
    assert nc["kv_bytes_per_token"] == es["kv_bytes_per_token"] == GEMMA_KV_BYTES_PER_TOKEN
    assert all(a["tokens"] == ref[0]["tokens"] for a in es_answers) and ref[0]["tokens"]
    if es["cache_refusal"] is None:
        assert es_answers[1]["hit"] == "exact" and es["store"]["fragments"] > 0
    else:
        assert "sliding-window" in es["cache_refusal"] and es_answers[1]["hit"] is None
    with make_system("llama-ram", model_path=gemma) as ram:  # the peers take the model too
        assert ram.answer(prompt, max_tokens=4).tokens == ref[0]["tokens"]


@pytest.mark.model
def test_kv_type_reaches_the_peers_and_edgesyncs_setting(tmp_path, prompt):
    """--kv-type q8_0: no cache runs a q8_0 context; EdgeSync gets EDGESYNC_KV_TYPE=q8_0 and
    runs it when it knows the setting (then its cold and hit answers equal no cache's q8_0
    ones), else f16, and the stats say which."""
    ref, nc = _answers(_lane(tmp_path, "no-cache@q8_0", "no-cache", kv_type="q8_0"), prompt, n=1)
    assert nc["kv_type"] == "q8_0" and nc["kv_bytes_per_token"] == SMOLLM2_KV_BYTES_PER_TOKEN
    answers, es = _answers(_lane(tmp_path, "edgesync@q8_0", "edgesync", kv_type="q8_0",
                                 config={"semantic": False}), prompt)
    if "kv_type" in BY_NAME:
        assert es["kv_type"] == "q8_0"
        assert [a["tokens"] for a in answers] == [ref[0]["tokens"]] * 2 and answers[1]["hit"] == "exact"
    else:
        assert es["kv_type"] == "f16" and not os.environ.get("EDGESYNC_KV_TYPE")


def _rec(system, i, tokens=(1, 2), n=301):
    return {"workload": "seed", "system": system, "index": i, "request_id": f"seed-{i:04d}", "prompt_key": f"p{i}",
            "group": "g", "first_seen": True, "ttft_ms": 100.0, "total_ms": 150.0, "prompt_tokens": n,
            "tokens_reused": 0, "hit": None, "source": None, "bytes_read": 0, "tokens": list(tokens), "cpu_s": 0.1,
            "rss_peak_bytes": 1, "lookup_ms": None, "detail": {}}


def test_report_sets_kv_types_side_by_side(tmp_path):
    """Two cached prompts per lane: f16 stores 10 MB on disk and 8 MB of fragments, q8_0 5.3
    and 4.2 MB; the table gives 0.530x and 0.525x. edgesync@q8_0's identity is against
    no-cache@q8_0 (equal tokens), not against f16's no cache (other tokens)."""
    recs = [_rec("no-cache", i) for i in range(2)] + [_rec("edgesync", i) for i in range(2)]
    recs += [_rec("no-cache@q8_0", i, tokens=(7,)) for i in range(2)] + [_rec("edgesync@q8_0", i, tokens=(7,))
                                                                         for i in range(2)]
    stats = {"seed": {
        "edgesync": {"kv_bytes_per_token": 100, "store_disk_bytes": 10_000_000, "kv_type": "f16",
                     "store": {"fragments": 4, "compressed_bytes": 8_000_000, "raw_bytes": 9_000_000}},
        "edgesync@q8_0": {"kv_bytes_per_token": 100, "store_disk_bytes": 5_300_000, "kv_type": "q8_0",
                          "store": {"fragments": 4, "compressed_bytes": 4_200_000, "raw_bytes": 4_800_000}},
        "no-cache@q8_0": {"kv_bytes_per_token": 100, "kv_type": "q8_0", "cache_refusal": None}}}
    meta = {"sizes": {"seed": 2}, "kv_types": ["f16", "q8_0"],
            "model": {"file": "gemma-3-270m-q4_k_m.gguf", "name": "Gemma 3 270m", "architecture": "gemma3",
                      "sliding_window": 512}}
    rep = build_report(recs, stats, meta, tmp_path)
    md = rep["markdown"]
    assert "Model: gemma-3-270m-q4_k_m.gguf (Gemma 3 270m, gemma3, sliding window 512) on llama.cpp, " \
           "KV type f16, q8_0" in md
    assert "| edgesync | f16 / f16 | 2 | 5.00 | 1.000x | 4.00 | 1.000x |" in md
    assert "| edgesync@q8_0 | q8_0 / q8_0 | 2 | 2.65 | 0.530x | 2.10 | 0.525x |" in md
    assert rep["summaries"]["seed/edgesync@q8_0"]["identity"] == 1.0
    assert kv_suffix("edgesync@q8_0") == "@q8_0" and kv_suffix("edgesync-warm") == ""
    assert "did not run as asked" not in md
    stats["seed"]["edgesync@q8_0"].update(kv_type="f16", cache_refusal="gemma3: sliding-window attention")
    md = build_report(recs, stats, meta, tmp_path)["markdown"]
    assert "- seed/edgesync@q8_0: asked for KV type q8_0, the engine ran f16" in md
    assert "- seed/edgesync@q8_0: served uncached: gemma3: sliding-window attention" in md


def test_an_environment_kv_type_is_the_runs_and_a_bad_one_is_refused(monkeypatch):
    monkeypatch.delenv("EDGESYNC_KV_TYPE", raising=False)
    assert env_kv_types() == [None]
    monkeypatch.setenv("EDGESYNC_KV_TYPE", " Q8_0 ")
    assert env_kv_types() == ["q8_0"]  # the peers then run what EdgeSync reads
    monkeypatch.setenv("EDGESYNC_KV_TYPE", "q5_k")
    with pytest.raises(ValueError, match="EDGESYNC_KV_TYPE='q5_k': not one KV type name"):
        env_kv_types()
