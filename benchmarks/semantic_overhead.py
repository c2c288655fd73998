"""What the router's semantic lookup costs, beside the full prefill it may save.

The router embeds a request (``edgesync_store.semantic.embedders.embed_text_for`` + the ONNX MiniLM
embedder) and searches the HNSW index (``SemanticIndex.query``) only when its exact prefix walk
leaves at least 64 prompt tokens uncovered. This benchmark measures that lookup, encode plus
search, per query, at several index sizes, and in the same run the time to first token of a
full prefill of the same prompts with the real model (SmolLM2-135M-Instruct on llama.cpp,
``max_tokens=1``, KV cache cleared before each prompt). It prints p50 and p95 of each and the
lookup as a fraction of the prefill.

What is real and what is not (the run prints it too):

* the store and index are the real classes on a real LMDB environment and a real hnswlib graph
  (M 16, ef_construction 200, ef_search 100, one thread: the index's defaults);
* the fragments behind the vectors are tiny but valid (1 layer, 1 KV head of 8, f16, 64
  tokens, about 1 KB a blob): ``SemanticIndex.add`` requires a stored fragment, and the index's
  cost does not depend on the fragment's size. The LMDB size printed is therefore not that of a
  real store; the bytes of the index's own databases and of its sidecar are;
* vectors: every distinct text of the shared workloads (QQP clusters and pairs, GPTCache pairs,
  doc-QA questions and prompts, chat turns; 17,218), embedded once with the real model
  and cached in ``build/bench-cache`` as ``.npy``; beyond them the index is filled with
  paraphrase-like copies of those vectors (Gaussian noise, cosine 0.7-0.93 to their source,
  re-normalised; ``--fill noise``, default) or with random unit vectors (``--fill random``:
  no structure, HNSW's hardest case). HNSW search cost depends on the data distribution;
* queries: real request prompts from ``edgesync_bench.workloads``: the seed workload (a
  ~330-token app system prompt + a QQP question; the embedded text is the short question) and
  the doc-QA workload (a passage + a question in one user message; the embedded text is its
  last 160 words, near MiniLM's 256-word-piece limit, the slow case for the encoder).

Sizes are filled incrementally into one store (the 10,000 index is the first 10,000 vectors of
the 100,000 one). Not a test; never run in CI. Run from the project root:

    .venv/bin/python -m edgesync_bench.semantic_overhead [--quick] [--sizes 10000,100000]
        [--queries 200] [--prefill-prompts 20] [--repeat 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = ROOT / "build" / "bench-cache"
"""Where real embeddings are cached (``build/`` is git-ignored)."""
QUICK_REAL_TEXTS = 2000
"""Real texts embedded in ``--quick`` mode (the rest of the pool is synthetic)."""


# -- small helpers --------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100, linear interpolation) of ``values``; NaN when empty."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


def summary(values_ms: Sequence[float]) -> dict:
    """``{"n", "p50", "p95", "mean", "min", "max"}`` of a list of milliseconds."""
    a = np.asarray(values_ms, dtype=np.float64)
    return {
        "n": int(a.size),
        "p50": pct(a, 50),
        "p95": pct(a, 95),
        "mean": float(a.mean()) if a.size else float("nan"),
        "min": float(a.min()) if a.size else float("nan"),
        "max": float(a.max()) if a.size else float("nan"),
    }


def mb(nbytes: int) -> str:
    """Bytes as MB (10^6) with one decimal."""
    return f"{nbytes / 1e6:.1f}"


def load_note() -> str:
    """The 1-, 5- and 15-minute load averages as text (2 cores: above ~1 means busy)."""
    a, b, c = os.getloadavg()
    return f"{a:.2f} {b:.2f} {c:.2f}"


def bench_namespace():
    """A tiny but valid namespace for the benchmark's fragments: 1 layer, 1 KV head of 8, f16."""
    from edgesync_store.schema import Namespace

    return Namespace(
        model_fingerprint="be" * 32,
        engine="benchmark",
        engine_version="semantic_overhead",
        kv_dtype="f16",
        flash_attn=False,
        layout="bench-tiny",
        n_layer=1,
        n_head_kv=1,
        head_dim=8,
        kernels="bench",
    )


# -- real texts and their embeddings -----------------------------------------------------------------


