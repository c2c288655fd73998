"""A FAKE engine adapter: for fast tests of the request path's pure logic (what a request
reuses, what gets stored back), run beside the real-model tests and needing no model.
``EdgeSync(FakeAdapter(), store, config)`` drives it like a real engine. It proves nothing
about identity with an uncached run: the real-model tests (test_router.py,
test_semantic_router.py, test_cross_engine.py) do that.

:class:`FakeAdapter` has every member of ``adapters.protocol.MEMBERS`` without subclassing
``EngineAdapter`` (an instance of it all the same):

* tokenization is one token per character (token ID = ``ord(c)``), so a 64-character prompt is
  64 tokens; the chat template is ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``, then
  ``<|im_start|>assistant\\n``), tokenized the same way;
* the KV of position ``i`` holding token ``t`` is a deterministic function of ``(i, t)``: small
  arrays of ``[n_layer, span, n_head_kv * head_dim]`` (2 x span x 8 by default);
* ``usable_prefix`` follows llama.cpp's rule (never the last prompt token, and one fewer when
  a single token would be left to prefill), or ONNX Runtime's (``one_token_rule=False``);
* ``generate`` checks that the live sequence holds ``tokens[:n_past]`` (as the real engines do),
  records what it prefilled and answers with the fixed tokens of ``answer``.
"""

from __future__ import annotations

import codecs
import contextlib
import threading
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from edgesync_engines.adapters.protocol import InjectionError
from edgesync_store.schema import DEFAULT_TTL_SECONDS, KVFragment, Namespace, prefix_hash

LLAMA_LAYOUT = "llama.cpp-seq-state/tokens-major-v1"
ONNX_LAYOUT = "onnx-hf-rotate-half/tokens-major-v1"


def fake_namespace(engine: str = "llama.cpp", *, fingerprint: str = "fa" * 32, n_layer: int = 2,
                   n_head_kv: int = 2, head_dim: int = 4) -> Namespace:
    """A small namespace: llama.cpp (f16, interleaved rotary pairs) or ``"onnxruntime"`` (f32,
    rotate-half), which ``compat.compatible_with`` calls convertible for one fingerprint."""
    onnx = engine == "onnxruntime"
    return Namespace(
        model_fingerprint=fingerprint,
        engine=engine,
        engine_version="fake 1",
        kv_dtype="f32" if onnx else "f16",
        flash_attn=False,
        layout=ONNX_LAYOUT if onnx else LLAMA_LAYOUT,
        n_layer=n_layer,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        kernels="fake",
    )


