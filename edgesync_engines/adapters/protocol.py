"""The engine side of EdgeSync: what the router needs from an inference engine.

An engine adapter owns one model and one KV cache (one sequence). The six methods are the
seed's: ``extract_fragment``, ``inject_fragment``, ``generate``, ``tokenize``,
``clear_kv_cache`` and ``close``. Adapters are not re-entrant: callers hold ``adapter.lock``
for a whole request so that two threads never drive one engine at once.
"""

from __future__ import annotations

import threading
from typing import Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from edgesync_store.schema import KVFragment, Namespace, common_prefix_len, prefix_hash


class ContextOverflowError(ValueError):
    """A prompt plus its max_tokens does not fit the engine's context window.

    Attributes: ``prompt_tokens``, ``max_tokens``, ``n_ctx`` (all token counts).
    """

    def __init__(self, prompt_tokens: int, max_tokens: int, n_ctx: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.n_ctx = n_ctx
        super().__init__(
            f"prompt of {prompt_tokens} tokens plus max_tokens {max_tokens} = {prompt_tokens + max_tokens} "
            f"tokens does not fit the context of {n_ctx} tokens; shorten the prompt, lower max_tokens "
            f"or raise n_ctx (EDGESYNC_N_CTX)"
        )


class InjectionError(RuntimeError):
    """The engine refused injected KV; the adapter has cleared its sequence before raising."""


@runtime_checkable
class KVAdapter(Protocol):
    """What an engine offers the router.

    Attributes:
        namespace: the namespace of the KV this engine writes and accepts.
        n_ctx: context window in tokens.
        lock: held by the caller around a request.
    """

    namespace: Namespace
    n_ctx: int
    lock: threading.RLock

    def tokenize(self, text: str) -> list[int]:
        """Token IDs of ``text`` (special tokens such as chat markers parsed)."""
        ...

    def extract_fragment(
        self,
        tokens: Sequence[int],
        token_start: int,
        token_end: int,
        layer_start: int = 0,
        layer_end: int | None = None,
        layer_stride: int = 1,
    ) -> KVFragment:
        """Copy the live KV of ``tokens[token_start:token_end]`` over the given layers.

        ``tokens`` must be what the live sequence holds from position 0 (checked).
        """
        ...

    def inject_fragment(self, fragments: Sequence[KVFragment], n_tokens: int, tokens: Sequence[int]) -> int:
        """Replace the live sequence with positions 0..n_tokens-1 built from ``fragments``.

        The fragments must tile ``[0, >= n_tokens)`` and together hold every layer and head of
        each span; the last span is cut to ``n_tokens``. Returns the number of tokens injected.

        Raises:
            ValueError: fragments of another namespace, gaps, or tokens that differ from
                ``tokens`` (validated before the engine is touched).
            InjectionError: the engine refused the state (its sequence is cleared).
        """
        ...

    def generate(
        self,
        tokens: Sequence[int],
        n_past: int = 0,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 0.95,
        seed: int | None = None,
    ) -> Iterator[int]:
        """Prefill ``tokens[n_past:]`` on top of the first ``n_past`` tokens already in the KV
        cache, then yield up to ``max_tokens`` sampled token IDs (greedy when temperature is 0),
        stopping at end-of-generation tokens (not yielded).

        Raises:
            ContextOverflowError: ``len(tokens) + max_tokens`` exceeds ``n_ctx``.
        """
        ...

    def clear_kv_cache(self) -> None:
        """Empty the KV cache (every sequence)."""
        ...

    def close(self) -> None:
        """Free the engine's memory; the adapter is unusable afterwards."""
        ...


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
