"""Acceptance: the compactor process is killed (SIGKILL) at 20 or more moments (a seeded random
delay and named crash points inside reclaim and migration); after each, the store opens, every
fragment that no rule removed reads back byte-identical, and no read fails its checksum.

Real KV: SmolLM2-135M through llama.cpp (the ``adapter`` fixture) prefills three chats, the
system prompts of system_prompts.json rows 0, 1 and 2 (../shared/workloads) with one user
question each (344-362 tokens), and the 64-token chunks of each (``chunk_spans(n - 1, 64)``,
5 chunks, the last absorbing the remainder) are extracted; they stay in memory as numpy arrays.

The pristine store, built once (format 2 through ``FragmentStore``, and the same fragments as a
format-1 store written with py-lmdb for the migration kills), gives the compactor every kind of
work (285 fragments, ~22 MB):

* prompt A (row 0): chunk 0 whole; chunk 1 as layer halves [0, 15) + [15, 30) (a merge along
  axis 0); chunk 2 as KV-head groups [0, 2) + [2, 3) (axis 1); chunk 3 as 90 one-layer x
  one-head fragments (30 merges along heads, then one along layers); chunk 4 whole, plus a
  shorter duplicate of it, its first 64 tokens (same prefix and start, no fragment continues
  after it: dedup drops it);
* prompt B (row 1): 5 whole chunks created 2 h ago, expired 1.5 h ago on the real clock (the
  compactor subprocess uses the real clock): expiry removes them;
* prompt C (row 2): chunks 0 and 1 as 90 one-layer x one-head fragments each, chunks 2-4
  whole. The 180 + 90 singles take the store past ``m0002_lifecycle_v2.BATCH`` (256), so the
  migration of the format-1 copy runs two batches (crash points ``migrate.batch@1``, ``@2``).

No rule removes prompt A's or C's KV (the budget is the default 1 GiB), so after every kill and
after the completing run each of their ten chunks must be reassembled, from whatever fragments
now cover it (parts, partly merged groups or the merged whole), into K and V bit-equal to the
chunk extracted whole; every fragment present, B's and the duplicate too while they last, must
decode (checksums) into exactly the bytes of the original chunk it claims. After a completing run
the store holds exactly the ten whole chunks of A and C.

Kills, each on a fresh copy of a pristine store (``shutil.copytree``), of ``python -m
edgesync_store.compact STORE --force-reclaim --json`` (never loads the model):

* the five reclaim crash points (format-2 store);
* ``migrate.batch@1``, ``migrate.batch@2``, ``migrate.before_version`` (format-1 store: the
  compactor's open migrates it);
* 20 delays drawn by ``random.Random(SEED)`` in [0, the measured duration of a normal run);
* 4 delays (``random.Random(SEED + 1)``) in runs with ``--max-bytes`` at 60% of what A and C
  take, so the run evicts: there only every remaining fragment is checked intact, and the
  completing run must bring the store under the budget.

32 kills in all. After each: the store opens (finishing a migration), the checks above pass and
``stats().dropped_corrupt`` is 0, ``used_bytes`` equals the sum of the blobs, a compaction run
(in this process) completes, and the checks pass again. ``test_checks_catch_one_flipped_byte``
shows that the checks see a single corrupt byte in ``data.mdb``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from format1 import on_disk_version, write_format1_store

from edgesync_store.compactor import Compactor
from edgesync_store.core.crashpoints import ENV_VAR
from edgesync_store.core.store import STORE_FORMAT_VERSION, FragmentStore
from edgesync_store.lifecycle.merge import split_heads, split_layers
from edgesync_store.lifecycle.reclaim import TMP_NAME
from edgesync_store.migrations import migrate
from edgesync_store.schema import KVFragment, chunk_spans

pytestmark = [pytest.mark.model]

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "How do I revise for a chemistry test?"
CHUNK = 64
SEED = 20240611
N_RANDOM = 20
N_EVICT = 4
BUDGET_FRACTION = 0.6
RECLAIM_POINTS = ["reclaim.locked", "reclaim.copied", "reclaim.synced", "reclaim.renamed", "reclaim.reopened"]
MIGRATION_POINTS = ["migrate.batch@1", "migrate.batch@2", "migrate.before_version"]
_rng = random.Random(SEED)
RANDOM_FRACTIONS = [_rng.random() for _ in range(N_RANDOM)]
"""Kill delays as fractions of a normal run's duration, drawn once from Random(SEED)."""
_rng = random.Random(SEED + 1)
EVICT_FRACTIONS = [_rng.random() for _ in range(N_EVICT)]

