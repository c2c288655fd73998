"""Acceptance: a store in the first or the second format (built by the test) opens under the
current code with every fragment intact; a store marked with a future version is refused with a
clear error.

The format-1 and format-2 stores are written with py-lmdb (``format1.py``), never through
``FragmentStore``; their blobs are blob format 1 (``format1.encode_v1``), as the code of those
store formats wrote them.
Its fragments are real KV: SmolLM2-135M through llama.cpp (the ``adapter`` fixture) prefills the
chat of system_prompts.json row 3 (../shared/workloads) with one user question, and its five
64-token chunks (``chunk_spans(n - 1, 64)``) are stored whole (a prefix chain), plus chunks 0-2
as 90 one-layer x one-KV-head fragments each: 275 fragments, more than
``m0002_lifecycle_v2.BATCH`` and ``m0003_heads.BATCH`` (256), so each migration runs two batches.

Format-1 lifecycle records (hits, last hit, expiry; T = the chunks' creation time):
chunk 0 hit 7 times (format 1 never promoted: it must take the long lifetime, expiry >= last hit +
7 days), chunk 1 hit 4 times (stays short), chunk 2 hit 5 times (the threshold: long), chunks 3
and 4 0 and 1 hits; the singles none, and one single has no record at all (it must become an
expired record, never served).

The format-2 store holds the same fragments with format-2 lifecycle records (the same hits,
last hits and expiries; created_at, lifetime and sizes filled in) and ``used_bytes``, and no
``heads`` database: migration 3 must give every blob its head (``codec.head_of``) and nothing
else. A crash point's count (``migrate.batch@N``) runs over every migration of one open: from
format 1, migration 2 passes ``migrate.batch`` twice before migration 3 does.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from format1 import dump, edit, heads, on_disk_version, v1_head_nbytes, write_format1_store, write_format2_store

from edgesync_store.core import codec
from edgesync_store.core.crashpoints import ENV_VAR
from edgesync_store.core.store import FragmentStore
from edgesync_store.lifecycle.merge import split_heads, split_layers
from edgesync_store.migrations import (
    CURRENT_VERSION,
    MIGRATIONS,
    StoreFormatError,
    m0002_lifecycle_v2,
    m0003_heads,
    migrate,
)
from edgesync_store.schema import KVFragment, chunk_spans
from edgesync_store.ttl import LIFECYCLE_V1, LIFECYCLE_V2, LIFETIME_LONG, LIFETIME_SHORT, LONG_TTL_SECONDS, ManualClock

pytestmark = [pytest.mark.model]

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "What should I pack for three days in Lisbon?"
HITS = {0: 7, 1: 4, 2: 5, 3: 0, 4: 1}
"""Format-1 hit counts of the five whole chunks."""


def migrating(path, **kw) -> FragmentStore:
    """The store at ``path`` opened as the application opens it: older formats migrated."""
    return FragmentStore(path, upgrade=migrate, **kw)


def singles(whole: KVFragment) -> list[KVFragment]:
    return [h for layer in split_layers(whole, 1) for h in split_heads(layer, 1)]


class Material:
    def __init__(self, tokens, chunks, entries, no_record):
        self.tokens = tokens
        self.chunks = chunks
        self.entries = entries  # [(fragment, format-1 record or None)]
        self.no_record = no_record  # the key of the fragment without a record
        self.t0 = chunks[0].created_at

    @property
    def fragments(self) -> list[KVFragment]:
        return [f for f, _ in self.entries]


@pytest.fixture(scope="module")
def material(adapter, system_prompts) -> Material:
    tokens = adapter.tokenize(adapter.apply_chat_template(
        [{"role": "system", "content": system_prompts[3]}, {"role": "user", "content": QUESTION}]))
    adapter.clear_kv_cache()
    for start, end in adapter.prefill_plan(0, len(tokens)):
        adapter.llm.eval(tokens[start:end])
    spans = chunk_spans(len(tokens) - 1, 64)
    assert len(spans) == 5
    chunks = adapter.extract_fragments(tokens, spans)
    t0 = chunks[0].created_at
    entries = [(c, (HITS[i], t0 + 10.0 * (i + 1) if HITS[i] else 0.0, t0 + (600.0 if i == 0 else 1800.0)))
               for i, c in enumerate(chunks)]
    parts = [s for c in chunks[:3] for s in singles(c)]
    entries += [(p, None if i == 0 else (0, 0.0, p.expires_at)) for i, p in enumerate(parts)]
    assert len(entries) == 275 > max(m0002_lifecycle_v2.BATCH, m0003_heads.BATCH)
    return Material(tokens, chunks, entries, parts[0].key())


@pytest.fixture(scope="module")
def pristine_v1(material, tmp_path_factory) -> tuple[Path, dict[bytes, bytes]]:
    """The format-1 store, built once; copy it before opening it."""
    path = tmp_path_factory.mktemp("v1") / "store"
    return path, write_format1_store(path, material.entries)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def assert_same_fragment(got: KVFragment, want: KVFragment) -> None:
    assert got is not None
    assert got.key() == want.key()
    assert (got.token_start, got.token_end, got.layer_start, got.layer_end, got.layer_stride, got.head_start,
            got.head_end) == (want.token_start, want.token_end, want.layer_start, want.layer_end, want.layer_stride,
                              want.head_start, want.head_end)
    assert got.keys.dtype == want.keys.dtype == np.float16 and got.keys.shape == want.keys.shape
    assert np.array_equal(got.keys, want.keys) and np.array_equal(got.values, want.values)
    assert np.array_equal(got.token_ids, want.token_ids) and got.prefix_hash == want.prefix_hash
    assert got.created_at == want.created_at


def assert_heads_of_every_blob(path: Path, blobs: dict[bytes, bytes]) -> None:
    """The store at ``path`` holds, for every blob, its head (as long as format 1's layout says
    and as ``codec.head_of`` cuts it), and nothing else."""
    found = heads(path)
    assert found is not None and set(found) == set(blobs)
    for key, blob in blobs.items():
        assert found[key] == blob[:v1_head_nbytes(blob)] == codec.head_of(blob)


# ---------------------------------------------------------------------------------------------
# format 1 -> current


def test_format1_store_opens_migrated_with_every_fragment_intact(material, pristine_v1, tmp_path):
    src, blobs = pristine_v1
    path = copy(src, tmp_path / "store")
    before = dump(path)
    assert on_disk_version(path) == b"1"
    assert all(len(v) == LIFECYCLE_V1.size for _, v in before[b"lifecycle"])
    assert len(before[b"lifecycle"]) == len(material.entries) - 1  # one fragment has no record

    now = material.t0 + 60.0
    with migrating(path, clock=ManualClock(now)) as store:
        assert store.format_version == CURRENT_VERSION == 3
        for frag, record in material.entries:
            key = frag.key()
            assert_same_fragment(store.get(key), frag)
            life = store.lifecycle(key)
            assert life.created_at == frag.created_at
            assert life.nbytes == len(blobs[key]) and life.raw_nbytes == frag.raw_nbytes
            if record is None:  # no format-1 record: an expired one, never served
                assert key == material.no_record
                assert (life.hit_count, life.expires_at, life.lifetime) == (0, 0.0, LIFETIME_SHORT)
                assert not store.is_live(key)
                continue
            hits, last_hit, expires = record
            assert (life.hit_count, life.last_hit_at) == (hits, last_hit)
            if hits >= 5:
                assert life.lifetime == LIFETIME_LONG
                assert life.expires_at >= last_hit + LONG_TTL_SECONDS
                assert life.expires_at == max(expires, last_hit + LONG_TTL_SECONDS)
            else:
                assert life.lifetime == LIFETIME_SHORT and life.expires_at == expires
            assert store.is_live(key)
        # the promotions the records call for, by chunk
        lifetimes = [store.lifecycle(c.key()).lifetime for c in material.chunks]
        assert lifetimes == [LIFETIME_LONG, LIFETIME_SHORT, LIFETIME_LONG, LIFETIME_SHORT, LIFETIME_SHORT]
        assert store.used_bytes() == sum(len(b) for b in blobs.values())
        assert store.stats().dropped_corrupt == 0
        match = store.prefix_walk(material.chunks[0].namespace, material.tokens)
        assert match.matched_tokens == len(material.tokens) - 1
        assert [(s.token_start, s.token_end) for s in match.spans] == \
            [(c.token_start, c.token_end) for c in material.chunks]
        # a week on, only the promoted chunks 0 and 2 are served: the walk stops after chunk 0
        later = store.prefix_walk(material.chunks[0].namespace, material.tokens, now=material.t0 + 86400.0)
        assert later.matched_tokens == material.chunks[0].token_end

    after = dump(path)
    assert on_disk_version(path) == b"3"
    assert after[b"fragments"] == before[b"fragments"]  # blobs are not rewritten: still format 1
    assert all(blob[4:6] == b"\x01\x00" for _, blob in after[b"fragments"])
    assert after[b"by_prefix"] == before[b"by_prefix"]
    assert len(after[b"lifecycle"]) == len(material.entries)
    assert all(len(v) == LIFECYCLE_V2.size for _, v in after[b"lifecycle"])
    assert_heads_of_every_blob(path, blobs)
    # opening again changes nothing
    migrating(path).close()
    assert dump(path) == after


def test_read_only_open_of_format1_reads_without_migrating(material, pristine_v1, tmp_path):
    src, _ = pristine_v1
    path = copy(src, tmp_path / "store")
    before = dump(path)
    with migrating(path, readonly=True) as store:
        assert store.format_version == 1
        for frag, record in material.entries[:8]:  # the 5 chunks, the single without a record, 2 more
            assert_same_fragment(store.get(frag.key()), frag)
            life = store.lifecycle(frag.key())  # the format-1 record as it is (none: expired)
            assert (life.hit_count, life.last_hit_at, life.expires_at) == (record or (0, 0.0, 0.0))
            assert (life.created_at, life.nbytes) == (0.0, 0)  # not in format 1
        with pytest.raises(PermissionError):
            store.put(material.chunks[0])
    assert on_disk_version(path) == b"1"
    assert dump(path) == before


@pytest.mark.parametrize("readonly", [False, True], ids=["writable", "read-only"])
def test_future_format_is_refused_with_both_versions_and_the_path(material, tmp_path, readonly):
    path = tmp_path / "future-store"
    future = CURRENT_VERSION + 1
    write_format1_store(path, material.entries[:2], version=str(future).encode())
    before = dump(path)
    with pytest.raises(StoreFormatError) as info:
        migrating(path, readonly=readonly)
    message = str(info.value)
    assert f"format version {future}" in message
    assert f"reads up to {CURRENT_VERSION}" in message
    assert str(path) in message
    assert dump(path) == before  # refused without writing
    # and the store is not left locked: a second attempt gets the same refusal, not a wait
    with pytest.raises(StoreFormatError):
        migrating(path, readonly=readonly, open_timeout_s=1.0)


# ---------------------------------------------------------------------------------------------
# a migration killed mid-way


def open_in_subprocess(path: Path, crash: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{ENV_VAR: crash})
    code = ("import sys; from edgesync_store.core.store import FragmentStore; "
            "from edgesync_store.migrations import migrate; FragmentStore(sys.argv[1], upgrade=migrate).close()")
    return subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def assert_finished_by_the_next_open(path: Path, material, migrated: dict) -> None:
    """The next open of ``path`` finishes the migrations: the current format, the fragments read
    back unchanged, nothing refused, and every record equal to the uninterrupted migration's."""
    with migrating(path) as store:
        assert store.format_version == CURRENT_VERSION
        for frag in material.fragments[:5] + material.fragments[-3:]:
            assert_same_fragment(store.get(frag.key()), frag)
        assert store.stats().dropped_corrupt == 0
    assert dump(path) == migrated


