"""``edgesync run`` (edgesync_bench.cli_run), run as a subprocess on the real model and the
shared workloads."""

from __future__ import annotations

import json
import os

import pytest

from edgesync_bench import run_report as runreport
from tests.cli_support import cli_env, edgesync, ok


@pytest.mark.model
def test_run_seed_json(tmp_path):
    store = tmp_path / "store"
    out = tmp_path / "run.json"
    proc = ok(edgesync("run", "seed", "--limit", "6", "--max-tokens", "8", "--json",
                        "--json-out", str(out), "--store", str(store)))
    doc = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == doc
    assert doc["workload"] == "seed" and doc["n_requests"] == 6
    rows = doc["requests"]
    assert len(rows) == 6
    assert [r["request_id"] for r in rows] == [f"seed-{i:04d}" for i in range(6)]
    assert all(r["identical"] for r in rows)
    for r in rows:
        assert r["ttft_ms_uncached"] > 0 and r["ttft_ms_edgesync"] > 0
        assert r["tokens_reused"] + r["tokens_prefilled"] == r["prompt_tokens"]
    summary = doc["summary"]
    edge, base = summary["edgesync"], summary["uncached"]
    assert edge["identical_share"] == 1.0 and base["identical_share"] is None
    assert sum(edge["hits"].values()) == 6 and base["hits"]["miss"] == 6
    assert base["tokens_reused"] == 0 and base["bytes_read"] == 0
    assert edge["prompt_tokens"] == base["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert edge["fragments_written"] > 0
    assert doc["store"]["fragments"] == edge["fragments_written"] and doc["store"]["disk_bytes"] > 0
    assert summary["ttft_ratio"]["mean"] == pytest.approx(edge["ttft_ms"]["mean"] / base["ttft_ms"]["mean"])

    # The table renders from the same document (pure function, real data).
    from rich.console import Console

    console = Console(record=True, width=160, file=open(os.devnull, "w"))
    console.print(runreport.render_table(summary, doc["store"], "seed"))
    text = console.export_text()
    assert "identical outputs vs uncached" in text and "100.0%" in text and "TTFT p95" in text


def test_missing_workload_data_exits_2(tmp_path):
    proc = edgesync("run", "seed", "--limit", "2", "--store", str(tmp_path / "s"),
                    env=cli_env(EDGESYNC_WORKLOADS=str(tmp_path / "nowhere")))
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "EDGESYNC_WORKLOADS" in proc.stderr
    assert not (tmp_path / "s").exists()
