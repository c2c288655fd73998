"""The page check of a store (``edgesync_store/core/check.py``, run in a child by
``core/page_check.py``): real stores, bytes changed with LMDB's page layout (``mdb.c``:
``MDB_meta``, ``MDB_page``, ``MDB_node``), each found damaged by a child process; the store
then opens as damaged (uncached) and ``edgesync clear --yes`` brings back a working one. Every
open of a damaged store runs in a child, so that a miss could not take pytest down."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import edgesync as run_cli
from test_store import REPO, make_fragment, run_py

from edgesync_store.core import check as pages
from edgesync_store.core import page_check as check
from edgesync_store.core.check import P_BRANCH, P_LEAF, P_OVERFLOW, PAGEHDRSZ, check_file
from edgesync_store.core.store import FragmentStore

PSIZE = 4096
MAIN_ROOT = PAGEHDRSZ + 24 + 48 + 40  # MDB_meta: magic..mapsize (24), mm_dbs[FREE] (48), md_root in mm_dbs[MAIN]


@pytest.fixture(scope="module")
def made_store(tmp_path_factory) -> Path:
    """A real store: 300 fragments (overflow values), sharing prefixes (duplicates in
    ``by_prefix``), enough records for branch pages in ``heads``."""
    path = tmp_path_factory.mktemp("check") / "store"
    with FragmentStore(path) as s:
        for i in range(300):
            s.put(make_fragment(seed=i, end=128, start=0 if i % 2 else 64, layers=(0, 30, 10)))
    return path


@pytest.fixture
def store(made_store, tmp_path) -> Path:
    """A copy of :func:`made_store` for one test to damage."""
    return Path(shutil.copytree(made_store, tmp_path / "store"))


def _check_child(path: Path) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "edgesync_store.commands.page_check", str(path), "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    return proc.returncode, json.loads(proc.stdout)


def _poke(path: Path, offset: int, data: bytes) -> None:
    with open(path / "data.mdb", "r+b") as f:
        f.seek(offset)
        f.write(data)


def _page(runs, flags: int, db: str) -> int:
    return next(first for first, _n, name, fl in runs if fl & flags and name == db)


def test_a_healthy_store_is_healthy_and_matches_lmdb_own_counts(store):
    report = check_file(store / "data.mdb")
    assert report.healthy, report.damage
    assert set(report.databases) >= {"fragments", "heads", "by_prefix", "lifecycle", "meta"}
    import lmdb

    env = lmdb.open(str(store), readonly=True, max_dbs=16, lock=False)
    try:
        with env.begin() as txn:
            total = 0
            for name in report.databases:
                st = txn.stat(env.open_db(name.encode(), txn=txn, create=False))
                total += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
            main = txn.stat()
        assert report.txnid == env.info()["last_txnid"]
    finally:
        env.close()
    by_db = {}
    for _first, n, name, _fl in report.runs:
        by_db[name] = by_db.get(name, 0) + n
    assert sum(by_db[name] for name in report.databases) == total
    assert by_db["(main)"] == main["branch_pages"] + main["leaf_pages"] + main["overflow_pages"]
    assert _check_child(store) == (0, report.to_dict() | {"damage": None})


def _meta_root(path: Path, runs) -> int:
    """The offset of the main database's root in the meta page LMDB uses (larger txnid)."""
    raw = (path / "data.mdb").read_bytes()[:2 * PSIZE]
    txn = [struct.unpack_from("<Q", raw, i * PSIZE + MAIN_ROOT + 16)[0] for i in (0, 1)]
    return (1 if txn[1] > txn[0] else 0) * PSIZE + MAIN_ROOT


def _damage(path: Path, where: str) -> str:
    """Change ``data.mdb`` at ``where``; returns the word the check's message must hold."""
    runs = check_file(path / "data.mdb").runs
    if where == "meta root":  # the main database's root page number: a page that is no tree's root
        _poke(path, _meta_root(path, runs), struct.pack("<Q", _page(runs, P_OVERFLOW, "fragments") + 1))
        return "(main)"
    if where == "meta magic":
        _poke(path, PAGEHDRSZ, b"\x00")
        return "meta page 0"
    if where == "branch child":  # the first child's page number (mn_lo, mn_hi) far beyond the file
        pg = _page(runs, P_BRANCH, "heads")
        first = struct.unpack_from("<H", (path / "data.mdb").read_bytes(), pg * PSIZE + PAGEHDRSZ)[0]
        _poke(path, pg * PSIZE + first, b"\xff\xff\x7f\x00")
        return "heads"
    if where == "leaf key size":  # a node's mn_ksize past the page's end
        pg = _page(runs, P_LEAF, "lifecycle")
        first = struct.unpack_from("<H", (path / "data.mdb").read_bytes(), pg * PSIZE + PAGEHDRSZ)[0]
        _poke(path, pg * PSIZE + first + 6, b"\xf0\x3f")
        return f"lifecycle, page {pg}"
    if where == "leaf order":  # a key's first byte: keys out of order, or the count no longer adds up
        pg = _page(runs, P_LEAF, "fragments")
        first = struct.unpack_from("<H", (path / "data.mdb").read_bytes(), pg * PSIZE + PAGEHDRSZ)[0]
        _poke(path, pg * PSIZE + first + 8, b"\xff")
        return "fragments"
    if where == "overflow header":  # the run's page count (mp_pages) shorter than its value
        pg = _page(runs, P_OVERFLOW, "fragments")
        _poke(path, pg * PSIZE + 12, struct.pack("<I", 1))
        return f"overflow page {pg}"
    raise AssertionError(where)


