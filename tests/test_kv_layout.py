"""kv_layout's pure logic, no model: the prefill's evaluation blocks (``prefill_blocks``), with
flash attention's batches of a tile or more (``tiled_rule``), the sliding-window rows kept during a
prefill (``SwaCapture``) and the namespace's layout string (``StateLayout.name``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from seqstate_writer import to_parts

from edgesync_engines.adapters.kv_layout import (
    ANY_ROW,
    FA_TILE_Q,
    GROUPED_ROWS,
    LAYOUT,
    InjectionRule,
    StateLayout,
    SwaCapture,
    exact_batches,
    prefill_blocks,
    tiled_rule,
    turn_batches,
    usable_prefix,
)
from edgesync_engines.adapters.seqstate import CachePart, SeqStateError

F16 = 1
Q8_0 = 8


def _check_cover(plan: list[tuple[int, int]], n_past: int, n_prompt: int) -> None:
    """The blocks cover n_past..n_prompt-1 in order, without gaps or overlaps, and the last
    prompt token is evaluated alone."""
    assert plan[0][0] == n_past
    assert plan[-1] == (n_prompt - 1, n_prompt)
    for (_, end), (start, _) in zip(plan, plan[1:]):
        assert end == start
    assert all(end > start for start, end in plan)


RULES = st.sampled_from([GROUPED_ROWS, ANY_ROW])


def _valid_injection(n: int, usable: int, block: int, rule: InjectionRule) -> bool:
    """An injection point usable_prefix may return for an n-token prompt."""
    end = n - 1
    if usable in (0, end) or usable % block == 0:
        return True
    first = min(usable - usable % block + block, end) - usable
    return usable % rule.row_group == 0 and first >= rule.min_first_batch


@given(n_prompt=st.integers(2, 5000), data=st.data(), block=st.integers(1, 1024))
def test_blocks_end_on_the_grid(n_prompt, data, block):
    n_past = data.draw(st.integers(0, n_prompt - 1))
    assume(n_prompt - n_past != 2)  # a 2-token remainder is the one-token batch + the last token
    plan = prefill_blocks(n_past, n_prompt, block)
    _check_cover(plan, n_past, n_prompt)
    grid = max(block, 2)
    for i, (start, end) in enumerate(plan[:-1]):
        # one-token batches run other kernels: only the last prompt token is evaluated alone
        assert end - start >= 2
        # so a window's cells are all still in it once a block is evaluated
        assert end - start <= grid + 1
        on_grid = end % grid == 0
        crossing = end - start in (2, 3) and (end - 1) // grid != start // grid
        last_before_final = i == len(plan) - 2 and end == n_prompt - 1
        one_short = end % grid == grid - 1 and i + 1 < len(plan) - 1
        assert on_grid or crossing or last_before_final or one_short, (start, end, grid, plan)


@given(n_prompt=st.integers(2, 5000), data=st.data(), block=st.sampled_from([64, 128, 512, 2048]), rule=RULES)
def test_usable_prefix_keeps_later_tokens_where_an_uncached_prefill_puts_them(n_prompt, data, block, rule):
    """The injection point is an exact hit, on the grid, or a multiple of the rule's row group
    with a first batch of its minimum or more; it is the largest such point within what is
    available, and the prefill after it starts with one batch and then follows the uncached grid."""
    available = data.draw(st.integers(0, n_prompt + 5))
    usable = usable_prefix(available, n_prompt, block, rule)
    assert 0 <= usable <= min(available, n_prompt - 1)
    assert _valid_injection(n_prompt, usable, block, rule)
    assert not any(_valid_injection(n_prompt, u, block, rule)
                   for u in range(usable + 1, min(available, n_prompt - 1) + 1))
    uncached = prefill_blocks(0, n_prompt, block)
    cached = prefill_blocks(usable, n_prompt, block)
    assert cached[1:] == [b for b in uncached if b[0] >= cached[0][1]] or usable == n_prompt - 1


def test_blocks_examples():
    assert prefill_blocks(0, 1, 512) == [(0, 1)]
    assert prefill_blocks(0, 2, 512) == [(0, 1), (1, 2)]  # a 2-token prompt: the only 1-token batch
    assert prefill_blocks(0, 700, 512) == [(0, 512), (512, 699), (699, 700)]
    # Gemma 3's window of 512 with an injected prefix of 296 tokens: the first block ends on the
    # grid, so its cells are all in the window when it is read
    assert prefill_blocks(296, 1500, 512) == [(296, 512), (512, 1024), (1024, 1499), (1499, 1500)]
    # a remainder of one token is never left before the last prompt token
    assert prefill_blocks(0, 514, 512) == [(0, 511), (511, 513), (513, 514)]
    assert usable_prefix(309, 323, 512) == 304 and usable_prefix(322, 323, 512) == 322
    assert usable_prefix(500, 1300, 512) == 496 and usable_prefix(1000, 1300, 512) == 1000
    assert usable_prefix(512, 1300, 512) == 512 and usable_prefix(515, 1300, 512) == 512


TILED = st.sampled_from([tiled_rule(GROUPED_ROWS), tiled_rule(ANY_ROW)])


def _tiled_plan_ok(plan: list[tuple[int, int]], n_past: int, n_prompt: int, block: int, rule: InjectionRule) -> None:
    """Every batch but the last token's holds ``min_batch`` tokens or more (all of them when
    fewer are left), at most ``block``, and starts and ends on the row group but at the end."""
    _check_cover(plan, n_past, n_prompt)
    end = n_prompt - 1
    for start, stop in plan[:-1]:
        assert rule.min_batch <= stop - start <= block or (start, stop) == (n_past, end), (start, stop, plan)
        assert stop % rule.row_group == 0 or stop == end
        assert start % rule.row_group == 0 or start == n_past


@given(n_prompt=st.integers(2, 5000), data=st.data(), block=st.sampled_from([136, 256, 512, 2048]), rule=TILED)
def test_tiled_plans_keep_every_row_in_a_batch_of_a_tile_or_more(n_prompt, data, block, rule):
    """With flash attention, an uncached prefill and one after any injection point
    ``usable_prefix`` gives put every token but the last in a batch of ``FA_TILE_Q`` or more
    (its tiled kernel), unless the prompt is shorter than that; then nothing is reused."""
    assert rule.min_batch == FA_TILE_Q and rule.min_first_batch >= FA_TILE_Q
    available = data.draw(st.integers(0, n_prompt + 5))
    usable = usable_prefix(available, n_prompt, block, rule)
    end = n_prompt - 1
    assert 0 <= usable <= min(available, end)
    valid = {0, end} if end >= rule.min_batch else {0}
    valid |= {u for u in range(rule.min_batch, end - rule.min_first_batch + 1, rule.row_group)}
    assert usable in valid and not any(u in valid for u in range(usable + 1, min(available, end) + 1))
    _tiled_plan_ok(prefill_blocks(0, n_prompt, block, rule), 0, n_prompt, block, rule)
    _tiled_plan_ok(prefill_blocks(usable, n_prompt, block, rule), usable, n_prompt, block, rule)
    if usable:  # the first batch after the injection point is never short
        assert prefill_blocks(usable, n_prompt, block, rule)[0][1] - usable >= rule.min_batch or usable == end


@given(n_past=st.integers(0, 3000), end=st.integers(0, 3000), batch_tokens=st.integers(1, 600), rule=TILED,
       block=st.sampled_from([256, 512, 2048]), every=st.sampled_from([64, 128, 256]))
def test_tiled_idle_and_turn_batches_keep_a_tile(n_past, end, batch_tokens, rule, block, every):
    """Idle-time batches and the workers' turns hold a tile or more under the tiled rule."""
    assert all(b - a >= FA_TILE_Q for a, b in exact_batches(n_past, end, block, batch_tokens, rule))
    n_prompt = max(end, 2)
    start = usable_prefix(n_past, n_prompt, block, rule)
    pieces = turn_batches(prefill_blocks(start, n_prompt, block, rule), every, rule)
    _tiled_plan_ok(pieces, start, n_prompt, block, rule)


