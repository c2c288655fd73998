"""``edgesync docs add|list|remove`` on the real model (SmolLM2 through llama.cpp) and real LMDB
stores in temp dirs, run through the real entry point (``cli.main`` in this process, and once
as a subprocess). No mocks.

The documents are rows 0-3 of the shared ``doc_qa.jsonl`` (SQuAD passages, 153-296 tokens each:
every one has at least one fragment), written as they are to a small JSON Lines file. One store
is shared by the module: the model load and the four documents' prefill dominate the time.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgesync_engines.app import cli
from edgesync_store.core.store import FragmentStore

ROOT = Path(__file__).resolve().parents[1]
ROWS = 4


def run(*args: str) -> tuple[int, str, str]:
    """``edgesync ARGS`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(list(args))
    return status, out.getvalue(), err.getvalue()


def run_json(*args: str) -> dict:
    status, out, err = run(*args, "--json")
    assert status == 0, err
    return json.loads(out)


def store_totals(path: Path) -> tuple[int, int]:
    """(fragments, stored bytes) of the store at ``path``, read-only."""
    with FragmentStore(path, readonly=True) as store:
        stats = store.stats()
    return stats.fragments, stats.compressed_bytes


@pytest.fixture(scope="module")
def rows(data_dir) -> list[dict]:
    """Rows 0-3 of doc_qa.jsonl, as parsed JSON objects."""
    with open(data_dir / "doc_qa.jsonl", encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(ROWS)]


@pytest.fixture(scope="module")
def added(tmp_path_factory, rows):
    """A store with rows 0-3 added by ``docs add FILE.jsonl --json``; yields (store, jsonl, report)."""
    tmp = tmp_path_factory.mktemp("docs")
    jsonl, store = tmp / "four.jsonl", tmp / "store"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    report = run_json("docs", "add", str(jsonl), "--store", str(store))
    return store, jsonl, report


@pytest.mark.model
def test_add_stores_each_document_with_its_tokens(added, rows, adapter):
    store, _, report = added
    assert (report["added"], report["already_stored"], report["duplicates"]) == (ROWS, 0, 0)
    want = [len(adapter.tokenize(r["context"], add_bos=False, special=False)) for r in rows]
    assert [d["tokens"] for d in report["documents"]] == want
    assert report["tokens"] == sum(want)
    assert [(d["title"], d["source"], d["status"]) for d in report["documents"]] == \
        [(r["title"], r["doc_id"], "added") for r in rows]
    fragments, nbytes = store_totals(store)
    assert report["fragments_written"] == fragments > 0 and report["bytes_written"] == nbytes > 0

    listed = run_json("docs", "list", "--store", str(store))
    assert listed["count"] == ROWS
    by_source = {d["source"]: d for d in listed["documents"]}
    assert {s: d["tokens"] for s, d in by_source.items()} == {r["doc_id"]: n for r, n in zip(rows, want)}
    assert all(d["kv_stored"] is True and d["windows"] >= 1 for d in listed["documents"])
    assert {d["id"] for d in listed["documents"]} == {d["id"] for d in report["documents"]}

    status, table, _ = run("docs", "list", "--store", str(store))
    assert status == 0
    for doc in listed["documents"]:
        line = next(line for line in table.splitlines() if doc["id"][:12] in line)
        assert doc["id"][:13] not in line and f" {doc['tokens']} " in line and " yes " in line


@pytest.mark.model
def test_second_add_computes_nothing(added):
    store, jsonl, _ = added
    before = store_totals(store)
    report = run_json("docs", "add", str(jsonl), str(jsonl), "--store", str(store))  # the file twice
    assert (report["added"], report["already_stored"], report["duplicates"], report["tokens"]) == (0, ROWS, ROWS, 0)
    assert (report["fragments_written"], report["bytes_written"]) == (0, 0)
    assert store_totals(store) == before
    assert {d["status"] for d in report["documents"]} == {"stored"}


@pytest.mark.model
def test_bad_input_refuses_before_any_kv(added, rows, tmp_path, adapter):
    store, _, _ = added
    before = store_totals(store)
    cases = []
    missing = tmp_path / "absent.jsonl"
    cases.append(((str(missing),), f"error: {missing}: no such file or directory"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n\n{\"text\": oops}\n", encoding="utf-8")
    cases.append(((str(bad),), f"error: {bad}:3: not valid JSON (Expecting value at column 10)"))
    empty = tmp_path / "empty_text.jsonl"
    empty.write_text(json.dumps({"context": "  ", "title": "x"}) + "\n", encoding="utf-8")
    cases.append(((str(empty),), f"error: {empty}:1: the text is empty"))
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text(json.dumps({"title": "x"}) + "\n", encoding="utf-8")
    cases.append(((str(no_text),), f"error: {no_text}:1: the object has no string \"text\" or \"context\""))
    other = tmp_path / "notes.csv"
    other.write_text("a,b\n", encoding="utf-8")
    cases.append(((str(other),), f"error: {other}: expected a .jsonl file, a .txt or .md file, or a directory"))
    for paths, message in cases:
        status, out, err = run("docs", "add", *paths, "--store", str(store))
        assert (status, out, err.strip()) == (2, "", message), paths

    # a document longer than the context (4,096 tokens) on line 2, after a new valid one on line 1:
    # neither is stored
    long_doc = tmp_path / "long.jsonl"
    new_row = {"text": "A note that was never stored before. " * 20, "title": "new"}
    long_text = "word " * 5000
    long_doc.write_text(json.dumps(new_row) + "\n" + json.dumps({"text": long_text}) + "\n", encoding="utf-8")
    n_long = len(adapter.tokenize(long_text, add_bos=False, special=False))
    status, out, err = run("docs", "add", str(long_doc), "--store", str(store))
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: {long_doc}:2: {n_long} tokens do not fit the context of {adapter.n_ctx} tokens")
    assert store_totals(store) == before
    assert run_json("docs", "list", "--store", str(store))["count"] == ROWS


@pytest.mark.model
def test_directory_reads_text_files_and_skips_bad_ones(tmp_path):
    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    (notes / "b.md").write_text("# Shopping\nMilk, bread and eggs.\n", encoding="utf-8")
    (notes / "sub" / "a.txt").write_text("The meeting moved to Thursday at ten.\n", encoding="utf-8")
    (notes / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (notes / "blank.md").write_text("\n  \n", encoding="utf-8")
    (notes / "ignored.rst").write_text("not a document\n", encoding="utf-8")
    store = tmp_path / "store"
    status, out, err = run("docs", "add", str(notes), "--store", str(store), "--json")
    assert status == 0, err
    report = json.loads(out)
    # sorted paths; short notes have no fragment (under 64 tokens) but are recorded and embedded
    assert [(d["title"], d["source"]) for d in report["documents"]] == [("b.md", "b.md"), ("a.txt", "sub/a.txt")]
    assert report["skipped"] == [{"path": str(notes / "blank.md"), "reason": "empty"},
                                 {"path": str(notes / "latin1.txt"), "reason": "not UTF-8 (byte 3)"}]
    assert f"skipped {notes / 'latin1.txt'}: not UTF-8 (byte 3)" in err
    listed = run_json("docs", "list", "--store", str(store))
    assert [d["kv_stored"] for d in listed["documents"]] == [None, None]

    status, _, err = run("docs", "add", str(tmp_path / "notes" / "sub" / "nothing"), "--store", str(store))
    assert status == 2 and "no such file or directory" in err


@pytest.mark.model
def test_remove_by_prefix_then_all(added, adapter):
    store, _, _ = added
    listed = run_json("docs", "list", "--store", str(store))["documents"]
    victim = listed[1]
    with FragmentStore(store, readonly=True) as fs:
        [namespace] = fs.namespaces()
        assert namespace == adapter.namespace
    record = _record_of(store, victim["id"])
    chain = record.chain  # the document's own tokens after the (default: empty) header
    assert chain[len(record.header):] == adapter.tokenize(record.text, add_bos=False, special=False)
    with FragmentStore(store, readonly=True) as fs:
        along = fs.keys_along(namespace, chain)
    assert along
    before = store_totals(store)

    status, out, err = run("docs", "remove", "0123456789abcdef", "--store", str(store))  # unknown
    assert (status, err.strip()) == (2, "error: no stored document 0123456789abcdef")
    status, _, err = run("docs", "remove", victim["id"][:7], "--store", str(store))
    assert status == 2 and "8 to 64 hex digits" in err
    status, _, err = run("docs", "remove", victim["id"][:8], "--all", "--store", str(store))
    assert (status, err.strip()) == (2, "error: docs remove: give document IDs or --all (not both)")
    assert store_totals(store) == before

    report = run_json("docs", "remove", victim["id"][:8], "--store", str(store))
    assert (report["removed"], report["ids"], report["remaining"]) == (1, [victim["id"]], ROWS - 1)
    assert report["fragments_removed"] == len(along)
    with FragmentStore(store, readonly=True) as fs:
        assert fs.keys_along(namespace, chain) == []
    assert store_totals(store)[0] == before[0] - len(along)
    left = run_json("docs", "list", "--store", str(store))["documents"]
    assert [d["id"] for d in left] == [d["id"] for d in listed if d["id"] != victim["id"]]

    # the real entry point, as a user runs it: --all empties the store of documents and fragments
    proc = subprocess.run([sys.executable, "-m", "edgesync_engines.app.cli", "docs", "remove", "--all",
                           "--store", str(store)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{store}: {ROWS - 1} documents removed (")
    assert run_json("docs", "list", "--store", str(store))["count"] == 0
    assert store_totals(store) == (0, 0)


def _record_of(store: Path, doc_id: str):
    """The stored record of document ``doc_id``."""
    from edgesync_store.documents.records import get_document

    with FragmentStore(store, readonly=True) as fs:
        return get_document(fs, bytes.fromhex(doc_id))


def test_list_and_remove_need_an_existing_store(tmp_path):
    missing = tmp_path / "nothing"
    for args in (("docs", "list"), ("docs", "remove", "--all")):
        status, out, err = run(*args, "--store", str(missing))
        assert (status, out, err.strip()) == (2, "", f"error: no store at {missing}")
    assert not missing.exists()
