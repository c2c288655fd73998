"""The seq-state parser on states the reference writer makes (no model): one stream, or one
stream per sequence with the cells in any of them."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from seqstate_writer import serialize_parts, to_parts

from edgesync_engines.adapters.kv_layout import StateLayout
from edgesync_engines.adapters.seqstate import SeqStateError, parse_parts

F16 = 1


def layout(n_stream: int) -> StateLayout:
    return StateLayout((2,), None, 0, False, False, F16, 1, 8, n_stream)


def kv(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, n, 8)).astype(np.float16), rng.standard_normal((2, n, 8)).astype(np.float16))


@pytest.mark.parametrize("n_stream, stream", [(1, 0), (4, 0), (4, 2), (4, 3)])
def test_the_cells_of_any_one_stream_parse_alike(n_stream, stream):
    k, v = kv(5)
    data = bytes(serialize_parts(to_parts(layout(n_stream), k, v, range(5)), seq_id=stream, stream=stream))
    (part,) = parse_parts(data)
    assert part.n_stream == n_stream and part.pos.tolist() == [0, 1, 2, 3, 4]
    assert all(np.array_equal(a, b) for a, b in zip(part.k, k)) and all(np.array_equal(a, b) for a, b in zip(part.v, v))
    # four bytes more for each empty stream than a one-stream state, and nothing else
    one = serialize_parts(to_parts(layout(1), k, v, range(5)), seq_id=stream)
    assert len(data) - len(one) == 4 * (n_stream - 1)


def test_cells_in_two_streams_or_in_none_are_refused():
    k, v = kv(3)
    data = bytearray(serialize_parts(to_parts(layout(2), k, v, range(3)), stream=0))
    empty = struct.pack("<IiII", 0xAF143CD8, 0, 2, 0) + struct.pack("<I", 0)
    with pytest.raises(SeqStateError, match="empty"):
        parse_parts(empty)
    # stream 0 holds cells, then stream 1's cell_count is not 0 either: another stream's cells follow
    twice = bytes(data[:-4]) + bytes(serialize_parts(to_parts(layout(1), k, v, range(3)))[12:])
    with pytest.raises(SeqStateError, match="several streams"):
        parse_parts(twice)
    with pytest.raises(SeqStateError, match="n_stream"):
        parse_parts(struct.pack("<IiI", 0xAF143CD8, 0, 0))
