"""The plots write valid PNG files from records and summaries, with no display (Agg backend)."""

from __future__ import annotations

import matplotlib  # noqa: F401  (the bench extra; a missing install should fail, not skip)

from edgesync_bench import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def records():
    out = []
    for workload in ("seed", "doc-qa"):
        for system in ("no-cache", "naive-string", "edgesync"):
            for i in range(20):
                hit = None if i < 5 else ("exact" if i % 2 else "partial")
                if system == "no-cache":
                    hit = None
                ttft = 0.0 if (system == "naive-string" and hit) else 50.0 + 90 * (i % 7) + (1500 if hit is None else 0)
                out.append({"workload": workload, "system": system, "index": i, "ttft_ms": ttft, "hit": hit})
    return out


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 1024


def test_ttft_distribution(tmp_path):
    out = plots.ttft_distribution(records(), tmp_path / "ttft.png")
    assert out == tmp_path / "ttft.png"
    assert_png(out)


def test_hits_by_kind_from_records_and_summaries(tmp_path):
    assert_png(plots.hits_by_kind(records(), tmp_path / "hits.png"))
    summary = {"seed": {"no-cache": {"exact": 0, "partial": 0, "miss": 300},
                        "edgesync": {"exact": 400, "partial": 550, "miss": 50}}}
    assert_png(plots.hits_by_kind(summary, tmp_path / "hits-summary.png"))
    rows = [{"workload": "chat", "system": "edgesync", "exact": 3, "partial": 90, "miss": 52}]
    assert_png(plots.hits_by_kind(rows, tmp_path / "sub" / "hits-rows.png"))


def test_bytes_per_cached_prompt(tmp_path):
    seed_raw, doc_raw = 23_040 * 348, 23_040 * 223  # SmolLM2-135M raw f16 KV: 23,040 B per token
    rows = [
        {"system": "edgesync", "workload": "seed", "bytes_on_disk_per_prompt": 2_100_000,
         "raw_f16_kv_per_prompt": seed_raw},
        {"system": "llama-disk", "workload": "seed", "bytes_on_disk_per_prompt": 9_000_000,
         "raw_f16_kv_per_prompt": seed_raw},
        {"system": "no-cache", "workload": "seed", "bytes_on_disk_per_prompt": 0, "raw_f16_kv_per_prompt": seed_raw},
        {"system": "edgesync", "workload": "doc-qa", "bytes_on_disk_per_prompt": 1_500_000,
         "raw_f16_kv_per_prompt": doc_raw},
        {"system": "llama-disk", "workload": "doc-qa", "bytes_on_disk_per_prompt": None,
         "raw_f16_kv_per_prompt": doc_raw},
    ]
    assert_png(plots.bytes_per_cached_prompt(rows, tmp_path / "bytes.png"))


def test_figures_are_closed(tmp_path):
    import matplotlib.pyplot as plt

    plots.ttft_distribution(records(), tmp_path / "a.png")
    plots.hits_by_kind(records(), tmp_path / "b.png")
    plots.bytes_per_cached_prompt([], tmp_path / "c.png")
    assert plt.get_fignums() == []
    assert matplotlib.get_backend().lower() == "agg"
