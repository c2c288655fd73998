"""How a llama.cpp model's seq state maps to the store's ``[n_layer, n_tokens, width]`` arrays,
and the sliding-window KV captured during a prefill.

Canonical layer order is the seq state's: part 0's layers, then part 1's (an iSWA model's global
then sliding-window layers), recorded in the layout string (``parts=3+15;swa=512``). Injection
needs a full-size window cache (``swa_full``) to stay bit-identical (../shared/DESIGN.md 2.7).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from edgesync_engines.adapters import seqstate
from edgesync_engines.adapters.seqstate import CachePart, SeqStateError
from edgesync_store.schema import Namespace

LAYOUT = "llama.cpp-seq-state/tokens-major-v1"
"""Name of the fragment tensor layout: per layer [tokens, heads*head_dim] rows."""


@dataclass(frozen=True)
class StateLayout:
    """The parts of a model's seq state, learnt from a probe (:meth:`from_probe`):
    ``part_layers`` (layers per part, in state order), ``swa_part`` (the sliding-window part's
    index, None: no window), ``n_swa`` (window, tokens), ``cell_ext`` / ``pos_2d`` (cells carry
    an extension / a 2D position), ``type_kv`` (ggml type of every row), ``v_trans``, ``width``
    (items per K and V row: elements, or bytes for quantized types), ``n_stream`` (the context's KV
    streams, which a state written for it lists; not part of the namespace: the KV is the same)."""

    part_layers: tuple[int, ...]
    swa_part: int | None
    n_swa: int
    cell_ext: bool
    pos_2d: bool
    type_kv: int
    v_trans: int
    width: int
    n_stream: int = 1

    @classmethod
    def from_probe(cls, parts: Sequence[CachePart], n_layer: int, n_swa: int, pos_2d: bool) -> "StateLayout":
        """The layout of a probe's parsed parts (``n_swa``: window, 0: none). Raises SeqStateError when
        layers do not add up, types or widths differ, or a window model's state is not two parts."""
        part_layers = tuple(p.n_layer for p in parts)
        if sum(part_layers) != n_layer:
            raise SeqStateError(f"probe: seq state has {sum(part_layers)} layers, the model {n_layer}")
        if n_swa > 0 and len(parts) != 2:
            raise SeqStateError(f"probe: a sliding-window model wrote {len(parts)} cache parts, not 2")
        if len(parts) > 1 and n_swa == 0:
            raise SeqStateError(f"probe: {len(parts)} cache parts without a sliding window")
        layered = [p for p in parts if p.n_layer]
        types = {(p.type_k, p.type_v) for p in layered}
        widths = {a.shape[1] for p in layered for a in (*p.k, *p.v)}
        if len(types) != 1 or len(set(types.pop())) != 1:
            raise SeqStateError("probe: K and V types differ between layers or parts")
        if len(widths) != 1:
            raise SeqStateError(f"probe: K/V row widths differ between layers ({sorted(widths)})")
        if len({p.v_trans for p in layered}) != 1 or len({p.n_stream for p in parts}) != 1:
            raise SeqStateError("probe: parts disagree on the V layout or the stream count")
        return cls(part_layers, 1 if n_swa > 0 else None, n_swa, parts[0].ext is not None, pos_2d,
                   layered[0].type_k, layered[0].v_trans, widths.pop(), parts[0].n_stream)

    @property
    def name(self) -> str:
        """The namespace's layout string; a single-part layout keeps the plain form."""
        name = f"{LAYOUT};v_trans={self.v_trans}"
        if len(self.part_layers) > 1:
            name += ";parts=" + "+".join(map(str, self.part_layers))
        if self.swa_part is not None:
            name += f";swa={self.n_swa};swa_full=1"
        if self.cell_ext:
            name += f";cell_ext={'2d' if self.pos_2d else 'tok'}"
        return name

    def namespace(self, n_head_kv: int, **fields) -> Namespace:
        """The namespace of KV in this layout (``fields``: the other Namespace fields). Raises
        SeqStateError when rows do not split into ``n_head_kv`` heads of whole blocks."""
        t = seqstate.ggml_type(self.type_kv)
        elements = self.width * np.dtype(t.dtype).itemsize // t.block_bytes * t.block
        if elements % n_head_kv or (elements // n_head_kv) % t.block:
            raise SeqStateError(f"probe: row of {elements} {t.name} values, {n_head_kv} KV heads")
        return Namespace(kv_dtype=t.name, layout=self.name, n_layer=sum(self.part_layers), n_head_kv=n_head_kv,
                         head_dim=elements // n_head_kv, **fields)

    def blend_refusal(self) -> str | None:
        """Why KV in this layout cannot be moved to another position (None: it can)."""
        if self.swa_part is not None:
            return "a sliding-window KV cache (its window part cannot hold documents moved to new positions)"
        if self.cell_ext:
            return "cells with a position extension (M-RoPE)"
        if seqstate.ggml_type(self.type_kv).quantized:
            return f"a quantized KV cache ({seqstate.ggml_type(self.type_kv).name})"
        return None

    def part_range(self, i: int) -> range:
        """Canonical layer indices of part ``i``."""
        start = sum(self.part_layers[:i])
        return range(start, start + self.part_layers[i])

    def span_kv(self, parts: Sequence[CachePart], swa: "SwaCapture", spans: Sequence[tuple[int, int]],
                live: Sequence[int], layers: range, cols: slice) -> list[tuple[np.ndarray, np.ndarray]]:
        """K and V ``[len(layers), span, cols]`` (C-contiguous) of each span, from a parsed seq
        state's ``parts`` of the live sequence ``live``; a sliding-window part's rows come from
        ``swa`` where the window no longer holds them. Raises ValueError for a span neither holds, or
        cells that are not plain text tokens."""
        out = []
        for start, end in spans:
            k_parts, v_parts = [], []
            for i, part in enumerate(parts):
                if not part.n_layer:
                    continue
                if part.pos[0] <= start and end - 1 <= part.pos[-1]:
                    self.check_text_cells(part, start, end, live)
                    at = slice(int(start - part.pos[0]), int(end - part.pos[0]))
                    k_parts.append(np.stack([a[at] for a in part.k]))
                    v_parts.append(np.stack([a[at] for a in part.v]))
                elif i == self.swa_part:
                    k_rows, v_rows = swa.rows(start, end)
                    k_parts.append(k_rows)
                    v_parts.append(v_rows)
                else:
                    raise SeqStateError(f"cache part {i} does not hold positions [{start}, {end})")
            k, v = np.concatenate(k_parts), np.concatenate(v_parts)
            rows = slice(layers.start, layers.stop, layers.step)
            out.append((np.ascontiguousarray(k[rows, :, cols]), np.ascontiguousarray(v[rows, :, cols])))
        return out

    def check_text_cells(self, part: CachePart, start: int, end: int, tokens: Sequence[int]) -> None:
        """Raise ValueError when cells ``[start, end)`` of ``part`` are not text tokens (e.g. an image
        embedding): their KV cannot be rebuilt from token IDs."""
        if not self.cell_ext:
            return
        at = int(start - part.pos[0])
        want = seqstate.text_cell_ext(np.arange(start, end), np.asarray(tokens[start:end]), self.pos_2d)
        if not np.array_equal(part.ext[at:at + end - start], want):
            raise ValueError(f"cells [{start}, {end}) are not plain text tokens (cell extension differs)")


class SwaCapture:
    """Rows of the sliding-window layers, ``[n_swa_layers, n, width]`` for positions 0..n-1,
    gathered while they are in the window. Blocks arrive in position order."""

    def __init__(self) -> None:
        self._k: list[np.ndarray] = []
        self._v: list[np.ndarray] = []
        self.n_tokens = 0

    def clear(self) -> None:
        """Forget every row."""
        self._k, self._v, self.n_tokens = [], [], 0

    def seed(self, k: np.ndarray, v: np.ndarray) -> None:
        """Start from ``k``, ``v`` ``[n_swa_layers, n, width]`` (positions 0..n-1, injected)."""
        self._k, self._v, self.n_tokens = [k], [v], int(k.shape[1])

    def add(self, part: CachePart, start: int, end: int) -> None:
        """Take positions ``[start, end)`` (``start <= n_tokens``; held rows skipped) from a parsed
        sliding-window part. Raises SeqStateError when the part does not hold them."""
        start = max(start, self.n_tokens)
        if start >= end:
            return
        if start > self.n_tokens or start < part.pos[0] or end - 1 > part.pos[-1]:
            raise SeqStateError(
                f"sliding-window KV of positions [{start}, {end}) not in the window's cells "
                f"[{part.pos[0]}, {part.pos[-1]}] (held: {self.n_tokens})"
            )
        rows = slice(int(start - part.pos[0]), int(end - part.pos[0]))
        self._k.append(np.stack([a[rows] for a in part.k]))
        self._v.append(np.stack([a[rows] for a in part.v]))
        self.n_tokens = end

    def truncate(self, n: int) -> None:
        """Keep positions 0..n-1 only."""
        if n >= self.n_tokens:
            return
        k, v = self.rows(0, n) if n else (None, None)
        self._k, self._v = ([k], [v]) if n else ([], [])
        self.n_tokens = n

    def rows(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """K, V ``[n_swa_layers, end - start, width]`` of ``[start, end)``; SeqStateError beyond those held."""
        if end > self.n_tokens:
            raise SeqStateError(f"sliding-window KV captured for {self.n_tokens} positions, not {end}")
        if len(self._k) > 1:
            self._k, self._v = [np.concatenate(self._k, axis=1)], [np.concatenate(self._v, axis=1)]
        return self._k[0][:, start:end], self._v[0][:, start:end]


ROW_GROUP = 8
"""Tokens a cached prefill's first batch must start on a multiple of: llama.cpp's CPU kernels
for repacked quantized weights (``ggml-cpu/repack.cpp``) quantize activations 4 or 8 rows at a
time, so a token's row depends on its group within the batch."""
MIN_FIRST_BATCH = 16
"""Fewest tokens of a cached prefill's first batch off the block grid (smaller ones take other kernels)."""
FA_TILE_Q = 64
"""Queries from which llama.cpp's CPU flash attention takes its tiled path (``GGML_FA_TILE_Q``,
``ggml-cpu/common.h``; ``ops.cpp`` picks it for f16/f32 KV when a batch holds at least this many
tokens). Below, a per-row path computes other bits; either path computes each row alone.
Quantized KV takes the per-row path at every size."""


@dataclass(frozen=True)
class InjectionRule:
    """Where a cached prefill may start and stay bit-identical: its first batch starts on a multiple
    of ``row_group`` tokens and holds at least ``min_first_batch`` (off the block grid).

    ``min_batch`` (0: none) is for kernels that a batch's size selects (:func:`tiled_rule`):
    every prefill batch but the last token's then holds at least that many tokens, a prompt
    of fewer than ``min_batch + 1`` tokens reuses nothing, and no injection point is below it,
    so every stored or reused row was computed by the same kernel as the uncached prefill's."""

    row_group: int = ROW_GROUP
    min_first_batch: int = MIN_FIRST_BATCH
    min_batch: int = 0


GROUPED_ROWS = InjectionRule()
"""The default rule: exact where a batch's rows are computed by groups (repacked weights)."""
ANY_ROW = InjectionRule(1, 2)
"""Any injection point with a first batch of 2+ tokens, where all rows compute alike (see probe_rows)."""


def tiled_rule(rule: InjectionRule) -> InjectionRule:
    """``rule`` with llama.cpp's flash attention on over f16/f32 KV: batches of at least
    :data:`FA_TILE_Q` tokens, which take its tiled path, where a row's bits depend neither on
    the batch nor on where it starts (../shared/DESIGN.md 2.11, docs/engines.md)."""
    return InjectionRule(rule.row_group, max(rule.min_first_batch, FA_TILE_Q), FA_TILE_Q)


def usable_prefix(available: int, n_prompt: int, block: int, rule: InjectionRule = GROUPED_ROWS) -> int:
    """How many of ``available`` stored prompt tokens to inject for an ``n_prompt``-token
    prompt prefilled in ``block``-token blocks (:func:`prefill_blocks`) so that the result is
    bit-identical to an uncached prefill: ``n_prompt - 1`` (the last token is always evaluated
    alone), or the largest point not above ``available`` on the block grid or on a
    ``rule.row_group`` multiple leaving a first batch of ``rule.min_first_batch`` (0: none).
    Under a rule with ``min_batch``, any ``rule.row_group`` multiple of at least ``min_batch``
    that leaves ``rule.min_first_batch`` tokens, or ``n_prompt - 1``; 0 for a prompt of fewer than
    ``min_batch + 1`` tokens, which an uncached prefill evaluates in one smaller batch."""
    end = n_prompt - 1
    usable = min(available, end)
    if rule.min_batch:
        if end < rule.min_batch:
            return 0
        if usable < end:
            usable = min(usable, end - rule.min_first_batch)
            usable -= usable % rule.row_group
        return usable if usable >= rule.min_batch else 0
    if usable == end:
        return max(usable, 0)
    usable -= usable % rule.row_group
    while usable > 0 and usable % block:
        if min(usable - usable % block + block, end) - usable >= rule.min_first_batch:
            break
        usable -= rule.row_group
    return max(usable, 0)


def prefill_blocks(n_past: int, n_prompt: int, block: int, rule: InjectionRule | None = None) -> list[tuple[int, int]]:
    """The ``[start, end)`` evaluation batches for prompt tokens ``n_past..n_prompt-1``:
    batches ending on the grid of ``block`` tokens (``n_batch``, or a shorter sliding window)
    up to the last prompt token, then that token alone; no other one-token batch. Under a
    ``rule`` with ``min_batch`` (:func:`tiled_rule`), no batch but the last token's is shorter
    than ``min_batch`` unless the whole prompt is: a short first batch reaches past the grid,
    and a short remainder before the last token takes ``min_batch`` tokens or more from the
    batch before it, cut on a ``rule.row_group`` multiple. Raises ValueError when such a rule
    needs batches longer than ``block``."""
    if rule is not None and rule.min_batch:
        return _tiled_blocks(n_past, n_prompt - 1, block, rule) + [(n_prompt - 1, n_prompt)]
    plan = []
    end = n_prompt - 1
    pos = n_past
    block = max(block, 2)
    while pos < end:
        size = min(block - pos % block, end - pos)
        if size < 2 and end - pos >= 2:
            size = 2
        if end - pos - size == 1:  # never leave a one-token remainder
            size = size - 1 if size > 2 else size + 1
        plan.append((pos, pos + size))
        pos += size
    plan.append((end, n_prompt))
    return plan


def _tiled_blocks(pos: int, end: int, block: int, rule: InjectionRule) -> list[tuple[int, int]]:
    """:func:`prefill_blocks`' batches of ``[pos, end)`` under a rule with ``min_batch``."""
    least, group = rule.min_batch, rule.row_group
    if block < 2 * least + group or block % group:
        raise ValueError(f"prefill_blocks: batches of at least {least} tokens on multiples of {group} need "
                         f"a block of at least {2 * least + group} tokens on that multiple, got {block}")
    plan = []
    while pos < end:
        stop = min(pos - pos % block + block, end)
        if stop - pos < least:
            stop = min(pos + least, end)
        if 0 < end - stop < least:
            cut = end - least - (end - least) % group
            stop = cut if cut - pos >= least else end  # else at most 2 * least + group - 1 tokens
        plan.append((pos, stop))
        pos = stop
    return plan


def turn_batches(plan: Sequence[tuple[int, int]], every: int,
                 rule: InjectionRule = GROUPED_ROWS) -> list[tuple[int, int]]:
    """``plan``'s batches cut at multiples of ``every`` tokens where both sides keep at least
    ``rule.min_first_batch`` (bit-identical to the plan's), so that a server's workers take
    turns on the CPUs between pieces; a batch of at most ``2 * every`` tokens stays whole (a
    small batch costs more per token). Raises ValueError unless ``every`` is a multiple of
    ``rule.row_group`` of at least ``rule.min_first_batch``."""
    if every < rule.min_first_batch or every % rule.row_group:
        raise ValueError(f"turn_batches: every must be a multiple of {rule.row_group} of at least "
                         f"{rule.min_first_batch}, got {every}")
    pieces = []
    for start, end in plan:
        if end - start <= 2 * every:
            pieces.append((start, end))
            continue
        pos = start
        for cut in range(start - start % every + every, end, every):
            if cut - pos >= rule.min_first_batch and end - cut >= rule.min_first_batch:
                pieces.append((pos, cut))
                pos = cut
        pieces.append((pos, end))
    return pieces


def exact_batches(n_past: int, end: int, block: int, batch_tokens: int,
                  rule: InjectionRule = GROUPED_ROWS) -> list[tuple[int, int]]:
    """Small batches (about ``batch_tokens``) that extend a live ``[0, n_past)`` towards
    ``end`` with KV bit-identical to an uncached prefill of any longer prompt with the same
    start (idle-time storing): on ``rule.row_group`` multiples, at least
    ``rule.min_first_batch`` tokens, never across the ``block`` grid. The first may start
    before ``n_past``; the last ends at ``end`` rounded down to the row group. [] when none."""
    group, least = rule.row_group, rule.min_first_batch
    block = max(block - block % group, least)
    size = min(max(batch_tokens - batch_tokens % group, least), block)
    stop_at = end - end % group
    pos = max(n_past - n_past % group, 0)
    batches: list[tuple[int, int]] = []
    while pos < stop_at:
        base, grid = pos - pos % block, pos - pos % block + block
        stop = min(pos + size, grid, stop_at)
        if stop < min(grid, stop_at) and min(grid, stop_at) - stop < least:
            stop = min(grid, stop_at)  # no batch too small to be exact after this one
        if stop - pos < least:
            if batches and batches[-1][1] == pos and batches[-1][0] >= base:
                pos = batches.pop()[0]  # one batch with the previous one, inside the block
            else:
                pos = max(stop - least, base)  # reach back into the live part
            if stop - pos < least:
                break  # too few tokens left in this block to be evaluated exactly
        batches.append((pos, stop))
        pos = stop
    return batches


def probe_layout(raw: bytes, n_layer: int, n_swa: int, window_part: Callable[[int], CachePart]) -> StateLayout:
    """The :class:`StateLayout` of a probe's two-cell seq state, parsed without, then with cell
    extensions; for a window model ``window_part(ext_bytes)`` (the window part read alone)
    must match the state's second part. Raises SeqStateError when neither parse works or parts disagree."""
    try:
        parts = seqstate.parse_parts(raw)
    except SeqStateError as plain:
        try:
            parts = seqstate.parse_parts(raw, seqstate.CELL_EXT_BYTES)
        except SeqStateError:
            raise plain from None
    pos_2d = parts[0].ext is not None and int(parts[0].ext[1, 0]) == 1
    layout = StateLayout.from_probe(parts, n_layer, n_swa, pos_2d)
    if layout.swa_part is not None:
        window = window_part(seqstate.CELL_EXT_BYTES if layout.cell_ext else 0)
        if window.n_layer != layout.part_layers[layout.swa_part]:
            raise SeqStateError("probe: the sliding-window read disagrees with the state's part")
    return layout
