"""Quality and speed of documents reuse on the ``rag`` workload, every system in one process.

One run (:func:`run_rag`), used by ``edgesync fidelity --workload rag`` and ``edgesync bench
--workloads rag``:

1. the corpus is added to the store (:func:`add_corpus`; timed on its own);
2. each request (:func:`~edgesync_bench.rag_workload.rag_workload`) is answered, greedy,
   ``max_tokens`` tokens, by every system in turn, the order rotated by the request's index so
   that machine drift hits every system alike:

   * ``full-prefill``: the same token sequence prefilled in full, no store (the reference);
   * ``prefix-only``: EdgeSync with ``documents=`` and exact reuse (only the head repeats);
   * ``blend``: EdgeSync with ``reuse="blend"`` at each recompute share (``blend_recompute``);
   * ``noise-floor``: full prefill again with flash attention on (two exact computations with
     different kernels: how far apart exact answers drift);

   shares other than the default run on the first ``curve_limit`` requests only;
3. retrieval: the gold passage among the ``k`` nearest stored documents (recall@1, @3).

Quality per answer: greedy identity of the output tokens and ROUGE-L against full prefill's
answer, SQuAD F1 and exact match against the gold answers (:mod:`.answer_metrics`). Speed:
TTFT (ms, :attr:`GenerationResult.ttft_ms`); every ratio divides means over the same requests.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from edgesync_bench.answer_metrics import exact_match, f1_score, rouge_l

log = logging.getLogger(__name__)

FULL, PREFIX, BLEND, NOISE = "full-prefill", "prefix-only", "blend", "noise-floor"
DEFAULT_SHARES = (0.0, 0.05, 0.15, 0.3, 1.0)
DEFAULT_MAX_TOKENS = 32
RECALL_KS = (1, 3)


@dataclass
class RagRecord:
    """One system's answer to one request.

    ``share`` is the recompute share (blend only, else None); ``ttft_ms`` in ms; token counts
    from the :class:`GenerationResult`; ``identical`` (output token IDs equal full prefill's)
    and ``rouge_l`` against full prefill's answer; ``f1``/``em`` against the gold answers.
    """

    index: int
    request_id: str
    system: str
    share: float | None
    ttft_ms: float
    prompt_tokens: int
    tokens_reused: int
    blended_tokens: int
    recomputed_tokens: int
    approximate: bool
    blend_refusal: str | None
    text: str
    tokens: list[int]
    identical: bool | None = None
    rouge_l: float | None = None
    f1: float | None = None
    em: float | None = None

    @property
    def label(self) -> str:
        """``blend@0.15`` for a blend record, else the system's name."""
        return self.system if self.share is None else f"{self.system}@{self.share:g}"


def add_corpus(es, corpus: Sequence[dict], progress: Callable[[int], None] | None = None) -> dict:
    """Add ``corpus`` to ``es``'s store; returns ``{"documents", "document_tokens", "add_s",
    "store_bytes"}`` (seconds, and the store's used bytes after the add).

    Raises:
        ValueError, PermissionError, StoreError: as :meth:`EdgeSync.add_documents`.
    """
    t0 = time.perf_counter()
    recs = es.add_documents(corpus, progress=progress)
    seconds = time.perf_counter() - t0
    return {"documents": len(recs), "document_tokens": sum(len(r.tokens) for r in recs),
            "add_s": round(seconds, 3), "store_bytes": int(es.store.used_bytes())}


def runs_for(index: int, shares: Sequence[float], default_share: float, curve_limit: int | None) -> list:
    """The ``(system, share)`` runs of request ``index``, rotated by ``index``: full prefill,
    prefix-only, the noise floor and blend at ``default_share`` always; the other ``shares``
    while ``index < curve_limit`` (None: always)."""
    runs = [(FULL, None), (PREFIX, None), (NOISE, None), (BLEND, default_share)]
    if curve_limit is None or index < curve_limit:
        runs += [(BLEND, s) for s in shares if s != default_share]
    k = index % len(runs)
    return runs[k:] + runs[:k]


def _answer(lanes: dict, cfg, req, index: int, system: str, share, max_tokens: int) -> RagRecord:
    es = lanes[system]
    docs = [dict(d) for d in req.documents]
    if system == BLEND:
        es.config = dataclasses.replace(cfg, blend_recompute=share)
        try:
            res = es.generate(req.as_messages(), max_tokens=max_tokens, temperature=0.0, documents=docs,
                              reuse="blend")
        finally:
            es.config = cfg
    else:
        res = es.generate(req.as_messages(), max_tokens=max_tokens, temperature=0.0, documents=docs,
                          reuse="exact")
    return RagRecord(index, req.request_id, system, share, float(res.ttft_ms), res.prompt_tokens,
                     res.tokens_reused, res.blended_tokens, res.recomputed_tokens, bool(res.approximate),
                     res.blend_refusal, res.text, [int(t) for t in res.tokens])


def answer_request(lanes: dict, cfg, req, index: int, runs: Sequence, max_tokens: int) -> list[RagRecord]:
    """Every run of ``runs`` on request ``req``, then each record scored against the gold
    answers and against the full-prefill record (which must be among ``runs``).

    ``lanes`` maps FULL, PREFIX, BLEND, NOISE to the EdgeSync that serves each (PREFIX and
    BLEND: the one with the store).
    """
    out = [_answer(lanes, cfg, req, index, system, share, max_tokens) for system, share in runs]
    ref = next(r for r in out if r.system == FULL)
    for rec in out:
        rec.identical = rec.tokens == ref.tokens
        rec.rouge_l = rouge_l(rec.text, ref.text)
        rec.f1 = f1_score(rec.text, req.answers)
        rec.em = exact_match(rec.text, req.answers)
    return out


def retrieval_recall(es, requests: Sequence, ks: Sequence[int] = RECALL_KS) -> dict:
    """``{"n", "recall@k"...}``: the share of ``requests`` whose gold passage
    (``record.source == request.gold_doc``) is among the ``k`` stored documents nearest to the
    question (:meth:`DocumentLibrary.retrieve`)."""
    hits = dict.fromkeys(ks, 0)
    for req in requests:
        found = [rec.source for rec, _ in es.documents.retrieve(req.messages[-1]["content"], max(ks))]
        for k in ks:
            hits[k] += req.gold_doc in found[:k]
    n = len(requests)
    return {"n": n, **{f"recall@{k}": round(hits[k] / n, 4) if n else None for k in ks}}


def _mean(values) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def _round(x, nd=4):
    return None if x is None else round(x, nd)


def summarize(records: Sequence[RagRecord], shares: Sequence[float]) -> list[dict]:
    """One row per system (full prefill, noise floor, prefix-only, then blend by share): ``n``
    (requests it ran), TTFT mean and p50 (ms), ``ttft_vs_full`` and ``ttft_vs_prefix`` (its mean
    over the mean of full prefill / prefix-only on the same requests), ``identical`` (count) and
    ``identical_share``, mean ``rouge_l``, ``f1``, ``em``, ``f1_full_same`` (full prefill's F1 on
    the same requests) and ``f1_delta`` (its F1 minus that), mean token counts, and ``fallbacks``
    (blend runs answered exactly instead)."""
    by_label: dict[str, list[RagRecord]] = {}
    for rec in records:
        by_label.setdefault(rec.label, []).append(rec)
    base = {s: {r.index: r for r in records if r.system == s} for s in (FULL, PREFIX)}
    labels = [FULL, NOISE, PREFIX] + [f"{BLEND}@{s:g}" for s in shares]
    rows = []
    for label in labels:
        recs = by_label.get(label, [])
        if not recs:
            continue
        ttft = [r.ttft_ms for r in recs]
        same = {s: [base[s][r.index] for r in recs if r.index in base[s]] for s in base}
        f1_full = _mean(r.f1 for r in same[FULL])
        f1 = _mean(r.f1 for r in recs)
        rows.append({
            "system": recs[0].system, "share": recs[0].share, "label": label, "n": len(recs),
            "ttft_mean_ms": _round(_mean(ttft), 2), "ttft_p50_ms": _round(statistics.median(ttft), 2),
            "ttft_vs_full": _ratio(_mean(ttft), _mean(r.ttft_ms for r in same[FULL])),
            "ttft_vs_prefix": _ratio(_mean(ttft), _mean(r.ttft_ms for r in same[PREFIX])),
            "identical": sum(bool(r.identical) for r in recs),
            "identical_share": _round(_mean(float(bool(r.identical)) for r in recs)),
            "rouge_l": _round(_mean(r.rouge_l for r in recs)), "f1": _round(f1),
            "em": _round(_mean(r.em for r in recs)),
            "f1_full_same": _round(f1_full), "f1_delta": _round(None if f1_full is None else f1 - f1_full),
            "prompt_tokens_mean": _round(_mean(r.prompt_tokens for r in recs), 1),
            "tokens_reused_mean": _round(_mean(r.tokens_reused for r in recs), 1),
            "blended_tokens_mean": _round(_mean(r.blended_tokens for r in recs), 1),
            "recomputed_tokens_mean": _round(_mean(r.recomputed_tokens for r in recs), 1),
            "fallbacks": sum(r.system == BLEND and not r.approximate for r in recs),
        })
    return rows


def run_rag(es, requests: Sequence, corpus: Sequence[dict], *, shares: Sequence[float] = DEFAULT_SHARES,
            default_share: float | None = None, curve_limit: int | None = None,
            max_tokens: int = DEFAULT_MAX_TOKENS, flash=None, progress: Callable[[str, int, int], None] | None = None
            ) -> dict:
    """The whole measurement (module docstring) on ``es`` (an EdgeSync with a fresh, writable
    store) and return the report: ``settings``, ``corpus`` (:func:`add_corpus`), ``systems``
    (:func:`summarize`), ``retrieval`` (:func:`retrieval_recall`), ``timings_s`` and
    ``records`` (every :class:`RagRecord` as a dict, without token IDs).

    ``default_share``: the share always measured (default ``es.config.blend_recompute``; added
    to ``shares`` when missing). ``flash``: the noise floor's EdgeSync (flash attention on, no
    store); None loads one from ``es.config`` and closes it at the end. ``progress(stage, done,
    total)`` with stages ``corpus`` and ``requests``.

    Raises:
        ValueError: no requests, a share outside [0, 1], or a failure of the store or a request.
    """
    from edgesync_engines.request.router import EdgeSync

    if not requests:
        raise ValueError("rag: no requests")
    cfg = es.config
    default_share = cfg.blend_recompute if default_share is None else default_share
    shares = sorted({*shares, default_share})
    if any(not 0 <= s <= 1 for s in shares):
        raise ValueError(f"shares must be in [0, 1], got {shares}")
    report = progress or (lambda stage, done, total: None)
    own_flash = flash is None
    if own_flash:
        flash = EdgeSync(config=dataclasses.replace(cfg, flash_attn=True), store=False)
    full = EdgeSync(model=es.adapter, store=False, config=cfg)
    lanes = {FULL: full, PREFIX: es, BLEND: es, NOISE: flash}
    try:
        report("corpus", 0, len(corpus))
        corpus_info = add_corpus(es, corpus, lambda i: report("corpus", i, len(corpus)))
        t0 = time.perf_counter()
        records: list[RagRecord] = []
        report("requests", 0, len(requests))
        for i, req in enumerate(requests):
            records += answer_request(lanes, cfg, req, i, runs_for(i, shares, default_share, curve_limit),
                                      max_tokens)
            report("requests", i + 1, len(requests))
        requests_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        retrieval = retrieval_recall(es, requests)
        retrieval_s = time.perf_counter() - t0
    finally:
        if own_flash:
            flash.close()
    n = len(requests)
    curve_n = n if curve_limit is None else min(n, curve_limit)
    return {
        "workload": "rag", "model": es.adapter.model_path.name,
        "settings": {"requests": n, "curve_requests": curve_n, "shares": shares, "default_share": default_share,
                     "max_tokens": max_tokens, "greedy": True, "n_ctx": cfg.n_ctx, "n_threads": cfg.n_threads,
                     "document_header": cfg.document_header, "noise_floor": "full prefill, flash attention on"},
        "corpus": corpus_info,
        "systems": summarize(records, shares),
        "retrieval": retrieval,
        "timings_s": {"corpus": corpus_info["add_s"], "requests": round(requests_s, 2),
                      "retrieval": round(retrieval_s, 2)},
        "records": [{k: v for k, v in dataclasses.asdict(r).items() if k != "tokens"} for r in records],
    }
