"""Tests for edgesync_bench.workloads against the real shared data.

Data: ../shared/workloads/ (or $EDGESYNC_WORKLOADS): qqp_clusters.jsonl (all 1,000 rows,
shuffled with random.Random(0), first 64 kept), system_prompts.json (all 8 rows), and
doc_qa.jsonl (first 40 rows). Seed draws use a fresh random.Random(0). No mocks.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from edgesync_bench.workloads import (
    DOC_QA_SYSTEM_PROMPT,
    WORKLOAD_NAMES,
    Request,
    WorkloadDataError,
    doc_qa_workload,
    load_workload,
    seed_workload,
    workloads_dir,
)


@pytest.fixture(scope="module")
def data_dir() -> Path:
    # Fails (does not skip) when the data is missing.
    return workloads_dir()


@pytest.fixture(scope="module")
def seed() -> list[Request]:
    return seed_workload()


def _readme_recipe(data_dir: Path):
    """The README's seed recipe, re-implemented here independently of the module."""
    with open(data_dir / "qqp_clusters.jsonl", encoding="utf-8") as fh:
        clusters = [json.loads(line) for line in fh]
    random.Random(0).shuffle(clusters)
    clusters = clusters[:64]
    with open(data_dir / "system_prompts.json", encoding="utf-8") as fh:
        topics = {t["topic_id"]: t["system_prompt"] for t in json.load(fh)}
    rng = random.Random(0)
    draws = [rng.randrange(256) for _ in range(1000)]
    return clusters, topics, draws


def test_seed_has_1000_requests(seed):
    assert len(seed) == 1000
    assert [r.request_id for r in seed[:3]] == ["seed-0000", "seed-0001", "seed-0002"]
    assert len({r.request_id for r in seed}) == 1000


def test_seed_is_deterministic(seed):
    assert seed_workload() == seed