def test_tiled_examples():
    rule = tiled_rule(GROUPED_ROWS)
    assert rule == InjectionRule(8, 64, 64) and tiled_rule(ANY_ROW) == InjectionRule(1, 64, 64)
    # a remainder of 6 before the last token takes 64 + 6 (on the row group) from the batch before
    assert prefill_blocks(0, 1031, 512, rule) == [(0, 512), (512, 960), (960, 1030), (1030, 1031)]
    assert prefill_blocks(600, 1031, 512, rule) == [(600, 960), (960, 1030), (1030, 1031)]
    assert prefill_blocks(1000, 1090, 512, rule) == [(1000, 1089), (1089, 1090)]  # short first batch crosses the grid
    assert prefill_blocks(0, 40, 512, rule) == [(0, 39), (39, 40)]  # a short prompt: one batch
    assert usable_prefix(1000, 1031, 512, rule) == 960 and usable_prefix(1030, 1031, 512, rule) == 1030
    assert usable_prefix(60, 200, 512, rule) == 0 and usable_prefix(70, 200, 512, rule) == 64
    assert usable_prefix(50, 60, 512, rule) == 0 and usable_prefix(64, 65, 512, rule) == 64
    with pytest.raises(ValueError, match="block of at least 136"):
        prefill_blocks(0, 1000, 128, rule)

