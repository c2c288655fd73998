"""KV layout conversion between llama.cpp and ONNX Runtime (Hugging Face export) caches.

Layouts of one fragment's K or V (``n_layers`` layers of a ``span``-token span, ``n_head`` KV
heads of ``head_dim``):

* **llama.cpp** (``schema.KVFragment``, from ``src/llama-kv-cache.cpp`` ``state_write_data``):
  ``[n_layers, span, n_head * head_dim]``, float16; heads are consecutive blocks of
  ``head_dim`` in a row.
* **ONNX** (``past_key_values.{i}.key`` / ``.value`` of a ``torch.onnx.export`` of
  ``LlamaForCausalLM``): ``[n_layers, 1, n_head, span, head_dim]`` float32 (the leading 1 is
  the batch; one layer's input is ``[1, n_head, span, head_dim]``).

K also differs inside each head: llama.cpp applies rotary embeddings to interleaved pairs
(dimensions ``2i, 2i+1``), Hugging Face to halves (``i, i + head_dim/2``), and the GGUF loader
permutes the Q/K weights accordingly. So, per head (../shared/DESIGN.md 2.3)::

    k_llamacpp = k_hf.reshape(T, 2, head_dim // 2).transpose(0, 2, 1).reshape(T, head_dim)

V needs no permutation. Converting float16 to float32 is exact; float32 to float16 rounds
(round-to-nearest-even), so KV converted from ONNX is close to, not equal to, llama.cpp's own.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from edgesync_store.schema import KVFragment, Namespace

__all__ = ["can_inject_with_reshape", "convert_fragment", "halves_to_interleaved", "interleaved_to_halves",
           "llamacpp_to_onnx", "onnx_to_llamacpp"]


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
    to interleaved rotary pairs (llama.cpp); any dtype, a new array of the same shape.

    Raises:
        ValueError: ``head_dim`` odd or not the size of the last axis.
    """
    return _swap_rotary(k, head_dim, to_pairs=True)


def interleaved_to_halves(k: np.ndarray, head_dim: int) -> np.ndarray:
    """The inverse of :func:`halves_to_interleaved` (llama.cpp pairs -> Hugging Face halves)."""
    return _swap_rotary(k, head_dim, to_pairs=False)


def llamacpp_to_onnx(keys: np.ndarray, values: np.ndarray, n_head: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp K, V ``[n_layers, span, n_head * head_dim]`` (any float dtype, usually f16)
    -> ONNX K, V ``[n_layers, 1, n_head, span, head_dim]`` float32, K's rotary pairs reordered.

    Raises:
        ValueError: shapes that disagree with each other or with ``n_head * head_dim``.
    """
    if keys.shape != values.shape or keys.ndim != 3:
        raise ValueError(
            f"keys/values: need two equal [n_layers, span, width] shapes, got {keys.shape} and {values.shape}"
        )
    n_layers, span, width = keys.shape
    if width != n_head * head_dim:
        raise ValueError(f"keys: width {width} != n_head {n_head} x head_dim {head_dim}")

    def to_onnx(x: np.ndarray) -> np.ndarray:
        return x.astype(np.float32).reshape(n_layers, span, n_head, head_dim).transpose(0, 2, 1, 3)[:, None]

    k = to_onnx(keys)
    return np.ascontiguousarray(interleaved_to_halves(k, head_dim)), np.ascontiguousarray(to_onnx(values))


def onnx_to_llamacpp(keys: np.ndarray, values: np.ndarray, dtype=np.float16) -> tuple[np.ndarray, np.ndarray]:
    """ONNX K, V ``[n_layers, 1, n_head, span, head_dim]`` (float32) -> llama.cpp K, V
    ``[n_layers, span, n_head * head_dim]`` of ``dtype`` (float16: rounded to nearest), K's
    rotary pairs reordered.

    Raises:
        ValueError: shapes that disagree, a batch other than 1, or an odd head_dim.
    """
    if keys.shape != values.shape or keys.ndim != 5 or keys.shape[1] != 1:
        raise ValueError(f"keys/values: need two equal [n_layers, 1, n_head, span, head_dim] shapes, "
                         f"got {keys.shape} and {values.shape}")
    n_layers, _, n_head, span, head_dim = keys.shape

    def to_llama(x: np.ndarray) -> np.ndarray:
        return x[:, 0].transpose(0, 2, 1, 3).reshape(n_layers, span, n_head * head_dim).astype(dtype)

    k = halves_to_interleaved(keys, head_dim)
    return np.ascontiguousarray(to_llama(k)), np.ascontiguousarray(to_llama(values))


def can_inject_with_reshape(fragment: KVFragment, adapter) -> bool:
    """True when ``fragment`` can serve ``adapter`` (an engine adapter or a Namespace), as is
    or through :func:`convert_fragment`: ``compat.compatible_with`` says exact or convertible.
    When False the router prefills those tokens instead."""
    from edgesync_engines.adapters.compat import compatible_with

    return compatible_with(fragment, adapter).usable


def convert_fragment(fragment: KVFragment, target: Namespace) -> KVFragment:
    """The same fragment (token span, layers, heads, tokens, prefix hash, times) with its K and
    V in ``target``'s layout and element type: K's rotary pairs reordered per head when the
    two layouts order them differently (:func:`halves_to_interleaved`), then cast (float16 ->
    float32 is exact, float32 -> float16 rounds to nearest). A fragment already of ``target``
    is returned as is.

    Raises:
        ValueError: ``compat.compatible_with`` says the fragment cannot serve ``target``
            (another model or head layout, or a layout without a conversion).
    """
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
