"""What both engine adapters share: :class:`EngineAdapterBase` (chat template, text stream,
the argument checks and decoding loop of ``generate``, fragment extraction and injection
glue); the fragments' validation and layout behind it are ``adapters/kv_blocks.py``.
"""

from __future__ import annotations

import abc
import codecs
import contextlib
import logging
import time
from typing import Callable, ContextManager, Iterator, Mapping, Sequence

import numpy as np

from edgesync_engines.adapters.kv_blocks import KVBlock, assemble_kv, blocks_kv, fragment_blocks, kv_ranges
from edgesync_engines.adapters.kv_layout import GROUPED_ROWS, InjectionRule, turn_batches
from edgesync_engines.adapters.protocol import ContextOverflowError, InjectionError
from edgesync_store.schema import KVFragment, common_prefix_len, prefix_hash

log = logging.getLogger(__name__)


def check_messages(messages: Sequence[Mapping[str, str]]) -> None:
    """Raise ValueError naming the first chat message that is not a dict of 'role' and
    'content' strings."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}]: need a dict with 'role' and 'content' strings")


class EngineAdapterBase(abc.ABC):
    """The shared half of an :class:`~edgesync_engines.adapters.protocol.EngineAdapter`.

    Subclasses set ``namespace``, ``n_ctx``, ``lock`` and ``model_path`` in ``__init__`` and
    implement the abstract methods (the engine: reading and loading KV, evaluating, sampling,
    its chat template, the live tokens). Beyond the protocol, every adapter offers
    :meth:`extract_fragment`, :meth:`assemble`, :meth:`detokenize`, :meth:`is_eog` and
    :meth:`prefill_plan` (tests and benchmarks use them).
    """

    _chat_formatter = None  # built on first use: the Jinja2 template compiles once
    kv_epoch: int = 0
    """See the protocol: bumped by every method that may change the live sequence's KV."""
    cache_refusal: str | None = None
    """Why this engine's KV cannot be cached (None: it can); see the protocol."""
    batch_turn: Callable[[int], ContextManager] | None = None
    """Called with the prompt tokens left to evaluate (this batch's included), returns the
    context manager each prefill batch (of :meth:`generate`, :meth:`prefill`, :meth:`extend`)
    runs in: a server whose workers share the CPUs sets it (``server/core_share.py``). None:
    nothing is waited for."""
    injection_rule: InjectionRule = GROUPED_ROWS
    """Where a cached prefill may start (``kv_layout.InjectionRule``); an engine that checks
    its kernels at load may relax it (``LlamaCppAdapter.probe_rows``)."""
    turn_tokens: int = 0
    """When set, :meth:`generate`'s and :meth:`prefill`'s batches are cut at multiples of this
    many tokens (``kv_layout.turn_batches``; bit-identical), so that :attr:`batch_turn` comes
    round more often. 0: the batches of :meth:`prefill_plan`."""
    blend_refusal: str | None = "this engine cannot move stored KV to another position"
    """Why stored KV cannot be placed at another position here (None: :meth:`place_kv` and
    :meth:`recompute` work); see the protocol."""

    def place_kv(self, fragments: Sequence[KVFragment], chain_tokens: Sequence[int], keep: tuple[int, int],
                 at: int, tokens: Sequence[int]) -> None:
        """Raises InjectionError: this engine cannot move stored KV (see the protocol)."""
        raise InjectionError(self.blend_refusal or "place_kv: not supported")

    def recompute(self, tokens: Sequence[int], start: int, end: int) -> None:
        """Raises InjectionError: this engine cannot move stored KV (see the protocol)."""
        raise InjectionError(self.blend_refusal or "recompute: not supported")

    def prefill_batches(self, n_past: int, end: int, batch_tokens: int) -> list[tuple[int, int]]:
        """The protocol's ``prefill_batches`` for an engine whose prefill may be cut anywhere
        (:meth:`usable_prefix` is any point): ``batch_tokens`` at a time up to ``end``."""
        step = max(batch_tokens, 1)
        return [(pos, min(pos + step, end)) for pos in range(max(n_past, 0), end, step)]

    def extend(self, tokens: Sequence[int], start: int, end: int) -> None:
        """The protocol's ``extend``."""
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
        """The protocol's ``live_tokens``."""
        return [int(t) for t in self._live_tokens(self.n_tokens)]

    def prefill(self, tokens: Sequence[int], n_past: int = 0) -> None:
        """The protocol's ``prefill``, in :meth:`prefill_plan`'s batches."""
        if len(tokens) > self.n_ctx:
            raise ContextOverflowError(len(tokens), 0, self.n_ctx)
        self.kv_epoch += 1
        self._resume(tokens, n_past)
        self._evaluate_plan(tokens, n_past)

    def _evaluate_plan(self, tokens: Sequence[int], n_past: int) -> None:
        """Evaluate ``tokens[n_past:]`` in :meth:`prefill_plan`'s batches (cut at multiples of
        :attr:`turn_tokens` when set), each in its :attr:`batch_turn`."""
        plan = self.prefill_plan(n_past, len(tokens))
        if self.turn_tokens:
            plan = turn_batches(plan, self.turn_tokens, self.injection_rule)
        for start, end in plan:
            with self._turn(len(tokens) - start):
                self._eval_batch(tokens[start:end])

    def _turn(self, tokens_left: int) -> ContextManager:
        return self.batch_turn(tokens_left) if self.batch_turn is not None else contextlib.nullcontext()

    def warm_up(self, n_tokens: int = 0) -> None:
        """The protocol's ``warm_up``: render the chat template (its compilation), evaluate one
        token (the first decode's graph and buffer set-up), then clear the cache. A failure is
        logged at DEBUG and leaves that work to the first request."""
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
        """The protocol's ``make_room``: an engine that allocates nothing per injection needs
        none."""
        return True

    def abortable(self, should_stop: Callable[[], bool]) -> ContextManager:
        """The protocol's ``abortable``: this engine cannot stop an evaluation midway, so each
        runs whole."""
        return contextlib.nullcontext()

    def set_threads(self, n_threads: int) -> None:
        """The protocol's ``set_threads``: this engine's thread count is fixed at load, so
        nothing changes.

        Raises:
            ValueError: ``n_threads`` below 1.
        """
        if n_threads < 1:
            raise ValueError(f"set_threads: n_threads must be >= 1, got {n_threads}")

    # -- engine hooks -------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """True once :meth:`close` ran."""

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
        """K and V of each span of the live sequence, C-contiguous ``[len(layers), span,
        (head_end - head_start) * head_dim]`` of ``namespace.np_dtype``, in the store's
        tokens-major layout (spans, layers and heads already checked)."""

    def _load_blocks(self, blocks: Sequence[KVBlock], n_tokens: int, tokens: Sequence[int]) -> None:
        """Make the live sequence hold the validated ``blocks`` (:func:`fragment_blocks`) as
        positions 0..n_tokens-1 of ``tokens``; here assembled for :meth:`_load_kv` (an engine
        that writes blocks in place overrides this). Raises InjectionError as :meth:`_load_kv`."""
        self._load_kv(*blocks_kv(self.namespace, blocks, n_tokens), n_tokens, tokens)

    def _load_kv(self, k: np.ndarray, v: np.ndarray, n_tokens: int, tokens: Sequence[int]) -> None:
        """Make the live sequence hold K, V ``[n_layer, n_tokens, n_head_kv * head_dim]`` (of
        ``namespace.np_dtype``) for ``tokens[:n_tokens]`` (the engine supplies this, or
        :meth:`_load_blocks`). Raises InjectionError when the engine refused it (the sequence
        is cleared)."""
        raise NotImplementedError(f"{type(self).__name__} loads KV through _load_blocks")

    @abc.abstractmethod
    def _eval_batch(self, batch: Sequence[int]) -> None:
        """Evaluate ``batch`` on top of the live sequence (which then holds it too)."""

    @abc.abstractmethod
    def _sampled_tokens(self, temperature: float, top_p: float, seed: int | None) -> Iterator[int]:
        """An endless generator of sampled tokens after the live sequence; each ``next()``
        first evaluates the token yielded before."""

    @abc.abstractmethod
    def _chat_template(self) -> tuple[str, str, str]:
        """``(template, eos_token, bos_token)`` of the model's chat template (Jinja2 source
        and the texts of its EOS and BOS tokens, "" when it has none).

        Raises:
            ValueError: the model has none.
        """

    @abc.abstractmethod
    def prefill_plan(self, n_past: int, n_prompt: int) -> list[tuple[int, int]]:
        """The ``[start, end)`` evaluation batches for prompt tokens ``n_past..n_prompt-1``,
        the last prompt token alone last."""

    @abc.abstractmethod
    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, ``<|im_end|>``, ...)."""

    @abc.abstractmethod
    def clear_kv_cache(self) -> None:
        """Empty the KV cache and forget the live tokens."""

    # -- text ---------------------------------------------------------------------------

    def text_stream(self) -> codecs.IncrementalDecoder:
        return codecs.getincrementaldecoder("utf-8")("replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The protocol's ``apply_chat_template``, through llama-cpp-python's
        ``Jinja2ChatFormatter`` (one per value of ``add_generation_prompt``)."""
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

    # -- fragments ----------------------------------------------------------------------

    def _check_live(self, tokens: Sequence[int], end: int) -> None:
        if end > self.n_tokens:
            raise ValueError(f"token_end: {end} exceeds the {self.n_tokens} tokens in the live sequence")
        if common_prefix_len(self._live_tokens(end), np.asarray(tokens[:end])) != end:
            raise ValueError("tokens: differ from what the live sequence holds")

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
        """The protocol's ``extract_fragments`` (shapes, arguments, errors), with one engine
        read for all spans."""
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

    def extract_fragment(self, tokens: Sequence[int], token_start: int, token_end: int, layer_start: int = 0,
                         layer_end: int | None = None, layer_stride: int = 1) -> KVFragment:
        """One fragment of the live sequence; see :meth:`extract_fragments`."""
        return self.extract_fragments(tokens, [(token_start, token_end)], layer_start, layer_end, layer_stride)[0]

    def assemble(self, fragments: Sequence[KVFragment], n_tokens: int,
                 tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """:func:`assemble_kv` in this adapter's namespace."""
        return assemble_kv(self.namespace, fragments, n_tokens, tokens)

    def inject_fragment(self, fragments: Sequence[KVFragment], n_tokens: int, tokens: Sequence[int]) -> int:
        """The protocol's ``inject_fragment``: validated (:func:`fragment_blocks`) before the
        engine is touched, then loaded (:meth:`_load_blocks`)."""
        self.kv_epoch += 1
        self._load_blocks(fragment_blocks(self.namespace, fragments, n_tokens, tokens), n_tokens, tokens)
        return n_tokens

    def stage_fragment(self, fragment: KVFragment) -> KVFragment:
        """The protocol's ``stage_fragment``: here the fragment itself."""
        return fragment

    # -- generation ---------------------------------------------------------------------

    def _resume(self, tokens: Sequence[int], n_past: int) -> None:
        """Make the live sequence hold exactly ``tokens[:n_past]`` (0: cleared); the
        ValueErrors of the protocol's ``prefill``."""
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

    def generate(
        self,
        tokens: Sequence[int],
        n_past: int = 0,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 0.95,
        seed: int | None = None,
    ) -> Iterator[int]:
        """The protocol's ``generate``, prefilling in :meth:`prefill_plan`'s batches.

        Raises:
            RuntimeError: the adapter is closed.
            ContextOverflowError, ValueError: as the protocol says.
        """
        if self.closed:
            raise RuntimeError(f"{type(self).__name__}: closed")
        if not tokens:
            raise ValueError("tokens: the prompt is empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
        if len(tokens) + max_tokens > self.n_ctx:
            raise ContextOverflowError(len(tokens), max_tokens, self.n_ctx)
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