def _part(start: int, end: int, n_layer: int = 2, width: int = 4) -> CachePart:
    """A sliding-window part holding positions [start, end): K rows are position*10 + layer,
    V rows their negatives, so every row says where it came from."""
    pos = np.arange(start, end, dtype=np.int64)
    k = [np.repeat((pos * 10 + layer)[:, None], width, axis=1).astype(np.float16) for layer in range(n_layer)]
    v = [-a for a in k]
    return CachePart(pos, None, k, v, F16, F16, 1)


def _expected(start: int, end: int, n_layer: int = 2, width: int = 4) -> np.ndarray:
    pos = np.arange(start, end)
    return np.stack([np.repeat((pos * 10 + layer)[:, None], width, axis=1) for layer in range(n_layer)])


def test_swa_capture_blocks_in_order():
    cap = SwaCapture()
    cap.add(_part(0, 8), 0, 8)
    cap.add(_part(4, 16), 8, 16)  # the window dropped 0..3; rows 8..15 are new
    cap.add(_part(10, 18), 12, 18)  # 12..15 are held already and skipped
    assert cap.n_tokens == 18
    k, v = cap.rows(0, 18)
    assert k.shape == (2, 18, 4) and k.dtype == np.float16
    np.testing.assert_array_equal(k, _expected(0, 18))
    np.testing.assert_array_equal(v, -_expected(0, 18))
    k, v = cap.rows(5, 9)
    np.testing.assert_array_equal(k, _expected(5, 9))


def test_swa_capture_refuses_gaps_and_rows_gone():
    cap = SwaCapture()
    cap.add(_part(0, 8), 0, 8)
    with pytest.raises(SeqStateError, match="not in the window"):
        cap.add(_part(12, 20), 8, 20)  # 8..11 already left the window
    with pytest.raises(SeqStateError, match="not in the window"):
        cap.add(_part(8, 12), 8, 14)  # the part does not hold 12..13 yet
    assert cap.n_tokens == 8
    with pytest.raises(SeqStateError, match="captured for 8 positions, not 9"):
        cap.rows(0, 9)


