"""What the request path needs from an inference engine: the :class:`EngineAdapter` protocol
and the two errors it raises.

An engine adapter owns one model and one KV cache holding one sequence (llama.cpp's sequence
0, or ONNX Runtime's ``past_key_values``). The request path (``edgesync_engines.request``) and
the app surface (``edgesync_engines.app``) use nothing else of an engine than the members
declared here; the two real adapters (``LlamaCppAdapter``, ``OnnxRuntimeAdapter``) share their
common code in ``base.EngineAdapterBase``, and ``EdgeSync`` takes any object that has these
members (``isinstance(obj, EngineAdapter)`` checks their presence, :func:`missing_members`
names the absent ones), such as the tests' fake adapter.

Adapters are not re-entrant: the caller holds ``adapter.lock`` for a whole request (inject,
generate, extract) so that two threads never drive one engine at once.

Units: token counts and positions are tokens; positions count from 0 at the start of the
sequence. Token IDs are Python ints (int32 in fragments).
"""

from __future__ import annotations

import codecs
import threading
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Mapping, Protocol, Sequence, runtime_checkable

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


class EvaluationAborted(RuntimeError):
    """An evaluation inside :meth:`EngineAdapter.abortable` stopped midway because its check
    said so: the batch left nothing behind (the live sequence is what it was before it)."""


