"""How many workers the machine holds: ``edgesync serve``'s start-up check of its worker count
against the memory available (refused beyond it) and the CPUs (a warning).

A worker is estimated as the model file + its KV cache for ``n_ctx`` (GGUF header) +
:data:`WORKER_OVERHEAD_BYTES`; llama.cpp's figures, so looser for ONNX Runtime. Figures:
docs/serving.md and docs/architecture.md ("`edgesync serve` in detail").
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from edgesync_engines.adapters.gguf_header import GGML_BLOCKS, GGUFHeader, GGUFHeaderError, read_header
from edgesync_engines.adapters.seqstate import GGML_TYPE_BY_NAME

log = logging.getLogger(__name__)

MIB = 1 << 20
WORKER_OVERHEAD_BYTES = 128 * MIB
"""A worker's memory besides model and KV cache (measured with SmolLM2, rounded up)."""
KV_CELL_PADDING = 256
"""llama.cpp rounds the context up to a multiple of this many cells (the adapter's ``n_ctx``)."""
MEMINFO = Path("/proc/meminfo")


class WorkerCountError(ValueError):
    """The worker count asked for does not fit the memory available (the message says by how much, and how many fit)."""


@dataclass(frozen=True)
class WorkerEstimate:
    """One worker's estimated memory, bytes: the model file, its KV cache (0 when the header
    says too little to tell) and the rest of the process (:data:`WORKER_OVERHEAD_BYTES`)."""

    model: int
    kv_cache: int
    overhead: int = WORKER_OVERHEAD_BYTES

    @property
    def total(self) -> int:
        return self.model + self.kv_cache + self.overhead

    def describe(self, n_ctx: int, slots: int = 1) -> str:
        cells = f"n_ctx {n_ctx}" + (f" x {slots} slots" if slots > 1 else "")
        kv = f"its KV cache for {cells} {size_text(self.kv_cache)}" if self.kv_cache else "its KV cache unknown"
        return f"the model {size_text(self.model)} + {kv} + {size_text(self.overhead)} for the process"


def size_text(n_bytes: int) -> str:
    """``n_bytes`` for a message: in MiB below 10 GiB, in GiB below 10 TiB, else in TiB."""
    for unit, scale in (("MiB", MIB), ("GiB", 1 << 30)):
        if n_bytes < 10 * 1024 * scale:
            return f"{n_bytes / scale:,.{0 if unit == 'MiB' else 1}f} {unit}"
    return f"{n_bytes / (1 << 40):,.1f} TiB"


def available_memory(meminfo: Path = MEMINFO) -> int | None:
    """Bytes available for new processes: Linux ``MemAvailable``, else ``SC_AVPHYS_PAGES * SC_PAGE_SIZE``, else None."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # "MemAvailable:  23186000 kB"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def kv_cache_bytes(header: GGUFHeader, n_ctx: int, kv_type: str) -> int:
    """Bytes of llama.cpp's K and V cache for ``n_ctx`` tokens in ``kv_type`` (every layer full size):
    per layer and cell ``head_count_kv`` x (``key_length`` + ``value_length``) elements at ggml's
    size (``GGML_BLOCKS``); 0 when the header lacks the figures."""
    layers, embd, heads = (header.arch_value(k) for k in ("block_count", "embedding_length",
                                                          "attention.head_count"))
    kv_heads = header.arch_value("attention.head_count_kv", heads)
    if not isinstance(layers, int) or layers <= 0:
        return 0
    per_layer_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    if not per_layer_heads or not all(isinstance(h, int) and h >= 0 for h in per_layer_heads):
        return 0
    head_dim = embd // heads if isinstance(embd, int) and isinstance(heads, int) and heads > 0 else None
    k_dim = header.arch_value("attention.key_length", head_dim)
    v_dim = header.arch_value("attention.value_length", head_dim)
    if not isinstance(k_dim, int) or not isinstance(v_dim, int):
        return 0
    per_block, block_bytes = GGML_BLOCKS[GGML_TYPE_BY_NAME[kv_type].code]
    cells = -(-n_ctx // KV_CELL_PADDING) * KV_CELL_PADDING
    elements = cells * sum(per_layer_heads) * (k_dim + v_dim)
    return elements * block_bytes // per_block


def worker_estimate(model: Path, n_ctx: int, kv_type: str) -> WorkerEstimate:
    """One worker's estimated memory for ``model``.

    Raises:
        OSError: the model file cannot be read (its size).
    """
    try:
        kv = kv_cache_bytes(read_header(model), n_ctx, kv_type)
    except GGUFHeaderError as exc:  # the engine's load says what is wrong with the file
        log.debug("no KV cache estimate: %s", exc)
        kv = 0
    return WorkerEstimate(model=model.stat().st_size, kv_cache=kv)


def check_workers(n_workers: int, explicit: bool, estimate: WorkerEstimate, n_ctx: int, cpus: int,
                  available: int | None) -> int:
    """The worker count to start: ``n_workers`` when they fit ``available`` bytes (None: unchecked);
    a default count is lowered to what fits, one worker always starts (with a warning). Warns above
    ``cpus``.

    Raises:
        WorkerCountError: an explicit ``--workers`` above 1 that does not fit.
    """
    if available is None:
        log.debug("memory available unknown on this platform: --workers %d unchecked", n_workers)
    elif n_workers * estimate.total > available:
        fit = available // estimate.total
        need = (f"{n_workers} worker{'s' if n_workers > 1 else ''} need{'' if n_workers > 1 else 's'} an estimated "
                f"{size_text(n_workers * estimate.total)} (each: {estimate.describe(n_ctx)}), and "
                f"{size_text(available)} of memory is available")
        if explicit and n_workers > 1:
            raise WorkerCountError(f"--workers {n_workers}: {need}; "
                                   + (f"at most {fit} fit" if fit else "not even 1 fits"))
        started = max(1, min(n_workers, fit))
        log.warning("%s: starting %d%s%s", need, started, "" if fit else ", which may swap or be killed for memory",
                    " (--workers sets the count)" if started < n_workers else "")
        n_workers = started
    if n_workers > cpus:
        log.warning("--workers %d is more than the %d CPUs this process may run on: the workers share them "
                    "(a request's prefill runs alone on all of them), so those beyond %d add memory, not "
                    "compute", n_workers, cpus, cpus)
    return n_workers


def check_slots(slots: int, explicit: bool, n_workers: int, model: Path, n_ctx: int, kv_type: str,
                available: int | None) -> int:
    """Slots per worker (each a KV stream of ``n_ctx`` tokens): ``slots`` when ``n_workers``
    workers of that many fit ``available`` bytes (None: unchecked); a default count is lowered to
    what fits, at least 1.

    Raises:
        WorkerCountError: an explicit ``--slots`` above 1 that does not fit.
    """
    if available is None or slots == 1:
        return slots
    for n in range(slots, 0, -1):
        estimate = worker_estimate(model, n_ctx * n, kv_type)
        if n_workers * estimate.total <= available:
            break
        if explicit:
            raise WorkerCountError(
                f"--slots {slots}: {n_workers} worker{'s' if n_workers > 1 else ''} of {slots} slots need an "
                f"estimated {size_text(n_workers * estimate.total)} (each: {estimate.describe(n_ctx, slots)}), "
                f"and {size_text(available)} of memory is available")
    if n < slots:
        log.warning("%d slots per worker do not fit the %s of memory available: starting %d (--slots sets the "
                    "count)", slots, size_text(available), n)
    return n
