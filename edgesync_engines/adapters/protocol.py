"""The engine interface, :class:`EngineAdapter` (an ABC: abstract members are what an engine
supplies, concrete ones are shared), and its errors. Callers use only :data:`MEMBERS`; any class
with all their methods and properties counts as one. Adapters are not re-entrant: the caller holds
``adapter.lock`` for a whole request. Positions and counts are tokens.
"""

from __future__ import annotations

import abc
import codecs
import contextlib
import hashlib
import logging
import threading
import time
from pathlib import Path
from typing import Callable, ContextManager, Iterable, Iterator, Mapping, Sequence

import numpy as np

from edgesync_engines.adapters.kv_blocks import KVBlock, blocks_kv, fragment_blocks, kv_ranges
from edgesync_engines.adapters.kv_layout import GROUPED_ROWS, InjectionRule, turn_batches
from edgesync_store.schema import KVFragment, Namespace, common_prefix_len, prefix_hash

log = logging.getLogger(__name__)

PROBE_TEXT = ("The cache keeps what a prefill computed, so that the next request that starts with the "
              "same tokens skips it.")
"""The text an engine's probes evaluate at load: its kernel digest (:func:`kernel_digest`) and
llama.cpp's injection rule (``LlamaCppAdapter.probe_rows``)."""
KERNEL_PROBE_TOKENS = 20
"""Tokens of :data:`PROBE_TEXT` a kernel probe evaluates in one batch before one more alone."""
_KERNEL_TAG = b"edgesync/kernels/v1\0"


def kernel_digest(logits: Iterable[np.ndarray]) -> str:
    """``Namespace.kernels`` from the logits an engine's kernels computed for the probe: SHA-256
    hex over the float32 bytes of each row (a batch's last row, then the single token's). Two
    builds or machines agree only when every bit agrees."""
    digest = hashlib.sha256(_KERNEL_TAG)
    for row in logits:
        digest.update(np.ascontiguousarray(row, dtype=np.float32).tobytes())
    return digest.hexdigest()


class ContextOverflowError(ValueError):
    """A prompt plus its max_tokens does not fit the context window; attributes ``prompt_tokens``,
    ``max_tokens``, ``n_ctx`` (tokens)."""

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
    """An evaluation inside :meth:`EngineAdapter.abortable` stopped midway; the live sequence
    is what it was before the batch."""