KILLS: list[dict] = []
"""One row per kill of this module's runs (what, when, the state it left): the summary test."""


# ---------------------------------------------------------------------------------------------
# real KV and the pristine stores


def singles(whole: KVFragment) -> list[KVFragment]:
    """The 90 one-layer x one-KV-head fragments of a whole chunk."""
    return [h for layer in split_layers(whole, 1) for h in split_heads(layer, 1)]


def short_duplicate(whole: KVFragment, span: int = CHUNK) -> KVFragment:
    """The first ``span`` tokens of ``whole``: the KV of a position depends only on the tokens
    up to it, so these are exactly the bytes a 64-token extraction would give."""
    return KVFragment(
        namespace=whole.namespace, token_start=whole.token_start, token_end=whole.token_start + span,
        layer_start=0, layer_end=whole.namespace.n_layer,
        keys=np.ascontiguousarray(whole.keys[:, :span]), values=np.ascontiguousarray(whole.values[:, :span]),
        token_ids=whole.token_ids[:span], prefix_hash=whole.prefix_hash,
        created_at=whole.created_at, expires_at=whole.expires_at,
    )


def origin_key(frag: KVFragment) -> tuple[bytes, int, bytes]:
    return frag.prefix_hash, frag.token_start, frag.token_ids[:CHUNK].tobytes()


@dataclass
class Layout:
    """The pristine store's fragments and what compaction must make of them."""

    tokens: dict[str, list[int]]
    whole: dict[str, list[KVFragment]]
    fragments: list[KVFragment] = field(default_factory=list)
    origin: dict[tuple[bytes, int, bytes], KVFragment] = field(default_factory=dict)
    """(prefix hash, token_start, first 64 token IDs) -> the whole chunk (chunk 0 of every
    prompt shares the empty prefix)."""
    final_keys: set[bytes] = field(default_factory=set)
    expired_keys: set[bytes] = field(default_factory=set)
    dup_key: bytes = b""
    known_keys: set[bytes] = field(default_factory=set)

    @property
    def kept_chunks(self) -> list[KVFragment]:
        return self.whole["A"] + self.whole["C"]


@pytest.fixture(scope="module")
def layout(adapter, system_prompts) -> Layout:
    tokens, whole = {}, {}
    for row, name in enumerate("ABC"):
        toks = adapter.tokenize(adapter.apply_chat_template(
            [{"role": "system", "content": system_prompts[row]}, {"role": "user", "content": QUESTION}]))
        adapter.clear_kv_cache()
        for start, end in adapter.prefill_plan(0, len(toks)):
            adapter.llm.eval(toks[start:end])
        spans = chunk_spans(len(toks) - 1, CHUNK)
        assert len(spans) == 5 and spans[-1][1] - spans[-1][0] > CHUNK
        if name == "B":  # created 2 h ago, lived 30 min: expired 1.5 h ago on the real clock
            chunks = adapter.extract_fragments(toks, spans, now=time.time() - 7200, ttl_seconds=1800)
        else:
            chunks = adapter.extract_fragments(toks, spans)
        tokens[name], whole[name] = toks, chunks
    lay = Layout(tokens, whole)
    a, b, c = whole["A"], whole["B"], whole["C"]
    dup = short_duplicate(a[4])
    lay.fragments = (
        [a[0]] + split_layers(a[1], 15) + split_heads(a[2], 2) + singles(a[3]) + [a[4], dup]
        + list(b)
        + singles(c[0]) + singles(c[1]) + [c[2], c[3], c[4]]
    )
    for chunk in a + b + c:
        lay.origin[origin_key(chunk)] = chunk
    lay.final_keys = {chunk.key() for chunk in a + c}
    lay.expired_keys = {chunk.key() for chunk in b}
    lay.dup_key = dup.key()
    # what may legitimately be in the store at any moment: the pristine fragments, the merged
    # wholes, and the one-layer all-heads fragments between the two merges of the singles
    lay.known_keys = ({f.key() for f in lay.fragments} | lay.final_keys
                      | {f.key() for chunk in (a[3], c[0], c[1]) for f in split_layers(chunk, 1)})
    assert len(lay.fragments) == len({f.key() for f in lay.fragments}) == 285
    return lay


