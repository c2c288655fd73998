"""``edgesync_store.commands.clear.clear_store`` and ``edgesync clear``, on real LMDB stores in temp dirs.

No mocks: real fragments, donor records, vectors and a real hnswlib sidecar; the other process
that holds the store open is a real subprocess; the command runs as a subprocess.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from test_store import make_fragment  # noqa: E402  (tests/test_store.py)
from unreadable_store import BECOME_NOBODY, run_on_unreadable_store

from edgesync_store.commands.clear import clear_store
from edgesync_store.commands.inventory import StoreNotFoundError
from edgesync_store.core.locks import OPEN_LOCK_NAME, PINS_LOCK_NAME, OpenLock
from edgesync_store.core.store import FragmentStore, StoreOpenError, default_max_bytes
from edgesync_store.errors import StoreBusyError, StoreDamagedError
from edgesync_store.semantic import donors
from edgesync_store.semantic.index import SIDECAR_HNSW, SIDECAR_JSON, SIDECAR_LOCK, SemanticIndex
from edgesync_store.semantic.vectors import VectorTable

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
BUDGET = 48 * MiB
SECRET = "clear-test donor prompt text 7f3a9c"
"""Donor text written into the store: after a real erase its bytes must be gone from data.mdb."""
N = 3


def _env() -> dict[str, str]:
    return dict(os.environ)


@pytest.fixture
def full_store(tmp_path):
    """A closed store with N fragments, their donor records (text SECRET), vectors and the
    semantic sidecar files, and the budget BUDGET recorded. Returns its path."""
    path = tmp_path / "store"
    frags = [make_fragment(seed=i) for i in range(N)]
    with FragmentStore(path, max_bytes=BUDGET) as store:
        assert store.put_many(frags) == N
        for f in frags:
            donors.put_donor(store, f.key(), f.namespace.digest(), f.token_ids, text=SECRET)
        vecs = np.random.default_rng(0).standard_normal((N, 384)).astype(np.float32)
        index = SemanticIndex(store, "test/random-unit-vectors", dim=384)
        index.add_many([f.key() for f in frags], vecs)
        index.save()
        index.close()
    assert (path / SIDECAR_HNSW).exists() and (path / SIDECAR_JSON).exists()
    assert SECRET.encode() in (path / "data.mdb").read_bytes()
    return path


def _assert_empty(path: Path) -> None:
    with FragmentStore(path) as store:
        assert store.stats().fragments == 0
        assert store.used_bytes() == 0
        assert list(store.iterate_lifecycle()) == []
        assert list(donors.iterate_donors(store)) == []
        assert VectorTable(store, dim=384).count() == 0
        assert store.max_bytes == BUDGET  # the budget survives


def test_clear_erases_files_and_the_store_takes_new_fragments(full_store):
    path = full_store
    before = (path / "data.mdb").stat().st_size
    result = clear_store(path)

    assert result.erased_files is True
    assert result.fragments_removed == N
    assert result.bytes_before == before
    assert result.bytes_after == (path / "data.mdb").stat().st_size < before
    assert set(result.files_removed) == {"data.mdb", "lock.mdb", SIDECAR_HNSW, SIDECAR_JSON}
    assert not (path / SIDECAR_HNSW).exists() and not (path / SIDECAR_JSON).exists()
    for name in (SIDECAR_LOCK, OPEN_LOCK_NAME, PINS_LOCK_NAME):
        assert (path / name).exists(), name  # lock files stay
    assert SECRET.encode() not in (path / "data.mdb").read_bytes()  # the old bytes are gone
    _assert_empty(path)

    new = make_fragment(seed=99)
    with FragmentStore(path) as store:
        assert store.put(new)
        match = store.prefix_walk(new.namespace, new.token_ids)
        assert match.matched_tokens == new.span and store.used_bytes() > 0


def test_clear_falls_back_to_drop_all_while_another_process_has_it_open(full_store):
    path = full_store
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from edgesync_store.core.store import FragmentStore
            s = FragmentStore({str(path)!r})
            print("open", flush=True)
            sys.stdin.read()  # until the test closes our stdin
            print(s.stats().fragments, flush=True)
            s.close()
        """)],
        cwd=ROOT, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open", holder.stderr.read()
        sidecar = (path / SIDECAR_HNSW).read_bytes()
        result = clear_store(path)
        assert result.erased_files is False
        assert "another process has the store open" in result.reason
        assert result.fragments_removed == N
        assert result.files_removed == []
        assert (path / SIDECAR_HNSW).read_bytes() == sidecar  # nothing else removed
        _assert_empty(path)
        out, err = holder.communicate("", timeout=60)
        assert holder.returncode == 0, err
        assert out.strip() == "0"  # the other process sees the store empty too
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_clear_refuses_paths_without_a_store(tmp_path):
    missing = tmp_path / "absent"
    with pytest.raises(StoreNotFoundError, match="no store at"):
        clear_store(missing)
    assert not missing.exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(StoreOpenError, match="no EdgeSync store"):
        clear_store(foreign)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    with pytest.raises(StoreOpenError, match="not a directory"):
        clear_store(foreign / "notes.txt")