def _jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def real_texts(data_dir: Path) -> tuple[list[str], dict[str, int]]:
    """Every distinct text the index could hold for the shared workloads, as the router would
    embed it (``embed_text_for`` of a user message): QQP cluster questions, QQP labelled pairs,
    GPTCache pairs, doc-QA questions, doc-QA request prompts (passage + question), chat turns.
    All rows, file order, first occurrence kept. Returns the texts and a count per source."""
    from edgesync_bench.workloads import doc_qa_workload
    from edgesync_engines.request.prompt_text import embed_text_for

    n_docs = len(_jsonl(data_dir / "doc_qa.jsonl"))
    sources: list[tuple[str, list[str]]] = [
        ("qqp_clusters", [q for r in _jsonl(data_dir / "qqp_clusters.jsonl") for q in r["questions"]]),
        ("qqp_pairs_labelled", [r[x] for r in _jsonl(data_dir / "qqp_pairs_labelled.jsonl") for x in ("a", "b")]),
        (
            "gptcache_mock_pairs",
            [r[x] for r in _jsonl(data_dir / "gptcache_mock_pairs.jsonl") for x in ("origin", "similar")],
        ),
        ("doc_qa questions", [q for r in _jsonl(data_dir / "doc_qa.jsonl") for q in r["questions"]]),
        (
            "doc_qa prompts",
            [embed_text_for(r.as_messages()) for r in doc_qa_workload(n_docs=n_docs, data_dir=data_dir)],
        ),
        ("chat_sessions turns", [t for r in _jsonl(data_dir / "chat_sessions.jsonl") for t in r["turns"]]),
    ]
    seen: set[str] = set()
    texts: list[str] = []
    counts: dict[str, int] = {}
    for name, items in sources:
        before = len(texts)
        for item in items:
            text = embed_text_for([{"role": "user", "content": item}])
            if text and text not in seen:
                seen.add(text)
                texts.append(text)
        counts[name] = len(texts) - before
    return texts, counts


def real_vectors(texts: list[str], embedder, progress, use_cache: bool = True) -> tuple[np.ndarray, str, float]:
    """Embeddings (float32 ``[len(texts), 384]``, unit rows) of ``texts``, from the ``.npy``
    cache in :data:`CACHE_DIR` when it holds them (keyed by SHA-256 of the backend id and the
    texts), else computed now and cached. Returns ``(vectors, "cache" | "encoded", seconds)``."""
    h = hashlib.sha256(embedder.backend_id.encode() + b"\0")
    for t in texts:
        h.update(t.encode("utf-8") + b"\0")
    digest = h.hexdigest()
    slug = embedder.backend_id.replace("/", "_")
    npy, meta = CACHE_DIR / f"{slug}-{digest[:16]}.npy", CACHE_DIR / f"{slug}-{digest[:16]}.json"
    t0 = time.perf_counter()
    if use_cache and npy.exists() and meta.exists():
        try:
            info = json.loads(meta.read_text())
            vecs = np.load(npy, allow_pickle=False)
            if (
                info.get("sha256") == digest
                and vecs.shape == (len(texts), embedder.dim)
                and vecs.dtype == np.float32
                and np.all(np.isfinite(vecs))
                and np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-3)
            ):
                return vecs, "cache", time.perf_counter() - t0
        except (OSError, ValueError):
            pass
        print(f"ignoring an unusable embedding cache {npy}", file=sys.stderr)
    vecs = np.empty((len(texts), embedder.dim), dtype=np.float32)
    task = progress.add_task(f"embedding {len(texts):,} real texts (once; cached)", total=len(texts))
    step = 256
    for start in range(0, len(texts), step):
        vecs[start : start + step] = embedder.encode(texts[start : start + step])
        progress.advance(task, min(step, len(texts) - start))
    seconds = time.perf_counter() - t0
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = npy.with_suffix(".tmp.npy")
    np.save(tmp, vecs, allow_pickle=False)
    os.replace(tmp, npy)
    meta.write_text(json.dumps({"backend_id": embedder.backend_id, "sha256": digest, "n": len(texts),
                                "dim": embedder.dim, "encode_seconds": seconds}, indent=1))
    return vecs, "encoded", seconds