@pytest.fixture(scope="module")
def pristine(layout, tmp_path_factory) -> dict[str, Path]:
    """The pristine stores, built once: ``"v2"`` (current format, through FragmentStore) and
    ``"v1"`` (format 1, py-lmdb; lifecycle records carry each fragment's own hits and expiry)."""
    base = tmp_path_factory.mktemp("pristine")
    with FragmentStore(base / "v2") as store:
        assert store.put_many(layout.fragments) == len(layout.fragments)
    write_format1_store(base / "v1", [(f, (0, 0.0, f.expires_at)) for f in layout.fragments])
    return {"v2": base / "v2", "v1": base / "v1"}


# ---------------------------------------------------------------------------------------------
# the checks


def expected_part(whole: KVFragment, frag: KVFragment) -> tuple[np.ndarray, np.ndarray]:
    """The K and V that ``frag`` must hold: its layers, tokens and heads cut from ``whole``."""
    rows = list(frag.layers)
    dim = whole.namespace.head_dim
    cols = slice(frag.head_start * dim, frag.head_end * dim)
    return whole.keys[rows][:, :frag.span, cols], whole.values[rows][:, :frag.span, cols]


def reassemble(frags: list[KVFragment], whole: KVFragment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """K, V ``[layers, span, width]`` of ``whole``'s span filled from ``frags`` (the fragments of
    exactly that span), and the (layer, head) cells they covered."""
    ns = whole.namespace
    keys, values = np.zeros_like(whole.keys), np.zeros_like(whole.values)
    covered = np.zeros((ns.n_layer, ns.n_head_kv), dtype=bool)
    dim = ns.head_dim
    for f in frags:
        for i, layer in enumerate(f.layers):
            for h in range(f.head_start, f.head_end):
                src = slice((h - f.head_start) * dim, (h - f.head_start + 1) * dim)
                keys[layer, :, h * dim:(h + 1) * dim] = f.keys[i, :, src]
                values[layer, :, h * dim:(h + 1) * dim] = f.values[i, :, src]
                covered[layer, h] = True
    return keys, values, covered


def check_store(path: Path, lay: Layout, *, final: bool, budget: int | None = None) -> set[bytes]:
    """Open the store at ``path`` (finishing any migration) and check it (module docstring);
    ``final``: a compaction has run to completion; ``budget``: runs with eviction, where only
    each remaining fragment is checked. Returns the keys present."""
    with FragmentStore(path, upgrade=migrate) as store:
        assert store.format_version == STORE_FORMAT_VERSION
        present: set[bytes] = set()
        by_span: dict[tuple[bytes, int, int], list[KVFragment]] = {}
        total = 0
        for key, head, life, nbytes in store.iterate():
            assert head is not None, f"fragment {key.hex()[:16]}: header does not parse"
            assert key in lay.known_keys, f"fragment {key.hex()[:16]}: not one the store could hold"
            frag = store.get(key)
            assert frag is not None, f"fragment {key.hex()[:16]} failed its checksum or vanished"
            whole = lay.origin[origin_key(frag)]
            assert np.array_equal(frag.token_ids, whole.token_ids[:frag.span])
            k, v = expected_part(whole, frag)
            assert frag.keys.dtype == k.dtype and frag.keys.shape == k.shape
            assert np.array_equal(frag.keys, k) and np.array_equal(frag.values, v), \
                f"fragment {key.hex()[:16]}: KV differs from the chunk it claims"
            assert life.nbytes == nbytes and life.raw_nbytes == frag.raw_nbytes
            present.add(key)
            total += nbytes
            by_span.setdefault(origin_key(frag) + (frag.token_end,), []).append(frag)
        assert store.stats().dropped_corrupt == 0
        assert store.used_bytes() == total, "used_bytes drifted from the stored blobs"
        expired_left = present & lay.expired_keys
        assert expired_left in (set(), lay.expired_keys), "the expiry sweep (one transaction) half done"
        if budget is None:
            for whole in lay.kept_chunks:
                frags = by_span.get(origin_key(whole) + (whole.token_end,), [])
                keys, values, covered = reassemble(frags, whole)
                assert covered.all(), f"chunk [{whole.token_start}, {whole.token_end}): {int((~covered).sum())} " \
                                      "layer x head cells lost"
                assert np.array_equal(keys, whole.keys) and np.array_equal(values, whole.values)
            for name in "AC":
                match = store.prefix_walk(whole.namespace, lay.tokens[name])
                assert match.matched_tokens == len(lay.tokens[name]) - 1
            # expired KV is never served (B's walk may only match the chat template's first
            # tokens, in chunk 0 of another prompt)
            match = store.prefix_walk(whole.namespace, lay.tokens["B"])
            assert match.matched_tokens < CHUNK
            assert not {k for span in match.spans for k in span.keys} & lay.expired_keys
        if final:
            assert not expired_left and lay.dup_key not in present
            if budget is None:
                assert present == lay.final_keys
            else:
                assert total <= budget
    return present


def run_compactor(path: Path, *args: str, crash: str | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop(ENV_VAR, None)
    if crash:
        env[ENV_VAR] = crash
    return subprocess.Popen(
        [sys.executable, "-m", "edgesync_store.compact", str(path), "--force-reclaim", "--json", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def fresh_copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "store"
    shutil.copytree(src, dst)
    return dst


def complete(path: Path, lay: Layout, budget: int | None = None) -> set[bytes]:
    """After the checks of a killed run: compact to completion in this process, check again."""
    with FragmentStore(path) as store:
        report = Compactor(store).run(force_reclaim=True, max_bytes=budget)
    assert report.skipped is None and not report.stopped
    assert not (path / TMP_NAME).exists()  # a killed reclaim's copy is removed by the next run
    return check_store(path, lay, final=True, budget=budget)


def classify(present: set[bytes], lay: Layout) -> str:
    if present == {f.key() for f in lay.fragments}:
        return "untouched"
    return "done" if present == lay.final_keys else "mid"


# ---------------------------------------------------------------------------------------------
# the reference run


@pytest.fixture(scope="module")
def reference(layout, pristine, tmp_path_factory) -> dict:
    """One uninterrupted run on a copy of the format-2 store: its JSON report and its duration
    (process start to exit), the window the random kills fall in."""
    path = fresh_copy(pristine["v2"], tmp_path_factory.mktemp("reference"))
    t0 = time.monotonic()
    proc = run_compactor(path)
    out, err = proc.communicate(timeout=120)
    duration = time.monotonic() - t0
    assert proc.returncode == 0, err
    report = json.loads(out)
    assert report["fragments_before"] == 285 and report["fragments_after"] == 10
    assert (report["expired"], report["deduplicated"]) == (5, 1)
    assert (report["merged_heads"], report["merged_layers"]) == (1 + 30 + 60, 1 + 1 + 2)
    assert report["evicted"] == 0
    assert report["reclaim"]["reclaimed"] is True and report["bytes_reclaimed"] > 0
    check_store(path, layout, final=True)
    report["duration_s"] = duration
    print(f"reference compaction: {duration:.2f} s, {report['elapsed_s']} s inside")
    report["data_bytes"] = (path / "data.mdb").stat().st_size
    shutil.rmtree(path)
    return report


def test_reference_run_does_all_the_work(reference, pristine):
    assert reference["data_bytes"] < (pristine["v2"] / "data.mdb").stat().st_size
    assert reference["duration_s"] > 0


# ---------------------------------------------------------------------------------------------
# kills


def kill_after(proc: subprocess.Popen, delay: float) -> bool:
    """SIGKILL ``proc`` after ``delay`` seconds; False when it had finished by then."""
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    return proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("point", RECLAIM_POINTS)
def test_kill_inside_reclaim(point, layout, pristine, reference, tmp_path):
    path = fresh_copy(pristine["v2"], tmp_path)
    proc = run_compactor(path, crash=point)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, f"not killed at {point}: exit {proc.returncode}: {err}"
    data = (path / "data.mdb").stat().st_size
    pristine_size = (pristine["v2"] / "data.mdb").stat().st_size
    if point in ("reclaim.renamed", "reclaim.reopened"):
        # the new file, whole: the swap happened
        assert not (path / TMP_NAME).exists()
        assert data < pristine_size
    else:
        # the old file (LMDB never shrinks it), the copy (if any) lying beside it
        assert data >= pristine_size
        assert (path / TMP_NAME).exists() == (point != "reclaim.locked")
    present = check_store(path, layout, final=False)
    # every compaction step committed before the reclaim began
    assert present == layout.final_keys
    KILLS.append({"kind": "reclaim", "at": point, "state": classify(present, layout)})
    complete(path, layout)
    shutil.rmtree(path)


@pytest.mark.parametrize("point", MIGRATION_POINTS)
def test_kill_inside_migration(point, layout, pristine, tmp_path):
    path = fresh_copy(pristine["v1"], tmp_path)
    proc = run_compactor(path, crash=point)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, f"not killed at {point}: exit {proc.returncode}: {err}"
    assert on_disk_version(path) == b"1"  # killed before the migration's last transaction
    present = check_store(path, layout, final=False)  # this open finishes the migration
    assert present == {f.key() for f in layout.fragments}  # the compaction had not begun
    assert on_disk_version(path) == str(STORE_FORMAT_VERSION).encode()
    KILLS.append({"kind": "migration", "at": point, "state": classify(present, layout)})
    complete(path, layout)
    shutil.rmtree(path)


def _random_kill(kind: str, fraction: float, args: tuple[str, ...], lay: Layout, pristine: dict, reference: dict,
                 tmp_path: Path, budget: int | None) -> None:
    delay = fraction * reference["duration_s"]
    for attempt in range(4):  # a run faster than the reference may finish first: kill sooner
        path = fresh_copy(pristine["v2"], tmp_path / f"try{attempt}")
        if kill_after(run_compactor(path, *args), delay):
            break
        check_store(path, lay, final=True, budget=budget)  # it finished: that must be right too
        shutil.rmtree(path)
        delay /= 2
    else:
        pytest.fail(f"the compactor finished before every kill (last delay {delay:.3f} s)")
    if (path / TMP_NAME).exists():  # killed inside the reclaim before the swap: the old file
        assert (path / "data.mdb").stat().st_size >= (pristine["v2"] / "data.mdb").stat().st_size
    present = check_store(path, lay, final=False, budget=budget)
    KILLS.append({"kind": kind, "at": f"{delay:.3f} s", "state": classify(present, lay)})
    complete(path, lay, budget)
    shutil.rmtree(path)


@pytest.mark.parametrize("fraction", RANDOM_FRACTIONS, ids=[f"r{i}" for i in range(N_RANDOM)])
def test_kill_after_random_delay(fraction, layout, pristine, reference, tmp_path):
    _random_kill("random", fraction, (), layout, pristine, reference, tmp_path, None)


@pytest.mark.parametrize("fraction", EVICT_FRACTIONS, ids=[f"e{i}" for i in range(N_EVICT)])
def test_kill_after_random_delay_while_evicting(fraction, layout, pristine, reference, tmp_path):
    budget = int(reference["used_bytes_after"] * BUDGET_FRACTION)
    _random_kill("evict", fraction, ("--max-bytes", str(budget)), layout, pristine, reference, tmp_path, budget)


def test_kill_summary():
    """At least 20 kills, some of the random ones in the middle of the compaction."""
    expected = len(RECLAIM_POINTS) + len(MIGRATION_POINTS) + N_RANDOM + N_EVICT
    if len(KILLS) < expected:
        pytest.skip(f"only {len(KILLS)} of the {expected} kill tests ran")
    for row in KILLS:
        print(f"{row['kind']:<9} {row['at']:<24} {row['state']}")
    assert len(KILLS) >= 20
    assert sum(row["state"] == "mid" for row in KILLS if row["kind"] == "random") >= 2


# ---------------------------------------------------------------------------------------------
# the checks can fail


def test_checks_catch_one_flipped_byte(layout, pristine, tmp_path):
    path = fresh_copy(pristine["v2"], tmp_path)
    victim = layout.whole["A"][0]
    with FragmentStore(path) as store:
        blob = store.get_blob(victim.key())
    window = blob[len(blob) // 2: len(blob) // 2 + 64]  # inside the zstd payload
    raw = bytearray((path / "data.mdb").read_bytes())
    # LMDB's copy-on-write can leave a stale copy of the page in a freed page; the live copy is
    # one of the places the window occurs, so the byte is flipped in each of them.
    places = [raw.find(window)]
    while places[-1] >= 0:
        places.append(raw.find(window, places[-1] + 1))
    places.pop()
    assert places
    for at in places:
        raw[at + 10] ^= 0x01
    (path / "data.mdb").write_bytes(bytes(raw))
    with pytest.raises(AssertionError, match="failed its checksum"):
        check_store(path, layout, final=False)
    with FragmentStore(path) as store:  # the refused fragment was removed and counted
        assert store.get(victim.key()) is None and not store.contains(victim.key())
        assert store.dropped_corrupt == 0
    with pytest.raises(AssertionError, match="cells lost"):
        check_store(path, layout, final=False)
