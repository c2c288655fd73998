"""Tests for edgesync_store.core.store (FragmentStore on real LMDB in temp dirs) and
edgesync_engines.adapters.model_files (file fingerprints).

No mocks. Processes are real subprocesses; the only fault injection is a byte changed in a
stored blob or in its ``heads`` record through a raw LMDB environment (a fake for a corrupt page
on disk), or a blob copied under another fragment's key (a fake for a misfiled page). Log records of the
``edgesync_store`` loggers are counted to show which recovery path (map growth, another
process's resize) really ran.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import stat
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import lmdb
import numpy as np
import pytest

from edgesync_engines.adapters import model_files as fingerprint
from edgesync_store.core import codec
from edgesync_store.core.store import STORE_FORMAT_VERSION, FragmentStore, StoreFormatError, StoreOpenError
from edgesync_store.errors import StoreDamagedError, StoreError
from edgesync_store.schema import DEFAULT_TTL_SECONDS, KVFragment, Namespace, chunk_spans, prefix_hash

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
MiB = 1 << 20

from fragments import SMOL  # noqa: E402  (tests/fragments.py)


def make_fragment(
    tokens: np.ndarray | None = None,
    start: int = 0,
    end: int = 64,
    ns: Namespace = SMOL,
    layers: tuple[int, int, int] = (0, 30, 1),
    heads: tuple[int, int] = (0, 3),
    seed: int = 0,
    created_at: float | None = None,
    expires_at: float = 0.0,
    kind: str = "normal",
) -> KVFragment:
    """A fragment for ``tokens[start:end]`` (random tokens from ``seed`` when not given) with
    seeded random K/V: N(0, 1) like real activations, or random bit patterns (incompressible)."""
    rng = np.random.default_rng(seed)
    if tokens is None:
        tokens = rng.integers(0, 49152, size=end, dtype=np.int32)
    n_layers = len(range(*layers))
    shape = (n_layers, end - start, (heads[1] - heads[0]) * ns.head_dim)
    if kind == "bits":
        k = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(np.float16)
        v = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(np.float16)
    else:
        k = rng.standard_normal(shape).astype(ns.np_dtype)
        v = (rng.standard_normal(shape) * 0.5).astype(ns.np_dtype)
    return KVFragment(
        namespace=ns,
        token_start=start,
        token_end=end,
        layer_start=layers[0],
        layer_end=layers[1],
        layer_stride=layers[2],
        head_start=heads[0],
        head_end=heads[1],
        keys=k,
        values=v,
        token_ids=np.asarray(tokens[start:end]),
        prefix_hash=prefix_hash(tokens[:start]),
        created_at=time.time() if created_at is None else created_at,
        expires_at=expires_at,
    )


def shared_fragment(seed: int) -> KVFragment:
    """A 0.3 MB incompressible fragment that any process rebuilds identically (fixed times)."""
    return make_fragment(seed=seed, kind="bits", end=96, layers=(0, 6, 1), created_at=1_750_000_000.0 + seed)


def digest(frag: KVFragment) -> str:
    """SHA-256 over everything that must survive storage bit-exactly."""
    h = hashlib.sha256()
    for part in (frag.keys, frag.values, frag.token_ids, frag.embedding):
        h.update(str(part.dtype).encode() + str(part.shape).encode())
        h.update(np.ascontiguousarray(part).tobytes())
    h.update(frag.key())
    h.update(frag.content_hash.encode())
    h.update(repr((frag.created_at, frag.expires_at)).encode())
    return h.hexdigest()


def assert_same(a: KVFragment | None, b: KVFragment) -> None:
    assert a is not None
    assert a.key() == b.key()
    assert a.namespace == b.namespace
    assert (a.token_start, a.token_end, a.layer_start, a.layer_end, a.layer_stride, a.head_start, a.head_end) == (
        b.token_start, b.token_end, b.layer_start, b.layer_end, b.layer_stride, b.head_start, b.head_end
    )
    assert np.array_equal(a.keys.view(np.uint8), b.keys.view(np.uint8))
    assert np.array_equal(a.values.view(np.uint8), b.values.view(np.uint8))
    assert np.array_equal(a.token_ids, b.token_ids)
    assert a.expires_at == b.expires_at and a.created_at == b.created_at


class LogCounter(logging.Handler):
    """Counts the store's log records by message start (observes the real code paths)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def count(self, start: str) -> int:
        return sum(m.startswith(start) for m in self.messages)


@pytest.fixture
def store_log():
    logger = logging.getLogger("edgesync_store")
    handler = LogCounter()
    old = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


def raw_fragments_edit(path: Path, edit) -> None:
    """Open the store's LMDB directly (store closed: one env per file per process) and run
    ``edit(txn, fragments_db, by_prefix_db)`` in a write transaction."""
    env = lmdb.open(str(path), max_dbs=8, map_size=1 << 30)
    try:
        frags = env.open_db(b"fragments", create=False)
        by_prefix = env.open_db(b"by_prefix", dupsort=True, create=False)
        with env.begin(write=True) as txn:
            edit(txn, frags, by_prefix)
    finally:
        env.close()


def raw_db_edit(path: Path, name: bytes, edit) -> None:
    """Like :func:`raw_fragments_edit` for the named database ``name``: ``edit(txn, db)``."""
    env = lmdb.open(str(path), max_dbs=16, map_size=1 << 30)
    try:
        db = env.open_db(name, create=False)
        with env.begin(write=True) as txn:
            edit(txn, db)
    finally:
        env.close()


def raw_records(path: Path, name: bytes) -> dict[bytes, bytes]:
    """Every record of the named database ``name``, read with py-lmdb (the store closed)."""
    env = lmdb.open(str(path), max_dbs=16, map_size=1 << 30, readonly=True, lock=False)
    try:
        db = env.open_db(name, create=False)
        with env.begin() as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor(db=db)}
    finally:
        env.close()


