"""The ``edgesync`` subcommands that run the model: ``generate`` and ``export-onnx``
(:func:`add_engine_options` is shared with the benchmarks' ``edgesync run``). Bad input raises
:class:`~edgesync_engines.app.cli_common.CommandError` (exit 2)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from edgesync_engines.app.cli_common import CommandError, load_config, open_edgesync
from edgesync_engines.config import BY_NAME, ENGINES, KV_TYPES, REUSE_MODES
from edgesync_store.commands.units import format_bytes

STORE_HELP = "store directory (default: EDGESYNC_STORE or the per-user cache dir)"


def add_model_options(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--kv-type`` and ``--engine`` (each None when not given: the setting decides)."""
    p.add_argument("--model", help="GGUF file (default: EDGESYNC_MODEL or SmolLM2-135M-Instruct)")
    p.add_argument("--kv-type", type=str.lower, choices=KV_TYPES,
                   help="llama.cpp K/V cache type (default: EDGESYNC_KV_TYPE or f16)")
    p.add_argument("--engine", type=str.lower, choices=ENGINES, help=BY_NAME["engine"].help)


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The options that choose the model and engine: :func:`add_model_options`, ``--reuse`` and
    ``--allow-convertible``."""
    add_model_options(p)
    p.add_argument("--reuse", choices=REUSE_MODES, help=BY_NAME["reuse"].help)
    p.add_argument("--allow-convertible", action="store_true", default=None, help=BY_NAME["allow_convertible"].help)


def add_parsers(sub, common: argparse.ArgumentParser) -> None:
    """Register ``generate`` on ``sub`` (the subparsers of ``cli.build_parser``);
    ``common`` is the parent parser holding ``--log-level``."""
    gen = sub.add_parser("generate", parents=[common], help="answer one prompt, reusing stored KV")
    gen.add_argument("prompt", help="the user message (or, with --raw, the whole prompt text)")
    gen.add_argument("--store", help=STORE_HELP)
    gen.add_argument("--max-tokens", type=int, help="tokens to generate at most")
    gen.add_argument("--json", action="store_true", help="print one JSON object (the result) instead of streaming")
    gen.add_argument("--system", help="system message sent before the prompt")
    gen.add_argument("--raw", action="store_true", help="send the prompt string as is (no chat template)")
    gen.add_argument("--no-cache", action="store_true", help="do not use the fragment store")
    gen.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
    gen.add_argument("--top-p", type=float, help="nucleus sampling mass when temperature > 0")
    gen.add_argument("--seed", type=int, help="sampling seed")
    add_engine_options(gen)
    gen.set_defaults(func=cmd_generate)


def add_export_parser(sub, common: argparse.ArgumentParser) -> None:
    """Register ``export-onnx`` on ``sub``, as :func:`add_parsers` does."""
    export = sub.add_parser("export-onnx", parents=[common],
                            help="build the ONNX Runtime decoder of the GGUF (once; needs the `onnx` extra)")
    export.add_argument("--model", help="GGUF file (default: EDGESYNC_MODEL or SmolLM2-135M-Instruct)")
    export.add_argument("--out", help="export root (default: EDGESYNC_ONNX_DIR or the per-user cache dir)")
    export.add_argument("--force", action="store_true", help="export again even if a complete export is there")
    export.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    export.set_defaults(func=cmd_export_onnx)


# -- generate ---------------------------------------------------------------------------------

def _summary_line(r) -> str:
    """The stderr line after a streamed answer: hit kind, token counts, timings, bytes, flags."""
    return (f"[{r.hit}] prompt {r.prompt_tokens} tokens, reused {r.tokens_reused}, "
            f"prefilled {r.tokens_prefilled}, generated {len(r.tokens)}; "
            f"TTFT {r.ttft_ms:.1f} ms, total {r.total_ms:.1f} ms; read {format_bytes(r.bytes_read)}"
            + (f", wrote {r.fragments_written} fragments" if r.fragments_written else "")
            + (f"; similarity {r.similarity:.3f}" if r.similarity is not None else "")
            + ("; APPROXIMATE: answered from another prompt's KV" if r.approximate else "")
            + (f"; CONVERTED: {r.source_engine} KV injected" if r.convertible else "")
            + (f"; UNCACHED: {r.uncached_reason}" if r.uncached_reason else ""))


def is_utf8(text: str) -> bool:
    """False for an argument holding bytes that were not UTF-8 (Python keeps them as lone
    surrogates, which no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def cmd_generate(args: argparse.Namespace) -> int:
    """``edgesync generate``: stream the answer to stdout and a summary line to stderr, or
    (``--json``) print the result object."""
    cfg = load_config({
        "store_path": args.store,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "cache_enabled": False if args.no_cache else None,
        "reuse": args.reuse,
        "engine": args.engine,
        "model_path": args.model,
        "kv_type": args.kv_type,
        "allow_convertible": args.allow_convertible,
    })
    for name, text in (("prompt", args.prompt), ("--system", args.system)):
        if text is not None and not is_utf8(text):
            raise CommandError(f"{name}: is not valid UTF-8 text")
    if args.raw:
        if args.system is not None:
            raise CommandError("--system cannot be combined with --raw (the raw prompt is sent as is)")
        prompt: Any = args.prompt
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system is not None else [])
        prompt.append({"role": "user", "content": args.prompt})

    with open_edgesync(cfg, store=False if args.no_cache else None) as es:
        try:
            if args.json:
                result = es.generate(prompt)
            else:
                stream = es.generate(prompt, stream=True)
        except ValueError as exc:  # ContextOverflowError is a ValueError
            raise CommandError(str(exc)) from None
        if args.json:
            print(json.dumps(result.to_dict()), flush=True)
            return 0
        last = ""
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
            last = piece or last
        if not last.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
        print(_summary_line(stream.result), file=sys.stderr, flush=True)
    return 0


# -- export-onnx --------------------------------------------------------------------------------

def cmd_export_onnx(args: argparse.Namespace) -> int:
    """``edgesync export-onnx``: :func:`onnx_export.export_gguf`; prints the directory. A model it
    does not handle is refused in one line before anything loads."""
    from rich.console import Console

    from edgesync_engines.adapters.model_files import default_model_path
    from edgesync_engines.adapters.onnx_export import ExportError, check_exportable, export_gguf, read_meta

    cfg = load_config({"model_path": args.model})
    try:
        gguf = cfg.model_path or default_model_path()
        if not Path(gguf).is_file():
            raise CommandError(f"{gguf}: no such GGUF file")
        check_exportable(gguf)  # before the progress line: a refusal is one line, not "exporting ..."
        t0 = time.perf_counter()
        with Console(stderr=True).status(f"exporting {Path(gguf).name} to ONNX (a few minutes the first time)"):
            out = export_gguf(gguf, root=args.out, force=args.force)
        meta = read_meta(out)
    except (OSError, ExportError) as exc:
        raise CommandError(str(exc)) from None
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    doc = {"export_dir": str(out.resolve()), "source": str(gguf), "source_fingerprint": meta["source_fingerprint"],
           "bytes": size, "seconds": round(time.perf_counter() - t0, 1), "n_layer": meta["n_layer"],
           "n_head_kv": meta["n_head_kv"], "head_dim": meta["head_dim"]}
    if args.json:
        print(json.dumps(doc), flush=True)
    else:
        print(f"{doc['export_dir']}: ONNX decoder of {Path(gguf).name} ({format_bytes(size)}, "
              f"{meta['n_layer']} layers x {meta['n_head_kv']} KV heads x {meta['head_dim']}) "
              f"in {doc['seconds']} s", flush=True)
    return 0