def pool_vectors(real: np.ndarray, n: int, fill: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` unit vectors (float32 ``[n, 384]``) for the index, in insertion order.

    The first ``min(n, len(real))`` are the real vectors in a fixed shuffled order. The rest:
    ``fill="noise"``: a real vector (cycling through the same order) plus Gaussian noise of
    per-component sigma drawn uniformly from [0.02, 0.05], re-normalised (cosine to the source
    about 0.93-0.72, the range of real paraphrase pairs, DESIGN.md 2.5); ``fill="random"``:
    random unit vectors. Deterministic for a given ``seed``.

    Returns the vectors and, per synthetic row, its cosine to its source (float32
    ``[n - len(real)]``; NaN for random vectors)."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(real))
    n_real = min(n, len(real))
    out = np.empty((n, real.shape[1]), dtype=np.float32)
    out[:n_real] = real[order[:n_real]]
    m = n - n_real
    cos = np.full(m, np.nan, dtype=np.float32)
    if fill == "noise":
        for lo in range(0, m, 10_000):  # in slices: bounded temporaries
            hi = min(m, lo + 10_000)
            src = real[order[np.arange(lo, hi) % len(real)]]
            sigma = rng.uniform(0.02, 0.05, size=(hi - lo, 1)).astype(np.float32)
            noisy = src + sigma * rng.standard_normal(src.shape, dtype=np.float32)
            noisy /= np.linalg.norm(noisy, axis=1, keepdims=True)
            cos[lo:hi] = np.einsum("ij,ij->i", noisy, src)
            out[n_real + lo : n_real + hi] = noisy
    elif fill == "random":
        for lo in range(0, m, 10_000):
            hi = min(m, lo + 10_000)
            r = rng.standard_normal((hi - lo, real.shape[1]), dtype=np.float32)
            out[n_real + lo : n_real + hi] = r / np.linalg.norm(r, axis=1, keepdims=True)
    else:
        raise ValueError(f"fill: {fill!r} is not 'noise' or 'random'")
    return out, cos


def pool_info(size: int, n_real: int, fill: str, cos: np.ndarray) -> dict:
    """Composition of the first ``size`` pool vectors: real and synthetic counts, and the
    cosine of the synthetic noisy copies to their sources (p5, p50, p95)."""
    real = min(size, n_real)
    info: dict[str, Any] = {"fill": fill, "real": real, "synthetic": size - real}
    part = cos[: size - real]
    if part.size and not np.all(np.isnan(part)):
        info["noise_cosine_to_source"] = {f"p{q}": pct(part, q) for q in (5, 50, 95)}
    return info


# -- the index ------------------------------------------------------------------------------------


def add_fragments(
    store, index, vectors: np.ndarray, start: int, stop: int, batch: int, progress, task
) -> tuple[float, float]:
    """Store tiny fragments ``start..stop-1`` (``FragmentStore.put_many``, one transaction per
    ``batch``) and index their vectors (``SemanticIndex.add_many``, one transaction per batch).
    Returns ``(store seconds, index seconds)``; only the second is the index's build cost."""
    from edgesync_store.schema import KVFragment, prefix_hash

    ns = bench_namespace()
    zeros = np.zeros((1, 64, ns.head_dim), dtype=np.float16)
    rng = np.random.default_rng(12345 + start)
    t_store = t_index = 0.0
    now = time.time()
    for lo in range(start, stop, batch):
        hi = min(stop, lo + batch)
        t0 = time.perf_counter()
        frags = [
            KVFragment(
                namespace=ns, token_start=1, token_end=65, layer_start=0, layer_end=1,
                keys=zeros, values=zeros, token_ids=rng.integers(0, 49152, 64),
                prefix_hash=prefix_hash([i]), created_at=now, expires_at=now + 7 * 86400,
            )
            for i in range(lo, hi)
        ]
        keys = [f.key() for f in frags]
        store.put_many(frags)
        t1 = time.perf_counter()
        index.add_many(keys, vectors[lo:hi])
        t2 = time.perf_counter()
        t_store += t1 - t0
        t_index += t2 - t1
        progress.advance(task, hi - lo)
    return t_store, t_index


def index_lmdb_bytes(store) -> int | None:
    """Bytes of the pages of the index's two LMDB databases (``emb_vectors``: the vectors;
    ``emb_meta``: counters and change log), or None when they cannot be read."""
    try:
        from edgesync_store.semantic.vectors import META_DB, VECTORS_DB

        return store.page_bytes([VECTORS_DB, META_DB])
    except Exception as exc:  # noqa: BLE001 - a size figure is not worth failing the run
        print(f"cannot measure the index's LMDB bytes: {exc}", file=sys.stderr)
        return None


def router_query_k() -> tuple[int, str]:
    """The k the router asks of the index (``edgesync_engines.request.semantic_lookup.QUERY_K``) and where it
    came from; 8 (``SemanticIndex.query``'s default) when that module is absent."""
    try:
        from edgesync_engines.request.semantic_lookup import QUERY_K

        return int(QUERY_K), "edgesync_engines.request.semantic_lookup.QUERY_K"
    except ImportError:
        return 8, "SemanticIndex.query default"


# -- measurements -----------------------------------------------------------------------------------


def measure_lookups(
    embedder, index, queries: dict[str, list], k: int, repeat: int = 3, warmup: int = 10
) -> dict[str, dict]:
    """Time the router's lookup for every query, ``repeat`` passes over all queries, the
    workloads interleaved within a pass.

    Per query and pass: ``encode`` = ``embed_text_for(messages)`` + ``embedder.encode([text])``
    (the embedder warm), ``search`` = ``index.query(vector, k)``, ``total`` = both; milliseconds.
    Returns ``{workload: {"encode_ms", "search_ms", "total_ms": [repeat][n_queries] lists,
    "top1_similarity": [n_queries]}}`` in query order."""
    from edgesync_engines.request.prompt_text import embed_text_for

    names = list(queries)
    for name in names:  # warm-up: caches, allocator, hnswlib visited-list pool
        for req in queries[name][:warmup]:
            index.query(embedder.encode([embed_text_for(req.as_messages())])[0], k)
    out = {name: {"encode_ms": [], "search_ms": [], "total_ms": [], "top1_similarity": []} for name in names}
    longest = max(len(queries[name]) for name in names)
    for pass_ in range(repeat):
        for rec in out.values():
            for key in ("encode_ms", "search_ms", "total_ms"):
                rec[key].append([])
        for i in range(longest):
            for name in names:
                if i >= len(queries[name]):
                    continue
                messages = queries[name][i].as_messages()
                t0 = time.perf_counter_ns()
                vec = embedder.encode([embed_text_for(messages)])[0]
                t1 = time.perf_counter_ns()
                hits = index.query(vec, k)
                t2 = time.perf_counter_ns()
                rec = out[name]
                rec["encode_ms"][-1].append((t1 - t0) / 1e6)
                rec["search_ms"][-1].append((t2 - t1) / 1e6)
                rec["total_ms"][-1].append((t2 - t0) / 1e6)
                if pass_ == 0:
                    rec["top1_similarity"].append(hits[0][1] if hits else float("nan"))
    return out


def best_of(rec: dict) -> dict[str, np.ndarray]:
    """Per query, the pass with the smallest ``total_ms`` (its encode, search and total, so
    that they add up): ``{"encode_ms", "search_ms", "total_ms": float64 [n_queries]}``."""
    total = np.asarray(rec["total_ms"], dtype=np.float64)  # [repeat, n]
    pick = total.argmin(axis=0)
    cols = np.arange(total.shape[1])
    return {key: np.asarray(rec[key], dtype=np.float64)[pick, cols] for key in ("encode_ms", "search_ms", "total_ms")}


def measure_prefill(adapter, requests: list, repeat: int = 3, warmup: int = 2) -> tuple[list[list[float]], list[int]]:
    """Time to first token (ms) of a full prefill of each request (chat template, KV cache
    cleared first, ``max_tokens=1``, greedy) on ``adapter``, ``repeat`` passes over all
    requests; tokenization is not timed. Returns the times ``[repeat][n_requests]`` and the
    prompt token counts ``[n_requests]``."""
    tokens = [adapter.tokenize(adapter.apply_chat_template(r.as_messages())) for r in requests]

    def first_token(toks: list[int]) -> float:
        adapter.clear_kv_cache()
        t0 = time.perf_counter_ns()
        gen = adapter.generate(toks, 0, max_tokens=1)
        next(gen, None)
        dt = (time.perf_counter_ns() - t0) / 1e6
        gen.close()
        return dt

    for toks in tokens[:warmup]:
        first_token(toks)
    return [[first_token(t) for t in tokens] for _ in range(repeat)], [len(t) for t in tokens]


def pick_queries(n: int, data_dir: Path) -> dict[str, list]:
    """``n`` real requests per workload. seed: the distinct (prompt, variant) pairs of the seed
    workload in order of first draw (``seed_workload(1000)``; at most ~250). doc-qa: ``n``
    requests drawn by ``random.Random(0).sample`` from every question of every passage of
    ``doc_qa.jsonl`` (``doc_qa_workload(n_docs=all)``)."""
    from edgesync_bench.workloads import doc_qa_workload, seed_workload

    seen, seed = set(), []
    for r in seed_workload(1000, data_dir=data_dir):
        if r.prompt_key not in seen:
            seen.add(r.prompt_key)
            seed.append(r)
    docs = doc_qa_workload(n_docs=len(_jsonl(data_dir / "doc_qa.jsonl")), data_dir=data_dir)
    return {"seed": seed[:n], "doc-qa": random.Random(0).sample(docs, min(n, len(docs)))}


# -- output -----------------------------------------------------------------------------------------


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain fixed-width table (first column left-aligned, the others right-aligned)."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


QUIET_PREFILL_MS_PER_TOKEN = 3.0
"""SmolLM2 prefill speed on 2 quiet cores (../shared/DESIGN.md 2.2), for the busy-machine warning."""


def report_lines(result: dict) -> list[str]:
    """The report: the main table (lookup vs prefill per size and workload, milliseconds, each
    prompt's fastest of ``repeat`` passes), the same on every sample, the build table, the
    prefill baseline and the notes, as lines of text."""
    r = result["config"]["repeat"]
    out = [f"Router semantic lookup (encode + search) vs full prefill of the same prompts; ms; each prompt's "
           f"fastest of {r} passes", ""]
    rows = []
    for size_res in result["sizes"]:
        for name, w in size_res["workloads"].items():
            pf = result["prefill"][name]
            rows.append([
                f"{size_res['size']:,} {name}",
                f"{w['encode']['p50']:.2f} / {w['encode']['p95']:.2f}",
                f"{w['search']['p50']:.3f} / {w['search']['p95']:.3f}",
                f"{w['total']['p50']:.2f} / {w['total']['p95']:.2f}",
                f"{pf['ttft']['p50']:.0f} / {pf['ttft']['p95']:.0f}",
                f"{w['ratio_p50']:.2%} / {w['ratio_p95']:.2%}",
                f"{w['per_prompt_ratio_median']:.2%}",
            ])
    out.append(text_table(["size workload", "encode p50/p95", "search p50/p95", "total p50/p95", "prefill p50/p95",
                           "total/prefill p50/p95", "per-prompt ratio"], rows))
    out += ["", f"The same on every sample ({r} per prompt, interference included); ms", ""]
    rows = []
    for size_res in result["sizes"]:
        for name, w in size_res["workloads"].items():
            pf = result["prefill"][name]
            rows.append([
                f"{size_res['size']:,} {name}",
                f"{w['search_raw']['p50']:.3f} / {w['search_raw']['p95']:.3f}",
                f"{w['total_raw']['p50']:.2f} / {w['total_raw']['p95']:.2f}",
                f"{pf['ttft_raw']['p50']:.0f} / {pf['ttft_raw']['p95']:.0f}",
                f"{w['ratio_raw_p50']:.2%} / {w['ratio_raw_p95']:.2%}",
            ])
    out.append(text_table(["size workload", "search p50/p95", "total p50/p95", "prefill p50/p95",
                           "total/prefill p50/p95"], rows))
    out += ["", "Index build and size (fragments are tiny stand-ins, see notes; sizes in MB = 10^6 bytes)", ""]
    rows = []
    for s_ in result["sizes"]:
        bd = s_["build"]
        rows.append([
            f"{s_['size']:,}", f"{s_['pool']['real']:,} / {s_['pool']['synthetic']:,}",
            f"{bd['store_fill_s']:.1f}", f"{bd['index_add_s']:.1f}",
            f"{1000 * bd['index_add_s_increment'] / max(1, bd['vectors_added']):.2f}",
            f"{bd['save_s']:.2f}", f"{bd['reopen_s']:.2f}",
            mb(bd["sidecar_hnsw_bytes"] + bd["sidecar_json_bytes"]),
            mb(bd["index_lmdb_bytes"]) if bd["index_lmdb_bytes"] is not None else "n/a", mb(bd["data_mdb_bytes"]),
        ])
    out.append(text_table(["size", "real / synthetic", "store fill s", "index add s", "add ms/vector (last step)",
                           "save s", "reopen s", "sidecar MB", "index LMDB MB", "data.mdb MB"], rows))
    out += [
        "",
        f"Prefill baseline: SmolLM2-135M-Instruct Q4_1 on llama.cpp, {result['config']['llama_threads']} threads, "
        "time to first token with max_tokens=1, KV cache cleared before each prompt, tokenization not timed:",
    ]
    slow = []
    for name, pf in result["prefill"].items():
        tk = pf["prompt_tokens"]
        out.append(
            f"  {name}: {pf['ttft']['n']} prompts of {min(tk)}/{int(np.median(tk))}/{max(tk)} tokens (min/median/max), "
            f"fastest-of-{r} TTFT p50 {pf['ttft']['p50']:.0f} ms, p95 {pf['ttft']['p95']:.0f} ms, "
            f"median {pf['ms_per_token_median']:.2f} ms per prompt token; "
            f"embedded text of its queries: median {result['queries'][name]['embed_words_median']:.0f} words"
        )
        if pf["ms_per_token_median"] > 2 * QUIET_PREFILL_MS_PER_TOKEN:
            slow.append(f"{name} {pf['ms_per_token_median']:.1f}")
    if slow:
        out.append(
            f"  WARNING: prefill ran at {', '.join(slow)} ms per token, "
            f"against about {QUIET_PREFILL_MS_PER_TOKEN} on 2 "
            "quiet cores (DESIGN.md 2.2): other processes held the cores. llama.cpp's threads slow down far more under "
            "contention than the one-thread embedder, so the ratios above UNDERSTATE the lookup's share; rerun on a "
            "quiet machine."
        )
    out += ["", "Notes:"] + [f"  - {line}" for line in notes(result)]
    return out


def notes(result: dict) -> list[str]:
    """Plain-language notes on what was measured and what was synthetic."""
    cfg, pool = result["config"], result["vectors"]
    lines = [
        "Fragments are tiny stand-ins (1 layer, 1 KV head of 8, f16, 64 tokens, ~1 KB): SemanticIndex.add needs a "
        "stored fragment, and the index's cost does not depend on fragment size. data.mdb is NOT a real store's size; "
        "semantic.hnsw and the index's LMDB pages (vectors + change log) are real.",
        f"Vectors: {pool['n_real']:,} distinct real texts of ../shared/workloads embedded with {cfg['embedder']} "
        f"({pool['real_source']}, {pool['real_seconds']:.1f} s); beyond them: "
        + (
            "paraphrase-like noisy copies of the real vectors (cosine to source p5/p50/p95 "
            + "/".join(
                f"{result['sizes'][-1]['pool'].get('noise_cosine_to_source', {}).get(q, float('nan')):.2f}"
                for q in ("p5", "p50", "p95")
            )
            + ")"
            if cfg["fill"] == "noise"
            else "random unit vectors (no structure: HNSW's hardest case)"
        )
        + ".",
        f"Index: hnswlib M 16, ef_construction 200, ef_search {cfg['ef_search']}, 1 thread, "
        f"k={cfg['k']} ({cfg['k_source']}); sizes "
        f"filled incrementally into one store. 'total' = embed_text_for + encode of one text + SemanticIndex.query "
        f"(which includes its LMDB freshness check and the check that results are still stored).",
        f"Each prompt is timed {cfg['repeat']} times on both sides "
        f"(passes over all prompts, so a burst of load does not "
        f"hit one prompt's every sample); the first table keeps each prompt's fastest, so its p95 is over prompts "
        f"(text length), the second table's over every sample. Ratios: total p50 / prefill p50 and total p95 / prefill "
        f"p95 per workload; 'per-prompt ratio' is the median of lookup/prefill "
        f"over the {cfg['prefill_prompts']} prompts "
        f"timed both ways. p95 of {cfg['prefill_prompts']} prefills is interpolated.",
        f"Load average (1/5/15 min) at start {result['env']['load_start']}, at end {result['env']['load_end']} "
        f"({result['env']['cpus']} CPUs; this benchmark itself adds 1 to 2): figures from a busy machine are noisy.",
    ]
    return lines


# -- main -------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m edgesync_bench.semantic_overhead",
        description="Router semantic-lookup overhead (encode + HNSW search) at several index sizes, "
        "beside a full prefill of the same prompts with the real model.",
    )
    p.add_argument("--sizes", help="indexed fragments, comma-separated (default 10000,100000; --quick 1000,5000)")
    p.add_argument("--queries", type=int, help="timed lookups per workload (default 200; --quick 30)")
    p.add_argument(
        "--prefill-prompts", type=int, help="prompts per workload prefilled for the baseline (default 20; --quick 4)"
    )
    p.add_argument("--repeat", type=int, help="timed passes over every prompt, both sides; the table keeps each "
                   "prompt's fastest (default 3; --quick 2)")
    p.add_argument("--k", type=int, default=None, help="neighbours per query (default: the router's k, 8)")
    p.add_argument("--ef-search", type=int, default=100, help="hnswlib ef at query time (default 100, the index's)")
    p.add_argument("--fill", choices=("noise", "random"), default="noise",
                   help="vectors beyond the real ones: noisy copies of real ones (default) or random unit vectors")
    p.add_argument(
        "--batch", type=int, default=1000, help="fragments per put_many / add_many transaction (default 1000)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="llama.cpp threads for the prefill (default: all cores, as the router)",
    )
    p.add_argument("--workdir", default=None, help="directory for the temporary store (default: the system temp dir)")
    p.add_argument("--no-embedding-cache", action="store_true", help=f"re-embed the real texts (cache: {CACHE_DIR})")
    p.add_argument("--json", metavar="FILE", help="also write every figure (and the per-query timings) to FILE")
    p.add_argument("--quick", action="store_true",
                   help=f"small and fast: sizes 1000,5000, 30 queries, 4 prefills, {QUICK_REAL_TEXTS} real texts")
    a = p.parse_args(argv)
    try:
        a.sizes = sorted(
            {
                int(s.replace("_", ""))
                for s in (a.sizes or ("1000,5000" if a.quick else "10000,100000")).split(",")
                if s.strip()
            }
        )
    except ValueError:
        p.error(f"--sizes: expected comma-separated integers, got {a.sizes!r}")
    if not a.sizes:
        p.error("--sizes: no size given")
    a.queries = a.queries if a.queries is not None else (30 if a.quick else 200)
    a.repeat = a.repeat if a.repeat is not None else (2 if a.quick else 3)
    a.prefill_prompts = a.prefill_prompts if a.prefill_prompts is not None else (4 if a.quick else 20)
    if (
        min(a.sizes) < 1
        or a.queries < 1
        or a.prefill_prompts < 1
        or a.repeat < 1
        or (a.k is not None and a.k < 1)
        or a.ef_search < 1
        or a.batch < 1
    ):
        p.error("sizes, --queries, --prefill-prompts, --repeat, --k, --ef-search and --batch must be >= 1")
    a.prefill_prompts = min(a.prefill_prompts, a.queries)
    a.k, a.k_source = (a.k, "--k") if a.k is not None else router_query_k()
    return a


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the tables; return the exit status (0)."""
    args = parse_args(argv)
    from rich.console import Console

    from edgesync_bench.workloads import workloads_dir
    from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
    from edgesync_engines.app.cli_common import progress_bar
    from edgesync_engines.request.prompt_text import embed_text_for
    from edgesync_store.core.store import FragmentStore
    from edgesync_store.semantic.embedders import get_embedder
    from edgesync_store.semantic.index import SIDECAR_HNSW, SIDECAR_JSON, SemanticIndex

    t_run = time.perf_counter()
    err = Console(stderr=True)
    load_start = load_note()
    data_dir = workloads_dir()
    err.print(f"load average at start: {load_start} ({os.cpu_count()} CPUs); workloads: {data_dir}")

    embedder = get_embedder("onnx").load()
    queries = pick_queries(args.queries, data_dir)
    texts, counts = real_texts(data_dir)
    if args.quick:
        texts = texts[:: max(1, len(texts) // QUICK_REAL_TEXTS)][:QUICK_REAL_TEXTS]

    result: dict[str, Any] = {
        "benchmark": "semantic_overhead",
        "config": {
            "sizes": args.sizes,
            "queries_per_workload": args.queries,
            "repeat": args.repeat,
            "prefill_prompts": args.prefill_prompts,
            "k": args.k,
            "k_source": args.k_source,
            "ef_search": args.ef_search,
            "fill": args.fill,
            "batch": args.batch,
            "quick": args.quick,
            "embedder": embedder.backend_id,
            "embedder_threads": getattr(embedder, "intra_op_threads", None),
            "llama_threads": args.threads or os.cpu_count(),
        },
        "env": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "packages": {
                p: importlib.metadata.version(p)
                for p in ("hnswlib", "onnxruntime", "llama-cpp-python", "lmdb", "numpy")
            },
            "load_start": load_start,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "queries": {
            name: {
                "n": len(reqs),
                "embed_words_median": float(np.median([len(embed_text_for(r.as_messages()).split()) for r in reqs])),
                "source": "seed_workload(1000), distinct prompt_key in draw order"
                if name == "seed"
                else "doc_qa_workload(all passages), random.Random(0).sample",
            }
            for name, reqs in queries.items()
        },
    }

    # 1. Baseline: full prefill of the first prompts of each workload, real model.
    err.print(f"prefill baseline: {args.prefill_prompts} prompts per workload, SmolLM2 on llama.cpp ...")
    adapter = LlamaCppAdapter(n_threads=args.threads)
    try:
        result["prefill"] = {}
        for name, reqs in queries.items():
            samples, ntok = measure_prefill(adapter, reqs[: args.prefill_prompts], repeat=args.repeat)
            best = np.min(np.asarray(samples), axis=0)
            result["prefill"][name] = {
                "ttft": summary(best), "ttft_raw": summary(np.ravel(samples)), "ttft_best_ms": best.tolist(),
                "ttft_ms": samples, "prompt_tokens": ntok,
                "ms_per_token_median": float(np.median(best / np.asarray(ntok))),
            }
    finally:
        adapter.close()

    # 2. Vectors: real embeddings (cached) + fill.
    def bar():
        return progress_bar("{task.description}", console=err)

    with bar() as progress:
        real, source, seconds = real_vectors(texts, embedder, progress, use_cache=not args.no_embedding_cache)
    pool, noise_cos = pool_vectors(real, max(args.sizes), args.fill)
    result["vectors"] = {
        "n_real": len(texts),
        "real_by_source": counts if not args.quick else {"quick subset": len(texts)},
        "real_source": source,
        "real_seconds": seconds,
    }
    err.print(f"real vectors: {len(texts):,} ({source}, {seconds:.1f} s); fill beyond them: {args.fill}")

    # 3. Grow one store + index through the sizes; measure at each.
    base = Path(tempfile.mkdtemp(prefix="edgesync-semantic-bench-", dir=args.workdir))
    result["sizes"] = []
    try:
        store = FragmentStore(base / "store")
        index = SemanticIndex(store, embedder.backend_id, ef_search=args.ef_search)
        filled = 0
        t_store_total = t_index_total = 0.0
        try:
            for size in args.sizes:
                with bar() as progress:
                    task = progress.add_task(f"filling store + index to {size:,}", total=size - filled)
                    ts, ti = add_fragments(store, index, pool, filled, size, args.batch, progress, task)
                t_store_total += ts
                t_index_total += ti
                added, filled = size - filled, size
                t0 = time.perf_counter()
                index.save()
                save_s = time.perf_counter() - t0
                index.close()
                t0 = time.perf_counter()
                index = SemanticIndex(store, embedder.backend_id, ef_search=args.ef_search)
                reopen_s = time.perf_counter() - t0
                if len(index) != size:
                    raise RuntimeError(f"index holds {len(index)} vectors, expected {size}")
                err.print(
                    f"size {size:,}: measuring {sum(len(q) for q in queries.values())} lookups (load {load_note()})"
                )
                lookups = measure_lookups(embedder, index, queries, args.k, repeat=args.repeat)
                size_res = {
                    "size": size,
                    "pool": pool_info(size, len(real), args.fill, noise_cos),
                    "load_after": load_note(),
                    "build": {
                        "store_fill_s": t_store_total, "index_add_s": t_index_total, "index_add_s_increment": ti,
                        "vectors_added": added, "save_s": save_s, "reopen_s": reopen_s,
                        "sidecar_hnsw_bytes": (store.path / SIDECAR_HNSW).stat().st_size,
                        "sidecar_json_bytes": (store.path / SIDECAR_JSON).stat().st_size,
                        "index_lmdb_bytes": index_lmdb_bytes(store),
                        "data_mdb_bytes": (store.path / "data.mdb").stat().st_size,
                    },
                    "workloads": {},
                }
                for name, rec in lookups.items():
                    pf = result["prefill"][name]
                    n_pf = len(pf["ttft_best_ms"])
                    best = best_of(rec)
                    w = {key.replace("_ms", ""): summary(vals) for key, vals in best.items()}
                    w.update({key.replace("_ms", "_raw"): summary(np.ravel(rec[key])) for key in best})
                    w["ratio_p50"] = w["total"]["p50"] / pf["ttft"]["p50"]
                    w["ratio_p95"] = w["total"]["p95"] / pf["ttft"]["p95"]
                    w["ratio_raw_p50"] = w["total_raw"]["p50"] / pf["ttft_raw"]["p50"]
                    w["ratio_raw_p95"] = w["total_raw"]["p95"] / pf["ttft_raw"]["p95"]
                    w["per_prompt_ratio_median"] = float(
                        np.median(best["total_ms"][:n_pf] / np.asarray(pf["ttft_best_ms"]))
                    )
                    w["top1_similarity_median"] = float(np.nanmedian(rec["top1_similarity"]))
                    w["per_query"] = rec
                    size_res["workloads"][name] = w
                result["sizes"].append(size_res)
        finally:
            index.close()
            store.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)

    result["env"]["load_end"] = load_note()
    result["runtime_s"] = time.perf_counter() - t_run
    print("\n".join(report_lines(result)))
    print(f"Runtime {result['runtime_s']:.0f} s.")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