def killed_in_migration(src: Path, dst: Path, point: str) -> Path:
    """A copy of the store at ``src`` opened at ``dst`` by a process killed (SIGKILL) at ``point``."""
    path = copy(src, dst)
    proc = open_in_subprocess(path, point)
    assert proc.returncode == -signal.SIGKILL, f"not killed at {point}: exit {proc.returncode}: {proc.stderr}"
    return path


@pytest.fixture(scope="module")
def migrated_uninterrupted(pristine_v1, tmp_path_factory) -> dict:
    src, _ = pristine_v1
    path = copy(src, tmp_path_factory.mktemp("uninterrupted") / "store")
    migrating(path).close()
    return dump(path)


@pytest.mark.parametrize("point, upgraded", [("migrate.batch@1", m0002_lifecycle_v2.BATCH),
                                             ("migrate.batch@2", 275), ("migrate.before_version", 275)])
def test_killed_migration_is_finished_by_the_next_open(point, upgraded, material, pristine_v1,
                                                       migrated_uninterrupted, tmp_path):
    src, _ = pristine_v1
    path = killed_in_migration(src, tmp_path / "store", point)
    # killed mid-way: some records rewritten, the version not yet moved on
    assert on_disk_version(path) == b"1"
    half = dump(path)
    assert sum(len(v) == LIFECYCLE_V2.size for _, v in half[b"lifecycle"]) == upgraded
    assert not any(k == b"used_bytes" for k, _ in half[b"meta"])
    assert_finished_by_the_next_open(path, material, migrated_uninterrupted)


