"""``edgesync run`` (edgesync_bench.cli_run), run as a subprocess on the real model and the
shared workloads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgesync_bench import run_report as runreport

ROOT = Path(__file__).resolve().parents[1]
KEEP_ENV = {"EDGESYNC_MODEL", "EDGESYNC_WORKLOADS", "EDGESYNC_THREADS"}


def _env(**extra: str) -> dict[str, str]:
    """The environment without EDGESYNC_* settings that would change what is tested."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGESYNC_") or k in KEEP_ENV}
    env.update(extra)
    return env


def edgesync(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edgesync_engines.app.cli", *args],
        capture_output=True, text=True, cwd=ROOT, env=env or _env(), timeout=600,
    )


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


@pytest.mark.model
def test_run_seed_json(tmp_path):
    store = tmp_path / "store"
    out = tmp_path / "run.json"
    proc = _ok(edgesync("run", "seed", "--limit", "6", "--max-tokens", "8", "--json",
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
                    env=_env(EDGESYNC_WORKLOADS=str(tmp_path / "nowhere")))
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "EDGESYNC_WORKLOADS" in proc.stderr
    assert not (tmp_path / "s").exists()