@runtime_checkable
class EngineAdapter(Protocol):
    """One engine with one KV sequence, as the request path drives it.

    Attributes:
        namespace: the namespace of the KV this engine writes and accepts (model fingerprint,
            engine, KV dtype, layout, ``n_layer``, ``n_head_kv``, ``head_dim``); fragments of
            another namespace must be converted (``reshape.convert_fragment``) before
            :meth:`inject_fragment`. None when :attr:`cache_refusal` is set.
        blend_refusal: None when stored KV can be placed at another position of the sequence
            (:meth:`place_kv`, :meth:`recompute`: ``reuse="blend"``); otherwise why not (e.g.
            a sliding-window cache, the ONNX engine).
        cache_refusal: None when the engine's KV can be cut into fragments; otherwise one line
            saying why not (e.g. a sliding-window or quantized KV cache, found at start). The
            request path then serves every request uncached: no store read, no store write,
            and :meth:`extract_fragments` / :meth:`inject_fragment` are never called.
        n_ctx: context window, tokens (prompt plus generated tokens).
        lock: held by the caller around a whole request.
        model_path: the GGUF file the engine runs (or that its ONNX export was made from);
            the CLI prints its name.
        kv_epoch: a count that changes whenever the live sequence's KV may have changed
            (generate, prefill, extend, inject, place, recompute, clear): a caller that
            remembers what the sequence held knows it still does while the count is the same.
    """

    namespace: Namespace | None
    cache_refusal: str | None
    blend_refusal: str | None
    n_ctx: int
    lock: threading.RLock
    model_path: Path
    kv_epoch: int

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran; a closed adapter must not be called."""
        ...

    # -- text and tokens ------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        """Token IDs of ``text``, special tokens such as chat markers (``<|im_start|>``) parsed
        as such unless ``special`` is False; a BOS only when ``add_bos`` and the model asks for
        one. Both engines give the same IDs for the same model."""
        ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """Render chat messages (dicts with ``role`` and ``content``) with the model's own chat
        template (the GGUF's ``tokenizer.chat_template``), ending with the assistant prompt
        unless ``add_generation_prompt`` is False (the conversation as the next turn's prompt
        begins: messages that end with an answer).

        Raises:
            ValueError: the model has no chat template, or a message lacks role/content.
        """
        ...

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token's text (a piece of a multi-byte UTF-8 character is
        possible; decode a stream of them with :meth:`text_stream`). Control tokens such as
        chat markers differ between engines (llama.cpp gives ``b""``, ONNX Runtime their
        text); the request path decodes only generated tokens, which stop before an
        end-of-generation token."""
        ...

    def text_stream(self) -> codecs.IncrementalDecoder:
        """A fresh incremental UTF-8 decoder (errors replaced) for :meth:`token_bytes` pieces."""
        ...

    # -- KV in and out --------------------------------------------------------------------

    def usable_prefix(self, available: int, n_prompt: int) -> int:
        """How many tokens to inject when ``available`` leading prompt tokens are stored, for
        a prompt of ``n_prompt`` tokens, so that the answer equals an uncached run's: at most
        ``n_prompt - 1`` (the last prompt token is evaluated for the next-token logits), less
        where the engine's batching asks for it. Returns a count in ``[0, available]``."""
        ...

    def extract_fragments(
        self,
        tokens: Sequence[int],
        spans: Sequence[tuple[int, int]],
        layer_start: int = 0,
        layer_end: int | None = None,
        layer_stride: int = 1,
        ttl_seconds: float | None = None,
        now: float | None = None,
        head_start: int = 0,
        head_end: int | None = None,
    ) -> list[KVFragment]:
        """Copy the live KV of the token spans ``[token_start, token_end)`` into fragments of
        :attr:`namespace`, one per span, in the order given.

        Each fragment's ``keys`` and ``values`` are C-contiguous arrays of
        ``namespace.np_dtype`` (float16 for llama.cpp's default, float32 for ONNX Runtime),
        shape ``[n_layers, span, (head_end - head_start) * head_dim]`` with ``n_layers =
        len(range(layer_start, layer_end, layer_stride))``; ``token_ids`` int32 ``[span]``.

        Args:
            tokens: the token IDs the live sequence holds from position 0 (checked).
            spans: ``(token_start, token_end)`` pairs, each within the live sequence.
            layer_start, layer_end, layer_stride: the layers to keep (None: all).
            head_start, head_end: the KV heads to keep (None: all).
            ttl_seconds: lifetime from ``now``, seconds (None: the schema's
                ``DEFAULT_TTL_SECONDS``, 30 minutes).
            now: creation time, Unix seconds (None: the current time).

        Raises:
            ValueError: a span beyond the live sequence, ``tokens`` that differ from it, a head
                range outside ``[0, n_head_kv]`` or empty, or a KVFragment invariant (a span
                outside [64, 2048] tokens...).
        """
        ...

    def inject_fragment(self, fragments: Sequence[KVFragment], n_tokens: int, tokens: Sequence[int]) -> int:
        """Replace the live sequence with positions ``0..n_tokens-1`` built from ``fragments``
        (of :attr:`namespace`), so that the next :meth:`generate` with ``n_past=n_tokens``
        continues after them.

        The fragments must tile ``[0, >= n_tokens)`` and together hold every layer and KV head
        of each position; the last span is cut to ``n_tokens``. Returns ``n_tokens``.

        Raises:
            ValueError: fragments of another namespace, gaps, missing layers or heads,
                ``n_tokens`` outside ``[1, len(tokens)]``, or fragment tokens that differ from
                ``tokens`` (validated before the engine is touched: nothing changed).
            InjectionError: the engine refused the state (its sequence is cleared).
        """
        ...

    def stage_fragment(self, fragment: KVFragment) -> KVFragment:
        """The copy of a decoded fragment that a RAM tier keeps for this engine: the same
        values (``keys``, ``values`` equal element for element), its arrays possibly laid out
        otherwise (not C-contiguous) so that :meth:`inject_fragment` copies it fastest; may be
        ``fragment`` itself, changed in place. Fragments of another namespace come back as
        they are."""
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
        cache (``n_past = 0`` clears it first), then yield up to ``max_tokens`` sampled token
        IDs: the argmax when ``temperature`` is 0, else top-p sampling seeded by ``seed``.
        Stops at end-of-generation tokens (not yielded). The live sequence then holds the
        prompt and the generated tokens (but the last).

        A generator: the errors below raise at the first ``next()``.

        Raises:
            ContextOverflowError: ``len(tokens) + max_tokens > n_ctx``.
            ValueError: an empty prompt, ``max_tokens < 1``, ``n_past`` outside
                ``[0, len(tokens) - 1]``, or a live sequence that does not hold
                ``tokens[:n_past]``.
        """
        ...

    def prefill_batches(self, n_past: int, end: int, batch_tokens: int) -> list[tuple[int, int]]:
        """Evaluation batches of at most about ``batch_tokens`` tokens that extend a live
        ``[0, n_past)`` to ``[0, end')`` (``end' <= end``) with KV bit-identical to an uncached
        prefill of any longer prompt (``kv_layout.exact_batches``); [] when none can."""
        ...

    def extend(self, tokens: Sequence[int], start: int, end: int) -> None:
        """Evaluate ``tokens[start:end]`` as one batch on top of a live sequence holding
        ``tokens[:start]`` (cut back to it when it holds more), sampling nothing.

        Raises:
            ContextOverflowError: ``end`` exceeds the context.
            ValueError: ``start`` outside ``[0, end)`` or a live sequence that does not hold
                ``tokens[:start]``.
        """
        ...

    def live_tokens(self) -> list[int]:
        """The token IDs the live sequence holds, in order."""
        ...

    def prefill(self, tokens: Sequence[int], n_past: int = 0) -> None:
        """Evaluate ``tokens[n_past:]`` on top of the live ``tokens[:n_past]`` (0: cleared
        first), sampling nothing.

        Raises:
            ContextOverflowError: more tokens than the context holds.
            ValueError: ``n_past`` outside ``[0, len(tokens) - 1]`` or a live sequence that
                does not hold ``tokens[:n_past]``.
        """
        ...

    def place_kv(self, fragments: Sequence[KVFragment], chain_tokens: Sequence[int], keep: tuple[int, int],
                 at: int, tokens: Sequence[int]) -> None:
        """Add the cells ``keep = (start, end)`` of a stored chain (``fragments`` tiling
        ``chain_tokens`` from position 0) to the live sequence at positions ``at..at + end -
        start - 1``, K re-rotated for the shift; ``tokens`` is the prompt, whose
        ``[at, at + end - start)`` must equal the kept tokens. Positions may be left unfilled
        between placed ranges until :meth:`recompute` fills them.

        Raises:
            ValueError: fragments that do not tile the chain, or kept tokens that differ.
            InjectionError: :attr:`blend_refusal` is set, or the engine refused the state (the
                live sequence is unchanged).
        """
        ...

    def recompute(self, tokens: Sequence[int], start: int, end: int) -> None:
        """Evaluate ``tokens[start:end]`` at positions start..end-1 against the live cells
        before ``start`` (position ``start - 1`` must be filled) and make the result the live KV
        there.

        Raises:
            InjectionError: :attr:`blend_refusal` is set, or the decode failed (the old cells
                stay).
        """
        ...

    def clear_kv_cache(self) -> None:
        """Empty the KV cache and forget the live tokens."""
        ...

    def warm_up(self, n_tokens: int = 0) -> None:
        """Do a request's first-time work at load (chat template, one evaluation, then an empty
        cache again) and make room for injecting ``n_tokens`` tokens; never raises. The caller
        holds :attr:`lock`."""
        ...

    def make_room(self, n_tokens: int, should_stop: Callable[[], bool] | None = None) -> bool:
        """Make room now for injecting ``n_tokens`` tokens later (what :meth:`warm_up` does
        for its ``n_tokens``), keeping the live sequence: idle-time work, so that a later
        injection of a prompt that long does not allocate memory on its request's path.
        ``should_stop`` is asked as it goes; once it returns True nothing is kept. Returns True
        when the room is there (also where the engine needs none). The caller holds
        :attr:`lock`."""
        ...

    def abortable(self, should_stop: Callable[[], bool]) -> ContextManager:
        """A context in which an evaluation (e.g. :meth:`extend`) checks ``should_stop()`` as
        it goes and, once it returns True, stops midway and raises :class:`EvaluationAborted`
        (where the engine cannot stop midway, the evaluation runs whole). For work that may be
        dropped, such as idle-time batches, so that a request need not wait for one."""
        ...

    def set_threads(self, n_threads: int) -> None:
        """Evaluate on ``n_threads`` CPU threads (>= 1) from the next evaluation on, where the
        engine can change it after load (elsewhere nothing changes). The results do not depend
        on it. The caller holds :attr:`lock` or owns the engine's only thread.

        Raises:
            ValueError: ``n_threads`` below 1.
        """
        ...

    def close(self) -> None:
        """Free what the adapter loaded; it is unusable afterwards (:attr:`closed` is True).
        Idempotent."""
        ...


def protocol_members() -> list[str]:
    """The names :class:`EngineAdapter` declares (data attributes, properties, methods), sorted."""
    names = set(EngineAdapter.__annotations__)
    names |= {n for n, v in vars(EngineAdapter).items()
              if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return sorted(names)


def missing_members(obj) -> list[str]:
    """The :class:`EngineAdapter` members ``obj`` lacks (sorted; empty: it has them all)."""
    return [name for name in protocol_members() if not hasattr(obj, name)]