# ---------------------------------------------------------------------------------------------
# the checks can fail


def test_a_flipped_byte_in_a_format1_blob_is_refused_after_migration(material, pristine_v1, tmp_path):
    """A byte of chunk 4's token IDs flipped on disk: the migration still completes (the header
    does not parse, so the record keeps no creation time), the read refuses the fragment, counts
    it and removes it; every other fragment is intact."""
    src, blobs = pristine_v1
    path = copy(src, tmp_path / "store")
    victim = material.chunks[4]
    blob = blobs[victim.key()]
    header_len = int.from_bytes(blob[6:10], "little")
    ids_at = 10 + header_len
    crc_at = ids_at + 4 * victim.span
    window = blob[ids_at:crc_at + 4 + 64]  # token IDs, head checksum, start of the payload
    raw = bytearray((path / "data.mdb").read_bytes())
    at = raw.find(window)
    assert at >= 0 and raw.find(window, at + 1) == -1
    raw[at + 1] ^= 0x40
    (path / "data.mdb").write_bytes(bytes(raw))
    with pytest.raises(codec.CodecError, match="head checksum"):
        codec.peek(bytes(raw[at - ids_at: at - ids_at + len(blob)]))

    with migrating(path) as store:
        assert store.format_version == CURRENT_VERSION
        life = store.lifecycle(victim.key())
        assert life.created_at == 0.0 and life.nbytes == len(blob)
        assert store.get(victim.key()) is None
        assert store.stats().dropped_corrupt == 1
        assert not store.contains(victim.key())
        for frag in material.fragments:
            if frag is not victim:
                assert_same_fragment(store.get(frag.key()), frag)
        assert store.stats().dropped_corrupt == 1
        assert store.used_bytes() == sum(len(b) for k, b in blobs.items() if k != victim.key())


