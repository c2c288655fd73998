"""What both engine adapters share: the fragment assembly and range checks (``assemble_kv``,
``kv_ranges``) and the :class:`EngineAdapterBase` class."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from edgesync_store.schema import KVFragment, Namespace, common_prefix_len, prefix_hash


def kv_ranges(ns: Namespace, layer_end: int | None, head_start: int, head_end: int | None) -> tuple[int, int]:
    """An extraction's ``(layer_end, head_end)`` with None meaning all layers / all KV heads of
    ``ns``.

    Raises:
        ValueError: a head range outside ``[0, n_head_kv]`` or empty.
    """
    layer_end = ns.n_layer if layer_end is None else layer_end
    head_end = ns.n_head_kv if head_end is None else head_end
    if not 0 <= head_start < head_end <= ns.n_head_kv:
        raise ValueError(f"head_start: need 0 <= head_start < head_end <= {ns.n_head_kv}, got [{head_start}, {head_end})")
    return layer_end, head_end


def assemble_kv(ns: Namespace, fragments: Sequence[KVFragment], n_tokens: int, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Validate fragments of namespace ``ns`` and build K, V ``[n_layer, n_tokens, n_head_kv *
    head_dim]`` of ``ns.np_dtype`` for positions 0..n-1, each cell from the fragment that holds
    its layer, KV head and position (the last span cut to ``n_tokens``).

    Raises:
        ValueError: another namespace, a gap, missing layers or heads, or fragment tokens
            that differ from ``tokens``.
    """
    if n_tokens < 1 or n_tokens > len(tokens):
        raise ValueError(f"n_tokens: {n_tokens} outside [1, {len(tokens)}]")
    width = ns.n_head_kv * ns.head_dim
    k = np.empty((ns.n_layer, n_tokens, width), dtype=ns.np_dtype)
    v = np.empty_like(k)
    filled = np.zeros((ns.n_layer, ns.n_head_kv, n_tokens), dtype=bool)
    ids = np.asarray(tokens, dtype=np.int32)
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
        cols = slice(frag.head_start * ns.head_dim, frag.head_end * ns.head_dim)
        for i, layer in enumerate(frag.layers):
            k[layer, lo:hi, cols] = frag.keys[i, : hi - lo]
            v[layer, lo:hi, cols] = frag.values[i, : hi - lo]
            filled[layer, frag.head_start : frag.head_end, lo:hi] = True
    if not filled.all():
        layer, head, pos = (int(x[0]) for x in np.nonzero(~filled))
        raise ValueError(f"fragments: no KV for layer {layer}, head {head}, position {pos}")
    return k, v
