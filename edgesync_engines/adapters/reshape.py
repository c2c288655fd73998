"""KV fragments converted between llama.cpp's and ONNX Runtime's layouts (:func:`convert_fragment`).

Both engines' fragments are tokens-major, ``[n_layers, span, n_head * head_dim]``: llama.cpp's
float16 (``state_write_data``), ONNX Runtime's float32 (its ``past_key_values`` made
tokens-major). K differs inside each head: llama.cpp rotates interleaved pairs (``2i, 2i+1``),
Hugging Face halves (``i, i + head_dim/2``), so per head (../shared/DESIGN.md 2.3)::

    k_llamacpp = k_hf.reshape(T, 2, head_dim // 2).transpose(0, 2, 1).reshape(T, head_dim)

V needs no permutation. float16 -> float32 is exact; float32 -> float16 rounds to nearest even,
so KV converted from ONNX is close to, not equal to, llama.cpp's own.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from edgesync_store.schema import KVFragment, Namespace

__all__ = ["can_inject_with_reshape", "convert_fragment", "halves_to_interleaved", "interleaved_to_halves"]


def _swap_rotary(k: np.ndarray, head_dim: int, to_pairs: bool) -> np.ndarray:
    """Reorder the last axis of ``k`` (``[..., head_dim]``) between rotate-half and
    interleaved rotary pairs; see :func:`halves_to_interleaved`."""
    if not isinstance(head_dim, (int, np.integer)) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim: must be an even integer >= 2 (rotary pairs), got {head_dim!r}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"k: last axis is {k.shape[-1]}, not head_dim {head_dim}")
    lead, half = k.shape[:-1], int(head_dim) // 2
    split = (2, half) if to_pairs else (half, 2)
    return np.ascontiguousarray(np.swapaxes(k.reshape(*lead, *split), -1, -2).reshape(*lead, head_dim))


def halves_to_interleaved(k: np.ndarray, head_dim: int) -> np.ndarray:
    """Reorder the last axis of ``k`` (``[..., head_dim]``) from rotate-half (Hugging Face)
    to interleaved rotary pairs (llama.cpp); any dtype, a new array of the same shape. ValueError:
    ``head_dim`` odd or not the size of the last axis."""
    return _swap_rotary(k, head_dim, to_pairs=True)


def interleaved_to_halves(k: np.ndarray, head_dim: int) -> np.ndarray:
    """The inverse of :func:`halves_to_interleaved` (llama.cpp pairs -> Hugging Face halves)."""
    return _swap_rotary(k, head_dim, to_pairs=False)


def can_inject_with_reshape(fragment: KVFragment, adapter) -> bool:
    """True when ``fragment`` can serve ``adapter`` (an engine adapter or a Namespace), as is
    or through :func:`convert_fragment`: ``compat.compatible_with`` says exact or convertible.
    When False the router prefills those tokens instead."""
    from edgesync_engines.adapters.compat import compatible_with

    return compatible_with(fragment, adapter).usable


def convert_fragment(fragment: KVFragment, target: Namespace) -> KVFragment:
    """The same fragment with K and V in ``target``'s layout and element type (K's rotary pairs
    reordered per head, then cast); one already of ``target`` is returned as is. Raises ValueError
    when ``compat.compatible_with`` says it cannot serve ``target``."""
    from edgesync_engines.adapters.compat import compatible_with, layout_family

    if fragment.namespace == target:
        return fragment
    verdict = compatible_with(fragment.namespace, target)
    if not verdict.usable:
        raise ValueError(f"fragment {fragment.content_hash[:12]}: cannot serve {target.engine}: {verdict.reason}")
    head_dim = target.head_dim
    n_layers, span, width = fragment.keys.shape
    keys = fragment.keys.reshape(n_layers, span, width // head_dim, head_dim)
    source_order, target_order = layout_family(fragment.namespace), layout_family(target)
    if source_order == "rotate-half" and target_order == "interleaved":
        keys = halves_to_interleaved(keys, head_dim)
    elif source_order == "interleaved" and target_order == "rotate-half":
        keys = interleaved_to_halves(keys, head_dim)
    dtype = target.np_dtype
    return dataclasses.replace(
        fragment,
        namespace=target,
        keys=np.ascontiguousarray(keys.reshape(n_layers, span, width).astype(dtype)),
        values=np.ascontiguousarray(fragment.values.astype(dtype)),
    )
