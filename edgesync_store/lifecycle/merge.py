"""Cut fragments into layer/head groups and merge groups back: pure functions, no I/O.

A part holds a subset of the layers (a range or a stride) and a range of KV heads: arrays
``[n_layers, span, (head_end - head_start) * head_dim]``, rows in ``fragment.layers`` order.
Parts keep the span's identity (namespace, prefix hash, token IDs); merging the parts of one
fragment gives its key and bit-equal arrays.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from edgesync_store.schema import KVFragment, Namespace
from edgesync_store.ttl import merged_counters

log = logging.getLogger(__name__)


def _check_count(name: str, value, n: int, n_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= n:
        raise ValueError(f"{name}: must be an integer in [1, {n_name}={n}], got {value!r}")
    return int(value)


def _groups(n: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _partition(n, n_name: str, size, size_name: str) -> list[tuple[int, int]]:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{n_name}: must be a positive integer, got {n!r}")
    return _groups(int(n), _check_count(size_name, size, n, n_name))


def layer_groups(n_layer: int, layers_per_fragment: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` groups of ``layers_per_fragment`` layers covering ``[0,
    n_layer)``, the last holding the remainder (ValueError: a count out of range)."""
    return _partition(n_layer, "n_layer", layers_per_fragment, "layers_per_fragment")