def test_seed_matches_readme_recipe(seed, data_dir):
    clusters, topics, draws = _readme_recipe(data_dir)
    for i in (0, 1, 7, 123, 500, 999):
        k = draws[i]
        p, v = k // 4, k % 4
        expected = [
            {"role": "system", "content": topics[p // 8]},
            {"role": "user", "content": clusters[p]["questions"][v]},
        ]
        req = seed[i]
        assert req.as_messages() == expected
        assert req.prompt_key == f"p{p}v{v}"
        assert req.group == f"topic-{p // 8}"


def test_seed_system_prompt_is_topics(seed, data_dir):
    _, topics, _ = _readme_recipe(data_dir)
    for r in seed:
        msgs = r.as_messages()
        assert [m["role"] for m in msgs] == ["system", "user"]
        topic = int(r.group.removeprefix("topic-"))
        assert 0 <= topic < 8
        assert msgs[0]["content"] == topics[topic]
        p = int(r.prompt_key[1:].split("v")[0])
        assert p // 8 == topic


def test_seed_pairs_and_repeats(seed, data_dir):
    clusters, _, _ = _readme_recipe(data_dir)
    # 64 prompts x 4 variants are available.
    assert len(clusters) == 64
    assert all(len(c["questions"]) >= 4 for c in clusters)
    available = {(p, v) for p in range(64) for v in range(4)}
    assert len(available) == 256

    keys = [r.prompt_key for r in seed]
    distinct = len(set(keys))
    assert 200 <= distinct <= 256
    seen: set[str] = set()
    repeats = 0
    for key in keys:
        if key in seen:
            repeats += 1
        seen.add(key)
    assert repeats == 1000 - distinct
    assert 700 <= repeats <= 800  # "about 750"
    # Same key means the exact same request.
    by_key: dict[str, list[dict]] = {}
    for r in seed:
        assert by_key.setdefault(r.prompt_key, r.as_messages()) == r.as_messages()


def test_limit_is_prefix(seed):
    assert seed_workload(10) == seed[:10]
    assert load_workload("seed", limit=37) == seed[:37]
    assert load_workload("seed") == seed
    full_doc = load_workload("doc-qa")
    assert load_workload("doc_qa", limit=5) == full_doc[:5]
    with pytest.raises(ValueError):
        load_workload("seed", limit=0)


def test_as_messages_is_a_copy(seed):
    msgs = seed[0].as_messages()
    msgs[1]["content"] = "changed"
    msgs.append({"role": "user", "content": "x"})
    assert seed[0].messages[1]["content"] != "changed"
    assert len(seed[0].messages) == 2


def test_doc_qa_shares_passage(data_dir):
    reqs = doc_qa_workload()
    with open(data_dir / "doc_qa.jsonl", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh][:40]
    assert len(reqs) == sum(len(r["questions"]) for r in rows)
    assert [r.group for r in reqs][0] == rows[0]["doc_id"]
    by_doc: dict[str, list[Request]] = {}
    for r in reqs:
        by_doc.setdefault(r.group, []).append(r)
    assert list(by_doc) == [r["doc_id"] for r in rows]
    for row in rows:
        group = by_doc[row["doc_id"]]
        assert len(group) == len(row["questions"]) >= 2
        prefix = f"Passage ({row['title']}):\n{row['context']}\n\nQuestion: "
        for j, (req, q) in enumerate(zip(group, row["questions"])):
            msgs = req.as_messages()
            assert msgs[0] == {"role": "system", "content": DOC_QA_SYSTEM_PROMPT}
            assert msgs[1]["content"] == prefix + q
            assert req.prompt_key == f"{row['doc_id']}#q{j}"


def test_empty_env_dir_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESYNC_WORKLOADS", str(tmp_path))
    with pytest.raises(WorkloadDataError) as exc:
        seed_workload()
    assert str(tmp_path) in str(exc.value)
    assert "EDGESYNC_WORKLOADS" in str(exc.value)
    with pytest.raises(WorkloadDataError) as exc:
        load_workload("doc-qa")
    assert str(tmp_path) in str(exc.value)


def test_missing_env_dir_raises(tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    monkeypatch.setenv("EDGESYNC_WORKLOADS", str(missing))
    with pytest.raises(WorkloadDataError) as exc:
        workloads_dir()
    assert str(missing) in str(exc.value)


def test_malformed_line_raises(tmp_path, data_dir):
    shutil.copy(data_dir / "system_prompts.json", tmp_path / "system_prompts.json")
    with open(data_dir / "qqp_clusters.jsonl", encoding="utf-8") as fh:
        lines = fh.readlines()
    lines[4] = '{"cluster_id": 4, "questions": ["broken"\n'
    (tmp_path / "qqp_clusters.jsonl").write_text("".join(lines), encoding="utf-8")
    with pytest.raises(WorkloadDataError) as exc:
        seed_workload(data_dir=tmp_path)
    msg = str(exc.value)
    assert "qqp_clusters.jsonl" in msg
    assert "line 5" in msg


def test_unknown_name_raises():
    with pytest.raises(ValueError) as exc:
        load_workload("nope")
    for name in WORKLOAD_NAMES:
        assert name in str(exc.value)


def test_default_directory_is_found_beside_the_project_from_any_working_directory(monkeypatch, tmp_path):
    """With no explicit directory and no EDGESYNC_WORKLOADS, the data beside the checkout
    (``<project root>/../shared/workloads``) is found whatever the working directory is."""
    from edgesync_bench.workloads import checkout_workloads_dir, workloads_dir

    beside = Path(__file__).resolve().parents[2].parent / "shared" / "workloads"
    monkeypatch.delenv("EDGESYNC_WORKLOADS", raising=False)
    monkeypatch.chdir(tmp_path)
    assert checkout_workloads_dir().resolve() == beside.resolve()
    if beside.is_dir():
        assert workloads_dir() == beside.resolve()
    else:  # a clone elsewhere (its data given by EDGESYNC_WORKLOADS): the error names the tried path
        with pytest.raises(WorkloadDataError, match="EDGESYNC_WORKLOADS") as exc:
            workloads_dir()
        assert str(beside) in str(exc.value)


def test_outside_a_checkout_only_the_setting_finds_the_data(monkeypatch, tmp_path):
    """Installed (no ``pyproject.toml`` and ``edgesync_store/`` beside the package's folder), there
    is no default directory: one line names EDGESYNC_WORKLOADS; the setting still works."""
    from edgesync_bench import workloads

    monkeypatch.delenv("EDGESYNC_WORKLOADS", raising=False)
    monkeypatch.setattr(workloads, "__file__", str(tmp_path / "site-packages" / "edgesync_bench" / "workloads.py"))
    assert workloads.checkout_workloads_dir() is None
    with pytest.raises(WorkloadDataError) as exc:
        workloads_dir()
    message = str(exc.value)
    assert "\n" not in message and "EDGESYNC_WORKLOADS is not set and this is not a checkout" in message
    monkeypatch.setenv("EDGESYNC_WORKLOADS", str(tmp_path))
    assert workloads_dir() == tmp_path
