"""The systems the benchmark compares, behind one interface.

Every system answers the same chat requests on the same model (SmolLM2-135M-Instruct Q4_1 from
``edgesync_engines.adapters.model_files.default_model_path()`` unless ``model_path`` says
otherwise, e.g. Gemma 3 270M) with the same KV type (``kv_type``, :data:`KV_TYPES`; f16 by
default), greedily, and reports one :class:`Answer`::

    with make_system("llama-ram", n_threads=1) as system:
        a = system.answer([{"role": "system", "content": SYS}, {"role": "user", "content": Q}])
        a.ttft_ms, a.tokens, a.hit, a.tokens_reused, a.bytes_read

Systems (``SYSTEM_NAMES``):

* ``no-cache`` (:class:`NoCache`): llama-cpp-python ``Llama.create_completion(stream=True)``
  with the KV cache cleared before every request (``Llama.reset()`` plus
  ``llama_memory_clear``: ``reset()`` alone leaves the KV in place and the next request reuses
  the previous prompt's prefix). The prompt is evaluated as EdgeSync evaluates it (all tokens
  but the last in batches, then the last alone; see :meth:`NoCache._complete`), so that it is
  the reference for token identity.
* ``naive-string`` (:class:`NaiveStringCache`): the seed design's baseline, exact prompt text -> stored
  answer in RAM; a miss runs ``no-cache`` and stores its answer.
* ``llama-ram`` / ``llama-disk`` (:class:`LlamaCacheSystem`): ``Llama.set_cache(LlamaRAMCache)``
  or ``LlamaDiskCache``, driven through ``create_completion(stream=True)``; nothing is cleared
  between requests (llama-cpp-python's own reuse of the live context's prefix is part of what a
  user gets, and is reported separately as ``source="context"``).
* ``edgesync`` (:class:`EdgeSyncSystem`): ``EdgeSync.generate(stream=True)`` on a fragment
  store; ``edgesync-uncached``: the same with ``store=False`` (the project's own uncached path).

Timing: ``ttft_ms`` is wall time from the call of :meth:`System.answer` (chat template and
tokenization included, for every system) to the first streamed text piece; when a request
streams no text (first token end-of-generation) it is the time at the end. ``total_ms`` is the
time to the end. Both are ``time.perf_counter`` milliseconds.

Hit detection for the llama-cpp-python caches (the reliable way, documented): llama-cpp-python
0.3.36 ``Llama._create_completion`` looks ``self.cache[prompt_tokens]`` up and calls
``self.load_state(item)`` only when the item's prefix is longer than what the live context
already holds (``llama.py`` ``_create_completion``); its "cache hit" line goes to stderr only
with ``verbose=True``. This module subclasses ``Llama`` (:class:`_TracedLlama`) and records
(1) each ``load_state`` call (a cache hit; its bytes) and (2) ``n_tokens`` at the first
``eval`` of the request, which is exactly how many prompt tokens ``Llama.generate`` kept
(restored from the cache or left in the live context) and did not prefill. ``hit`` is then the
kind of that reuse with EdgeSync's definitions (``exact``: all but at most one prompt token;
``partial``: at least 64 tokens; None otherwise) and ``source`` says where it came from.

Token identity: every system tokenizes with EdgeSync's adapter (the GGUF's chat template via
``LlamaCppAdapter.apply_chat_template``, then ``tokenize(add_bos=True, special=True)``) and the
llama-cpp-python systems pass those token IDs to ``create_completion`` (its own text path
tokenizes the same way for SmolLM2, which adds no BOS, but IDs leave no doubt). Sampling equals
``LlamaCppAdapter.generate`` at temperature 0: greedy, ``top_k=40, top_p=0.95, min_p=0,
repeat_penalty=1`` (greedy ignores the others). llama-cpp-python on its own evaluates the prompt
as one batch (last token included), EdgeSync evaluates its last prompt token alone (docs/guarantees.md,
"Token-identical answers in the exact mode"): their logits differ slightly. ``no-cache``
therefore evaluates the prompt as EdgeSync does (:meth:`NoCache._complete`) and is token-
identical to it; ``llama-ram`` / ``llama-disk`` evaluate a miss as one batch and a hit's last
token alone, so their answers differ from ``no-cache`` on some requests.

Caveats: ``LlamaDiskCache`` stores ``LlamaState`` objects through ``diskcache``, which pickles
them (the system under test does; this module never unpickles anything itself; point it only at
a directory this process created). ``LlamaDiskCache.__setitem__`` prints to stderr
unconditionally: :class:`LlamaCacheSystem` captures stderr during a request
(``contextlib.redirect_stderr``, process-wide, so do not run two systems in threads of one
process) and logs the lines at DEBUG on ``edgesync.bench.systems``. Library code never prints.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import llama_cpp

from edgesync_engines.adapters.llamacpp import DEFAULT_N_CTX, LlamaCppAdapter
from edgesync_engines.adapters.model_files import (
    ModelLoadError,
    ModelNotFoundError,
    default_model_path,
    route_native_logs,
)
from edgesync_engines.adapters.protocol import ContextOverflowError
from edgesync_engines.config import EdgeSyncConfig
from edgesync_store.schema import MIN_SPAN

log = logging.getLogger(__name__)

SYSTEM_NAMES = ("no-cache", "naive-string", "llama-ram", "llama-disk", "edgesync", "edgesync-uncached")
"""Names accepted by :func:`make_system`."""

KV_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32, "q8_0": llama_cpp.GGML_TYPE_Q8_0,
            "q4_0": llama_cpp.GGML_TYPE_Q4_0}
"""KV element types a system can run with, by name -> ggml type (``ggml.h``). llama-cpp-python
systems set ``type_k = type_v`` to it, with flash attention for the quantized ones (llama.cpp
refuses a quantized V without it); EdgeSync reads it from ``EDGESYNC_KV_TYPE``."""
QUANTIZED_KV_TYPES = ("q8_0", "q4_0")
KV_TYPE_NAMES = {code: name for name, code in KV_TYPES.items()}
KV_TYPE_ENV = "EDGESYNC_KV_TYPE"
"""The environment setting EdgeSync takes its KV type from (ignored by an EdgeSync that does
not know it: the worker's stats then report the type the engine really ran)."""

HIT_EXACT, HIT_PARTIAL = "exact", "partial"

# LlamaCppAdapter.generate at temperature 0 (edgesync_engines/adapters/llamacpp.py)
GREEDY = dict(temperature=0.0, top_k=40, top_p=0.95, min_p=0.0, repeat_penalty=1.0,
              frequency_penalty=0.0, presence_penalty=0.0, seed=0)


@dataclass
class Answer:
    """One request's answer and cost.

    Times are milliseconds (``time.perf_counter``), counts are tokens, sizes bytes.
    ``hit`` is the hit kind (``"exact"``, ``"partial"``) or None for a miss; ``source`` where
    reused work came from: ``"store"`` (EdgeSync fragments), ``"cache"`` (a llama-cpp-python
    cache entry loaded), ``"context"`` (llama-cpp-python kept the previous request's prefix in
    the live context), ``"answer"`` (the naive cache returned a stored answer), None.
    ``bytes_read``: what the reuse read (EdgeSync: compressed fragment bytes from LMDB;
    llama-cpp-python caches: the loaded ``LlamaState``'s engine state + scores + input ids;
    0 otherwise). ``detail`` holds system-specific extras.
    """

    ttft_ms: float
    tokens: list[int]
    text: str
    prompt_tokens: int
    tokens_reused: int
    hit: str | None
    bytes_read: int
    total_ms: float = 0.0
    source: str | None = None
    detail: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def hit_kind_of(reused: int, n_prompt: int) -> str | None:
    """EdgeSync's hit kind for ``reused`` of ``n_prompt`` prompt tokens: ``exact`` when at most one
    token was evaluated, ``partial`` from 64 (``MIN_SPAN``) tokens, else None."""
    if reused > 0 and reused >= n_prompt - 1:
        return HIT_EXACT
    if reused >= MIN_SPAN:
        return HIT_PARTIAL
    return None


def identity(answers: Sequence[Answer], reference: Sequence[Answer]) -> float:
    """Share (0..1) of requests whose generated token IDs equal the reference's, pairwise.

    Raises:
        ValueError: the two sequences differ in length or are empty.
    """
    if len(answers) != len(reference) or not answers:
        raise ValueError(f"identity: need two equally long non-empty lists, got {len(answers)} and {len(reference)}")
    return sum(a.tokens == b.tokens for a, b in zip(answers, reference)) / len(answers)


def _default_threads() -> int:
    return EdgeSyncConfig.load().n_threads or os.cpu_count() or 1


class System:
    """One system under test. Subclasses implement :meth:`answer` and :meth:`close`."""

    name = "system"

    def answer(self, messages: "Sequence[dict] | str", max_tokens: int = 16) -> Answer:
        """Answer chat ``messages`` (or a raw prompt string) greedily with up to ``max_tokens``
        new tokens.

        Raises:
            ContextOverflowError: prompt + max_tokens exceed the context.
            ValueError: malformed messages or max_tokens < 1.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Free the model, context and cache handles (idempotent)."""

    def __enter__(self) -> "System":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _TracedLlama(llama_cpp.Llama):
    """``llama_cpp.Llama`` that records, per request, what it reused and what it sampled.

    ``begin_trace()`` starts a record: ``n_past`` (``n_tokens`` at the request's first ``eval``:
    prompt tokens not prefilled), ``loaded`` (the ``LlamaState`` loaded from a cache, or None),
    ``sampled`` (token IDs in order) and ``t_first`` (perf_counter of the first sample).
    """

    _trace: dict | None = None

    def begin_trace(self) -> dict:
        self._trace = {"n_past": None, "loaded": None, "sampled": [], "t_first": None}
        return self._trace

    def end_trace(self) -> dict | None:
        trace, self._trace = self._trace, None
        return trace

    def eval(self, tokens):
        if self._trace is not None and self._trace["n_past"] is None:
            self._trace["n_past"] = int(self.n_tokens)
        return super().eval(tokens)

    def load_state(self, state) -> None:
        super().load_state(state)
        if self._trace is not None:
            self._trace["loaded"] = state

    def sample(self, *args, **kwargs):
        token = super().sample(*args, **kwargs)
        if self._trace is not None:
            if self._trace["t_first"] is None:
                self._trace["t_first"] = time.perf_counter()
            self._trace["sampled"].append(int(token))
        return token


def kv_settings(kv_type: str) -> dict:
    """``llama_cpp.Llama`` keyword arguments for a :data:`KV_TYPES` name: nothing for f16
    (llama.cpp's default), ``type_k``/``type_v`` otherwise, and ``flash_attn=True`` for the
    quantized types.

    Raises:
        ValueError: an unknown name.
    """
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type: {kv_type!r} is not one of {', '.join(KV_TYPES)}")
    if kv_type == "f16":
        return {}
    return {"type_k": KV_TYPES[kv_type], "type_v": KV_TYPES[kv_type], "flash_attn": kv_type in QUANTIZED_KV_TYPES}


def llama_state_bytes(state) -> int:
    """Bytes a loaded ``LlamaState`` carries: engine state + scores + input ids."""
    return (int(state.llama_state_size) + int(getattr(state.scores, "nbytes", 0))
            + int(getattr(state.input_ids, "nbytes", 0)))


class _CompletionSystem(System):
    """A llama-cpp-python ``Llama`` driven through ``create_completion(stream=True)``.

    Args:
        model_path: GGUF file (default: ``default_model_path()``).
        n_threads: CPU threads (default: ``EDGESYNC_THREADS`` or all cores).
        n_ctx: context window, tokens (default 4,096 as EdgeSync).
        kv_type: KV element type, a :data:`KV_TYPES` name (default f16: llama.cpp's own
            default, nothing set).

    Raises:
        ValueError: an unknown ``kv_type``.
        ModelNotFoundError: no model file.
        ModelLoadError: llama.cpp cannot load it.
    """

    def __init__(self, model_path: str | os.PathLike | None = None, n_threads: int | None = None,
                 n_ctx: int = DEFAULT_N_CTX, kv_type: str = "f16") -> None:
        path = Path(model_path) if model_path is not None else default_model_path()
        if not path.is_file():
            raise ModelNotFoundError(f"{path}: no such model file")
        threads = n_threads or _default_threads()
        route_native_logs(False)
        try:
            self.llm = _TracedLlama(model_path=str(path), n_ctx=n_ctx, n_threads=threads,
                                    n_threads_batch=threads, verbose=False, seed=0, **kv_settings(kv_type))
        except ValueError as exc:
            raise ModelLoadError(f"{path}: {exc} (n_ctx={n_ctx}, kv_type={kv_type})") from None
        self.adapter = LlamaCppAdapter(self.llm, model_path=path)
        self.model_path = path
        self.n_threads = threads

    def _prompt(self, messages) -> list[int]:
        if isinstance(messages, str):
            text = messages
        else:
            text = self.adapter.apply_chat_template(messages)
        return self.adapter.tokenize(text)

    def _before(self) -> None:
        """Hook run before each request (NoCache clears the KV here)."""

    def _complete(self, tokens: list[int], max_tokens: int, t0: float,
                  before: bool = True) -> tuple[Answer, dict]:
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
        if len(tokens) + max_tokens > self.adapter.n_ctx:
            raise ContextOverflowError(len(tokens), max_tokens, self.adapter.n_ctx)
        if before:
            self._before()
        self.llm.begin_trace()
        captured = io.StringIO()
        ttft = None
        try:
            with contextlib.redirect_stderr(captured):
                stream = self.llm.create_completion(tokens, stream=True, max_tokens=max_tokens, stop=[], **GREEDY)
                try:
                    for _chunk in stream:
                        if ttft is None:
                            ttft = (time.perf_counter() - t0) * 1000
                finally:
                    stream.close()
        finally:
            trace = self.llm.end_trace()
            for line in captured.getvalue().splitlines():
                log.debug("%s: llama-cpp-python: %s", self.name, line)
        end = time.perf_counter()
        out: list[int] = []
        for token in trace["sampled"]:
            if self.adapter.is_eog(token) or len(out) >= max_tokens:
                break
            out.append(token)
        reused = trace["n_past"] or 0
        loaded = trace["loaded"]
        source = "cache" if loaded is not None and reused else "context" if reused else None
        answer = Answer(
            ttft_ms=ttft if ttft is not None else (end - t0) * 1000,
            tokens=out,
            text=self.adapter.text_stream().decode(b"".join(self.adapter.token_bytes(t) for t in out)),
            prompt_tokens=len(tokens),
            tokens_reused=reused,
            hit=hit_kind_of(reused, len(tokens)),
            bytes_read=llama_state_bytes(loaded) if loaded is not None else 0,
            total_ms=(end - t0) * 1000,
            source=source,
            detail={"first_sample_ms": None if trace["t_first"] is None else (trace["t_first"] - t0) * 1000,
                    "cache_loaded": loaded is not None,
                    "cache_state_tokens": None if loaded is None else int(loaded.n_tokens)},
        )
        return answer, trace

    def answer(self, messages, max_tokens: int = 16) -> Answer:
        t0 = time.perf_counter()
        return self._complete(self._prompt(messages), max_tokens, t0)[0]

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            self.adapter.close()
            llm.close()


class NoCache(_CompletionSystem):
    """llama-cpp-python with its KV cache cleared before every request (``Llama.reset()`` +
    ``llama_memory_clear``): every request prefills its whole prompt, all tokens but the last
    in batches and the last alone (:meth:`_complete`). See :class:`_CompletionSystem` for
    arguments and errors."""

    name = "no-cache"

    def _before(self) -> None:
        self.llm.reset()
        self.adapter.clear_kv_cache()

    def _complete(self, tokens: list[int], max_tokens: int, t0: float,
                  before: bool = True) -> tuple[Answer, dict]:
        """Prefill as EdgeSync does, inside the timed request: the KV is cleared, all prompt
        tokens but the last are evaluated in batches of >= 2 tokens
        (``LlamaCppAdapter.prefill_plan``), and ``create_completion`` then finds them in the
        live context and evaluates the last prompt token alone. Without this the prompt is
        evaluated as one batch, whose last-token logits differ from a one-token evaluation in
        rare tokens (``LlamaCppAdapter.usable_prefix``), so a cache could never be compared
        token for token with "no cache". Nothing is reused: ``tokens_reused`` is 0."""
        if max_tokens >= 1 and len(tokens) + max_tokens <= self.adapter.n_ctx and len(tokens) > 1:
            self._before()
            for start, end in self.adapter.prefill_plan(0, len(tokens))[:-1]:
                self.llm.eval(list(tokens[start:end]))
            answer, trace = super()._complete(tokens, max_tokens, t0, before=False)  # keep that prefill
        else:
            answer, trace = super()._complete(tokens, max_tokens, t0)
        answer.detail["prefilled_in_request"] = answer.tokens_reused
        answer.tokens_reused, answer.hit, answer.source = 0, None, None
        return answer, trace


class LlamaCacheSystem(_CompletionSystem):
    """llama-cpp-python with ``Llama.set_cache``: ``kind="ram"`` (``LlamaRAMCache``) or
    ``kind="disk"`` (``LlamaDiskCache`` in ``cache_dir``, which must be given). The cache and the
    live context are never cleared between requests: they are the system under test.

    Args:
        kind: ``"ram"`` or ``"disk"``.
        capacity_bytes: the cache's capacity (llama-cpp-python's default 2 GiB). It is checked
            against ``cache_size``, which counts ``llama_state_size`` only (about 8 MB for a
            350-token SmolLM2 prompt), while an entry also carries ``scores`` of n_tokens x
            49,152 float32 (about 69 MB): 2 GiB then admits about 250 entries, about 20 GB of
            RAM (measured: 15 GB peak RSS after 300 seed requests).
        cache_dir: directory for ``kind="disk"``.
        model_path, n_threads, n_ctx, kv_type: see :class:`_CompletionSystem`.

    Raises:
        ValueError: unknown kind, or ``kind="disk"`` without ``cache_dir``.
        ModelNotFoundError, ModelLoadError: see :class:`_CompletionSystem`.
    """

    def __init__(self, kind: str = "ram", capacity_bytes: int = 2 << 30, cache_dir: str | os.PathLike | None = None,
                 model_path: str | os.PathLike | None = None, n_threads: int | None = None,
                 n_ctx: int = DEFAULT_N_CTX, kv_type: str = "f16") -> None:
        if kind not in ("ram", "disk"):
            raise ValueError(f"kind: 'ram' or 'disk', got {kind!r}")
        if kind == "disk" and cache_dir is None:
            raise ValueError("cache_dir: required for kind='disk'")
        super().__init__(model_path, n_threads, n_ctx, kv_type)
        self.name = f"llama-{kind}"
        if kind == "ram":
            self.cache = llama_cpp.LlamaRAMCache(capacity_bytes=capacity_bytes)
        else:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
            self.cache = llama_cpp.LlamaDiskCache(cache_dir=str(cache_dir), capacity_bytes=capacity_bytes)
        self.llm.set_cache(self.cache)

    def answer(self, messages, max_tokens: int = 16) -> Answer:
        answer = super().answer(messages, max_tokens)
        entries = getattr(self.cache, "cache_state", None)
        answer.detail["cache_entries"] = len(entries) if entries is not None else len(self.cache.cache)
        return answer

    def close(self) -> None:
        cache = getattr(self, "cache", None)
        inner = getattr(cache, "cache", None)  # LlamaDiskCache's diskcache.Cache
        if inner is not None and hasattr(inner, "close"):
            inner.close()
        super().close()


class NaiveStringCache(System):
    """The seed design's baseline: exact prompt text (after the chat template) -> stored answer, in RAM.

    A hit returns the stored tokens; its ``ttft_ms`` is the time from the call to the end of the
    lookup (template rendering included), ``tokens_reused = prompt_tokens``, ``hit="exact"``,
    ``source="answer"``. A miss runs :class:`NoCache` and stores its answer. Arguments as
    :class:`_CompletionSystem`.
    """

    name = "naive-string"

    def __init__(self, model_path: str | os.PathLike | None = None, n_threads: int | None = None,
                 n_ctx: int = DEFAULT_N_CTX, kv_type: str = "f16") -> None:
        self.inner = NoCache(model_path, n_threads, n_ctx, kv_type)
        self.answers: dict[str, Answer] = {}

    def answer(self, messages, max_tokens: int = 16) -> Answer:
        t0 = time.perf_counter()
        text = messages if isinstance(messages, str) else self.inner.adapter.apply_chat_template(messages)
        key = f"{max_tokens}\x00{text}"
        stored = self.answers.get(key)
        if stored is not None:
            ttft = (time.perf_counter() - t0) * 1000
            return Answer(ttft_ms=ttft, tokens=list(stored.tokens), text=stored.text,
                          prompt_tokens=stored.prompt_tokens, tokens_reused=stored.prompt_tokens,
                          hit=HIT_EXACT, bytes_read=0, total_ms=(time.perf_counter() - t0) * 1000,
                          source="answer")
        answer = self.inner._complete(self.inner.adapter.tokenize(text), max_tokens, t0)[0]
        self.answers[key] = answer
        return answer

    def close(self) -> None:
        self.inner.close()


class EdgeSyncSystem(System):
    """EdgeSync's router, streaming.

    Args:
        store: a store directory, or False for ``edgesync-uncached`` (the project's own
            uncached path: same prefill plan, no store).
        config: more ``EdgeSyncConfig`` settings by field name (``ttl_seconds`` defaults to
            1e9 s so that nothing expires during a run).
        model_path, n_threads, n_ctx: as :class:`_CompletionSystem`.
        kv_type: a :data:`KV_TYPES` name given to EdgeSync's ``kv_type`` setting; None (default)
            leaves it to the configuration (``EDGESYNC_KV_TYPE``, f16). An EdgeSync without that
            setting runs its default (logged; :func:`engine_kv_type` says what ran).

    ``hit`` is ``result.hit`` (None for ``miss``); ``ttft_ms`` is measured here, the router's own
    figure is ``detail["engine_ttft_ms"]``.

    Raises:
        ValueError: a bad config setting. ModelNotFoundError, ModelLoadError as the router.
    """

    def __init__(self, store: "str | os.PathLike | bool", config: dict | None = None,
                 model_path: str | os.PathLike | None = None, n_threads: int | None = None,
                 n_ctx: int = DEFAULT_N_CTX, kv_type: str | None = None) -> None:
        from edgesync_engines.config import BY_NAME
        from edgesync_engines.request.router import EdgeSync

        settings = {"ttl_seconds": 1e9, "n_ctx": n_ctx, "n_threads": n_threads or _default_threads(), "seed": 0,
                    "temperature": 0.0, "model_path": model_path, "cache_enabled": store is not False,
                    **(config or {})}
        if kv_type is not None:
            kv_settings(kv_type)  # an unknown name fails here, by name
            if "kv_type" in BY_NAME:
                settings.setdefault("kv_type", kv_type)
            else:
                log.warning("this EdgeSync has no kv_type setting: kv_type %s ignored, it runs f16", kv_type)
        cfg = EdgeSyncConfig.load(settings)
        self.name = "edgesync" if store is not False else "edgesync-uncached"
        self.es = EdgeSync(model=None, store=store if store is not False else False, config=cfg)

    def answer(self, messages, max_tokens: int = 16) -> Answer:
        t0 = time.perf_counter()
        stream = self.es.generate(messages if isinstance(messages, str) else list(messages),
                                  max_tokens=max_tokens, stream=True, temperature=0.0)
        ttft = None
        with stream:
            for _piece in stream:
                if ttft is None:
                    ttft = (time.perf_counter() - t0) * 1000
        end = time.perf_counter()
        r = stream.result
        return Answer(
            ttft_ms=ttft if ttft is not None else (end - t0) * 1000,
            tokens=list(r.tokens),
            text=r.text,
            prompt_tokens=r.prompt_tokens,
            tokens_reused=r.tokens_reused,
            hit=None if r.hit == "miss" else r.hit,
            bytes_read=r.bytes_read,
            total_ms=(end - t0) * 1000,
            source="store" if r.tokens_reused else None,
            detail={"engine_ttft_ms": r.ttft_ms, "lookup_ms": r.lookup_ms, "similarity": r.similarity,
                    "fragments_written": r.fragments_written, "approximate": r.approximate,
                    "tokens_prefilled": r.tokens_prefilled, "ram_tier_hits": getattr(r, "ram_tier_hits", 0),
                    "donor": r.donor},
        )

    def close(self) -> None:
        es, self.es = getattr(self, "es", None), None
        if es is not None:
            es.close()


def engine_kv_type(system: System) -> str | None:
    """The KV type (a :data:`KV_TYPES` name, or ``"ggml type N"``) of the llama.cpp context a
    system really runs (``type_k``), None when it has none."""
    for llm in (getattr(system, "llm", None), getattr(getattr(system, "inner", None), "llm", None),
                getattr(getattr(getattr(system, "es", None), "adapter", None), "llm", None)):
        params = getattr(llm, "context_params", None)
        if params is not None:
            code = int(params.type_k)
            return KV_TYPE_NAMES.get(code, f"ggml type {code}")
    return None


def make_system(name: str, workdir: str | os.PathLike | None = None, **kwargs) -> System:
    """Build a system by name (``SYSTEM_NAMES``).

    ``workdir`` is needed by ``llama-disk`` (its cache goes to ``workdir/llama-disk-cache``) and
    ``edgesync`` (store in ``workdir/edgesync-store``); other keyword arguments go to the
    class (``model_path``, ``n_threads``, ``n_ctx``, ``kv_type``, ``capacity_bytes``, ``config``;
    ``config`` only for EdgeSync, ``capacity_bytes`` only for the llama-cpp-python caches).

    Raises:
        ValueError: unknown name, or no workdir where one is needed.
    """
    if name not in SYSTEM_NAMES:
        raise ValueError(f"system: unknown {name!r}; one of {', '.join(SYSTEM_NAMES)}")
    if name in ("llama-disk", "edgesync") and workdir is None:
        raise ValueError(f"{name}: needs a workdir")
    if name == "no-cache":
        return NoCache(**kwargs)
    if name == "naive-string":
        return NaiveStringCache(**kwargs)
    if name == "llama-ram":
        return LlamaCacheSystem("ram", **kwargs)
    if name == "llama-disk":
        return LlamaCacheSystem("disk", cache_dir=Path(workdir) / "llama-disk-cache", **kwargs)
    if name == "edgesync":
        return EdgeSyncSystem(Path(workdir) / "edgesync-store", **kwargs)
    return EdgeSyncSystem(False, **kwargs)
