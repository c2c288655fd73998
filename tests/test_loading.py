"""What ``EdgeSync`` does before its first request (``request/loading.py``), on the real SmolLM2
through llama.cpp and real stores in temp dirs: a hit keeps the tokens it injected as the
store's reuse hint (from any process), and a new ``EdgeSync`` on that store warms its engine up
for an injection of that size and rehearses that hit (recording no hit, leaving an empty cache
and zeroed counters), so that its first hit writes into the buffer the warm-up faulted in; the
warm-up changes no answer.

Prompts are an app's system prompt (../shared/workloads/system_prompts.json, rows 0-1) and a
question.
"""

from __future__ import annotations

import json
import logging
import mmap
import shutil
from pathlib import Path

import pytest
from llama_counts import chat
from unreadable_store import BECOME_NOBODY, run_on_unreadable_store

from edgesync_engines.adapters import state_buffer
from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.loading import open_store, warm_up
from edgesync_engines.request.router import EdgeSync
from edgesync_store.core.store import FragmentStore

MAX_TOKENS = 8


def config(**extra) -> EdgeSyncConfig:
    return EdgeSyncConfig.load({"semantic": False, "jobs": False, **extra})


@pytest.fixture(scope="module")
def fresh_adapter():
    """A SmolLM2 context of this module's own: its seq-state buffer starts unallocated."""
    a = LlamaCppAdapter(n_threads=EdgeSyncConfig.load().n_threads)
    yield a
    a.close()


@pytest.mark.model
def test_a_hit_keeps_its_size_and_a_new_edgesync_warms_up_for_it(adapter, fresh_adapter, system_prompts, tmp_path):
    path = tmp_path / "store"
    m = chat(system_prompts[0], "How can I remember new words faster?")
    first = EdgeSync(adapter, store=path, config=config())
    try:
        assert len(first.store.reuse_hint(first.namespace.digest())) == 0
        miss = first.generate(m, max_tokens=MAX_TOKENS)
        assert miss.hit == "miss" and len(first.store.reuse_hint(first.namespace.digest())) == 0  # no hit yet
        hit = first.generate(m, max_tokens=MAX_TOKENS)
        assert hit.hit == "exact" and hit.tokens == miss.tokens
        hint = first.store.reuse_hint(first.namespace.digest()).tolist()
        assert hint == first.prompt_tokens(m)[:hit.tokens_reused] and len(hint) == hit.prompt_tokens - 1
    finally:
        first.close()

    assert fresh_adapter._state_buf is None
    with FragmentStore(path) as store:  # a rehearsal on its own: a hit that answers nothing
        keys = [k for span in store.prefix_walk(adapter.namespace, hint).spans for k in span.keys]
        hits = [store.lifecycle(k).hit_count for k in keys]
        assert warm_up(fresh_adapter, store) == hit.tokens_reused - 1  # never the last token of the hint
        assert [store.lifecycle(k).hit_count for k in keys] == hits  # no hit recorded
        assert fresh_adapter.n_tokens == 0 and fresh_adapter.perf_counts() == {"n_p_eval": 1, "n_eval": 1}  # 0 as 1
    second = EdgeSync(fresh_adapter, store=path, config=config())
    try:
        buf = fresh_adapter._state_buf
        # room for the hint, and for a whole chunk of a longer hit (a store serves hits)
        cells = max(hit.tokens_reused, min(fresh_adapter.n_ctx, fresh_adapter._chunk_cells()))
        needed = state_buffer.state_bytes(fresh_adapter._layout, cells)
        assert buf is not None and needed <= len(buf) < needed + state_buffer.state_bytes(
            fresh_adapter._layout, state_buffer.ROOM_STEP)
        assert fresh_adapter.n_tokens == 0  # the warm-up left an empty cache
        again = second.generate(m, max_tokens=MAX_TOKENS)
        assert again.hit == "exact" and again.tokens == miss.tokens
        assert fresh_adapter._state_buf is buf  # the first hit wrote into the warmed-up buffer
    finally:
        second.close()


@pytest.mark.model
def test_warm_up_without_a_store_makes_no_room_and_changes_no_answer(adapter, fresh_adapter, system_prompts):
    """No store, no hint: the buffer is left as it was, the cache is empty, and an uncached
    answer after the warm-up equals the session adapter's."""
    m = chat(system_prompts[1], "Is it cheaper to fly midweek?")
    before = fresh_adapter._state_buf
    warm_up(fresh_adapter, None)
    assert fresh_adapter._state_buf is before and fresh_adapter.n_tokens == 0
    mine = EdgeSync(fresh_adapter, store=False, config=config()).generate(m, max_tokens=MAX_TOKENS)
    reference = EdgeSync(adapter, store=False, config=config()).generate(m, max_tokens=MAX_TOKENS)
    assert mine.tokens == reference.tokens and len(mine.tokens) > 0