# ---------------------------------------------------------------------------------------------
# format 2 -> 3: the heads


@pytest.fixture(scope="module")
def pristine_v2(material, tmp_path_factory) -> tuple[Path, dict[bytes, bytes]]:
    """The format-2 store (format-1 blobs, format-2 lifecycle records), built once; copy it
    before opening it."""
    entries = []
    for frag, record in material.entries:
        hits, last_hit, expires = record or (0, 0.0, 0.0)
        entries.append((frag, (hits, last_hit, expires, frag.created_at, 1 if hits >= 5 else 0, 0, frag.raw_nbytes)))
    path = tmp_path_factory.mktemp("v2") / "store"
    return path, write_format2_store(path, entries)


def test_format2_store_opens_at_version_3_with_the_head_of_every_blob(material, pristine_v2, tmp_path):
    src, blobs = pristine_v2
    path = copy(src, tmp_path / "store")
    before = dump(path)
    assert on_disk_version(path) == b"2" and heads(path) is None

    ns = material.chunks[0].namespace
    with migrating(path, clock=ManualClock(material.t0 + 60.0)) as store:
        assert store.format_version == CURRENT_VERSION == 3
        match = store.prefix_walk(ns, material.tokens)
        assert match.matched_tokens == len(material.tokens) - 1
        assert [(s.token_start, s.token_end) for s in match.spans] == \
            [(c.token_start, c.token_end) for c in material.chunks]
        # the walk's sizes are the blobs' (read beside the heads)
        assert [s.compressed_nbytes for s in match.spans[3:]] == [len(blobs[c.key()]) for c in material.chunks[3:]]
        assert store.keys_along(ns, material.tokens[:-1]).count(material.chunks[4].key()) == 1
        for frag in material.fragments:
            assert_same_fragment(store.get(frag.key()), frag)
        assert store.used_bytes() == sum(len(b) for b in blobs.values())
        assert store.stats().dropped_corrupt == 0

    after = dump(path)
    assert on_disk_version(path) == b"3"
    # the blobs unchanged byte for byte, and every other record but the version
    assert after[b"fragments"] == before[b"fragments"] == sorted(blobs.items())
    assert after[b"by_prefix"] == before[b"by_prefix"] and after[b"lifecycle"] == before[b"lifecycle"]
    # the open records the default size budget a store made before it lacked (core/store.py)
    assert [(k, v) for k, v in after[b"meta"] if k not in (b"format_version", b"max_bytes")] == \
        [(k, v) for k, v in before[b"meta"] if k != b"format_version"]
    assert_heads_of_every_blob(path, blobs)
    # opening again changes nothing
    found = heads(path)
    migrating(path).close()
    assert dump(path) == after and heads(path) == found