def flip_payload_byte(path: Path, key: bytes) -> None:
    """Flip one byte in the middle of the blob under ``key`` (FAKE: a flipped byte in the
    payload stands for a corrupt page on disk, which cannot be provoked otherwise)."""

    def flip(txn, frags, _by_prefix):
        data = bytearray(txn.get(key, db=frags))
        data[len(data) // 2] ^= 0x5A
        txn.put(key, bytes(data), db=frags)

    raw_fragments_edit(path, flip)


def raw_by_prefix_values(path: Path) -> list[bytes]:
    env = lmdb.open(str(path), max_dbs=8, map_size=1 << 30, readonly=True, lock=False)
    try:
        by_prefix = env.open_db(b"by_prefix", dupsort=True, create=False)
        with env.begin() as txn:
            return [bytes(v) for _, v in txn.cursor(db=by_prefix)]
    finally:
        env.close()


def run_py(code: str, *args: str, timeout: float = 60) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=REPO, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


_PRELUDE = textwrap.dedent(
    f"""
    import sys, json, logging, time
    sys.path.insert(0, {str(TESTS)!r})
    import test_store as T
    from edgesync_store.core.store import FragmentStore
    """
)


# ---------------------------------------------------------------------------------------------
# basic round trip


def test_put_get_contains_delete_iterate_stats(tmp_path):
    f32 = replace(SMOL, kv_dtype="f32")
    frags = [
        make_fragment(seed=1),
        make_fragment(seed=2, start=64, end=192, layers=(0, 30, 3), heads=(1, 3)),
        make_fragment(seed=3, ns=f32, layers=(5, 9, 1), end=100),
    ]
    with FragmentStore(tmp_path / "s") as store:
        assert store.stats().fragments == 0
        for f in frags:
            assert not store.contains(f.key())
            assert store.get(f.key()) is None
            assert store.put(f) is True
        for f in frags:
            assert store.contains(f.key())
            assert_same(store.get(f.key()), f)
            assert store.get_blob(f.key()) == codec.encode(f)
        rows = {key: (head, life, n) for key, head, life, n in store.iterate()}
        assert set(rows) == {f.key() for f in frags}
        for f in frags:
            head, life, nbytes = rows[f.key()]
            assert head.content_hash == f.content_hash
            assert np.array_equal(head.token_ids, f.token_ids)
            assert (life.hit_count, life.last_hit_at, life.expires_at) == (0, 0.0, f.expires_at)
            assert nbytes == len(codec.encode(f))
        stats = store.stats()
        assert stats.fragments == 3
        assert stats.compressed_bytes == sum(len(codec.encode(f)) for f in frags)
        assert stats.raw_bytes == sum(f.raw_nbytes for f in frags)
        assert stats.disk_bytes >= stats.compressed_bytes
        assert stats.dropped_corrupt == 0
        assert stats.to_dict()["fragments"] == 3

        assert store.delete(frags[1].key()) is True
        assert store.delete(frags[1].key()) is False
        assert not store.contains(frags[1].key())
        assert store.get(frags[1].key()) is None
        assert store.lifecycle(frags[1].key()) is None
        assert store.stats().fragments == 2
        assert store.stats().raw_bytes == frags[0].raw_nbytes + frags[2].raw_nbytes
        assert_same(store.get(frags[0].key()), frags[0])
        # after a delete the same fragment can be stored again
        assert store.put(frags[1]) is True
        assert_same(store.get(frags[1].key()), frags[1])
        assert store.delete(frags[1].key())
    # delete removed the prefix index entry too
    assert sorted(raw_by_prefix_values(tmp_path / "s")) == sorted([frags[0].key(), frags[2].key()])


def test_put_existing_key_returns_false_and_does_not_duplicate(tmp_path):
    frag = make_fragment(seed=4)
    with FragmentStore(tmp_path / "s") as store:
        assert store.put(frag) is True
        blob = store.get_blob(frag.key())
        assert store.put(frag) is False
        # the same content built again later (another created_at) has the same key: not added,
        # and the first blob is kept
        again = make_fragment(seed=4, created_at=frag.created_at + 10)
        assert again.key() == frag.key()
        assert store.put(again) is False
        assert store.get_blob(frag.key()) == blob
        other = make_fragment(seed=5)
        assert store.put_many([frag, other, other]) == 1
        assert sum(1 for _ in store.iterate()) == 2
        assert store.stats().fragments == 2
    assert sorted(raw_by_prefix_values(tmp_path / "s")) == sorted([frag.key(), other.key()])


_READER = _PRELUDE + textwrap.dedent(
    """
    store = FragmentStore(sys.argv[1], readonly=True)
    out = {}
    for key in sys.argv[2:]:
        frag = store.get(bytes.fromhex(key))
        out[key] = None if frag is None else [T.digest(frag), frag.hit_count, frag.last_hit_at]
    print(json.dumps(out))
    """
)


def test_committed_data_survives_reopen_and_is_read_by_a_new_process(tmp_path):
    path = tmp_path / "s"
    frags = [make_fragment(seed=10 + i, kind="bits" if i % 2 else "normal") for i in range(4)]
    with FragmentStore(path) as store:
        assert store.put_many(frags) == 4
        store.record_hits([frags[0].key()], now=1234.5)
    with FragmentStore(path) as store:
        for f in frags:
            assert_same(store.get(f.key()), f)
        assert store.stats().fragments == 4
    out = json.loads(run_py(_READER, path, *(f.key().hex() for f in frags)))
    for f in frags:
        assert out[f.key().hex()][0] == digest(f)
    assert out[frags[0].key().hex()][1:] == [1, 1234.5]
    assert out[frags[1].key().hex()][1:] == [0, 0.0]


def test_modes_0700_directory_0600_files(tmp_path):
    path = tmp_path / "nested" / "store"
    with FragmentStore(path) as store:
        store.put(make_fragment(seed=1))
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    files = sorted(path.glob("*.mdb"))
    assert [p.name for p in files] == ["data.mdb", "lock.mdb"]
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    # an existing empty directory is used as it is: its owner chose its mode
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    FragmentStore(loose).close()
    assert stat.S_IMODE(loose.stat().st_mode) == 0o755


def test_paths_that_cannot_hold_a_store_are_refused_untouched(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("not a store")
    with pytest.raises(StoreOpenError, match="not a directory"):
        FragmentStore(a_file)
    with pytest.raises(StoreOpenError):
        FragmentStore(a_file / "sub")
    busy = tmp_path / "photos"
    busy.mkdir(mode=0o755)
    (busy / "holiday.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(StoreOpenError, match="holds other files"):
        FragmentStore(busy)
    assert sorted(p.name for p in busy.iterdir()) == ["holiday.jpg"]
    assert stat.S_IMODE(busy.stat().st_mode) == 0o755
    with pytest.raises(StoreOpenError, match="no EdgeSync store"):
        FragmentStore(tmp_path / "empty-ro", readonly=True)
    with pytest.raises(StoreOpenError, match="empty"):
        FragmentStore("")


def test_readonly_store_reads_but_refuses_writes(tmp_path):
    frag = make_fragment(seed=6)
    with FragmentStore(tmp_path / "s") as store:
        store.put(frag)
    with FragmentStore(tmp_path / "s", readonly=True) as ro:
        assert_same(ro.get(frag.key()), frag)
        with pytest.raises(PermissionError):
            ro.put(make_fragment(seed=7))


def test_newer_store_format_is_refused(tmp_path):
    path = tmp_path / "s"
    FragmentStore(path).close()
    env = lmdb.open(str(path), max_dbs=8)
    meta = env.open_db(b"meta", create=False)
    with env.begin(write=True) as txn:
        assert bytes(txn.get(b"format_version", db=meta)) == str(STORE_FORMAT_VERSION).encode()
        txn.put(b"format_version", str(STORE_FORMAT_VERSION + 1).encode(), db=meta)
    env.close()
    with pytest.raises(
        StoreFormatError, match=f"version {STORE_FORMAT_VERSION + 1}; this EdgeSync reads up to {STORE_FORMAT_VERSION}"
    ):
        FragmentStore(path)


# ---------------------------------------------------------------------------------------------
# map growth and sharing


def test_map_grows_from_one_mib(tmp_path, store_log):
    """Writes grow the map ahead (``LmdbEnv.reserve``), never filling it; a write the estimate
    misses (here: a raw transaction, which skips it) fills it and is retried after doubling."""
    path = tmp_path / "s"
    # 14 incompressible fragments of 1.4 MiB: ~20 MiB
    frags = [make_fragment(seed=100 + i, kind="bits") for i in range(14)]
    with FragmentStore(path, map_size=MiB) as store:
        assert store.stats().map_size == MiB
        for f in frags[:10]:
            assert store.put(f)
        assert store.put_many(frags[10:]) == 4
        stats = store.stats()
        assert stats.fragments == 14
        assert stats.compressed_bytes > 19 * MiB
        assert stats.map_size >= stats.compressed_bytes > MiB
        for f in frags:
            assert_same(store.get(f.key()), f)
    assert store_log.count("LMDB map: growing") >= 1 and store_log.count("LMDB map full") == 0
    with FragmentStore(tmp_path / "raw", map_size=MiB) as raw:
        raw.transact(lambda txn: txn.put(b"k", bytes(20 * MiB), db=raw.named_db(b"meta")), write=True)
        assert raw.stats().map_size >= 32 * MiB
    assert store_log.count("LMDB map full: growing") >= 5  # 1 -> 2 -> 4 -> 8 -> 16 -> 32 MiB
    with FragmentStore(path, map_size=MiB) as again:  # reopening with a smaller map still works
        assert all(again.contains(f.key()) for f in frags)
        assert_same(again.get(frags[-1].key()), frags[-1])
        assert again.put(make_fragment(seed=999, kind="bits"))


def test_second_store_object_sees_writes_of_the_first(tmp_path):
    path = tmp_path / "s"
    a = FragmentStore(path)
    b = FragmentStore(path, map_size=MiB)
    try:
        frag = make_fragment(seed=20)
        assert not b.contains(frag.key())
        assert a.put(frag)
        assert b.contains(frag.key())
        assert_same(b.get(frag.key()), frag)
        other = make_fragment(seed=21)
        assert b.put(other)
        assert_same(a.get(other.key()), other)
        assert a.put(other) is False
    finally:
        b.close()
        a.close()


_WRITER = _PRELUDE + textwrap.dedent(
    """
    path, map_size, grow_seed0, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    counter = T.LogCounter()
    logging.getLogger("edgesync_store").setLevel(logging.DEBUG)
    logging.getLogger("edgesync_store").addHandler(counter)
    store = FragmentStore(path, map_size=map_size)
    added = 0
    for i in range(n):
        added += store.put(T.shared_fragment(grow_seed0 + i))
    print(json.dumps({"added": added, "grown": counter.count("LMDB map"),
                      "resized": counter.count("another process grew")}))
    """
)


def test_map_resized_by_another_process_is_adopted(tmp_path, store_log):
    path = tmp_path / "s"
    mine = make_fragment(seed=30)
    with FragmentStore(path, map_size=MiB) as store:
        assert store.put(mine)
        # another process grows the map far beyond this process's 1 MiB and fills it
        out = json.loads(run_py(_WRITER, path, MiB, 5000, 40))
        assert out["added"] == 40 and out["grown"] >= 1
        theirs = [shared_fragment(5000 + i) for i in range(40)]
        for f in theirs:
            assert_same(store.get(f.key()), f)
        assert store_log.count("another process grew the map") >= 1
        assert store.stats().map_size > MiB
        assert store.put(make_fragment(seed=31, kind="bits"))
        assert store.stats().fragments == 42


_CONCURRENT = _PRELUDE + textwrap.dedent(
    """
    import os
    path, ready, go = sys.argv[1], sys.argv[6], sys.argv[7]
    map_size, my_seed, other_seed, n = (int(a) for a in sys.argv[2:6])
    counter = T.LogCounter()
    logging.getLogger("edgesync_store").setLevel(logging.DEBUG)
    logging.getLogger("edgesync_store").addHandler(counter)
    mine = [T.shared_fragment(my_seed + i) for i in range(n)]
    others = [T.shared_fragment(other_seed + i) for i in range(n)]
    store = FragmentStore(path, map_size=map_size)
    open(ready, "w").close()
    deadline = time.time() + 30
    while not os.path.exists(go) and time.time() < deadline:   # both writers start together
        time.sleep(0.002)
    added = 0
    for f in mine:
        added += store.put(f)
    pending = {f.key(): f for f in others}
    ok = 0
    while pending and time.time() < deadline:
        for key in list(pending):
            got = store.get(key)
            if got is not None:
                ok += T.digest(got) == T.digest(pending.pop(key))
        time.sleep(0.01)
    print(json.dumps({"added": added, "read_ok": ok, "missing": len(pending),
                      "grown": counter.count("LMDB map"),
                      "resized": counter.count("another process grew")}))
    """
)


def test_two_processes_write_and_read_one_store_concurrently(tmp_path):
    path = tmp_path / "s"
    go = tmp_path / "go"
    n = 30
    FragmentStore(path, map_size=MiB).close()
    procs = []
    for map_size, mine, other in ((MiB, 7000, 8000), (64 * 1024, 8000, 7000)):
        ready = tmp_path / f"ready-{mine}"
        procs.append(
            (
                ready,
                subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        _CONCURRENT,
                        str(path),
                        str(map_size),
                        str(mine),
                        str(other),
                        str(n),
                        str(ready),
                        str(go),
                    ],
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
        )
    # both stores are open before either writes (opening during writes: see the next test)
    deadline = time.time() + 30
    while not all(r.exists() for r, _ in procs) and time.time() < deadline and all(p.poll() is None for _, p in procs):
        time.sleep(0.005)
    go.touch()
    results = []
    for _, p in procs:
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    for r in results:
        assert r["added"] == n
        assert r["missing"] == 0
        assert r["read_ok"] == n  # every fragment of the other process decoded bit-exactly
    # both started with a tiny map and wrote ~17 MiB between them: both maps grew. Each grows its
    # own ahead of its writes from the pages in use (the shared meta page), so it rarely meets the
    # other's growth as MapResizedError: the test above shows that adoption
    assert sum(r["grown"] for r in results) >= 2
    expected = [shared_fragment(s + i) for s in (7000, 8000) for i in range(n)]
    with FragmentStore(path) as store:
        assert store.stats().fragments == 2 * n
        for f in expected:
            assert_same(store.get(f.key()), f)
        assert store.stats().dropped_corrupt == 0


def test_opening_a_store_while_another_process_grows_it(tmp_path):
    """Opening must survive another process's concurrent growth (MapResizedError).

    lmdb.open() sizes the map to at least the data on disk; if another process commits new
    pages before the named databases are opened, open_db() raises MapResizedError. Repeated
    opens during a writer's run hit that window many times.
    """
    path = tmp_path / "s"
    FragmentStore(path, map_size=MiB).close()
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), str(64 * 1024), "9000", "30"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    opens, errors = 0, []
    try:
        while writer.poll() is None:
            try:
                store = FragmentStore(path, map_size=64 * 1024)
            except (lmdb.Error, StoreError) as exc:  # what a caller would see
                errors.append(type(exc).__name__)
                continue
            opens += 1
            store.close()
    finally:
        out, err = writer.communicate(timeout=90)
    assert writer.returncode == 0, err
    assert json.loads(out)["added"] == 30
    assert opens > 0
    assert errors == [], f"{len(errors)} of {opens + len(errors)} opens failed: {sorted(set(errors))}"
    with FragmentStore(path, map_size=64 * 1024) as store:
        assert store.stats().fragments == 30
        assert_same(store.get(shared_fragment(9029).key()), shared_fragment(9029))


# ---------------------------------------------------------------------------------------------
# lifecycle


def test_record_hits_persists_and_does_not_touch_the_blob(tmp_path):
    path = tmp_path / "s"
    frag = make_fragment(seed=40)
    other = make_fragment(seed=41)
    with FragmentStore(path) as store:
        store.put_many([frag, other])
        blob = store.get_blob(frag.key())
        store.record_hits([frag.key()], now=1000.25)
        store.record_hits([frag.key(), b"\x01" * 32], now=2000.5)  # unknown keys are ignored
        life = store.lifecycle(frag.key())
        assert (life.hit_count, life.last_hit_at, life.expires_at) == (2, 2000.5, frag.expires_at)
        assert store.lifecycle(b"\x01" * 32) is None
        assert store.get_blob(frag.key()) == blob
        got = store.get(frag.key())
        assert (got.hit_count, got.last_hit_at) == (2, 2000.5)
        before = time.time()
        store.record_hits([frag.key()])
        assert before <= store.lifecycle(frag.key()).last_hit_at <= time.time()
    with FragmentStore(path) as store:
        got = store.get(frag.key())
        assert got.hit_count == 3
        assert got.last_hit_at >= before
        untouched = store.get(other.key())
        assert (untouched.hit_count, untouched.last_hit_at) == (0, 0.0)


def test_record_hits_keeps_the_reuse_hint_per_namespace(tmp_path):
    """``record_hits(..., reused=(digest, token IDs))`` keeps the tokens the latest hit injected
    per namespace in ``meta`` (``<i4``): read back by ``reuse_hint``, overwritten by the next hit,
    kept across a reopen and readable from a read-only store; the hits are counted as before."""
    path = tmp_path / "s"
    frag = make_fragment(seed=42)
    digest_ = SMOL.digest()
    other = replace(SMOL, flash_attn=True).digest()
    assert other != digest_
    first, second = list(range(7, 328)), [5] * 400
    with FragmentStore(path) as store:
        store.put(frag)
        assert store.reuse_hint(digest_).tolist() == []
        store.record_hits([frag.key()], now=1000.0, reused=(digest_, first))
        assert store.reuse_hint(digest_).tolist() == first and store.reuse_hint(digest_).dtype == np.int32
        assert store.reuse_hint(other).tolist() == []
        life = store.lifecycle(frag.key())
        assert (life.hit_count, life.last_hit_at) == (1, 1000.0)
        store.record_hits([frag.key()], now=2000.0, reused=(digest_, np.asarray(second)))
        assert store.reuse_hint(digest_).tolist() == second
        assert store.reuse_hint(other).tolist() == []
        assert (store.lifecycle(frag.key()).hit_count, store.lifecycle(frag.key()).last_hit_at) == (2, 2000.0)
        # a hit without ``reused`` leaves the hint alone
        store.record_hits([frag.key()], now=3000.0)
        assert store.reuse_hint(digest_).tolist() == second
    assert raw_records(path, b"meta")[b"reuse_tokens:" + digest_] == np.asarray(second, "<i4").tobytes()
    with FragmentStore(path) as store:
        assert store.reuse_hint(digest_).tolist() == second
        assert store.reuse_hint(other).tolist() == []
        assert store.lifecycle(frag.key()).hit_count == 3
    with FragmentStore(path, readonly=True) as ro:
        assert ro.reuse_hint(digest_).tolist() == second
        with pytest.raises(PermissionError):
            ro.record_hits([frag.key()], reused=(digest_, first))
        assert ro.reuse_hint(digest_).tolist() == second


# ---------------------------------------------------------------------------------------------
# prefix walk

SEQ_LEN = 330  # chunk_spans(330) == [(0, 128), (128, 256), (256, 330)]; every span >= 64


@pytest.fixture(scope="module")
def sequence() -> np.ndarray:
    return np.random.default_rng(77).integers(0, 49152, size=SEQ_LEN, dtype=np.int32)


@pytest.fixture(scope="module")
def walk_store(tmp_path_factory, sequence):
    spans = chunk_spans(SEQ_LEN)
    assert spans == [(0, 128), (128, 256), (256, 330)]
    frags = [make_fragment(sequence, s, e, seed=i) for i, (s, e) in enumerate(spans)]
    store = FragmentStore(tmp_path_factory.mktemp("walk") / "s")
    assert store.put_many(frags) == 3
    yield store, frags
    store.close()


def test_walk_matches_the_whole_sequence(walk_store, sequence):
    store, frags = walk_store
    match = store.prefix_walk(SMOL, sequence)
    assert match.matched_tokens == SEQ_LEN
    assert [(s.token_start, s.token_end, s.matched) for s in match.spans] == [
        (0, 128, 128),
        (128, 256, 128),
        (256, 330, 74),
    ]
    assert [s.keys for s in match.spans] == [[f.key()] for f in frags]
    assert all(s.complete for s in match.spans)
    assert [s.compressed_nbytes for s in match.spans] == [len(store.get_blob(f.key())) for f in frags]
    # a longer prompt with the same start matches the stored part
    longer = np.concatenate([sequence, np.arange(50, dtype=np.int32)])
    assert store.prefix_walk(SMOL, longer).matched_tokens == SEQ_LEN
    # fragments are usable: every matched key decodes
    for s in match.spans:
        assert all(store.get(k) is not None for k in s.keys)


@pytest.mark.parametrize("k", [0, 1, 40, 73])
def test_walk_stops_where_the_prompt_diverges_in_the_last_span(walk_store, sequence, k):
    store, _ = walk_store
    prompt = sequence.copy()
    prompt[256 + k] = (prompt[256 + k] + 1) % 49152
    match = store.prefix_walk(SMOL, prompt)
    assert match.matched_tokens == 256 + k
    if k:
        assert not match.spans[-1].complete and match.spans[-1].matched == k
    else:
        assert len(match.spans) == 2


def test_walk_partial_inside_earlier_span_and_short_prompt(walk_store, sequence):
    store, _ = walk_store
    prompt = sequence.copy()
    prompt[100] += 1
    assert store.prefix_walk(SMOL, prompt).matched_tokens == 100
    assert store.prefix_walk(SMOL, sequence[:200]).matched_tokens == 200
    assert store.prefix_walk(SMOL, sequence[:256]).matched_tokens == 256


def test_walk_first_token_differs_or_other_namespace_matches_nothing(walk_store, sequence):
    store, _ = walk_store
    prompt = sequence.copy()
    prompt[0] += 1
    assert store.prefix_walk(SMOL, prompt).matched_tokens == 0
    assert store.prefix_walk(SMOL, prompt).spans == []
    assert store.prefix_walk(replace(SMOL, flash_attn=True), sequence).matched_tokens == 0
    assert store.prefix_walk(replace(SMOL, model_fingerprint="cd" * 32), sequence).matched_tokens == 0
    assert store.prefix_walk(SMOL, sequence[:0]).matched_tokens == 0


def test_walk_ignores_expired_fragments(walk_store, sequence, tmp_path):
    store, frags = walk_store
    ttl_end = min(f.expires_at for f in frags)
    assert store.prefix_walk(SMOL, sequence, now=ttl_end - 1).matched_tokens == SEQ_LEN
    assert store.prefix_walk(SMOL, sequence, now=ttl_end).matched_tokens == 0
    assert store.prefix_walk(SMOL, sequence, now=time.time() + DEFAULT_TTL_SECONDS + 60).matched_tokens == 0

    # fragments created an hour ago (default 30 min TTL): expired now; only the last one fresh
    old = time.time() - 3600
    with FragmentStore(tmp_path / "s") as s2:
        s2.put(make_fragment(sequence, 0, 128, seed=0, created_at=old))
        s2.put(make_fragment(sequence, 128, 256, seed=1, created_at=old))
        s2.put(make_fragment(sequence, 256, 330, seed=2))
        assert s2.prefix_walk(SMOL, sequence).matched_tokens == 0
        # the same content again has the same key: a live twin is kept, an expired one replaced
        assert s2.put(make_fragment(sequence, 256, 330, seed=2)) is False
        assert s2.put(make_fragment(sequence, 0, 128, seed=0, created_at=time.time())) is True
        assert s2.prefix_walk(SMOL, sequence).matched_tokens == 128
        assert sum(1 for _ in s2.iterate()) == 3
    with FragmentStore(tmp_path / "s3") as s3:
        s3.put(make_fragment(sequence, 0, 128, seed=0))
        s3.put(make_fragment(sequence, 128, 256, seed=1))
        s3.put(make_fragment(sequence, 256, 330, seed=2, created_at=old))
        assert s3.prefix_walk(SMOL, sequence).matched_tokens == 256


@pytest.mark.parametrize(
    "parts",
    [
        [dict(layers=(0, 15, 1)), dict(layers=(15, 30, 1))],
        [dict(layers=(0, 30, 2)), dict(layers=(1, 30, 2))],
        [dict(heads=(0, 1)), dict(heads=(1, 3))],
    ],
    ids=["layer-ranges", "layer-strides", "head-ranges"],
)
def test_walk_needs_complete_coverage_of_layers_and_heads(tmp_path, sequence, parts):
    frags = [make_fragment(sequence, 0, 128, seed=i, **p) for i, p in enumerate(parts)]
    with FragmentStore(tmp_path / "half") as half:
        half.put(frags[0])
        assert half.prefix_walk(SMOL, sequence[:128]).matched_tokens == 0
    with FragmentStore(tmp_path / "both") as both:
        both.put_many(frags)
        match = both.prefix_walk(SMOL, sequence[:128])
        assert match.matched_tokens == 128
        assert sorted(match.spans[0].keys) == sorted(f.key() for f in frags)
        assert match.spans[0].compressed_nbytes == sum(len(codec.encode(f)) for f in frags)
        # a partial prompt still matches through the split fragments
        assert both.prefix_walk(SMOL, sequence[:90]).matched_tokens == 90


# ---------------------------------------------------------------------------------------------
# corruption (fault injection: the only fakes, each a stand-in for a corrupt page on disk)


def test_corrupt_blob_is_refused_removed_and_counted(tmp_path):
    path = tmp_path / "s"
    bad, good = make_fragment(seed=50), make_fragment(seed=51)
    with FragmentStore(path) as store:
        store.put_many([bad, good])

    flip_payload_byte(path, bad.key())
    with FragmentStore(path) as store:
        assert store.contains(bad.key())
        assert store.get(bad.key()) is None
        assert not store.contains(bad.key())
        assert store.lifecycle(bad.key()) is None
        stats = store.stats()
        assert stats.dropped_corrupt == 1
        assert stats.fragments == 1
        assert_same(store.get(good.key()), good)
        assert store.get(bad.key()) is None
        assert store.stats().dropped_corrupt == 1  # gone: not counted twice
        # the fragment can be stored again
        assert store.put(bad)
        assert_same(store.get(bad.key()), bad)
    assert sorted(raw_by_prefix_values(path)) == sorted([bad.key(), good.key()])


def test_get_with_copy_returns_the_same_fragment_and_refuses_the_same_corruption(tmp_path):
    """``get(key, copy=True)`` (decoded after the store's lock is released, for the prefetch
    thread) gives the fragment and lifecycle counters ``get(key)`` gives, and a corrupt blob is
    refused and removed the same way."""
    path = tmp_path / "s"
    bad, good = make_fragment(seed=52), make_fragment(seed=53)
    with FragmentStore(path) as store:
        store.put_many([bad, good])
        store.record_hits([good.key()])
        plain, copied = store.get(good.key()), store.get(good.key(), copy=True)
        assert_same(copied, good)
        assert (copied.hit_count, copied.last_hit_at, copied.expires_at) == \
            (plain.hit_count, plain.last_hit_at, plain.expires_at) and copied.hit_count == 1
        assert store.get(b"\x00" * 32, copy=True) is None

    flip_payload_byte(path, bad.key())
    with FragmentStore(path) as store:
        assert store.get(bad.key(), copy=True) is None
        assert not store.contains(bad.key())
        assert store.stats().dropped_corrupt == 1
        assert_same(store.get(good.key(), copy=True), good)


def _walked(store, tokens, per_position: bool) -> int:
    """Tokens matched by the store's walk, or by ``longest_chain`` over ``core.walk.local_spans``
    (one read transaction per position: the local half of the walk over both tiers)."""
    if not per_position:
        return store.prefix_walk(SMOL, tokens).matched_tokens
    from edgesync_store.core.walk import PrefixMatch, local_spans, longest_chain

    tokens = np.asarray(tokens, dtype=np.int32)
    return PrefixMatch(longest_chain(tokens, local_spans(store, SMOL, tokens))).matched_tokens


@pytest.mark.parametrize("per_position", [False, True], ids=["walk", "per-position"])
def test_corrupt_header_met_by_prefix_walk_is_dropped(tmp_path, sequence, per_position, caplog):
    """The walk reads heads from the ``heads`` database: a corrupt head there drops the fragment,
    with a warning that says what is wrong."""
    path = tmp_path / "s"
    frags = [make_fragment(sequence, 0, 128, seed=0), make_fragment(sequence, 128, 256, seed=1)]
    with FragmentStore(path) as store:
        store.put_many(frags)
        assert _walked(store, sequence[:256], per_position) == 256
    kept = raw_records(path, b"heads")[frags[0].key()]

    def flip(txn, heads):
        data = bytearray(txn.get(frags[1].key(), db=heads))
        data[20] ^= 0x01  # FAKE: one flipped byte in the JSON header stands for a corrupt page
        txn.put(frags[1].key(), bytes(data), db=heads)

    raw_db_edit(path, b"heads", flip)
    with FragmentStore(path) as store, caplog.at_level(logging.WARNING):
        assert _walked(store, sequence[:256], per_position) == 128
        assert store.stats().dropped_corrupt == 1
        assert [r.getMessage() for r in caplog.records] == [
            f"refusing corrupt fragment {frags[1].key().hex()[:16]}: its head does not parse: head checksum: xxh3 "
            "mismatch (corrupt header or token IDs); removing it"]
        assert not store.contains(frags[1].key())
        # the dangling index entry is cleaned by the next walk
        assert _walked(store, sequence[:256], per_position) == 128
        assert_same(store.get(frags[0].key()), frags[0])
    assert raw_by_prefix_values(path) == [frags[0].key()]
    assert raw_records(path, b"heads") == {frags[0].key(): kept}
    assert list(raw_records(path, b"fragments")) == [frags[0].key()]


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_corrupt_header_in_the_blob_is_refused_when_the_fragment_is_read(tmp_path, sequence, compression):
    """A flipped byte in the blob's own header, its record in ``heads`` intact: the walk (heads
    only) still finds the fragment; reading it refuses, counts and removes it, head and index
    entry included."""
    path = tmp_path / "s"
    frags = [make_fragment(sequence, 0, 128, seed=0), make_fragment(sequence, 128, 256, seed=1)]
    with FragmentStore(path, compression=compression) as store:
        store.put_many(frags)
    heads_before = raw_records(path, b"heads")

    def flip(txn, fragments, _by_prefix):
        data = bytearray(txn.get(frags[1].key(), db=fragments))
        data[20] ^= 0x01  # FAKE: one flipped byte in the JSON header stands for a corrupt page
        with pytest.raises(codec.CodecError, match="head checksum"):
            codec.peek(bytes(data))
        txn.put(frags[1].key(), bytes(data), db=fragments)

    raw_fragments_edit(path, flip)
    assert raw_records(path, b"heads") == heads_before
    with FragmentStore(path, compression=compression) as store:
        assert store.prefix_walk(SMOL, sequence[:256]).matched_tokens == 256
        assert store.stats().dropped_corrupt == 0
        assert store.get(frags[1].key()) is None
        assert store.stats().dropped_corrupt == 1
        assert not store.contains(frags[1].key()) and store.lifecycle(frags[1].key()) is None
        assert store.prefix_walk(SMOL, sequence[:256]).matched_tokens == 128
        assert_same(store.get(frags[0].key()), frags[0])
        assert store.used_bytes() == len(store.get_blob(frags[0].key()))
    assert raw_by_prefix_values(path) == [frags[0].key()]
    assert raw_records(path, b"heads") == {frags[0].key(): heads_before[frags[0].key()]}


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_heads_are_written_and_deleted_with_the_blobs(tmp_path, sequence, compression):
    path = tmp_path / "s"
    frags = [make_fragment(sequence, s, e, seed=i) for i, (s, e) in enumerate(chunk_spans(SEQ_LEN))]
    frags += [make_fragment(sequence, 0, 128, seed=9, layers=(0, 30, 2)), make_fragment(seed=10, end=100)]
    with FragmentStore(path, compression=compression) as store:
        assert store.put_many(frags) == len(frags)
    blobs, heads = raw_records(path, b"fragments"), raw_records(path, b"heads")
    assert set(blobs) == set(heads) == {f.key() for f in frags}
    for f in frags:
        blob, head = blobs[f.key()], heads[f.key()]
        assert head == codec.head_of(blob) and blob.startswith(head) and len(head) < len(blob)
        assert blob == codec.encode(f, compression)
        assert codec.peek(head).compression == compression
    gone = [frags[1].key(), frags[3].key()]
    with FragmentStore(path) as store:
        assert store.delete_many(gone + [b"\x00" * 32]) == 2
        assert store.used_bytes() == sum(len(b) for k, b in blobs.items() if k not in gone)
    assert raw_records(path, b"fragments") == {k: b for k, b in blobs.items() if k not in gone}
    assert raw_records(path, b"heads") == {k: h for k, h in heads.items() if k not in gone}
    assert sorted(raw_by_prefix_values(path)) == sorted(k for k in blobs if k not in gone)


def test_blob_under_a_key_that_is_not_its_own_is_refused(tmp_path):
    path = tmp_path / "s"
    a, b = make_fragment(seed=60), make_fragment(seed=61)
    with FragmentStore(path) as store:
        store.put_many([a, b])

    def misfile(txn, db, _by_prefix):
        # FAKE: blob A copied under key B stands for a misfiled page
        txn.put(b.key(), bytes(txn.get(a.key(), db=db)), db=db)

    raw_fragments_edit(path, misfile)
    with FragmentStore(path) as store:
        assert store.contains(b.key())
        assert store.get(b.key()) is None
        assert not store.contains(b.key())
        assert store.stats().dropped_corrupt == 1
        assert_same(store.get(a.key()), a)


# ---------------------------------------------------------------------------------------------
# reads in place (``reading``) and V stored channel-major


def _bits(a: np.ndarray) -> np.ndarray:
    """``a``'s elements as unsigned integers of their width (f16 -> uint16): compared bit for bit."""
    return a.view(f"u{a.dtype.itemsize}")


def _reading_fragments() -> list[KVFragment]:
    return [
        make_fragment(seed=70),
        make_fragment(seed=71, kind="bits", start=64, end=192, layers=(1, 30, 2), heads=(1, 3)),
        make_fragment(seed=72, ns=replace(SMOL, kv_dtype="f32"), layers=(5, 9, 1), end=100),
    ]


def _assert_read(got: KVFragment, frag: KVFragment) -> None:
    assert got.key() == frag.key()
    assert got.keys.dtype == frag.keys.dtype and got.keys.shape == frag.keys.shape == got.values.shape
    assert np.array_equal(_bits(got.keys), _bits(frag.keys))
    assert np.array_equal(_bits(got.values), _bits(frag.values))
    assert np.array_equal(got.token_ids, frag.token_ids)


def test_reading_serves_uncompressed_blobs_in_place_and_zstd_ones_as_copies(tmp_path):
    """``reading`` on a "none" store: every fragment in place, K and V bit-equal to what was put,
    read-only, sharing no memory with the fragment put (they are LMDB's pages), with the
    lifecycle counters; on a "zstd" store the same keys come back as arrays of their own. A key
    not stored gives (None, False); results follow the order of the keys asked."""
    frags = _reading_fragments()
    missing = b"\x07" * 32
    asked = [frags[2].key(), missing, frags[0].key(), frags[1].key()]
    expected = [frags[2], None, frags[0], frags[1]]
    for compression, in_place in (("none", True), ("zstd", False)):
        with FragmentStore(tmp_path / compression, compression=compression) as store:
            assert store.serves_in_place is in_place
            assert store.put_many(frags) == 3
            store.record_hits([frags[0].key()], now=1500.0)
            assert codec.peek(store.get_blob(frags[0].key())).compression == compression
            with store.reading(asked) as got:
                assert len(got) == len(asked)
                for (frag, served_in_place), want in zip(got, expected):
                    if want is None:
                        assert (frag, served_in_place) == (None, False)
                        continue
                    assert served_in_place is in_place
                    _assert_read(frag, want)
                    assert (frag.hit_count, frag.expires_at) == (int(want is frags[0]), want.expires_at)
                    for arr in (frag.keys, frag.values):
                        assert not any(np.shares_memory(arr, orig) for orig in (want.keys, want.values))
                        assert arr.flags.writeable is not in_place
                    if in_place:
                        assert not frag.keys.flags.owndata and not frag.values.flags.owndata
                        with pytest.raises(ValueError, match="read-only"):
                            frag.keys[0, 0, 0] = 0
                        with pytest.raises(ValueError, match="read-only"):
                            frag.values[-1, -1, -1] = 0
                assert (got[2][0].hit_count, got[2][0].last_hit_at) == (1, 1500.0)
            # the block's transaction is over: the store reads and writes as before
            _assert_read(store.get(frags[1].key()), frags[1])
            assert store.stats().dropped_corrupt == 0
            with store.reading([]) as none:
                assert none == []


def test_reading_refuses_a_corrupt_blob_and_removes_it_after_the_block(tmp_path):
    """A flipped payload byte: (None, False) for that key, the others served; the blob is
    removed (with its head, lifecycle and index entry) only after the block, and counted once."""
    frags = _reading_fragments()
    bad = frags[0]
    for compression in ("none", "zstd"):
        path = tmp_path / compression
        with FragmentStore(path, compression=compression) as store:
            store.put_many(frags)
        flip_payload_byte(path, bad.key())
        with FragmentStore(path, compression=compression) as store:
            keys = [f.key() for f in frags]
            with store.reading(keys) as got:
                assert got[0] == (None, False)
                for (frag, in_place), want in zip(got[1:], frags[1:]):
                    assert in_place is (compression == "none")
                    _assert_read(frag, want)
                assert store.stats().dropped_corrupt == 0  # counted and removed after the block
            assert store.stats().dropped_corrupt == 1
            assert not store.contains(bad.key()) and store.lifecycle(bad.key()) is None
            assert store.get(bad.key()) is None
            with store.reading(keys) as again:
                assert again[0] == (None, False)
                assert [in_place for _, in_place in again[1:]] == [compression == "none"] * 2
            assert store.stats().dropped_corrupt == 1  # gone: not counted twice
            assert store.stats().fragments == 2
        assert bad.key() not in raw_records(path, b"heads")
        assert sorted(raw_by_prefix_values(path)) == sorted(f.key() for f in frags[1:])


def test_deferred_checks_report_a_corrupt_payload_at_confirm(tmp_path):
    """``reading(defer_checks=True)``: an uncompressed blob with a flipped payload byte is served
    in place (its checksum still running), and ``confirm()`` names it; it is then refused and
    removed after the block like any corrupt fragment. A zstd blob is checked before it is
    decoded, deferred or not. A block left without ``confirm()`` still waits for the checks."""
    frags = _reading_fragments()
    bad = frags[1]
    for compression in ("none", "zstd"):
        path = tmp_path / compression
        with FragmentStore(path, compression=compression) as store:
            store.put_many(frags)
        flip_payload_byte(path, bad.key())
        keys = [f.key() for f in frags]
        with FragmentStore(path, compression=compression) as store:
            with store.reading(keys, defer_checks=True) as got:
                if compression == "none":
                    assert got[1][0] is not None and got[1][1] is True  # served, checksum pending
                    assert got.confirm() == [bad.key()] and got.confirm() == [bad.key()]
                else:
                    assert got[1] == (None, False) and got.confirm() == []
                for i in (0, 2):
                    _assert_read(got[i][0], frags[i])
                assert store.stats().dropped_corrupt == 0
            assert store.stats().dropped_corrupt == 1 and not store.contains(bad.key())
            with store.reading(keys, defer_checks=True) as intact:  # no confirm() in the block
                assert intact[1] == (None, False)
            assert intact.confirm() == [] and store.stats().dropped_corrupt == 1


def test_an_exception_inside_reading_propagates_and_leaves_the_store_usable(tmp_path):
    """An error raised in the ``with`` block (an injection that failed) comes out unchanged;
    the read transaction and the environment's lock are given back (another thread reads and
    writes at once), and a corrupt blob met in that block is still removed."""
    import threading

    path = tmp_path / "s"
    frags = _reading_fragments()
    with FragmentStore(path) as store:
        store.put_many(frags)
    flip_payload_byte(path, frags[1].key())

    class InjectFailed(Exception):
        pass

    with FragmentStore(path) as store:
        with pytest.raises(InjectFailed, match="engine refused"):
            with store.reading([f.key() for f in frags]) as got:
                assert got[0][1] is True and got[1] == (None, False)
                raise InjectFailed("engine refused the state")
        assert store.stats().dropped_corrupt == 1 and not store.contains(frags[1].key())

        results: dict = {}

        def other_thread():
            results["get"] = store.get(frags[0].key())
            results["put"] = store.put(frags[1])
            with store.reading([frags[2].key()]) as got:
                results["reading"] = (got[0][1], digest(got[0][0]))

        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join(timeout=30)
        assert not worker.is_alive(), "another thread waited on the store after the failed block"
        _assert_read(results["get"], frags[0])
        assert results["put"] is True
        assert results["reading"][0] is True
        _assert_read(store.get(frags[1].key()), frags[1])
        assert results["reading"][1] == digest(store.get(frags[2].key()))


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_channel_major_values_are_stored_and_read_back_channel_major(tmp_path, compression):
    """V laid out channel-major (a transposed view of a C-contiguous ``[layers, width, span]``
    array, as an engine stages it) is written ``v_order: "channel"`` and comes back from ``get``
    and ``reading`` with the same values, laid out the same way; a C-contiguous V stays
    ``"token"``."""
    plain = make_fragment(seed=80, end=100)
    channel_major = np.ascontiguousarray(plain.values.transpose(0, 2, 1)).transpose(0, 2, 1)
    chan = replace(plain, values=channel_major)
    assert chan.key() == plain.key()
    assert not chan.values.flags.c_contiguous and chan.values.transpose(0, 2, 1).flags.c_contiguous
    token = make_fragment(seed=81, end=100)
    with FragmentStore(tmp_path / "s", compression=compression) as store:
        assert store.put_many([chan, token]) == 2
        assert codec.peek(store.get_blob(chan.key())).v_order == "channel"
        assert codec.peek(store.get_blob(token.key())).v_order == "token"
        got = store.get(chan.key())
        _assert_read(got, plain)
        assert not got.values.flags.c_contiguous and got.values.transpose(0, 2, 1).flags.c_contiguous
        assert got.keys.flags.c_contiguous
        assert store.get(token.key()).values.flags.c_contiguous
        with store.reading([chan.key(), token.key()]) as read:
            (frag, in_place), (tok, _) = read
            assert in_place is (compression == "none")
            _assert_read(frag, plain)
            assert not frag.values.flags.c_contiguous and frag.values.transpose(0, 2, 1).flags.c_contiguous
            _assert_read(tok, token)
            assert tok.values.flags.c_contiguous


def _rss_file_kb() -> int:
    """This process's resident file-backed pages (``RssFile`` of /proc/self/status), in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    pytest.skip("no RssFile in /proc/self/status")


def _big_fragments(n: int, span: int) -> list[KVFragment]:
    """``n`` whole SmolLM2 fragments of ``span`` tokens, each at position 0 with its own token
    IDs (so ``n`` chains off the one root of the prefix index), sharing one pair of K/V arrays."""
    base = make_fragment(seed=90, end=span)
    rng = np.random.default_rng(91)
    return [replace(base, token_ids=rng.integers(0, 49152, size=span, dtype=np.int32), content_hash="")
            for _ in range(n)]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc/self/status (Linux)")
@pytest.mark.parametrize("together", [False, True], ids=["a-transaction-each", "one-put_many"])
def test_walk_and_lifecycle_reads_do_not_map_blobs(tmp_path, together):
    """The prefix walk, ``lifecycles``, ``is_live`` and ``contains`` read heads, the index and
    lifecycle records only: RssFile (file pages mapped into this process) grows by well under
    one blob while they meet 20 blobs of 11.8 MB. This measures a kernel behaviour seen on Linux
    6.18 (ext4): asking py-lmdb for a large value maps the page-cache folios around its first
    page, about the blob's size; the control (one byte of each blob read through the map) shows
    the measure sees it, else the test is skipped with the numbers measured.

    A known limit: fragments written in one transaction (``put_many``, the store-back) get their
    small records' pages allocated among their blobs' pages, and reading such a page maps the
    2 MB folio around it, blob pages included (measured: +38.9 MB for these 20 heads, one 2 MB
    run each, against some 200 MB for one byte of each blob). There the walk must still map
    under a third of what reading the blobs maps."""
    frags = _big_fragments(20, 512)
    assert frags[0].raw_nbytes == 11_796_480
    keys = [f.key() for f in frags]
    assert len(set(keys)) == 20
    path = tmp_path / "big"
    with FragmentStore(path, map_size=512 * MiB) as store:
        if together:
            assert store.put_many(frags) == 20
        else:
            assert all(store.put(f) for f in frags)
    with FragmentStore(tmp_path / "warm") as warm:  # the same code paths once, on another store
        small = make_fragment(seed=92)
        warm.put(small)
        warm.prefix_walk(SMOL, small.token_ids)
        warm.lifecycles([small.key()])
        warm.is_live(small.key()) and warm.contains(small.key())
        warm.transact(lambda txn: len(bytes(txn.get(small.key(), db=warm.env.fragments)[:1])))

    with FragmentStore(path) as store:
        before = _rss_file_kb()
        match = store.prefix_walk(SMOL, frags[7].token_ids)
        lives = store.lifecycles(keys)
        live = [store.is_live(k) for k in keys]
        held = [store.contains(k) for k in keys]
        walked_kb = _rss_file_kb() - before
        assert match.matched_tokens == 512 and match.spans[0].keys == [keys[7]]
        assert all(life is not None and life.nbytes > frags[0].raw_nbytes for life in lives)
        assert all(live) and all(held)

        before = _rss_file_kb()
        firsts = store.transact(lambda txn: [bytes(txn.get(k, db=store.env.fragments)[:1]) for k in keys])
        control_kb = _rss_file_kb() - before
        assert firsts == [codec.MAGIC[:1]] * 20
    measured = f"walk and lifecycle reads +{walked_kb} kB, one byte of each blob +{control_kb} kB"
    if control_kb <= 20 * 1024:
        pytest.skip(f"RssFile does not show blobs mapped on this kernel ({measured})")
    assert walked_kb < (control_kb // 3 if together else 8 * 1024), measured


# ---------------------------------------------------------------------------------------------
# fingerprint


_FINGERPRINT = textwrap.dedent(
    """
    import sys
    from edgesync_engines.adapters.model_files import file_fingerprint
    print(file_fingerprint(sys.argv[1]))
    """
)


def test_file_fingerprint_is_sha256_and_cached(tmp_path, monkeypatch):
    cache = tmp_path / "cache" / "fingerprints.json"
    monkeypatch.setenv("EDGESYNC_FINGERPRINT_CACHE", str(cache))
    assert fingerprint.cache_file() == cache
    model = tmp_path / "model.gguf"
    content = np.random.default_rng(0).bytes(3 * (1 << 22) + 123)  # several read chunks
    model.write_bytes(content)
    expected = hashlib.sha256(content).hexdigest()

    assert fingerprint.file_fingerprint(model) == expected
    entries = json.loads(cache.read_text())
    st = model.stat()
    assert entries[str(model.resolve())] == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": expected}

    # Same size and mtime but other bytes: a cached digest is returned without re-reading the
    # file, in this process and in a new one (which only has the JSON cache).
    tampered = bytes([content[0] ^ 0xFF]) + content[1:]
    model.write_bytes(tampered)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fingerprint.file_fingerprint(model) == expected
    env = dict(os.environ, EDGESYNC_FINGERPRINT_CACHE=str(cache))
    proc = subprocess.run([sys.executable, "-c", _FINGERPRINT, str(model)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected

    # A new mtime re-hashes: the new digest is that of the new bytes, and the cache is updated.
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    new = fingerprint.file_fingerprint(model)
    assert new == hashlib.sha256(tampered).hexdigest() != expected
    assert json.loads(cache.read_text())[str(model.resolve())]["sha256"] == new
    # contents of another size (mtime updated by the write) re-hash too
    model.write_bytes(b"tiny")
    assert fingerprint.file_fingerprint(model) == hashlib.sha256(b"tiny").hexdigest()
    with pytest.raises(FileNotFoundError):
        fingerprint.file_fingerprint(tmp_path / "missing.gguf")


def test_walk_takes_the_branch_that_reaches_furthest(tmp_path):
    """Spans of two chunk sizes branch at position 0: a long span [0, 190) and the chain
    [0, 128) -> [128, 192). The walk must not stop at 190 because it took the longest first
    span: it returns the chain that reaches 192."""
    seq = np.random.default_rng(5).integers(0, 49152, size=193, dtype=np.int32)
    with FragmentStore(tmp_path / "s") as store:
        store.put_many([
            make_fragment(seq, 0, 190, seed=1),
            make_fragment(seq, 0, 128, seed=2),
            make_fragment(seq, 128, 192, seed=3),
        ])
        match = store.prefix_walk(SMOL, seq)
        assert match.matched_tokens == 192
        assert [(s.token_start, s.token_end) for s in match.spans] == [(0, 128), (128, 192)]
        other = seq.copy()
        other[150] += 1  # the chain's second span now matches only to 150: [0, 190) wins
        match = store.prefix_walk(SMOL, other)
        assert match.matched_tokens == 150


def test_foreign_or_truncated_lmdb_is_refused_untouched(tmp_path):
    import lmdb

    foreign = tmp_path / "foreign"
    env = lmdb.open(str(foreign))
    with env.begin(write=True) as txn:
        txn.put(b"user", b"alice")
    env.close()
    before = (foreign / "data.mdb").read_bytes()
    with pytest.raises(StoreOpenError, match="not an EdgeSync store"):
        FragmentStore(foreign)
    assert (foreign / "data.mdb").read_bytes() == before

    good = tmp_path / "good"
    with FragmentStore(good) as store:
        store.put(make_fragment(seed=3, kind="bits", end=400))
    data = (good / "data.mdb").read_bytes()
    (good / "data.mdb").write_bytes(data[: len(data) // 4])  # a half-finished copy
    cut = rf"data.mdb is truncated \({len(data) // 4} of \d+ bytes\)"
    with pytest.raises(StoreDamagedError, match=cut) as exc:
        FragmentStore(good)
    assert isinstance(exc.value, StoreOpenError) and exc.value.damage.startswith("data.mdb is truncated")
    assert f"edgesync clear {good} --yes" in str(exc.value)
    assert (good / "data.mdb").read_bytes() == data[: len(data) // 4]  # untouched
    for size in (1, 4096):  # cut inside LMDB's two meta pages: LMDB itself cannot tell what it was
        (good / "data.mdb").write_bytes(data[:size])
        with pytest.raises(StoreDamagedError, match=rf"data.mdb is truncated to {size} bytes, inside LMDB's meta"):
            FragmentStore(good)
    overwritten = bytes(2 * mmap.PAGESIZE) + data[2 * mmap.PAGESIZE:]  # both meta pages zeroed
    (good / "data.mdb").write_bytes(overwritten)
    with pytest.raises(StoreDamagedError, match="data.mdb's LMDB meta pages are unreadable"):
        FragmentStore(good)  # a store was opened here before (pins.lock): its header is damaged
    assert (good / "data.mdb").read_bytes() == overwritten
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.mdb").write_bytes(b"not lmdb" * 4096)  # someone else's file: refused, not called damaged
    with pytest.raises(StoreOpenError, match="cannot open the store at .*: data.mdb is not an LMDB file") as refused:
        FragmentStore(other)
    assert not isinstance(refused.value, StoreDamagedError)
    assert (other / "data.mdb").read_bytes() == b"not lmdb" * 4096
    (other / "data.mdb").write_bytes(b"my notes\n")  # shorter than LMDB's meta pages, yet not a cut store
    with pytest.raises(StoreOpenError, match="data.mdb is not an LMDB file") as refused:
        FragmentStore(other)
    assert not isinstance(refused.value, StoreDamagedError)
    assert (other / "data.mdb").read_bytes() == b"my notes\n"


# -- the storage seam -------------------------------------------------------------------------


def test_fragment_store_implements_the_backend_interfaces():
    """Every abstract method of both seams is implemented; the request seam names the methods
    the request path calls, the maintenance seam adds what maintenance calls."""
    from edgesync_store.core.backend import FragmentBackend, MaintenanceBackend

    assert issubclass(FragmentStore, MaintenanceBackend) and issubclass(MaintenanceBackend, FragmentBackend)
    assert not FragmentStore.__abstractmethods__
    request = {"get", "reading", "serves_in_place", "put_many", "put_donor", "is_live", "prefix_walk", "covers_span",
               "keys_along", "namespaces", "forget_tokens", "lifecycle", "lifecycles", "record_hits", "reuse_hint",
               "release_mapped", "stats", "close"}
    assert request == set(FragmentBackend.__abstractmethods__)
    maintenance = {"contains", "delete_many", "set_lifecycle", "iterate", "iterate_lifecycle", "delete_expired",
                   "put_replacing", "absorb", "used_bytes", "recount_used", "transact", "named_db", "contains_in",
                   "delete_in", "used_in", "lifecycle_rows_in", "closed"}
    assert (request - {"forget_tokens"}) | maintenance == set(MaintenanceBackend.__abstractmethods__)
    assert {"put", "delete", "forget_tokens"} <= set(vars(MaintenanceBackend))


def test_lmdb_errors_leave_the_store_as_store_io_errors(tmp_path):
    """A failure inside LMDB (here: an empty key, which LMDB refuses) comes out as
    StoreIOError naming the store; nothing is written."""
    from edgesync_store.errors import StoreIOError

    with FragmentStore(tmp_path / "s", map_size=MiB) as store:
        frag = make_fragment()
        assert store.put(frag)
        with pytest.raises(StoreIOError, match=str(tmp_path / "s")) as info:
            store.transact(lambda txn: (store.delete_in(txn, frag.key()), txn.put(b"", b"x", db=store.env.fragments)),
                           write=True)
        assert isinstance(info.value, StoreError) and isinstance(info.value.__cause__, lmdb.Error)
        assert store.contains(frag.key())  # the transaction was rolled back whole
        assert store.used_bytes() == store.stats().compressed_bytes > 0


def test_page_bytes_counts_the_pages_in_use(tmp_path):
    """``page_bytes`` of the fragments database grows with its blobs; every page in use
    includes it and fits in the file."""
    with FragmentStore(tmp_path / "s", map_size=MiB) as store:
        empty = store.page_bytes([b"fragments"])
        store.put_many([make_fragment(seed=i, kind="bits") for i in range(4)])
        used = store.page_bytes([b"fragments"])
        assert used - empty >= store.used_bytes() > 0
        assert store.page_bytes() >= used + store.page_bytes([b"lifecycle", b"by_prefix"])
        assert store.page_bytes() <= (tmp_path / "s" / "data.mdb").stat().st_size
        assert store.page_bytes([b"no such database"]) == 0


def test_a_new_store_created_by_another_process_at_the_same_moment_is_opened(tmp_path, monkeypatch):
    """Two processes opening one new store both see it missing and both mkdir it; the loser's
    FileExistsError means the directory is there, not that the store is unavailable. FAKE: the
    race cannot be provoked on demand, so mkdir is made to lose it (the directory is created,
    then FileExistsError raised, as when the other process's mkdir came first)."""
    path = tmp_path / "new-store"
    real_mkdir = Path.mkdir

    def lose_the_race(self, *args, **kwargs):
        real_mkdir(self, *args, **kwargs)
        raise FileExistsError(17, "File exists", str(self))

    monkeypatch.setattr(Path, "mkdir", lose_the_race)
    frag = make_fragment(seed=60)
    with FragmentStore(path) as store:
        assert store.put(frag)
    monkeypatch.undo()
    with FragmentStore(path) as store:
        assert_same(store.get(frag.key()), frag)


def test_budget_is_checked_and_recorded(tmp_path):
    """``max_bytes`` from 1 to 2**63 - 1 (the settings' largest size) is recorded and read back by
    the next open; 0, 2**63 and a non-integer are refused with ValueError before anything is
    created."""
    for bad in (0, 2**63, 1.5):
        with pytest.raises(ValueError, match=r"^max_bytes: must be a number of bytes from 1 to 2\*\*63 - 1"):
            FragmentStore(tmp_path / "refused", max_bytes=bad)
        assert not (tmp_path / "refused").exists()
    with FragmentStore(tmp_path / "s", max_bytes=2**63 - 1) as store:
        assert store.max_bytes == 2**63 - 1
    with FragmentStore(tmp_path / "s") as store:
        assert store.recorded_max_bytes() == store.max_bytes == 2**63 - 1


def test_a_store_back_replaces_twins_whose_stored_head_is_corrupt(tmp_path, sequence):
    """Corrupt heads of a whole chain: the walk stops at the first, and the store-back of the
    prefilled chain (put_many of the same fragments) replaces every corrupt twin, not only the
    one the walk dropped; an intact twin is left alone. The next walk covers the chain."""
    path = tmp_path / "s"
    frags = [make_fragment(sequence, 0, 128, seed=0), make_fragment(sequence, 128, 256, seed=1),
             make_fragment(sequence, 256, SEQ_LEN, seed=2)]
    with FragmentStore(path) as store:
        store.put_many(frags)
    heads = raw_records(path, b"heads")

    def flip(txn, db):
        for f in frags[:2]:
            data = bytearray(txn.get(f.key(), db=db))
            data[20] ^= 0x01  # FAKE: one flipped byte in the JSON header stands for a corrupt page
            txn.put(f.key(), bytes(data), db=db)

    raw_db_edit(path, b"heads", flip)
    with FragmentStore(path) as store:
        assert _walked(store, sequence, False) == 0  # the first head is corrupt: dropped
        assert store.stats().dropped_corrupt == 1
        assert store.put_many(frags) == 2  # the dropped one and its corrupt twin; the third kept
        assert store.stats().dropped_corrupt == 2
        assert _walked(store, sequence, False) == SEQ_LEN
        for f in frags:
            assert_same(store.get(f.key()), f)
    assert raw_records(path, b"heads") == heads


# ---------------------------------------------------------------------------------------------
# the size budget's default, a batch larger than the budget, and the map grown ahead of a write

LLAMA8B = replace(SMOL, n_layer=32, n_head_kv=8, head_dim=128)
"""Llama-3.1-8B's KV geometry: 128 KiB of f16 K and V a token."""


def _store_state(store: FragmentStore) -> tuple:
    """What a refused write must leave as it was: fragments, bytes stored, lifecycle records,
    the index, and data.mdb's size."""
    return (sorted(k for k, _ in store.iterate_lifecycle()), store.used_bytes(), store.stats().compressed_bytes,
            sorted(raw_by_prefix_values(store.path)), (store.path / "data.mdb").stat().st_size)


def test_the_default_budget_is_the_smaller_of_8_gib_and_a_quarter_of_the_free_space(tmp_path):
    """A new store records min(8 GiB, 25% of the free space); a later open keeps it; a budget
    given replaces it."""
    from edgesync_store.core.store import DEFAULT_MAX_BYTES, budget_for_space, default_max_bytes

    assert DEFAULT_MAX_BYTES == 8 * 1024**3
    assert budget_for_space(100 * 1024**3) == DEFAULT_MAX_BYTES  # a laptop: llama-server's 8 GiB
    assert budget_for_space(16 * 10**9) == 4 * 10**9  # a small device: a quarter of what is free
    assert budget_for_space(0) == 1
    with FragmentStore(tmp_path / "s") as store:
        assert store.recorded_max_bytes() == store.max_bytes
        assert store.max_bytes == pytest.approx(default_max_bytes(tmp_path / "s"), rel=0.01)
    with FragmentStore(tmp_path / "s", max_bytes=3 * MiB) as store:
        assert store.max_bytes == 3 * MiB
    with FragmentStore(tmp_path / "s") as store:
        assert store.max_bytes == 3 * MiB


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_batch_larger_than_the_budget_is_refused_whole(tmp_path, compression, store_log):
    """A budget of 4 MiB: one fragment of 5.6 MiB, or three of 1.4 MiB (4.2 MiB together), is
    refused with StoreBudgetError naming both sizes; nothing is written, nothing evicted, the
    map does not grow; a batch that fits is then written, evicting what it must."""
    from edgesync_store.errors import StoreBudgetError, sized

    budget = 4 * MiB
    with FragmentStore(tmp_path / "s", max_bytes=budget, compression=compression) as store:
        kept = make_fragment(seed=1, end=64, layers=(0, 10, 1))  # 0.5 MiB
        assert store.put(kept)
        before, map_size = _store_state(store), store.stats().map_size
        big = make_fragment(seed=2, end=256, kind="bits")  # 5.6 MiB of K and V
        chain = [make_fragment(seed=3 + i, kind="bits") for i in range(3)]  # 1.4 MiB each
        for batch in ([big], chain):
            with pytest.raises(StoreBudgetError) as refused:
                store.put_many(batch)
            err = refused.value
            assert err.max_bytes == budget and err.nbytes > budget and err.held == 0
            assert sized(err.nbytes) in str(err) and sized(budget) in str(err) and "nothing written" in str(err)
            assert "4.0 MiB (4194304 bytes)" in str(err)
            assert _store_state(store) == before and store.stats().map_size == map_size
            assert not any(store.contains(f.key()) for f in batch) and store.contains(kept.key())
        assert store_log.count("size budget") == 0  # nothing was evicted
        assert store.put_many(chain[:2]) == 2  # 2.8 MiB + 0.5 MiB fits
        assert store.used_bytes() <= budget


def test_a_batch_that_fits_only_by_evicting_pinned_fragments_is_refused_whole(tmp_path):
    """Two stored fragments pinned by a request reading them: a batch that would need their
    room is refused (StoreBudgetError naming what cannot be evicted), nothing evicted; once
    they are unpinned the same batch is written, evicting them."""
    from edgesync_store.errors import StoreBudgetError, sized

    with FragmentStore(tmp_path / "s", max_bytes=4 * MiB) as store:
        old = [make_fragment(seed=10 + i, kind="bits") for i in range(2)]  # 2.8 MiB stored
        new = [make_fragment(seed=20 + i, kind="bits") for i in range(2)]  # 2.8 MiB more
        assert store.put_many(old) == 2
        before = _store_state(store)
        with store.pins.pinned([f.key() for f in old]):
            with pytest.raises(StoreBudgetError, match="cannot be evicted") as refused:
                store.put_many(new)
            assert refused.value.held == store.used_bytes() and sized(refused.value.held) in str(refused.value)
            assert _store_state(store) == before
        assert store.put_many(new) == 2
        assert all(store.contains(f.key()) for f in new) and not any(store.contains(f.key()) for f in old)


def test_the_map_grows_ahead_of_a_multi_hundred_mb_batch(tmp_path, store_log):
    """From a 1 MiB map, one put_many of 256 MiB (32 fragments of 64 tokens of Llama-3.1-8B's
    KV, 8 MiB each) grows the map once, before its one transaction: it never fills."""
    base = make_fragment(seed=50, end=64, ns=LLAMA8B, layers=(0, 32, 1), heads=(0, 8))
    assert base.raw_nbytes == 8 * MiB
    rng = np.random.default_rng(51)
    tokens = rng.integers(0, 128000, size=64 * 32, dtype=np.int32)
    frags = [replace(base, token_start=64 * i, token_end=64 * (i + 1), token_ids=tokens[64 * i:64 * (i + 1)],
                     prefix_hash=prefix_hash(tokens[:64 * i]), content_hash="") for i in range(32)]
    with FragmentStore(tmp_path / "s", map_size=MiB, max_bytes=1 << 30) as store:
        assert store.put_many(frags) == 32
        stats = store.stats()
        assert stats.fragments == 32 and stats.raw_bytes == 256 * MiB
        assert stats.map_size >= stats.disk_bytes > 256 * MiB
        assert store.prefix_walk(LLAMA8B, tokens).matched_tokens == 64 * 32
        assert_same(store.get(frags[-1].key()), frags[-1])
    assert store_log.count("LMDB map: growing") == 1 and store_log.count("LMDB map full") == 0


def test_the_map_is_not_grown_inside_a_transaction(tmp_path):
    """Growing remaps the file: inside a read of this process (whose views point into the map)
    ``reserve`` leaves it alone, and a write that fills it there fails as StoreIOError instead
    of remapping under the read."""
    from edgesync_store.errors import StoreIOError

    with FragmentStore(tmp_path / "s", map_size=MiB) as store:
        size = store.stats().map_size
        with store.env.reader():
            assert store.env.reserve(64 * MiB, 1) == size
            with pytest.raises(StoreIOError, match="a transaction of this process is open"):
                store.transact(lambda txn: txn.put(b"k", bytes(8 * MiB), db=store.named_db(b"meta")), write=True)
        assert store.env.reserve(64 * MiB, 1) > 64 * MiB  # outside any transaction it grows