def kv_of(namespace: Namespace, tokens: Sequence[int], start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """The fake KV of positions ``[start, end)``: K[l, i, c] = (position + l + c / 8) / 1024 and
    V = K + token / 65536, of ``namespace.np_dtype``, shape ``[n_layer, end - start, n_head_kv *
    head_dim]``."""
    width = namespace.n_head_kv * namespace.head_dim
    pos = np.arange(start, end, dtype=np.float64)[None, :, None]
    layer = np.arange(namespace.n_layer, dtype=np.float64)[:, None, None]
    chan = np.arange(width, dtype=np.float64)[None, None, :]
    keys = (pos + layer + chan / 8) / 1024
    values = keys + np.asarray(tokens[start:end], dtype=np.float64)[None, :, None] / 65536
    dtype = namespace.np_dtype
    return np.ascontiguousarray(keys.astype(dtype)), np.ascontiguousarray(values.astype(dtype))


class FakeAdapter:
    """A fake of ``EngineAdapter`` (see the module docstring); not an engine.

    Attributes beyond the protocol, for tests: ``live`` (the token IDs the fake KV holds),
    ``injected`` (``n_tokens`` of every successful :meth:`inject_fragment`), ``prefilled``
    (tokens evaluated by each :meth:`generate`), ``refuse_injection`` (raise InjectionError).
    """

    def __init__(self, namespace: Namespace | None = None, *, n_ctx: int = 4096, one_token_rule: bool = True,
                 answer: Sequence[int] = (ord("o"), ord("k"))) -> None:
        self.namespace = namespace or fake_namespace()
        self.cache_refusal = None
        self.blend_refusal = "the fake adapter does not place KV"
        self.n_ctx = n_ctx
        self.lock = threading.RLock()
        self.model_path = Path("fake.gguf")
        self.one_token_rule = one_token_rule
        self.answer = list(answer)
        self.live: list[int] = []
        self.injected: list[int] = []
        self.prefilled: list[int] = []
        self.refuse_injection = False
        self.kv_epoch = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def prefill(self, tokens, n_past: int = 0) -> None:
        self.kv_epoch += 1
        self.live = list(tokens)
        self.prefilled.append(len(tokens) - n_past)

    def place_kv(self, fragments, chain_tokens, keep, at, tokens) -> None:
        raise InjectionError(self.blend_refusal)

    def recompute(self, tokens, start: int, end: int) -> None:
        raise InjectionError(self.blend_refusal)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        parts = []
        for m in messages:
            if "role" not in m or "content" not in m:
                raise ValueError("a chat message lacks role or content")
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        return "".join(parts) + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def token_bytes(self, token: int) -> bytes:
        return chr(token).encode()

    def text_stream(self) -> codecs.IncrementalDecoder:
        return codecs.getincrementaldecoder("utf-8")(errors="replace")

    def usable_prefix(self, available: int, n_prompt: int) -> int:
        usable = min(available, n_prompt - 1)
        if self.one_token_rule and n_prompt - 1 - usable == 1:
            usable -= 1
        return max(usable, 0)

    def extract_fragments(self, tokens, spans, layer_start=0, layer_end=None, layer_stride=1, ttl_seconds=None,
                          now=None, head_start=0, head_end=None) -> list[KVFragment]:
        tokens = [int(t) for t in tokens]
        if tokens[: len(self.live)] != self.live[: len(tokens)]:
            raise ValueError("tokens: differ from the live sequence")
        ns = self.namespace
        layer_end = ns.n_layer if layer_end is None else layer_end
        head_end = ns.n_head_kv if head_end is None else head_end
        layers = list(range(layer_start, layer_end, layer_stride))
        cols = slice(head_start * ns.head_dim, head_end * ns.head_dim)
        ttl = DEFAULT_TTL_SECONDS if ttl_seconds is None else ttl_seconds
        created = 0.0 if now is None else now
        out = []
        for start, end in spans:
            if end > len(self.live):
                raise ValueError(f"span [{start}, {end}) beyond the live sequence of {len(self.live)}")
            keys, values = kv_of(ns, tokens, start, end)
            out.append(
                KVFragment(
                    namespace=ns,
                    token_start=start,
                    token_end=end,
                    layer_start=layer_start,
                    layer_end=layer_end,
                    layer_stride=layer_stride,
                    head_start=head_start,
                    head_end=head_end,
                    keys=np.ascontiguousarray(keys[layers][:, :, cols]),
                    values=np.ascontiguousarray(values[layers][:, :, cols]),
                    token_ids=np.asarray(tokens[start:end], dtype=np.int32),
                    prefix_hash=prefix_hash(tokens[:start]),
                    created_at=created,
                    expires_at=created + ttl,
                )
            )
        return out

    def inject_fragment(self, fragments: Sequence[KVFragment], n_tokens: int, tokens: Sequence[int],
                        on_chunk=None) -> int:
        tokens = [int(t) for t in tokens]
        if not 1 <= n_tokens <= len(tokens):
            raise ValueError(f"n_tokens: {n_tokens} outside [1, {len(tokens)}]")
        covered = 0
        for frag in fragments:
            if frag.namespace != self.namespace:
                raise ValueError("fragment of another namespace")
            if frag.token_start > covered:
                raise ValueError(f"gap at token {covered}")
            end = min(frag.token_end, n_tokens)  # the last span is cut to n_tokens
            if [int(t) for t in frag.token_ids[: end - frag.token_start]] != tokens[frag.token_start:end]:
                raise ValueError(f"fragment tokens at {frag.token_start} differ from the prompt's")
            covered = max(covered, frag.token_end)
        if covered < n_tokens:
            raise ValueError(f"fragments cover {covered} of {n_tokens} tokens")
        if self.refuse_injection:
            self.clear_kv_cache()
            raise InjectionError("fake refusal")
        self.live = tokens[:n_tokens]
        self.kv_epoch += 1
        self.injected.append(n_tokens)
        return n_tokens

    def stage_fragment(self, fragment: KVFragment) -> KVFragment:
        return fragment

    def generate(self, tokens, n_past=0, max_tokens=128, temperature=0.0, top_p=0.95, seed=None):
        tokens = [int(t) for t in tokens]
        if not tokens or not 0 <= n_past <= len(tokens) - 1:
            raise ValueError(f"n_past: {n_past} outside [0, {len(tokens) - 1}]")
        if n_past == 0:
            self.live = []
        elif self.live[:n_past] != tokens[:n_past]:
            raise ValueError("the live sequence does not hold tokens[:n_past]")
        self.prefilled.append(len(tokens) - n_past)
        self.kv_epoch += 1
        out = self.answer[:max_tokens]
        self.live = tokens + out[:-1]
        yield from out

    def prefill_batches(self, n_past: int, end: int, batch_tokens: int) -> list[tuple[int, int]]:
        step = max(batch_tokens, 1)
        return [(pos, min(pos + step, end)) for pos in range(max(n_past, 0), end, step)]

    def extend(self, tokens, start: int, end: int) -> None:
        tokens = [int(t) for t in tokens]
        if not 0 <= start < end <= len(tokens) or self.live[:start] != tokens[:start]:
            raise ValueError(f"extend: bad span [{start}, {end}) or live sequence")
        self.live = tokens[:end]
        self.kv_epoch += 1
        self.prefilled.append(end - start)

    def live_tokens(self) -> list[int]:
        return list(self.live)

    def clear_kv_cache(self) -> None:
        self.kv_epoch += 1
        self.live = []

    def warm_up(self, n_tokens: int = 0, any_hit: bool = False) -> None:
        """Nothing to warm: the fake evaluates nothing (``warmed_for`` records the size asked)."""
        self.warmed_for = n_tokens

    def make_room(self, n_tokens: int, should_stop=None) -> bool:
        """No buffer to grow (``room_for`` records the largest count asked)."""
        self.room_for = max(getattr(self, "room_for", 0), n_tokens)
        return True

    def abortable(self, should_stop):
        """Nothing evaluates midway here: each call runs whole."""
        return contextlib.nullcontext()

    def set_threads(self, n_threads: int) -> None:
        """No threads to set (``threads`` records the count asked)."""
        if n_threads < 1:
            raise ValueError(f"set_threads: n_threads must be >= 1, got {n_threads}")
        self.threads = n_threads

    def slot_adapters(self) -> list:
        return [self]

    def close(self) -> None:
        self._closed = True