_OPEN = """
import sys, json
sys.path.insert(0, "tests")
from edgesync_store.core.store import FragmentStore
from edgesync_store.errors import StoreDamagedError
try:
    FragmentStore(sys.argv[1]).close()
    print(json.dumps({"opened": True}))
except StoreDamagedError as exc:
    print(json.dumps({"opened": False, "error": str(exc)}))
"""

_USE = """
import sys
sys.path.insert(0, "tests")
import test_store as T
from edgesync_store.core.store import FragmentStore
frag = T.make_fragment(seed=7, end=128)
with FragmentStore(sys.argv[1]) as s:
    assert s.fragment_count() == 0
    s.put(frag)
    T.assert_same(s.get(frag.key()), frag)
print("ok")
"""


@pytest.mark.parametrize("where", ["meta root", "meta magic", "branch child", "leaf key size", "leaf order",
                                   "overflow header"])
def test_damaged_pages_are_found_refused_and_cleared(store, where):
    expected = _damage(store, where)
    code, report = _check_child(store)
    assert code == 1 and not report["healthy"], report
    assert expected in report["damage"]
    opened = json.loads(run_py(_OPEN, store).strip().splitlines()[-1])  # a child: LMDB may touch the pages
    assert opened["opened"] is False
    assert f"edgesync clear {store} --yes" in opened["error"]
    cli = run_cli("check", str(store))
    assert cli.returncode == 1 and "damaged" in cli.stdout and expected in cli.stdout
    compact = subprocess.run([sys.executable, "-m", "edgesync_store.compact", str(store)], capture_output=True,
                             text=True, cwd=REPO, timeout=120)
    assert compact.returncode == 1 and "not compacting a damaged store" in compact.stderr
    cleared = run_cli("clear", str(store), "--yes")
    assert cleared.returncode == 0, cleared.stderr
    assert run_py(_USE, store).strip() == "ok"
    assert _check_child(store)[0] == 0


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_data_file_that_is_not_a_file_is_damaged_and_cleared(store, kind):
    """A data.mdb replaced by a directory or a FIFO (which would block a read) in a store
    directory: damaged (exit 1), and clear recreates the store."""
    data = store / "data.mdb"
    data.unlink()
    data.mkdir() if kind == "directory" else os.mkfifo(data)
    cli = run_cli("check", str(store))
    assert cli.returncode == 1 and "data.mdb is not a regular file" in cli.stdout
    cleared = run_cli("clear", str(store), "--yes")
    assert cleared.returncode == 0, cleared.stderr
    assert data.is_file() and _check_child(store)[0] == 0


def test_check_commands_on_a_healthy_store(store):
    cli = run_cli("check", str(store), "--json")
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["healthy"] is True
    compact = subprocess.run([sys.executable, "-m", "edgesync_store.compact", str(store), "--check"],
                             capture_output=True, text=True, cwd=REPO, timeout=120)
    assert compact.returncode == 0 and "healthy" in compact.stdout
    missing = run_cli("check", str(store / "nothing"))
    assert missing.returncode == 2 and "no EdgeSync store" in missing.stderr


def test_a_foreign_data_file_is_no_store_and_every_command_leaves_it_as_it_was(tmp_path):
    """A directory whose data.mdb is not LMDB and that was never opened as a store (no
    pins.lock): check says it is no store instead of advising a clear that would be refused,
    and no command adds a file beside it."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.mdb").write_bytes(b"not an LMDB file, someone's data\n" * 300)
    for args in (("check", str(foreign)), ("docs", "list", "--store", str(foreign))):
        out = run_cli(*args)
        assert out.returncode == 2 and "no EdgeSync store" in out.stderr and "clear" not in out.stderr, out.stderr
    for command in (("clear", "--yes"), ("dump",), ("compact",)):
        out = run_cli(*command[:1], str(foreign), *command[1:])
        assert out.returncode == 2 and "not an LMDB file" in out.stderr, (command, out.stderr)
    assert sorted(p.name for p in foreign.iterdir()) == ["data.mdb"]


def test_a_child_killed_by_a_signal_means_damaged(store, monkeypatch):
    """The child is replaced by one that dies of SIGSEGV: the verdict is damaged, naming it."""
    monkeypatch.setattr(check.sys, "executable", str(_killer(store.parent)))
    report = check.PendingCheck(store).result()
    assert not report.healthy and "SIGSEGV" in report.damage


@pytest.mark.parametrize("stop", ["INT", "TERM", "HUP"])
def test_a_child_stopped_on_request_is_no_damage_and_the_check_runs_again(store, monkeypatch, stop):
    """The first child dies of SIGINT, SIGTERM or SIGHUP (a stand-in that signals itself, then
    runs the real check the second time): that says nothing of the file, so the check runs
    again and passes. The child is in a session of its own: a Ctrl-C at the terminal, sent to
    the caller's process group, never reaches it."""
    marker = store.parent / "stopped-once"
    script = store.parent / "stop-once.py"
    # Python, not sh: a shell cannot undo a signal its runner ignored (a job started with &)
    script.write_text(f"#!{sys.executable}\nimport os, signal, sys\n"
                      f"if not os.path.exists({str(marker)!r}):\n"
                      f"    open({str(marker)!r}, 'w').close()\n"
                      f"    signal.signal(signal.SIG{stop}, signal.SIG_DFL)\n"
                      f"    os.kill(os.getpid(), signal.SIG{stop})\n"
                      f"os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n")
    script.chmod(0o755)
    monkeypatch.setattr(check.sys, "executable", str(script))
    pending = check.PendingCheck(store)
    assert os.getsid(pending.pid) != os.getsid(0)
    report = pending.result()
    assert marker.exists() and report.healthy, report.damage


