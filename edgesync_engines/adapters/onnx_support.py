"""Which GGUFs the ONNX Runtime engine can export and serve, decided from the GGUF header alone
(before anything is loaded into torch): a ``llama`` GGUF with full attention in every layer,
rotary over the whole head without scaling, dense feed-forward layers and a byte-level BPE
vocabulary (SmolLM2). Why: transformers' GGUF loader ignores rope scaling and experts (the
numbers would differ from llama.cpp's, silently); the export keeps one full KV per layer (no
sliding window, no recurrent state); ``reshape``'s K permutation is Llama's rotary; the adapter
maps tokens to bytes through GPT-2's byte-level alphabet.
"""

from __future__ import annotations

import os
from pathlib import Path

from edgesync_engines.adapters.gguf_header import GGUFHeader, GGUFHeaderError, not_a_model, read_header

SUPPORTED_ARCHITECTURES = ("llama",)
"""``general.architecture`` values the ONNX export handles (see the module docstring)."""
SUPPORTED_TOKENIZERS = ("gpt2",)
"""``tokenizer.ggml.model`` values the onnxrt adapter serves: byte-level BPE."""
NO_ROPE_SCALING = (None, "none")
"""``<arch>.rope.scaling.type`` values that mean no scaling."""


def _unsupported(h: GGUFHeader) -> str | None:
    arch = h.architecture
    window = h.arch_value("attention.sliding_window")
    if isinstance(window, int) and window > 0:
        return (f"{arch}: sliding-window attention (window {window} tokens) is not exported to ONNX; "
                f"the export handles {'/'.join(SUPPORTED_ARCHITECTURES)} with full attention in every layer")
    if arch not in SUPPORTED_ARCHITECTURES:
        return f"architecture {arch!r}: the ONNX export handles {', '.join(SUPPORTED_ARCHITECTURES)} only"
    experts = h.arch_value("expert_count")
    if isinstance(experts, int) and experts > 0:
        return f"{arch}: a mixture of {experts} experts; the ONNX export handles dense models only"
    scaling = h.arch_value("rope.scaling.type")
    if scaling not in NO_ROPE_SCALING or "rope_freqs.weight" in h.tensors:
        return (f"{arch}: rope scaling ({scaling or 'rope_freqs tensor'}), which transformers' GGUF loader "
                "drops; the export would compute other numbers than llama.cpp")
    n_head = h.arch_value("attention.head_count")
    head_dim = h.arch_value("attention.key_length") or (
        h.arch_value("embedding_length", 0) // n_head if isinstance(n_head, int) and n_head > 0 else None)
    n_rot = h.arch_value("rope.dimension_count")
    if isinstance(n_rot, int) and head_dim and n_rot != head_dim:
        return f"{arch}: rotary embedding on {n_rot} of {head_dim} head dimensions; the export handles full rotary"
    tokenizer = h.metadata.get("tokenizer.ggml.model")
    if tokenizer not in SUPPORTED_TOKENIZERS:
        return (f"{arch}: tokenizer {tokenizer!r}; the onnx engine serves byte-level BPE "
                f"({', '.join(SUPPORTED_TOKENIZERS)}) vocabularies only")
    return None


def onnx_refusal(gguf_path: str | os.PathLike) -> str | None:
    """Why the ONNX engine cannot export or serve the GGUF at ``gguf_path`` (one line naming
    the file and the reason), or None when it can; reads only the header. FileNotFoundError: no file."""
    path = Path(gguf_path)
    try:
        header = read_header(path)
    except GGUFHeaderError as exc:
        return str(exc)
    reason = not_a_model(header) or _unsupported(header)
    return None if reason is None else f"{path}: {reason}"