def test_swa_capture_truncate_seed_clear():
    cap = SwaCapture()
    cap.add(_part(0, 6), 0, 6)
    cap.add(_part(0, 12), 6, 12)
    cap.truncate(20)  # beyond what is held: nothing changes
    assert cap.n_tokens == 12
    cap.truncate(7)
    assert cap.n_tokens == 7
    np.testing.assert_array_equal(cap.rows(0, 7)[0], _expected(0, 7))
    cap.add(_part(3, 10), 7, 10)  # the prefill goes on from the truncation point
    np.testing.assert_array_equal(cap.rows(0, 10)[0], _expected(0, 10))
    cap.truncate(0)
    assert cap.n_tokens == 0
    with pytest.raises(SeqStateError):
        cap.rows(0, 1)
    seeded = _expected(0, 5).astype(np.float16)
    cap.seed(seeded, -seeded)  # an injected prefix of 5 tokens
    cap.add(_part(0, 9), 5, 9)
    np.testing.assert_array_equal(cap.rows(0, 9)[1], -_expected(0, 9))
    cap.clear()
    assert cap.n_tokens == 0


def test_swa_capture_quantized_rows_are_bytes():
    pos = np.arange(0, 4, dtype=np.int64)
    rows = [np.arange(4 * 34, dtype=np.uint8).reshape(4, 34) + layer for layer in range(3)]
    cap = SwaCapture()
    cap.add(CachePart(pos, None, rows, rows, Q8_0, Q8_0, 0), 0, 4)
    k, _ = cap.rows(1, 3)
    assert k.dtype == np.uint8 and k.shape == (3, 2, 34)
    np.testing.assert_array_equal(k[2], rows[2][1:3])


def test_layout_name_single_part_is_the_plain_form():
    """A single-part model (SmolLM2) keeps the layout string stores were written with, so its
    existing fragments stay in the same namespace."""
    smollm = StateLayout((30,), None, 0, False, False, F16, 1, 64)
    assert smollm.name == f"{LAYOUT};v_trans=1" == "llama.cpp-seq-state/tokens-major-v1;v_trans=1"
    flash = StateLayout((30,), None, 0, False, False, Q8_0, 0, 68)
    assert flash.name == "llama.cpp-seq-state/tokens-major-v1;v_trans=0"


def test_layout_name_two_parts_and_ranges():
    gemma = StateLayout((3, 15), 1, 512, False, False, F16, 1, 256)
    assert gemma.name == "llama.cpp-seq-state/tokens-major-v1;v_trans=1;parts=3+15;swa=512;swa_full=1"
    assert gemma.part_range(0) == range(0, 3) and gemma.part_range(1) == range(3, 18)
    other_split = StateLayout((6, 12), 1, 512, False, False, F16, 1, 256)
    assert other_split.name != gemma.name  # fragments of another split never mix


def test_layout_from_probe_and_to_parts():
    parts = [_part(0, 2, n_layer=3), _part(0, 2, n_layer=15)]
    layout = StateLayout.from_probe(parts, 18, 512, False)
    assert layout.part_layers == (3, 15) and layout.swa_part == 1 and layout.width == 4
    with pytest.raises(SeqStateError, match="18 layers, the model 20"):
        StateLayout.from_probe(parts, 20, 512, False)
    with pytest.raises(SeqStateError, match="not 2"):
        StateLayout.from_probe(parts[:1], 3, 512, False)
    with pytest.raises(SeqStateError, match="without a sliding window"):
        StateLayout.from_probe(parts, 18, 0, False)
    k = _expected(0, 5, n_layer=18).astype(np.float16)
    out = to_parts(layout, k, -k, list(range(5)))
    assert [p.n_layer for p in out] == [3, 15]
    for p, rows in zip(out, (range(0, 3), range(3, 18))):
        np.testing.assert_array_equal(p.pos, np.arange(5))  # every part holds 0..N-1
        np.testing.assert_array_equal(np.stack(p.k), k[rows.start:rows.stop])


@given(st.integers(0, 3000), st.integers(0, 3000), st.sampled_from([64, 128, 256, 512, 2048]),
       st.integers(1, 600), RULES)
