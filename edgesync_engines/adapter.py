"""The engine side of EdgeSync: what the router needs from an inference engine.

An engine adapter owns one model and one KV cache (one sequence). The six methods are the
seed's: ``extract_fragment``, ``inject_fragment``, ``generate``, ``tokenize``,
``clear_kv_cache`` and ``close``. Adapters are not re-entrant: callers hold ``adapter.lock``
for a whole request so that two threads never drive one engine at once.
"""

from __future__ import annotations

import threading
from typing import Iterator, Protocol, Sequence, runtime_checkable

from edgesync_store.schema import KVFragment, Namespace


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
