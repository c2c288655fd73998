"""Validating stored fragments for an injection (:class:`KVBlock` per fragment), their assembled
``[n_layer, n, width]`` K and V, and the layer and head ranges of an extraction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from edgesync_store.schema import KVFragment, Namespace, common_prefix_len, prefix_hash


def kv_ranges(ns: Namespace, layer_end: int | None, head_start: int, head_end: int | None) -> tuple[int, int]:
    """An extraction's ``(layer_end, head_end)``, None meaning all of ``ns``'s; ValueError for a head
    range outside ``[0, n_head_kv]`` or empty."""
    layer_end = ns.n_layer if layer_end is None else layer_end
    head_end = ns.n_head_kv if head_end is None else head_end
    if not 0 <= head_start < head_end <= ns.n_head_kv:
        raise ValueError(
            f"head_start: need 0 <= head_start < head_end <= {ns.n_head_kv}, got [{head_start}, {head_end})"
        )
    return layer_end, head_end


@dataclass(frozen=True)
class KVBlock:
    """One validated piece of the KV to load: K and V of positions ``[start, end)`` for the
    canonical layers ``layers`` and the KV heads ``heads``.

    ``keys``, ``values``: ``[len(layers), >= end - start, len(heads) * head_width]`` of the
    namespace's dtype, row ``t`` being position ``start + t`` (a fragment's arrays, rows past
    ``end - start`` unused; any strides)."""

    layers: range
    heads: range
    start: int
    end: int
    keys: np.ndarray
    values: np.ndarray


def fragment_blocks(
    ns: Namespace, fragments: Sequence[KVFragment], n_tokens: int, tokens: Sequence[int]
) -> list[KVBlock]:
    """Validate fragments of namespace ``ns`` for positions 0..n_tokens-1 of ``tokens`` and
    return the block each contributes (the last span cut to ``n_tokens``; a fragment wholly
    past it contributes none). Every (layer, KV head, position) must be held by some fragment.
    Raises ValueError for ``n_tokens`` outside ``[1, len(tokens)]``, another namespace, a gap,
    missing layers or heads, differing tokens, or a fragment that follows another prefix."""
    if n_tokens < 1 or n_tokens > len(tokens):
        raise ValueError(f"n_tokens: {n_tokens} outside [1, {len(tokens)}]")
    filled = np.zeros((ns.n_layer, ns.n_head_kv, n_tokens), dtype=bool)
    ids = np.asarray(tokens, dtype=np.int32)
    blocks = []
    for frag in fragments:
        if frag.namespace != ns:
            raise ValueError(f"namespace: fragment {frag.content_hash[:12]} belongs to another namespace")
        lo, hi = frag.token_start, min(frag.token_end, n_tokens)
        if lo >= hi:
            continue
        if common_prefix_len(frag.token_ids[: hi - lo], ids[lo:hi]) != hi - lo:
            raise ValueError(f"token_ids: fragment [{lo}, {frag.token_end}) differs from the prompt's tokens")
        if frag.prefix_hash != prefix_hash(ids[:lo]):
            raise ValueError(f"prefix_hash: fragment [{lo}, {frag.token_end}) follows another prefix")
        layers, heads = frag.layers, range(frag.head_start, frag.head_end)
        filled[layers.start:layers.stop:layers.step, heads.start:heads.stop, lo:hi] = True
        blocks.append(KVBlock(layers, heads, lo, hi, frag.keys, frag.values))
    if not filled.all():
        layer, head, pos = (int(x[0]) for x in np.nonzero(~filled))
        raise ValueError(f"fragments: no KV for layer {layer}, head {head}, position {pos}")
    return blocks


def assemble_kv(
    ns: Namespace, fragments: Sequence[KVFragment], n_tokens: int, tokens: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`blocks_kv` of :func:`fragment_blocks` (its ValueErrors)."""
    return blocks_kv(ns, fragment_blocks(ns, fragments, n_tokens, tokens), n_tokens)


def blocks_kv(ns: Namespace, blocks: Sequence[KVBlock], n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """K, V ``[n_layer, n_tokens, n_head_kv * head_dim]`` of ``ns.np_dtype`` assembled from
    validated ``blocks`` (:func:`fragment_blocks`: they cover every cell)."""
    width = ns.n_head_kv * ns.head_width
    k = np.empty((ns.n_layer, n_tokens, width), dtype=ns.np_dtype)
    v = np.empty_like(k)
    for b in blocks:
        rows, n = slice(b.layers.start, b.layers.stop, b.layers.step), b.end - b.start
        cols = slice(b.heads.start * ns.head_width, b.heads.stop * ns.head_width)
        k[rows, b.start:b.end, cols] = b.keys[:, :n]
        v[rows, b.start:b.end, cols] = b.values[:, :n]
    return k, v