def test_read_only_open_of_format2_reads_the_heads_from_the_blobs(material, pristine_v2, tmp_path):
    src, _ = pristine_v2
    path = copy(src, tmp_path / "store")
    before = dump(path)
    with migrating(path, readonly=True, clock=ManualClock(material.t0 + 60.0)) as store:
        assert store.format_version == 2
        match = store.prefix_walk(material.chunks[0].namespace, material.tokens)
        assert match.matched_tokens == len(material.tokens) - 1
        assert_same_fragment(store.get(material.chunks[4].key()), material.chunks[4])
    assert on_disk_version(path) == b"2" and heads(path) is None
    assert dump(path) == before


@pytest.mark.parametrize("read", ["get", "walk"])
def test_blob_whose_head_does_not_parse_gets_no_head_and_is_refused_by_the_next_read(read, material, pristine_v2,
                                                                                   tmp_path):
    """A byte of chunk 4's token IDs flipped in its blob (a fake for a corrupt page on disk):
    the migration completes and gives that blob no head; the next read (a ``get`` or a walk)
    refuses the fragment, counts it and removes it; every other fragment is intact."""
    src, blobs = pristine_v2
    path = copy(src, tmp_path / "store")
    victim = material.chunks[4]
    key = victim.key()
    ids_at = v1_head_nbytes(blobs[key]) - 4 - 4 * victim.span

    def flip(txn, env):
        db = env.open_db(b"fragments", txn=txn, create=False)
        blob = bytearray(txn.get(key, db=db))
        blob[ids_at + 1] ^= 0x40
        with pytest.raises(codec.CodecError, match="head checksum"):
            codec.peek(bytes(blob))
        txn.put(key, bytes(blob), db=db)

    edit(path, flip)
    migrating(path).close()  # the migration alone
    assert on_disk_version(path) == b"3"
    found = heads(path)
    assert set(found) == set(blobs) - {key}
    assert all(found[k] == codec.head_of(b) for k, b in blobs.items() if k != key)

    ns = victim.namespace
    with migrating(path, clock=ManualClock(material.t0 + 60.0)) as store:
        assert store.contains(key)
        if read == "get":
            assert store.get(key) is None
        else:
            assert store.prefix_walk(ns, material.tokens).matched_tokens == victim.token_start
        assert store.stats().dropped_corrupt == 1
        assert not store.contains(key) and store.lifecycle(key) is None
        assert store.prefix_walk(ns, material.tokens).matched_tokens == victim.token_start
        for frag in material.fragments:
            if frag is not victim:
                assert_same_fragment(store.get(frag.key()), frag)
        assert store.stats().dropped_corrupt == 1
        assert store.used_bytes() == sum(len(b) for k, b in blobs.items() if k != key)
    after = dump(path)
    assert key not in {k for k, _ in after[b"fragments"]} | {v for _, v in after[b"by_prefix"]}
    assert set(heads(path)) == set(blobs) - {key}


