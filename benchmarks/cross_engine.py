"""How close converted KV is to the receiving engine's own: ``python -m edgesync_bench.cross_engine``.

For each real doc-QA context of at least ``--tokens`` tokens (SQuAD text, ../shared/workloads),
the first ``--prefix`` tokens' KV is taken from one engine, converted
(``reshape.convert_fragment``) and injected into the other, which then prefills the rest; the
suffix logits are compared with the receiving engine's own clean prefill. Beside it, the
baseline: the two engines' own clean prefills compared with each other (the engine-to-engine
gap), and each engine's own KV re-injected (its exact reuse). Figures: argmax agreement over all
suffix positions, mean and max absolute logit difference, and the converted/baseline ratio.
Not a test: never run by CI.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def _llama_logits(llama, tokens, n_past=0, fragments=None) -> np.ndarray:
    llama.clear_kv_cache()
    if fragments is not None:
        llama.inject_fragment(fragments, n_past, tokens)
    llama.llm.eval(tokens[n_past:])
    return np.array(llama.llm.scores[n_past : len(tokens)], dtype=np.float32)


def measure(n_prompts: int, prefix: int, total: int, threads: int | None, progress=None) -> dict:
    """The comparison over ``n_prompts`` prompts; returns a JSON-able dict of figures."""
    import llama_cpp

    from edgesync_bench.workloads import workloads_dir
    from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
    from edgesync_engines.adapters.model_files import default_model_path
    from edgesync_engines.adapters.onnxrt import OnnxRuntimeAdapter
    from edgesync_engines.adapters.reshape import convert_fragment

    path = default_model_path()
    ort = OnnxRuntimeAdapter(path, n_threads=threads)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(1024, total + 8), logits_all=True, verbose=False,
                          n_threads=threads or 2, n_threads_batch=threads or 2)
    llama = LlamaCppAdapter(llm, model_path=path)
    rows = [json.loads(line) for line in (workloads_dir() / "doc_qa.jsonl").read_text().splitlines()]
    prompts = [t[:total] for t in (ort.tokenize(r["context"]) for r in rows) if len(t) >= total][:n_prompts]
    pairs: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {
        "llama.cpp -> onnxruntime": [], "onnxruntime -> llama.cpp": [], "engine gap (own prefills)": [],
        "onnxruntime own KV re-injected": [], "llama.cpp own KV re-injected": []}
    for i, tokens in enumerate(prompts):
        own_ort = ort.eval_logits(tokens)[prefix:]
        ort_frag = ort.extract_fragment(tokens, 0, prefix)
        own_llama = _llama_logits(llama, tokens)[prefix:]
        llama_frag = llama.extract_fragment(tokens, 0, prefix)
        ort.clear_kv_cache()
        ort.inject_fragment([convert_fragment(llama_frag, ort.namespace)], prefix, tokens)
        pairs["llama.cpp -> onnxruntime"].append((ort.eval_logits(tokens, prefix), own_ort))
        pairs["onnxruntime -> llama.cpp"].append(
            (_llama_logits(llama, tokens, prefix, [convert_fragment(ort_frag, llama.namespace)]), own_llama))
        pairs["engine gap (own prefills)"].append((own_ort, own_llama))
        ort.clear_kv_cache()
        ort.inject_fragment([ort_frag], prefix, tokens)
        pairs["onnxruntime own KV re-injected"].append((ort.eval_logits(tokens, prefix), own_ort))
        pairs["llama.cpp own KV re-injected"].append((_llama_logits(llama, tokens, prefix, [llama_frag]), own_llama))
        if progress is not None:
            progress(i + 1, len(prompts))
    out = {"prompts": len(prompts), "prefix_tokens": prefix, "total_tokens": total, "rows": {}}
    for name, items in pairs.items():
        a = np.concatenate([x for x, _ in items])
        b = np.concatenate([y for _, y in items])
        out["rows"][name] = {
            "positions": int(len(a)),
            "argmax_agreement": float(np.mean(a.argmax(1) == b.argmax(1))),
            "mean_abs_logit_diff": float(np.abs(a - b).mean()),
            "max_abs_logit_diff": float(np.abs(a - b).max()),
        }
    gap = out["rows"]["engine gap (own prefills)"]["mean_abs_logit_diff"]
    for row in out["rows"].values():
        row["diff_vs_engine_gap"] = row["mean_abs_logit_diff"] / gap if gap else None
    ort.close()
    llama.close()
    llm.close()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgesync_bench.cross_engine", description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=20, help="doc-QA contexts to use (default 20)")
    parser.add_argument("--prefix", type=int, default=128, help="tokens injected (default 128)")
    parser.add_argument("--tokens", type=int, default=200, help="prompt length, tokens (default 200)")
    parser.add_argument("--threads", type=int, help="threads per engine (default: all cores)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    if not 64 <= args.prefix < args.tokens:
        parser.error(f"--prefix must be in [64, --tokens), got {args.prefix}")
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from edgesync_store.commands.inventory import wide_console

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("prompts", total=args.prompts)
        result = measure(args.prompts, args.prefix, args.tokens, args.threads,
                         lambda done, total: bar.update(task, completed=done, total=total))
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    table = Table(title=f"{result['prompts']} prompts: {args.prefix} tokens injected, "
                        f"{args.tokens - args.prefix} prefilled (logits compared per suffix position)")
    for col in ("comparison", "positions", "argmax agreement", "mean |dlogit|", "max |dlogit|", "vs engine gap"):
        table.add_column(col, justify="left" if col == "comparison" else "right")
    for name, r in result["rows"].items():
        ratio = r["diff_vs_engine_gap"]
        table.add_row(name, str(r["positions"]), f"{100 * r['argmax_agreement']:.1f}%",
                      f"{r['mean_abs_logit_diff']:.4f}", f"{r['max_abs_logit_diff']:.4f}",
                      "-" if ratio is None else f"{ratio:.2f}x")
    wide_console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
