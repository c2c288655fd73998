"""``edgesync_store/core/map_advice.py`` on a real LMDB store in a temp dir (Linux): the store's
map is found in ``/proc/self/maps``; whole-blob reads turn read-ahead on and off again without
changing what is read; ``release_mapped`` gives back the resident pages a read mapped, and the
next read maps them again with the same bytes. Resident pages are read from
``/proc/self/status`` (``RssFile``, kB).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fragments import SMOL  # noqa: E402  (tests/fragments.py)

from edgesync_store.core.map_advice import mapped_ranges
from edgesync_store.core.store import FragmentStore
from edgesync_store.schema import KVFragment, prefix_hash

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="Linux /proc needed")


def _rss_file_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    pytest.skip("no RssFile in /proc/self/status")


def _fragment(seed: int, span: int = 512) -> KVFragment:
    """A whole SmolLM2 fragment at position 0 (11.8 MB of f16 K and V) with seeded values."""
    rng = np.random.default_rng(seed)
    shape = (SMOL.n_layer, span, SMOL.n_head_kv * SMOL.head_dim)
    return KVFragment(namespace=SMOL, token_start=0, token_end=span, layer_start=0, layer_end=SMOL.n_layer,
                      keys=rng.standard_normal(shape).astype(np.float16),
                      values=rng.standard_normal(shape).astype(np.float16),
                      token_ids=rng.integers(0, 49152, size=span, dtype=np.int32), prefix_hash=prefix_hash([]))


def test_the_map_is_found_and_released(tmp_path):
    frags = [_fragment(seed) for seed in range(6)]
    with FragmentStore(tmp_path / "s") as store:
        store.put_many(frags)
    with FragmentStore(tmp_path / "s") as store:
        ranges = mapped_ranges(store.path / "data.mdb")
        assert ranges and all(end > start for start, end in ranges)
        keys = [f.key() for f in frags]
        before = _rss_file_kb()
        with store.reading(keys) as got:
            first = [bytes(f.keys[0, 0].view(np.uint8)) for f, _ in got]
            assert all(in_place for _, in_place in got)
        mapped = _rss_file_kb() - before
        if mapped < 10 * 1024:
            pytest.skip(f"reading {len(keys)} blobs mapped only {mapped} kB here")
        store.release_mapped()
        assert _rss_file_kb() - before < mapped / 4  # the blobs' pages are no longer resident here
        with store.reading(keys) as again:  # mapped again from the page cache: the same bytes
            assert [bytes(f.keys[0, 0].view(np.uint8)) for f, _ in again] == first
            for (f, _), want in zip(again, frags):
                assert np.array_equal(f.values.view(np.uint16), want.values.view(np.uint16))


def test_drop_pages_unmaps_a_read_view_and_keeps_its_bytes(tmp_path):
    import mmap

    from edgesync_store.core.map_advice import drop_pages

    data = np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        before = _rss_file_kb()
        assert int(np.frombuffer(view, np.uint8)[::4096].sum()) == int(data[::4096].sum())  # every page mapped
        mapped = _rss_file_kb() - before
        assert mapped >= 30 << 10
        assert drop_pages(view[100:])  # whole pages inside the view only
        assert _rss_file_kb() - before < mapped - (30 << 10)
        assert np.array_equal(np.frombuffer(view, np.uint8), data)  # read again: the same bytes
        view.release()