@pytest.fixture(scope="module")
def migrated_v2_uninterrupted(pristine_v2, tmp_path_factory) -> tuple[dict, dict]:
    src, _ = pristine_v2
    path = copy(src, tmp_path_factory.mktemp("uninterrupted-v2") / "store")
    migrating(path).close()
    return dump(path), heads(path)


@pytest.mark.parametrize("point, headed", [("migrate.batch@1", m0003_heads.BATCH), ("migrate.batch@2", 275),
                                           ("migrate.before_version", 275)])
def test_killed_migration_3_is_finished_by_the_next_open(point, headed, material, pristine_v2,
                                                         migrated_v2_uninterrupted, tmp_path):
    src, blobs = pristine_v2
    before = dump(src)
    path = killed_in_migration(src, tmp_path / "store", point)
    # killed mid-way: some heads written, nothing else, the version not yet moved on
    assert on_disk_version(path) == b"2"
    half = heads(path)
    assert len(half) == headed and all(half[k] == codec.head_of(blobs[k]) for k in half)
    assert dump(path) == before
    with migrating(path) as store:
        assert store.format_version == CURRENT_VERSION
        for frag in material.fragments[:5] + material.fragments[-3:]:
            assert_same_fragment(store.get(frag.key()), frag)
        assert store.stats().dropped_corrupt == 0
    assert (dump(path), heads(path)) == migrated_v2_uninterrupted
    assert_heads_of_every_blob(path, blobs)


@pytest.mark.parametrize("point, headed", [("migrate.batch@3", m0003_heads.BATCH),
                                           ("migrate.before_version@2", 275)])
def test_format1_store_killed_in_migration_3_is_finished_by_the_next_open(point, headed, material, pristine_v1,
                                                                         migrated_uninterrupted, tmp_path):
    """From format 1, the first two passes of ``migrate.batch`` and the first of
    ``migrate.before_version`` are migration 2's: these kills land in migration 3, with
    migration 2 done."""
    src, blobs = pristine_v1
    path = killed_in_migration(src, tmp_path / "store", point)
    assert on_disk_version(path) == b"2"
    half = dump(path)
    assert all(len(v) == LIFECYCLE_V2.size for _, v in half[b"lifecycle"]) and len(half[b"lifecycle"]) == 275
    assert len(heads(path)) == headed
    assert_finished_by_the_next_open(path, material, migrated_uninterrupted)
    assert_heads_of_every_blob(path, blobs)


def test_an_old_store_opened_without_upgrade_is_refused_untouched(material, pristine_v1, tmp_path):
    """The store's core never migrates by itself: a writable open without ``upgrade`` refuses a
    format-1 store, naming the way to migrate it, and leaves it as it was."""
    path = copy(pristine_v1[0], tmp_path / "store")
    before = dump(path)
    with pytest.raises(StoreFormatError, match="format version 1, older than 3: open it with upgrade="):
        FragmentStore(path)
    assert dump(path) == before
    assert len(MIGRATIONS) + 1 == CURRENT_VERSION