def test_exact_batches_keep_every_token_in_its_row_group(n_past, end, block, batch_tokens, rule):
    """Idle-time batches: contiguous, on the row group, at least the rule's minimum of tokens,
    never across the block grid, starting at or before the live end and never past ``end``."""
    group, least = rule.row_group, rule.min_first_batch
    batches = exact_batches(n_past, end, block, batch_tokens, rule)
    if not batches:  # only when too few tokens are left to add
        assert end - end % group < n_past + least
        return
    assert batches[0][0] <= max(n_past, 0) and batches[-1][1] <= end
    for (a, b), nxt in zip(batches, batches[1:] + [None]):
        assert a % group == 0 and b % group == 0 and b - a >= least
        assert a // block == (b - 1) // block  # inside one block
        assert nxt is None or nxt[0] == b
    assert batches[-1][1] > n_past  # they add something


def test_exact_batches_reach_the_end_on_the_row_group():
    assert exact_batches(39, 138, 512, 64) == [(32, 96), (96, 136)]
    assert exact_batches(508, 530, 512, 64) == [(496, 512), (512, 528)]
    assert exact_batches(152, 166, 512, 64) == [(144, 160)]
    assert exact_batches(0, 10, 512, 64) == []
    # with every row alike the batches reach ``end`` itself
    assert exact_batches(39, 138, 512, 64, ANY_ROW) == [(39, 103), (103, 138)]
    assert exact_batches(152, 166, 512, 64, ANY_ROW) == [(152, 166)]


@given(n_prompt=st.integers(2, 3000), data=st.data(), block=st.sampled_from([64, 128, 512, 2048]),
       every=st.sampled_from([16, 64, 128, 256]), rule=RULES)
def test_turn_batches_cut_the_plan_only_where_an_exact_injection_could_start(n_prompt, data, block, every, rule):
    """The plan after an injection point, cut for the workers' turns: the same tokens in order,
    the same last-token batch, and every new piece starts on a multiple of ``every`` with at
    least the rule's minimum of tokens on both sides of the cut."""
    least = rule.min_first_batch
    n_past = usable_prefix(data.draw(st.integers(0, n_prompt - 1)), n_prompt, block, rule)
    plan = prefill_blocks(n_past, n_prompt, block)
    pieces = turn_batches(plan, every, rule)
    _check_cover(pieces, n_past, n_prompt)
    plan_starts = {start for start, _ in plan}
    for start, end in plan:
        if end - start <= 2 * every:  # short enough to stay whole
            assert (start, end) in pieces
    for start, end in pieces:
        if start not in plan_starts:  # a cut
            assert start % every == 0 and start % rule.row_group == 0 and end - start >= least
    for start, end in pieces:
        if end not in plan_starts and end != n_prompt:  # cut here: this side keeps enough too
            assert end - start >= least
        if start not in plan_starts:  # a piece the cuts made: about one turn long
            assert end - start < every + least


def test_turn_batches_examples_and_refusals():
    assert turn_batches([(0, 512), (512, 1070), (1070, 1071)], 128) == [
        (0, 128), (128, 256), (256, 384), (384, 512), (512, 640), (640, 768), (768, 896), (896, 1024),
        (1024, 1070), (1070, 1071)]
    assert turn_batches([(200, 512), (512, 520), (520, 521)], 128) == [
        (200, 256), (256, 384), (384, 512), (512, 520), (520, 521)]
    assert turn_batches([(0, 140), (140, 141)], 128) == [(0, 140), (140, 141)]  # 12 after the cut: kept whole
    # a chat turn's new message after its injection point: at most two turns long, kept whole
    assert turn_batches([(1256, 1305), (1305, 1306)], 64) == [(1256, 1305), (1305, 1306)]
    assert turn_batches([(1256, 1384), (1384, 1385)], 64) == [(1256, 1384), (1384, 1385)]
    assert turn_batches([(1256, 1385), (1385, 1386)], 64) == [(1256, 1280), (1280, 1344), (1344, 1385), (1385, 1386)]
    for every in (0, 8, 20):
        with pytest.raises(ValueError, match="multiple of 8 of at least 16"):
            turn_batches([(0, 100)], every)