@pytest.mark.parametrize("damage", ["truncated", "meta pages"])
def test_clear_recreates_a_damaged_store_unless_another_process_has_it_open(full_store, damage):
    """A truncated data.mdb, or one whose LMDB meta pages are overwritten, cannot be opened;
    clear removes the files and creates an empty store (the recorded budget was in the lost
    pages: the default one) when no other process holds the store's open lock, and refuses,
    removing nothing, while one does."""
    path = full_store
    data = (path / "data.mdb").read_bytes()
    if damage == "truncated":
        damaged = data[: len(data) // 3]
    else:
        damaged = b"\xff" * (2 * mmap.PAGESIZE) + data[2 * mmap.PAGESIZE:]
    (path / "data.mdb").write_bytes(damaged)
    with pytest.raises(StoreDamagedError):
        FragmentStore(path)
    holder = OpenLock(path)  # another open file description: flock(2) locks conflict as between processes
    try:
        with pytest.raises(StoreBusyError, match=f"{damage}.*another process has it open"):
            clear_store(path)
        assert (path / "data.mdb").read_bytes() == damaged and (path / SIDECAR_HNSW).exists()
    finally:
        holder.close()
    result = clear_store(path)
    assert result.erased_files is True and "damaged" in result.reason
    assert result.bytes_before == len(damaged) and result.fragments_removed == 0
    assert result.files_removed == [SIDECAR_HNSW, SIDECAR_JSON, "data.mdb", "lock.mdb"]
    assert SECRET.encode() not in (path / "data.mdb").read_bytes()
    with FragmentStore(path) as store:
        assert store.stats().fragments == 0 and store.max_bytes == store.recorded_max_bytes()
        assert store.max_bytes == pytest.approx(default_max_bytes(path), rel=0.01)  # the default (free space moves)
        assert store.put_many([make_fragment(seed=9)]) == 1


def _clear_cmd(*args: str, stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgesync_engines.app.cli", "clear", *args],
                          capture_output=True, text=True, cwd=ROOT, env=_env(), stdin=stdin, timeout=120)


def test_clear_command(full_store, tmp_path):
    path = full_store
    refused = _clear_cmd(str(path))  # stdin is not a terminal and no --yes
    assert refused.returncode == 2 and refused.stdout == ""
    assert (
        refused.stderr.strip()
        == f"error: refusing to clear {path} without --yes (stdin is not a terminal to confirm on)"
    )
    with FragmentStore(path, readonly=True) as store:
        assert store.stats().fragments == N  # untouched

    before = (path / "data.mdb").stat().st_size
    done = _clear_cmd(str(path), "--yes", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["fragments_removed"] == N and doc["erased_files"] is True
    assert doc["bytes_before"] == before and doc["bytes_after"] == (path / "data.mdb").stat().st_size < before
    _assert_empty(path)

    missing = tmp_path / "absent"
    gone = _clear_cmd(str(missing), "--yes")
    assert gone.returncode == 2 and gone.stderr.strip() == f"error: no store at {missing}"
    assert not missing.exists()

    a_file = tmp_path / "file"
    a_file.write_text("x")
    bad = _clear_cmd(str(a_file), "--yes")
    assert bad.returncode == 2 and bad.stderr.strip() == f"error: store path {a_file}: exists and is not a directory"


@pytest.mark.parametrize("answer, code, left", [("n", 1, N), ("y", 0, 0)])
def test_clear_command_asks_on_a_terminal(full_store, answer, code, left):
    path = full_store
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "edgesync_engines.app.cli", "clear", str(path)],
                                cwd=ROOT, env=_env(), stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        os.write(master, f"{answer}\n".encode())
        out, err = proc.communicate(timeout=120)
    finally:
        os.close(slave)
        os.close(master)
    assert proc.returncode == code, err
    assert "Erase every fragment, donor and vector of the store at" in err
    with FragmentStore(path, readonly=True) as store:
        assert store.stats().fragments == left
    if code == 0:
        assert out.startswith(f"cleared {path}: {N} fragments removed;") and "files erased" in out
    else:
        assert out == "" and f"not cleared: {path} left as it was" in err


_CLEAR_AS_ANOTHER_USER = """
import sys
from edgesync_store.commands.clear import clear_store
from edgesync_store.errors import StoreOpenError
""" + BECOME_NOBODY + """
try:
    clear_store(sys.argv[1])
except StoreOpenError as exc:
    print(exc)
"""


@pytest.mark.parametrize("closed", ["store", "parent"])
def test_clear_refuses_a_store_directory_it_cannot_read_by_name(closed):
    """A store directory without read permission, or inside a directory we may not enter:
    refused as unreadable, not as 'no store', and nothing is removed (the store was not
    cleared: clear_store raised)."""
    path, child = run_on_unreadable_store(closed, _CLEAR_AS_ANOTHER_USER)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == f"store path {path}: cannot be read (permission denied)"


def test_clear_remote_without_redis_is_refused_before_anything_is_erased(full_store):
    """A core install has no redis-py: ``clear --remote`` names the ``remote`` extra and erases
    nothing. (The missing package is simulated in the child: ``sys.modules["redis"] = None``.)"""
    code = ("import sys; sys.modules['redis'] = None\n"
            "from edgesync_engines.app.cli import main\n"
            f"raise SystemExit(main(['clear', {str(full_store)!r}, '--yes', '--remote']))")
    env = {**_env(), "EDGESYNC_REMOTE_URL": "redis://127.0.0.1:9/0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "'remote' extra" in proc.stderr and "Traceback" not in proc.stderr
    with FragmentStore(full_store, readonly=True) as store:
        assert store.stats().fragments == N
