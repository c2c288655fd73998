"""One benchmark worker process: one system, driven over stdin/stdout in JSON lines.

``python -m edgesync_bench.worker --system NAME --workdir DIR [--threads N] [--config JSON]
[--model GGUF] [--kv-type TYPE]``

``--model``: the GGUF every system loads (default: EdgeSync's configured model, SmolLM2).
``--kv-type``: the KV element type (``systems.KV_TYPES``): the llama-cpp-python systems set
it on their context; EdgeSync systems get it as ``EDGESYNC_KV_TYPE`` (the runner sets it in the
worker's environment too).

The runner (:mod:`edgesync_bench.runner`) starts one worker per system and workload, so that every
system has its own process (its own model, caches, peak RSS and CPU time), and deals requests
to them in turn. Each line on stdin is one JSON command; each reply is one JSON line on the
worker's original stdout. File descriptor 1 is pointed at stderr before the model loads, so
nothing that llama.cpp or a library writes can corrupt the replies.

Commands (``op``):

``answer``  ``{"op": "answer", "messages": [...] | "raw prompt", "max_tokens": 16}`` ->
    ``{"ok": true, "answer": Answer.to_dict(), "cpu_s": float, "rss_peak_bytes": int}``;
    ``cpu_s`` is the user + system CPU seconds of the whole process (all threads: the
    semantic index's encoder and the prefetch thread count) during the request.
``count``   ``{"op": "count", "messages": [...]}`` -> ``{"ok": true, "n": prompt tokens}``
    (chat template and tokenizer of the model).
``stats``   -> ``{"ok": true, "stats": {...}}``: what the system holds at the end (see
    :func:`system_stats`).
``close``   closes the system and exits 0.

A command that fails replies ``{"ok": false, "error": "<exception type>", "message": "..."}``
and the worker goes on (a ``ContextOverflowError`` is an ordinary reply, not a crash).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


def dir_disk_bytes(path: str | os.PathLike) -> int:
    """Bytes a directory tree occupies on disk (allocated blocks, ``st_blocks * 512``): what a
    sparse or pre-sized file (LMDB's ``data.mdb``) really costs. 0 when it does not exist."""
    total = 0
    root = Path(path)
    if not root.exists():
        return 0
    for p in [root, *root.rglob("*")]:
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        if p.is_file():
            total += st.st_blocks * 512
    return total


def kv_bytes_per_token(llm) -> int:
    """Raw f16 K+V bytes per token of a llama-cpp-python model, every layer holding the token:
    n_layer x n_head_kv x (K head size + V head size) x 2 bytes. The head sizes are the GGUF's
    ``<arch>.attention.key_length`` / ``value_length`` when it has them (Gemma 3 270M: 256,
    not n_embd / n_head = 160), else n_embd / n_head. SmolLM2-135M: 30 x 3 x (64 + 64) x 2 =
    23,040 (DESIGN.md 2.2); Gemma 3 270M: 18 x 1 x (256 + 256) x 2 = 18,432."""
    import llama_cpp

    model = llm.model
    n_layer = llama_cpp.llama_model_n_layer(model)
    n_head = llama_cpp.llama_model_n_head(model)
    n_head_kv = llama_cpp.llama_model_n_head_kv(model)
    meta = getattr(llm, "metadata", None) or {}
    arch = meta.get("general.architecture", "")
    default = llama_cpp.llama_model_n_embd(model) // n_head
    k_dim = int(meta.get(f"{arch}.attention.key_length", default))
    v_dim = int(meta.get(f"{arch}.attention.value_length", k_dim))
    return int(n_layer * n_head_kv * (k_dim + v_dim) * 2)


def _adapter(system):
    for obj in (system, getattr(system, "inner", None), getattr(getattr(system, "es", None), "adapter", None)):
        if obj is None:
            continue
        if hasattr(obj, "apply_chat_template") and hasattr(obj, "tokenize"):
            return obj
        if getattr(obj, "adapter", None) is not None:
            return obj.adapter
    raise RuntimeError(f"{system.name}: no adapter to count tokens with")


def system_stats(system, workdir: Path) -> dict:
    """What a system holds after its requests, for the report.

    Every system: ``kv_bytes_per_token`` (raw f16 KV of one token of its model), ``model``
    (the GGUF's file name), ``kv_type`` (the KV type its llama.cpp context really runs,
    ``systems.engine_kv_type``). EdgeSync: ``cache_refusal`` (why it serves uncached, None
    when it caches),
    ``store`` (fragments, compressed/raw bytes from the store's headers), ``store_disk_bytes``
    (allocated bytes of the store directory, LMDB and semantic sidecar), ``prefetch`` (the
    router's ``prefetch_stats()`` when it has one). llama-cpp-python caches: ``cache_entries``,
    ``cache_bytes`` (``cache_size``), for the RAM cache ``cache_entry_bytes`` (state + scores +
    input ids of every entry), for the disk cache ``cache_disk_bytes``. Naive string
    cache: ``answers`` stored.
    """
    from edgesync_bench.systems import engine_kv_type

    adapter = _adapter(system)
    out: dict = {"system": system.name, "kv_bytes_per_token": kv_bytes_per_token(adapter.llm),
                 "model": Path(str(adapter.model_path)).name, "kv_type": engine_kv_type(system)}
    es = getattr(system, "es", None)
    if es is not None:
        out["cache_refusal"] = getattr(es, "uncached_reason", None)
    if es is not None and getattr(es, "store", None) is not None:
        from edgesync_store.commands.inventory import summary

        out["store"] = summary(es.store)
        out["store_disk_bytes"] = dir_disk_bytes(es.store.path)
        stats = getattr(es, "prefetch_stats", None)
        out["prefetch"] = stats() if callable(stats) else None
    cache = getattr(system, "cache", None)
    if cache is not None:
        from edgesync_bench.systems import llama_state_bytes

        out["cache_bytes"] = int(cache.cache_size)
        entries = getattr(cache, "cache_state", None)
        out["cache_entries"] = len(entries) if entries is not None else len(cache.cache)
        if entries is not None:  # LlamaRAMCache: what its entries really hold (scores included)
            out["cache_entry_bytes"] = sum(llama_state_bytes(state) for state in entries.values())
        if system.name == "llama-disk":
            out["cache_disk_bytes"] = dir_disk_bytes(workdir / "llama-disk-cache")
    if hasattr(system, "answers"):
        out["answers"] = len(system.answers)
    return out


def wait_for_warm_up(timeout_s: float = 300.0) -> bool:
    """Wait for EdgeSync's background semantic warm-up when one is running (the router starts
    it where its mode uses the lookup), so that its loading does not overlap a timed request;
    True if there was one. It loads nothing itself: where EdgeSync loads the embedder lazily,
    nothing is waited for and nothing is loaded (``SemanticLookup.wait_ready`` would load it)."""
    from edgesync_engines.request.semantic_lookup import WARM_UP_THREAD

    warm = [t for t in threading.enumerate() if t.name == WARM_UP_THREAD and t.is_alive()]
    for t in warm:
        t.join(timeout_s)
    return bool(warm)


def _rusage() -> tuple[float, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024  # Linux: ru_maxrss in KiB


def _wait_prefetch(system) -> float | None:
    """Let EdgeSync's prefetch thread finish before the next request (any system's) starts, as
    it would in the pause between a user's requests; returns the wait in ms (None: no
    prefetcher). The wait is outside TTFT; its CPU time counts in the request's ``cpu_s``."""
    wait = getattr(getattr(getattr(system, "es", None), "prefetcher", None), "wait_idle", None)
    if not callable(wait):
        return None
    t0 = time.perf_counter()
    wait(30.0)
    return (time.perf_counter() - t0) * 1000


def serve(system, workdir: Path, inp, out) -> None:
    """Answer commands from ``inp`` (text lines) on ``out`` until ``close`` or end of input."""
    from edgesync_bench.workloads import Request  # noqa: F401  (import cost outside timing)

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    for line in inp:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "answer":
                cpu0, _ = _rusage()
                answer = system.answer(cmd["messages"], int(cmd.get("max_tokens", 16)))
                idle_ms = _wait_prefetch(system)
                cpu1, rss = _rusage()
                reply({"ok": True, "answer": answer.to_dict(), "cpu_s": cpu1 - cpu0, "rss_peak_bytes": rss,
                       "prefetch_wait_ms": idle_ms})
            elif op == "count":
                ad = _adapter(system)
                reply({"ok": True, "n": len(ad.tokenize(ad.apply_chat_template(list(cmd["messages"]))))})
            elif op == "stats":
                _wait_prefetch(system)
                reply({"ok": True, "stats": system_stats(system, workdir)})
            elif op == "close":
                system.close()
                reply({"ok": True})
                return
            else:
                reply({"ok": False, "error": "ValueError", "message": f"unknown op {op!r}"})
        except Exception as exc:  # reported to the runner, which decides
            log.debug("command failed", exc_info=True)
            reply({"ok": False, "error": type(exc).__name__, "message": str(exc)})
    system.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgesync_bench.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--system", required=True)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--config", default=None, help="JSON object of EdgeSyncConfig fields (edgesync systems)")
    parser.add_argument("--model", type=Path, default=None, help="GGUF file every system loads")
    parser.add_argument("--kv-type", default=None, help="KV element type (f16, f32, q8_0, q4_0)")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    # replies go to the original stdout; fd 1 becomes stderr so native prints cannot corrupt them
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    out = os.fdopen(reply_fd, "w", buffering=1)

    from edgesync_bench.systems import make_system

    kwargs: dict = {"n_threads": args.threads, "model_path": args.model}
    if args.kv_type is not None:
        if args.system.startswith("edgesync"):
            from edgesync_bench.systems import KV_TYPE_ENV

            os.environ[KV_TYPE_ENV] = args.kv_type  # EdgeSync reads its KV type from its settings
        else:
            kwargs["kv_type"] = args.kv_type
    if args.config:
        try:
            kwargs["config"] = json.loads(args.config)
        except json.JSONDecodeError as exc:
            out.write(json.dumps({"ok": False, "error": "ValueError", "message": f"--config: {exc}"}) + "\n")
            return 2
    name = args.system
    args.workdir.mkdir(parents=True, exist_ok=True)
    try:
        system = make_system(name, workdir=args.workdir, **kwargs)
    except Exception as exc:
        out.write(json.dumps({"ok": False, "error": type(exc).__name__, "message": str(exc)}) + "\n")
        return 2
    wait_for_warm_up()  # a background warm-up must not run during another system's request
    out.write(json.dumps({"ok": True, "ready": name, "pid": os.getpid()}) + "\n")
    serve(system, args.workdir, sys.stdin, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
