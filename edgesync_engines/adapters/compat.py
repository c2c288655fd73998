"""Which stored KV an engine may use: :func:`compatible_with` compares two namespaces.

* :data:`COMPATIBLE`: the same namespace; the KV is this engine's own, bit for bit.
* :data:`CONVERTIBLE`: the same model file (SHA-256 of the GGUF; an ONNX export records its
  GGUF's) and KV geometry, in layouts ``reshape.convert_fragment`` converts; close to, not equal
  to, the engine's own KV, so used only when asked (``allow_convertible``). KV that the same
  engine computed with other kernels (another kernel digest: another architecture or build) is
  convertible, never compatible.
* :data:`INCOMPATIBLE`: anything else; never injected.

The matrix for the two engines: docs/engines.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgesync_store.schema import KVFragment, Namespace

COMPATIBLE = "exact"
CONVERTIBLE = "convertible"
INCOMPATIBLE = "incompatible"

LAYOUT_FAMILIES = {
    "llama.cpp-seq-state/tokens-major-v1": "interleaved",
    "onnx-hf-rotate-half/tokens-major-v1": "rotate-half",
}
"""Layouts ``reshape.convert_fragment`` converts between (the name before any ``;`` option) ->
the order of K's rotary pairs: interleaved (llama.cpp) or rotate-half (Hugging Face)."""
CONVERTIBLE_LAYOUT_OPTIONS = ("v_trans",)
"""Layout options (``name=value`` after a ``;``) a conversion may ignore (fragments are
tokens-major whatever llama.cpp's V order); any other one blocks it."""
CONVERTIBLE_KV_DTYPES = ("f16", "f32")
"""Element types ``reshape.convert_fragment`` casts between (quantized KV does not convert)."""


@dataclass(frozen=True)
class Compatibility:
    """The answer of :func:`compatible_with`: ``verdict`` (:data:`COMPATIBLE`,
    :data:`CONVERTIBLE` or :data:`INCOMPATIBLE`) and a one-line ``reason`` naming what differs."""

    verdict: str
    reason: str

    @property
    def usable(self) -> bool:
        """True for compatible and convertible KV."""
        return self.verdict != INCOMPATIBLE


def _namespace(x) -> Namespace:
    if isinstance(x, Namespace):
        return x
    if isinstance(x, KVFragment):
        return x.namespace
    ns = getattr(x, "namespace", None)
    if isinstance(ns, Namespace):
        return ns
    raise TypeError(f"expected a Namespace, a KVFragment or an engine adapter, got {type(x).__name__}")


def layout_family(ns: Namespace) -> str | None:
    """The K rotary order of a namespace's layout (:data:`LAYOUT_FAMILIES`), None if unknown."""
    return LAYOUT_FAMILIES.get(ns.layout.split(";", 1)[0])


def layout_refusal(ns: Namespace) -> str | None:
    """Why KV of namespace ``ns`` cannot be converted to or from another namespace (unknown
    layout, a layout option not in :data:`CONVERTIBLE_LAYOUT_OPTIONS`, an element type not in
    :data:`CONVERTIBLE_KV_DTYPES`), None when a conversion exists."""
    if layout_family(ns) is None:
        return f"no conversion for layout {ns.layout!r}"
    for option in ns.layout.split(";")[1:]:
        if option.split("=", 1)[0].strip() not in CONVERTIBLE_LAYOUT_OPTIONS:
            return (f"no conversion for layout option {option!r} of {ns.engine}: only one full-attention "
                    "KV per layer converts (not, e.g., the parts of a sliding-window cache)")
    if ns.kv_dtype not in CONVERTIBLE_KV_DTYPES:
        return f"no conversion for KV type {ns.kv_dtype!r} (only {', '.join(CONVERTIBLE_KV_DTYPES)} convert)"
    return None


def compatible_with(a, b) -> Compatibility:
    """Can KV written under ``a`` serve an engine of namespace ``b`` (namespaces, fragments or
    adapters)? Symmetric; TypeError for an argument that has no namespace."""
    na, nb = _namespace(a), _namespace(b)
    if na == nb:
        return Compatibility(COMPATIBLE, f"same engine and settings ({na.engine}, {na.kv_dtype})")
    if na.model_fingerprint != nb.model_fingerprint:
        return Compatibility(INCOMPATIBLE, f"another model: fingerprint {na.model_fingerprint[:12]} "
                                           f"is not {nb.model_fingerprint[:12]}")
    geometry_a = (na.n_layer, na.n_head_kv, na.head_dim)
    geometry_b = (nb.n_layer, nb.n_head_kv, nb.head_dim)
    if geometry_a != geometry_b:
        return Compatibility(INCOMPATIBLE, "another head layout: {} layers x {} KV heads x {} vs {} x {} x {}".format(
            *geometry_a, *geometry_b))
    for ns in (na, nb):
        refusal = layout_refusal(ns)
        if refusal is not None:
            return Compatibility(INCOMPATIBLE, refusal)
    differs = [f"{name} {getattr(na, name)!r} -> {getattr(nb, name)!r}"
               for name in ("engine", "engine_version", "kv_dtype", "flash_attn", "kernels")
               if getattr(na, name) != getattr(nb, name)]
    if layout_family(na) != layout_family(nb):
        differs.append(f"K rotary pairs {layout_family(na)} -> {layout_family(nb)}")
    return Compatibility(CONVERTIBLE, "same model; " + ", ".join(differs or ["another layout option"]))