def head_groups(n_head_kv: int, heads_per_fragment: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` groups of ``heads_per_fragment`` KV heads covering ``[0,
    n_head_kv)``, the last holding the remainder (ValueError: a count out of range)."""
    return _partition(n_head_kv, "n_head_kv", heads_per_fragment, "heads_per_fragment")


def group_ranges(
    namespace: Namespace, layers_per_fragment: int | None, heads_per_fragment: int | None
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The ``((layer_start, layer_end), (head_start, head_end))`` of every fragment a whole
    chunk is stored as, layer groups outermost. ``None``: one group; a value above the model's
    count is clamped to it (ValueError: a value that is not an integer >= 1)."""
    lay = namespace.n_layer if layers_per_fragment is None else layers_per_fragment
    hds = namespace.n_head_kv if heads_per_fragment is None else heads_per_fragment
    for name, value in (("layers_per_fragment", lay), ("heads_per_fragment", hds)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1 or None, got {value!r}")
    layers = layer_groups(namespace.n_layer, min(int(lay), namespace.n_layer))
    heads = head_groups(namespace.n_head_kv, min(int(hds), namespace.n_head_kv))
    return [(lg, hg) for lg in layers for hg in heads]


def laid_out_like(like: np.ndarray, arr: np.ndarray) -> np.ndarray:
    """``arr`` ``[layers, span, width]`` in memory as ``like`` is: a transposed view of a
    C-contiguous ``[layers, width, span]`` array when ``like`` is one (V as llama.cpp's seq
    state holds it without flash attention: ``codec`` stores it so, and an injection then
    copies rows), else C-contiguous. A copy unless ``arr`` is laid out so already."""
    if not like.flags.c_contiguous and like.transpose(0, 2, 1).flags.c_contiguous:
        return np.ascontiguousarray(arr.transpose(0, 2, 1)).transpose(0, 2, 1)
    return np.ascontiguousarray(arr)


def _derived(src: KVFragment, keys: np.ndarray, values: np.ndarray, **ranges) -> KVFragment:
    """A fragment of ``src``'s span and lifecycle with other arrays and layer/head ranges."""
    return KVFragment(
        namespace=src.namespace, token_start=src.token_start, token_end=src.token_end,
        keys=np.ascontiguousarray(keys), values=laid_out_like(src.values, values), token_ids=src.token_ids,
        prefix_hash=src.prefix_hash, content_hash=src.content_hash, embedding=src.embedding,
        created_at=src.created_at, expires_at=src.expires_at, hit_count=src.hit_count,
        last_hit_at=src.last_hit_at, **ranges,
    )


def split_layers(fragment: KVFragment, layers_per_fragment: int) -> list[KVFragment]:
    """Cut ``fragment`` along axis 0: group ``i`` holds ``fragment.layers[i*k:(i+1)*k]`` (same
    stride) and everything else of the source (ValueError: ``k`` not in [1, n_layers])."""
    stride = fragment.layer_stride
    out = []
    for a, b in _groups(fragment.n_layers, _check_count("layers_per_fragment", layers_per_fragment,
                                                        fragment.n_layers, "fragment.n_layers")):
        out.append(_derived(
            fragment, fragment.keys[a:b], fragment.values[a:b],
            layer_start=fragment.layer_start + a * stride,
            layer_end=min(fragment.layer_start + b * stride, fragment.layer_end),
            layer_stride=stride, head_start=fragment.head_start, head_end=fragment.head_end,
        ))
    return out


def split_heads(fragment: KVFragment, heads_per_fragment: int) -> list[KVFragment]:
    """Cut ``fragment`` into contiguous groups of ``heads_per_fragment`` KV heads (absolute
    head numbers), arrays ``[n_layers, span, heads * head_dim]``, the rest as the source's
    (ValueError: a count not in [1, head_end - head_start])."""
    n = fragment.head_end - fragment.head_start
    dim = fragment.namespace.head_width
    out = []
    for a, b in _groups(n, _check_count("heads_per_fragment", heads_per_fragment, n, "fragment heads")):
        cols = slice(a * dim, b * dim)
        out.append(_derived(
            fragment, fragment.keys[:, :, cols], fragment.values[:, :, cols],
            layer_start=fragment.layer_start, layer_end=fragment.layer_end, layer_stride=fragment.layer_stride,
            head_start=fragment.head_start + a, head_end=fragment.head_start + b,
        ))
    return out


def _check_same_span(fragments: Sequence[KVFragment]) -> KVFragment:
    """The first fragment, once all share namespace, span, prefix, tokens; else ValueError."""
    if not fragments:
        raise ValueError("fragments: nothing to merge")
    first = fragments[0]
    for i, f in enumerate(fragments[1:], 1):
        if f.namespace != first.namespace:
            raise ValueError(f"namespace: fragment {i} belongs to another namespace than fragment 0")
        if (f.token_start, f.token_end) != (first.token_start, first.token_end):
            raise ValueError(
                f"span: fragment {i} covers tokens [{f.token_start}, {f.token_end}), "
                f"fragment 0 [{first.token_start}, {first.token_end})"
            )
        if not np.array_equal(f.token_ids, first.token_ids):
            raise ValueError(f"token_ids: fragment {i} holds other tokens than fragment 0")
        if f.prefix_hash != first.prefix_hash:
            raise ValueError(f"prefix_hash: fragment {i} follows another prefix than fragment 0")
    return first


def _merged(parts: Sequence[KVFragment], keys: np.ndarray, values: np.ndarray, **ranges) -> KVFragment:
    first = parts[0]
    embedding = next((f.embedding for f in parts if f.embedding.size), first.embedding)
    hits, last_hit, expires, created = merged_counters(parts, sum_hits=False)
    return KVFragment(
        namespace=first.namespace, token_start=first.token_start, token_end=first.token_end,
        keys=keys, values=values, token_ids=first.token_ids, prefix_hash=first.prefix_hash,
        content_hash=first.content_hash, embedding=embedding,
        created_at=created, expires_at=expires, hit_count=hits, last_hit_at=last_hit,
        **ranges,
    )


def merge_layers(fragments: Sequence[KVFragment]) -> KVFragment:
    """Join fragments of one span and head range whose layer sets (ranges or strides, any
    order) partition all the layers: layers ``[0, n_layer)``, stride 1, row ``L`` from the part
    holding layer ``L``. Raises ValueError (message starting with the field) for no fragments,
    another namespace, span, token_ids, prefix_hash or head range ("heads"), or a layer held
    twice or by none.
    """
    first = _check_same_span(fragments)
    for i, f in enumerate(fragments[1:], 1):
        if (f.head_start, f.head_end) != (first.head_start, first.head_end):
            raise ValueError(
                f"heads: fragment {i} holds heads [{f.head_start}, {f.head_end}), "
                f"fragment 0 [{first.head_start}, {first.head_end})"
            )
    n_layer = first.namespace.n_layer
    owner: dict[int, int] = {}
    for i, f in enumerate(fragments):
        for layer in f.layers:
            if layer in owner:
                raise ValueError(f"layers: overlapping layer {layer} (fragments {owner[layer]} and {i})")
            owner[layer] = i
    missing = [layer for layer in range(n_layer) if layer not in owner]
    if missing:
        raise ValueError(f"layers: missing layer {missing[0]} ({len(missing)} of {n_layer} missing)")
    shape = (n_layer,) + first.keys.shape[1:]
    keys = np.empty(shape, dtype=first.keys.dtype)
    values = np.empty(shape, dtype=first.values.dtype)
    for f in fragments:
        rows = np.fromiter(f.layers, dtype=np.intp)
        keys[rows] = f.keys
        values[rows] = f.values
    log.debug("merged %d layer groups of [%d, %d)", len(fragments), first.token_start, first.token_end)
    return _merged(fragments, keys, laid_out_like(first.values, values), layer_start=0, layer_end=n_layer,
                   layer_stride=1, head_start=first.head_start, head_end=first.head_end)


def merge_heads(fragments: Sequence[KVFragment]) -> KVFragment:
    """Join fragments of one span and layer set whose head ranges (any order) partition
    ``[0, n_head_kv)``: the parts' columns concatenated in head order. Raises ValueError as
    :func:`merge_layers` does (another layer set: "layers"; a head held twice or by none).
    """
    first = _check_same_span(fragments)
    for i, f in enumerate(fragments[1:], 1):
        if f.layers != first.layers:
            raise ValueError(f"layers: fragment {i} holds layers {f.layers}, fragment 0 {first.layers}")
    ordered = sorted(fragments, key=lambda f: (f.head_start, f.head_end))
    n_head = first.namespace.n_head_kv
    pos = 0
    for f in ordered:
        if f.head_start < pos:
            raise ValueError(f"heads: overlapping head {f.head_start}")
        if f.head_start > pos:
            raise ValueError(f"heads: missing head {pos}")
        pos = f.head_end
    if pos < n_head:
        raise ValueError(f"heads: missing head {pos}")
    keys = np.concatenate([f.keys for f in ordered], axis=2)
    values = laid_out_like(first.values, np.concatenate([f.values for f in ordered], axis=2))
    log.debug("merged %d head groups of [%d, %d)", len(fragments), first.token_start, first.token_end)
    return _merged(fragments, keys, values, layer_start=first.layer_start, layer_end=first.layer_end,
                   layer_stride=first.layer_stride, head_start=0, head_end=n_head)