def check_messages(messages: Sequence[Mapping[str, str]]) -> None:
    """Raise ValueError naming the first message that is not a dict of 'role' and 'content' strings."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}]: need a dict with 'role' and 'content' strings")


def check_generation(adapter: "EngineAdapter", tokens: Sequence[int], max_tokens: int) -> None:
    """``EngineAdapter.generate``'s argument checks: RuntimeError (closed), ValueError (empty
    prompt, ``max_tokens < 1``), ContextOverflowError (``len(tokens) + max_tokens > n_ctx``)."""
    if adapter.closed:
        raise RuntimeError(f"{type(adapter).__name__}: closed")
    if not tokens:
        raise ValueError("tokens: the prompt is empty")
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    if len(tokens) + max_tokens > adapter.n_ctx:
        raise ContextOverflowError(len(tokens), max_tokens, adapter.n_ctx)


class EngineAdapter(abc.ABC):
    """One engine with one KV sequence, as the request path drives it.

    Attributes:
        namespace: of the KV this engine writes and accepts (convert others with
            ``reshape.convert_fragment``); None when :attr:`cache_refusal` is set.
        cache_refusal: None, or why the KV cannot be cut into fragments (then every request runs uncached).
        blend_refusal: None, or why stored KV cannot move position (:meth:`place_kv`, :meth:`recompute`).
        n_ctx: context window, tokens (prompt plus generated tokens).
        lock: held by the caller around a whole request.
        model_path: the GGUF file the engine runs (or its ONNX export was made from).
        kv_epoch: changes whenever the live sequence's KV may have changed.
    """

    namespace: Namespace | None
    n_ctx: int
    lock: threading.RLock
    model_path: Path
    cache_refusal: str | None = None
    blend_refusal: str | None = "this engine cannot move stored KV to another position"
    kv_epoch: int = 0
    batch_turn: Callable[[int], ContextManager] | None = None
    """Called with the prompt tokens left to evaluate, returns the context each prefill batch
    runs in (a server whose workers share the CPUs sets it). None: nothing is waited for."""
    injection_rule: InjectionRule = GROUPED_ROWS
    """Where a cached prefill may start (``kv_layout.InjectionRule``)."""
    turn_tokens: int = 0
    """When set, prefill batches are cut (bit-identically) at multiples of this many tokens; 0: not."""
    _chat_formatter = None  # add_generation_prompt -> Jinja2ChatFormatter, built on first use

    @classmethod
    def __subclasshook__(cls, other: type):
        if cls is not EngineAdapter:
            return NotImplemented
        # data attributes are set per instance: only methods and properties can be seen here
        return all(hasattr(other, name) for name in _CALLABLE_MEMBERS) or NotImplemented

    # -- the interface: engine-supplied members ---------------------------------------------

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """True once :meth:`close` ran; a closed adapter must not be called."""

    @abc.abstractmethod
    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        """Token IDs of ``text``, special tokens (``<|im_start|>``) parsed as such unless
        ``special`` is False; a BOS only when ``add_bos`` and the model asks for one."""

    @abc.abstractmethod
    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token's text (possibly part of a UTF-8 character: decode a
        stream of them with :meth:`text_stream`). Control tokens differ between engines."""

    @abc.abstractmethod
    def usable_prefix(self, available: int, n_prompt: int) -> int:
        """Tokens to inject when ``available`` leading prompt tokens are stored, so that the
        answer equals an uncached run's: in ``[0, min(available, n_prompt - 1)]``."""

    @abc.abstractmethod
    def clear_kv_cache(self) -> None:
        """Empty the KV cache and forget the live tokens."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free what the adapter loaded; :attr:`closed` is then True. Idempotent."""

    # -- the interface: shared implementation ------------------------------------------------

    def text_stream(self) -> codecs.IncrementalDecoder:
        """A fresh incremental UTF-8 decoder (errors replaced) for :meth:`token_bytes` pieces."""
        return codecs.getincrementaldecoder("utf-8")("replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """Render chat messages (dicts of ``role`` and ``content``) with the model's chat
        template, ending with the assistant prompt unless ``add_generation_prompt`` is False.
        ValueError: no chat template, or a message lacks role/content."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        check_messages(messages)
        if self._chat_formatter is None:
            self._chat_formatter = {}
        formatter = self._chat_formatter.get(add_generation_prompt)
        if formatter is None:
            template, eos_token, bos_token = self._chat_template()
            formatter = self._chat_formatter[add_generation_prompt] = Jinja2ChatFormatter(
                template=template, eos_token=eos_token, bos_token=bos_token,
                add_generation_prompt=add_generation_prompt,
            )
        return formatter(messages=list(messages)).prompt

    def extract_fragments(self, tokens: Sequence[int], spans: Sequence[tuple[int, int]], layer_start: int = 0,
                          layer_end: int | None = None, layer_stride: int = 1, ttl_seconds: float | None = None,
                          now: float | None = None, head_start: int = 0,
                          head_end: int | None = None) -> list[KVFragment]:
        """Copy the live KV of each ``(token_start, token_end)`` span into a fragment, in order:
        ``keys``/``values`` C-contiguous ``namespace.np_dtype`` ``[len(range(layer_start,
        layer_end, layer_stride)), span, (head_end - head_start) * head_dim]``, ``token_ids``
        int32. ``tokens``: what the live sequence holds; None ends: all layers or heads;
        ``ttl_seconds`` from ``now`` (Unix seconds; None: now, and no expiry). Raises ValueError for a
        span beyond the live sequence, differing ``tokens``, a bad head range, or a KVFragment invariant.
        """
        if not spans:
            return []
        layer_end, head_end = kv_ranges(self.namespace, layer_end, head_start, head_end)
        self._check_live(tokens, max(end for _, end in spans))
        kv = self._span_kv(spans, range(layer_start, layer_end, layer_stride), head_start, head_end)
        now = time.time() if now is None else now
        ids = np.asarray(tokens, dtype=np.int32)
        return [
            KVFragment(
                namespace=self.namespace, token_start=start, token_end=end,
                layer_start=layer_start, layer_end=layer_end, layer_stride=layer_stride,
                head_start=head_start, head_end=head_end, keys=keys, values=values,
                token_ids=ids[start:end], prefix_hash=prefix_hash(ids[:start]),
                created_at=now, expires_at=now + ttl_seconds if ttl_seconds is not None else 0.0,
            )
            for (start, end), (keys, values) in zip(spans, kv)
        ]

    def inject_fragment(self, fragments: Sequence[KVFragment], n_tokens: int, tokens: Sequence[int],
                        on_chunk: Callable[[], None] | None = None) -> int:
        """Replace the live sequence with positions ``0..n_tokens-1`` from ``fragments``, which
        tile ``[0, >= n_tokens)`` with every layer and KV head. ``on_chunk``: called each time an
        engine that loads a long context in chunks has copied one (so the caller may drop the
        pages it read them from). Returns ``n_tokens``. Raises ValueError (nothing changed) for
        another namespace, gaps, missing layers or heads, ``n_tokens`` outside ``[1, len(tokens)]``
        or differing tokens; InjectionError when refused (sequence cleared).
        """
        self.kv_epoch += 1
        self._load_blocks(fragment_blocks(self.namespace, fragments, n_tokens, tokens), n_tokens, tokens, on_chunk)
        return n_tokens

    def stage_fragment(self, fragment: KVFragment) -> KVFragment:
        """The copy of a fragment a RAM tier keeps: equal values laid out for the fastest
        :meth:`inject_fragment` (here the fragment itself)."""
        return fragment

    def generate(self, tokens: Sequence[int], n_past: int = 0, max_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 0.95, seed: int | None = None) -> Iterator[int]:
        """Prefill ``tokens[n_past:]`` on the live ``tokens[:n_past]`` (0: cleared first), then
        yield up to ``max_tokens`` sampled token IDs (argmax at temperature 0, else top-p
        seeded by ``seed``), stopping before an end-of-generation token; the live sequence then
        holds the prompt and the answer but its last token. At the first ``next()`` raises
        RuntimeError (closed), ContextOverflowError (``len(tokens) + max_tokens > n_ctx``) or ValueError
        (empty prompt, ``max_tokens < 1``, ``n_past`` not in ``[0, len(tokens) - 1]`` or not live).
        """
        check_generation(self, tokens, max_tokens)
        self.kv_epoch += 1
        self._resume(tokens, n_past)
        self._evaluate_plan(tokens, n_past)
        stream = self._sampled_tokens(temperature, top_p, seed)
        try:
            for i, token in enumerate(stream):
                if self.is_eog(token):
                    return
                yield int(token)
                if i + 1 >= max_tokens:
                    return
        finally:
            stream.close()

    def prefill(self, tokens: Sequence[int], n_past: int = 0) -> None:
        """Evaluate ``tokens[n_past:]`` on the live ``tokens[:n_past]`` (0: cleared first),
        sampling nothing. ContextOverflowError: more tokens than the context; ValueError:
        ``n_past`` outside ``[0, len(tokens) - 1]`` or not what the live sequence holds."""
        if len(tokens) > self.n_ctx:
            raise ContextOverflowError(len(tokens), 0, self.n_ctx)
        self.kv_epoch += 1
        self._resume(tokens, n_past)
        self._evaluate_plan(tokens, n_past)

    def prefill_batches(self, n_past: int, end: int, batch_tokens: int) -> list[tuple[int, int]]:
        """Batches of about ``batch_tokens`` extending a live ``[0, n_past)`` towards ``end``
        with KV bit-identical to an uncached prefill ([] when none can); here any cut will do."""
        step = max(batch_tokens, 1)
        return [(pos, min(pos + step, end)) for pos in range(max(n_past, 0), end, step)]

    def extend(self, tokens: Sequence[int], start: int, end: int) -> None:
        """Evaluate ``tokens[start:end]`` as one batch on the live ``tokens[:start]`` (cut back
        to it), sampling nothing. ContextOverflowError: ``end`` exceeds the context;
        ValueError: ``start`` outside ``[0, end)`` or not what the live sequence holds."""
        if end > self.n_ctx:
            raise ContextOverflowError(end, 0, self.n_ctx)
        if not 0 <= start < end <= len(tokens):
            raise ValueError(f"extend: [{start}, {end}) is not a non-empty span of the {len(tokens)} tokens")
        self.kv_epoch += 1
        if start == 0:
            self.clear_kv_cache()
        else:
            self._resume(tokens[:end], start)
        with self._turn(len(tokens) - start):
            self._eval_batch(tokens[start:end])

    def live_tokens(self) -> list[int]:
        """The token IDs the live sequence holds, in order."""
        return [int(t) for t in self._live_tokens(self.n_tokens)]

    def place_kv(self, fragments: Sequence[KVFragment], chain_tokens: Sequence[int], keep: tuple[int, int],
                 at: int, tokens: Sequence[int]) -> None:
        """Add the cells ``keep = (start, end)`` of a stored chain (``fragments`` tiling
        ``chain_tokens``) to the live sequence at ``at``, K re-rotated; the prompt ``tokens``
        holds the kept tokens there; gaps wait for :meth:`recompute`. ValueError: fragments or
        tokens that do not match; InjectionError: :attr:`blend_refusal` (always, here) or a
        refused state (the live sequence is unchanged)."""
        raise InjectionError(self.blend_refusal or "place_kv: not supported")

    def recompute(self, tokens: Sequence[int], start: int, end: int) -> None:
        """Evaluate ``tokens[start:end]`` against the live cells before ``start`` and make the
        result the live KV there. InjectionError: :attr:`blend_refusal` (always, here) or a
        failed decode (the old cells stay)."""
        raise InjectionError(self.blend_refusal or "recompute: not supported")

    def slot_adapters(self) -> "list[EngineAdapter]":
        """The adapters of every sequence this engine answers at once, their steps batched
        (``llamacpp_slots``); here itself alone."""
        return [self]

    def warm_up(self, n_tokens: int = 0, any_hit: bool = False) -> None:
        """A request's first-time work at load (chat template, one evaluation), then an empty
        cache and room for injecting ``n_tokens`` tokens (``any_hit``: a store will serve hits,
        so an engine may make the room a hit of any size needs); never raises. Caller holds
        :attr:`lock`."""
        try:
            if not getattr(self, "_warmed", False):  # once per engine; the cache is emptied each time
                self._warmed = True
                tokens = self.tokenize(self.apply_chat_template([{"role": "user", "content": "Hello"}]))
                if tokens:
                    self.prefill(tokens[:1])
        except (ValueError, RuntimeError) as exc:
            log.debug("warm-up skipped: %s", exc)
        finally:
            self.clear_kv_cache()

    def make_room(self, n_tokens: int, should_stop: Callable[[], bool] | None = None) -> bool:
        """Make room now for injecting ``n_tokens`` tokens later, keeping the live sequence;
        nothing is kept once ``should_stop()`` is True. True when the room is there (here
        always). Caller holds :attr:`lock`."""
        return True

    def abortable(self, should_stop: Callable[[], bool]) -> ContextManager:
        """A context in which an evaluation stops midway once ``should_stop()`` is True, raising
        :class:`EvaluationAborted` (here each runs whole)."""
        return contextlib.nullcontext()

    def set_threads(self, n_threads: int) -> None:
        """Evaluate on ``n_threads`` CPU threads from now on where the engine can change it
        (here it cannot); results do not depend on it. ValueError: below 1."""
        if n_threads < 1:
            raise ValueError(f"set_threads: n_threads must be >= 1, got {n_threads}")

    # -- engine hooks (not in the interface) -------------------------------------------------

    @property
    @abc.abstractmethod
    def n_tokens(self) -> int:
        """Tokens in the live sequence."""

    @abc.abstractmethod
    def _live_tokens(self, end: int) -> np.ndarray:
        """The live sequence's first ``end`` token IDs (``end <= n_tokens``)."""

    @abc.abstractmethod
    def _truncate(self, n: int) -> None:
        """Cut the live sequence back to its first ``n < n_tokens`` tokens."""

    @abc.abstractmethod
    def _span_kv(self, spans: Sequence[tuple[int, int]], layers: range, head_start: int,
                 head_end: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """K and V of each span, C-contiguous ``[len(layers), span, (head_end - head_start) *
        head_dim]`` of ``namespace.np_dtype`` (arguments already checked)."""

    def _load_blocks(self, blocks: Sequence[KVBlock], n_tokens: int, tokens: Sequence[int],
                     on_chunk: Callable[[], None] | None = None) -> None:
        """Make the live sequence hold the validated ``blocks`` as positions 0..n_tokens-1 (in one piece here)."""
        self._load_kv(*blocks_kv(self.namespace, blocks, n_tokens), n_tokens, tokens)

    def _load_kv(self, k: np.ndarray, v: np.ndarray, n_tokens: int, tokens: Sequence[int]) -> None:
        """Make the live sequence hold K, V ``[n_layer, n_tokens, n_head_kv * head_dim]``;
        InjectionError when refused (the sequence is cleared)."""
        raise NotImplementedError(f"{type(self).__name__} loads KV through _load_blocks")

    @abc.abstractmethod
    def _eval_batch(self, batch: Sequence[int]) -> None:
        """Evaluate ``batch`` on top of the live sequence (which then holds it too)."""

    @abc.abstractmethod
    def _sampled_tokens(self, temperature: float, top_p: float, seed: int | None) -> Iterator[int]:
        """Endless sampled tokens after the live sequence; each ``next()`` evaluates the one before."""

    @abc.abstractmethod
    def _chat_template(self) -> tuple[str, str, str]:
        """``(template, eos_token, bos_token)``: the Jinja2 chat template and the texts of
        EOS and BOS ("" when none). Raises ValueError: the model has none."""

    @abc.abstractmethod
    def prefill_plan(self, n_past: int, n_prompt: int) -> list[tuple[int, int]]:
        """The ``[start, end)`` evaluation batches for prompt tokens ``n_past..n_prompt-1``,
        the last prompt token alone last."""

    @abc.abstractmethod
    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, ``<|im_end|>``, ...)."""

    # -- shared helpers ---------------------------------------------------------------------

    def extract_fragment(self, tokens: Sequence[int], token_start: int, token_end: int, layer_start: int = 0,
                         layer_end: int | None = None, layer_stride: int = 1) -> KVFragment:
        """One fragment of the live sequence; see :meth:`extract_fragments`."""
        return self.extract_fragments(tokens, [(token_start, token_end)], layer_start, layer_end, layer_stride)[0]

    def _check_live(self, tokens: Sequence[int], end: int) -> None:
        if end > self.n_tokens:
            raise ValueError(f"token_end: {end} exceeds the {self.n_tokens} tokens in the live sequence")
        if common_prefix_len(self._live_tokens(end), np.asarray(tokens[:end])) != end:
            raise ValueError("tokens: differ from what the live sequence holds")

    def _resume(self, tokens: Sequence[int], n_past: int) -> None:
        """Make the live sequence hold exactly ``tokens[:n_past]`` (0: cleared); ValueError if it cannot."""
        if not 0 <= n_past < len(tokens):
            raise ValueError(f"n_past: {n_past} must be in [0, {len(tokens) - 1}]")
        if n_past == 0:
            self.clear_kv_cache()
            return
        if (
            self.n_tokens < n_past
            or common_prefix_len(self._live_tokens(n_past), np.asarray(tokens[:n_past])) != n_past
        ):
            raise ValueError("n_past: the live sequence does not hold the prompt's first n_past tokens")
        if self.n_tokens > n_past:
            self._truncate(n_past)

    def _evaluate_plan(self, tokens: Sequence[int], n_past: int) -> None:
        """Evaluate ``tokens[n_past:]`` in :meth:`prefill_plan`'s batches, each in its :attr:`batch_turn`."""
        plan = self.prefill_plan(n_past, len(tokens))
        if self.turn_tokens:
            plan = turn_batches(plan, self.turn_tokens, self.injection_rule)
        for start, end in plan:
            with self._turn(len(tokens) - start):
                self._eval_batch(tokens[start:end])

    def _turn(self, tokens_left: int) -> ContextManager:
        return self.batch_turn(tokens_left) if self.batch_turn is not None else contextlib.nullcontext()


MEMBERS = frozenset({
    "namespace", "cache_refusal", "blend_refusal", "n_ctx", "lock", "model_path", "kv_epoch", "closed",
    "tokenize", "apply_chat_template", "token_bytes", "text_stream", "usable_prefix", "extract_fragments",
    "inject_fragment", "stage_fragment", "generate", "prefill", "prefill_batches", "extend", "live_tokens",
    "place_kv", "recompute", "clear_kv_cache", "warm_up", "make_room", "abortable", "set_threads", "close",
    "slot_adapters",
})
"""The interface: the members of :class:`EngineAdapter` the request path and the app may use."""
_CALLABLE_MEMBERS = tuple(sorted(n for n in MEMBERS if callable(getattr(EngineAdapter, n, None))
                                 or isinstance(getattr(EngineAdapter, n, None), property)))


def protocol_members() -> list[str]:
    """:data:`MEMBERS`, sorted."""
    return sorted(MEMBERS)


def missing_members(obj) -> list[str]:
    """The :data:`MEMBERS` ``obj`` lacks (sorted; empty: it has them all)."""
    return [name for name in protocol_members() if not hasattr(obj, name)]