@pytest.mark.model
def test_make_room_keeps_the_live_sequence_and_gives_up_when_asked(fresh_adapter, system_prompts):
    """Idle-time room for a later injection (``make_room``): asked to stop at once, it keeps
    nothing and says so; let run, the buffer holds the state of that many cells; asked again,
    there is nothing to do. The live sequence is the same throughout."""
    tokens = fresh_adapter.tokenize(system_prompts[0])[:200]
    fresh_adapter.clear_kv_cache()
    fresh_adapter.prefill(tokens)
    n = fresh_adapter.n_ctx  # more than any injection so far
    fresh_adapter._state_buf = None  # whatever room earlier tests made
    before = fresh_adapter._state_buf
    assert not fresh_adapter.make_room(n, lambda: True) and fresh_adapter._state_buf is before
    assert fresh_adapter.make_room(n)
    buf = fresh_adapter._state_buf
    # a long state moves a chunk at a time: the room is one chunk's
    assert len(buf) >= state_buffer.state_bytes(fresh_adapter._layout, min(n, fresh_adapter._chunk_cells()))
    assert fresh_adapter.make_room(n, lambda: True) and fresh_adapter._state_buf is buf
    assert fresh_adapter.live_tokens() == tokens
    fresh_adapter.clear_kv_cache()


def test_open_store_takes_the_configured_compression(tmp_path):
    store = open_store(tmp_path / "z", config(compression="zstd"))
    try:
        assert store.compression == "zstd" and not store.serves_in_place
    finally:
        store.close()
    with FragmentStore(tmp_path / "n") as plain:
        assert plain.compression == "none" and plain.serves_in_place


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _meta_pages_overwritten(data: bytes) -> bytes:
    """Both LMDB meta pages (the file's first two pages, LMDB's page size being the OS's) overwritten."""
    return bytes(range(256)) * (2 * mmap.PAGESIZE // 256) + data[2 * mmap.PAGESIZE:]


DAMAGED_ASK = "How do I reset my password?"


@pytest.fixture(scope="module")
def stored_and_uncached(adapter, system_prompts, tmp_path_factory) -> tuple[Path, list[int]]:
    """A store that holds the answer of the damaged-store tests' prompt (system_prompts.json
    row 1 and :data:`DAMAGED_ASK`), built once to be copied, and the uncached run's tokens."""
    m = chat(system_prompts[1], DAMAGED_ASK)
    path = tmp_path_factory.mktemp("stored") / "store"
    with FragmentStore(path) as store:
        assert EdgeSync(adapter, store=store, config=config()).generate(m, max_tokens=MAX_TOKENS).fragments_written
    reference = EdgeSync(adapter, store=False, config=config()).generate(m, max_tokens=MAX_TOKENS)
    return path, reference.tokens


@pytest.mark.model
@pytest.mark.parametrize("damage", [_truncated, _meta_pages_overwritten])
def test_a_damaged_store_is_served_uncached_with_one_warning(adapter, system_prompts, stored_and_uncached, tmp_path,
                                                             caplog, damage):
    """A truncated data.mdb, or one whose meta pages are unreadable (in a copy of a store that
    holds the prompt): EdgeSync opens no store (one warning naming the clear command), answers
    exactly as uncached, and leaves the file as it was."""
    m = chat(system_prompts[1], DAMAGED_ASK)
    pristine, reference = stored_and_uncached
    path = Path(shutil.copytree(pristine, tmp_path / "store"))
    damaged = damage((path / "data.mdb").read_bytes())
    (path / "data.mdb").write_bytes(damaged)
    with caplog.at_level(logging.WARNING):
        es = EdgeSync(adapter, store=str(path), config=config())
    try:
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "damaged, serving uncached" in warnings[0]
        assert f"edgesync clear {path} --yes" in warnings[0]
        assert es.store is None
        got = es.generate(m, max_tokens=MAX_TOKENS)
    finally:
        es.close()
    assert got.tokens == reference and got.tokens_reused == 0
    assert (path / "data.mdb").read_bytes() == damaged


_OPEN_AS_ANOTHER_USER = """
import json, logging, sys
from pathlib import Path
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.loading import open_store
import edgesync_store.core.store  # open_store imports it (and lmdb) lazily: before the user can no longer read Python
warnings = []
class Kept(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger().addHandler(Kept())
cfg = EdgeSyncConfig.load({})
""" + BECOME_NOBODY + """
store = open_store(Path(sys.argv[1]), cfg)
print(json.dumps({"store": store is not None, "warnings": warnings}))
"""


@pytest.mark.parametrize("closed", ["store", "parent"])
def test_a_store_directory_we_cannot_read_is_served_uncached_with_one_warning(closed):
    """A store directory without read permission, or inside a directory we may not enter: no
    store, one warning that says so, no exception."""
    path, child = run_on_unreadable_store(closed, _OPEN_AS_ANOTHER_USER)
    assert child.returncode == 0, child.stderr
    got = json.loads(child.stdout.strip().splitlines()[-1])
    assert got["store"] is False
    assert len(got["warnings"]) == 1
    assert f"cannot read the store directory {path}: permission denied" in got["warnings"][0]