def _killer(directory: Path) -> Path:
    script = directory / "segv.sh"
    script.write_text("#!/bin/sh\nkill -SEGV $$\n")
    script.chmod(0o755)
    return script


def test_a_passed_check_is_remembered_until_the_file_changes(store):
    assert check.verify(store).healthy
    state = check.PendingCheck  # a second verify of the same file state runs no child
    try:
        check.PendingCheck = None  # type: ignore[assignment,misc]
        assert check.verify(store).healthy
    finally:
        check.PendingCheck = state
    _damage(store, "overflow header")
    assert not check.verify(store).healthy


def test_loops_and_shared_pages_are_damage(store):
    """A branch whose child is itself, and a leaf reached from two branches: refused, not looped."""
    runs = check_file(store / "data.mdb").runs
    pg = _page(runs, P_BRANCH, "heads")
    raw = (store / "data.mdb").read_bytes()
    first = struct.unpack_from("<H", raw, pg * PSIZE + PAGEHDRSZ)[0]
    _poke(store, pg * PSIZE + first, struct.pack("<HH", pg & 0xFFFF, pg >> 16))
    report = pages.check_file(store / "data.mdb")
    assert not report.healthy and "heads" in report.damage


def _answer(store: Path, requests: Path) -> tuple[list[dict], str]:
    """``proc_request.py`` in a child: its JSON rows and its stderr (where the warning goes)."""
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "proc_request.py"), str(store), str(requests), "16"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")], proc.stderr


@pytest.fixture(scope="module")
def answered_store(system_prompts, tmp_path_factory) -> tuple[Path, Path, dict]:
    """A real store (a SmolLM2 answer's KV, plus synthetic fragments for branch pages) whose
    prompt a second child then hit; the requests file; and the first child's answer, a miss on
    a new store (prefilled: the uncached reference)."""
    from llama_counts import chat

    base = tmp_path_factory.mktemp("answered")
    requests = base / "requests.json"
    requests.write_text(json.dumps([chat(system_prompts[2], "How do I export my data?")]))
    store = base / "store"
    (reference,), _ = _answer(store, requests)
    assert reference["hit"] == "miss" and reference["tokens_reused"] == 0
    with FragmentStore(store) as s:
        for i in range(300):
            s.put(make_fragment(seed=i, end=128, start=0 if i % 2 else 64, layers=(0, 30, 10)))
    (hit,), _ = _answer(store, requests)
    assert hit["tokens"] == reference["tokens"] and hit["tokens_reused"] > 0
    return store, requests, reference


@pytest.mark.model
@pytest.mark.parametrize("where", ["meta root", "branch child", "leaf key size", "overflow header"])
def test_a_request_on_a_damaged_store_is_answered_uncached_by_a_child(answered_store, tmp_path, where):
    """A copy of :func:`answered_store` damaged at ``where``: a child process answers with the
    uncached run's tokens and one warning naming ``edgesync clear``; after the clear, the
    prompt is stored and reused again."""
    pristine, requests, reference = answered_store
    store = Path(shutil.copytree(pristine, tmp_path / "store"))
    _damage(store, where)
    (got,), err = _answer(store, requests)
    assert got["tokens"] == reference["tokens"] and got["tokens_reused"] == 0
    assert "damaged, serving uncached" in err and f"edgesync clear {store} --yes" in err
    assert run_cli("clear", str(store), "--yes").returncode == 0
    _answer(store, requests)
    (again,), _ = _answer(store, requests)
    assert again["tokens"] == reference["tokens"] and again["tokens_reused"] > 0


def test_docs_add_refuses_a_damaged_store_by_name(store, tmp_path):
    _damage(store, "leaf key size")
    notes = tmp_path / "note.txt"
    notes.write_text("The office is closed on Mondays.")
    before = (store / "data.mdb").read_bytes()
    refused = run_cli("docs", "add", str(notes), "--store", str(store))
    assert refused.returncode == 2, refused.stderr
    assert "not writing into a damaged store" in refused.stderr and f"edgesync clear {store} --yes" in refused.stderr
    assert (store / "data.mdb").read_bytes() == before
