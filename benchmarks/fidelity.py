"""How often the opt-in approximate mode (``reuse="semantic"``) serves a paraphrase's KV, and
what that does to the answer.

Data: ``qqp_pairs_labelled.jsonl`` of the workloads directory (3,000 human-labelled Quora
question pairs, 1,507 duplicates and 1,493 non-duplicates) or any file of the same shape
``{"a": str, "b": str, "duplicate": bool}``.

1. **Shares** (:func:`pair_similarities`, :func:`threshold_shares`): each question is embedded
   once, as the router embeds a chat request (``embed_text_for``: the question); a pair is
   *served* at ``t`` when its cosine is ``>= t`` (request ``b`` would get donor ``a``'s KV
   whole). Precision = duplicates / served, on this near-balanced file (traffic has another mix).
2. **Model sample** (:func:`sample_fidelity`): per threshold, up to ``n`` pairs drawn uniformly
   (seeded) from the pairs served there, duplicates and not as they come. Questions go behind a
   fixed system prompt (~340-token prompts: short ones are never cached). Per pair, in a fresh
   store of its own, ``a`` is stored as the only donor, then ``b`` is asked and its greedy tokens
   compared with ``b``'s uncached answer. A store of many donors would serve ``b`` its nearest
   one, not necessarily ``a``: the private store makes the sample measure the event the shares
   count (the router's similarity is recorded to check it). A pair drawn at several thresholds
   runs once: what the mode injects does not depend on the threshold it passed.

Library code: nothing is printed; progress goes to an optional callback. The question vectors
are cached between runs by :mod:`edgesync_bench.fidelity_vectors`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from edgesync_bench.fidelity_vectors import Progress, embed_texts
from edgesync_bench.workloads import WorkloadDataError, data_file
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.prompt_text import embed_text_for
from edgesync_store.errors import require_extra
from edgesync_store.schema import common_prefix_len
from edgesync_store.semantic.embedders import Embedder

log = logging.getLogger(__name__)

PAIRS_FILE = "qqp_pairs_labelled.jsonl"
SYSTEM_PROMPTS_FILE = "system_prompts.json"
DEFAULT_THRESHOLDS = (0.75, 0.80, 0.85, 0.90, 0.95)
DEFAULT_SAMPLE = 8
"""Pairs per threshold run through the model (about 5 s per pair on 2 quiet cores)."""
DEFAULT_MAX_TOKENS = 32


@dataclass(frozen=True)
class Pair:
    """One labelled pair: ``index`` is its 0-based row in the file."""

    index: int
    a: str
    b: str
    duplicate: bool


@dataclass(frozen=True)
class ShareRow:
    """Served pairs at one threshold: counts, and shares in [0, 1] of each label's pairs;
    ``precision`` = dup_served / (dup_served + nondup_served), None when nothing is served."""

    threshold: float
    n_dup: int
    n_nondup: int
    dup_served: int
    nondup_served: int
    dup_share: float
    nondup_share: float
    precision: float | None


@dataclass
class SampleRecord:
    """One sampled pair through the model. ``similarity`` is this module's cosine of the pair;
    ``router_similarity`` and ``approximate`` are what the router reported for request ``b``;
    ``served`` = hit "exact" (the donor's KV was injected whole). ``identical`` compares the
    greedy token IDs, ``equals_donor_answer`` compares them with the answer the donor ``a``
    got when it was stored; ``common_prefix`` is how many leading tokens agree; ``rouge_l`` is the
    ROUGE-L F-measure of the two texts (see :func:`rouge_l`). Times are milliseconds."""

    pair_index: int
    duplicate: bool
    similarity: float
    hit: str
    approximate: bool
    router_similarity: float | None
    served: bool
    identical: bool
    equals_donor_answer: bool
    common_prefix: int
    rouge_l: float
    prompt_tokens: int
    approx_ttft_ms: float
    uncached_ttft_ms: float
    approx_text: str
    uncached_text: str
    approx_tokens: list[int] = field(default_factory=list)
    uncached_tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ThresholdSample:
    """The model sample of one threshold: ``n`` pairs drawn, ``served`` of them served as exact
    hits; ``identical`` / ``identical_share`` and ``mean_rouge_l`` are over the served ones
    (None when none was)."""

    threshold: float
    n: int
    served: int
    duplicates: int
    identical: int
    identical_share: float | None
    mean_rouge_l: float | None
    pair_indices: list[int]


# -- data ---------------------------------------------------------------------------------------

def load_pairs(path: str | os.PathLike | None = None) -> list[Pair]:
    """Read labelled pairs (default: ``qqp_pairs_labelled.jsonl`` of the workloads directory, :func:`data_file`).

    Raises:
        WorkloadDataError: unreadable file, no rows, or a line that is not JSON ``{"a": str,
            "b": str, "duplicate": bool}`` (the message names it).
    """
    path = Path(path) if path is not None else data_file(PAIRS_FILE)
    pairs: list[Pair] = []
    try:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                try:
                    row = json.loads(line) if line.strip() else None
                except json.JSONDecodeError:
                    row = {}
                if row is not None and not (isinstance(row, dict) and isinstance(row.get("a"), str)
                                            and isinstance(row.get("b"), str)
                                            and isinstance(row.get("duplicate"), bool)):
                    raise WorkloadDataError(f'{path}: line {lineno}: not {{"a": str, "b": str, "duplicate": bool}}')
                if row is not None:
                    pairs.append(Pair(len(pairs), row["a"], row["b"], row["duplicate"]))
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadDataError(f"cannot read {str(path)!r}: {exc}") from None
    if not pairs:
        raise WorkloadDataError(f"{path}: no pairs")
    return pairs


def load_system_prompt(topic: int = 0, data_dir: str | os.PathLike | None = None) -> tuple[str, str]:
    """``(app, system_prompt)`` of entry ``topic`` (0-based) of ``system_prompts.json``.

    Raises:
        WorkloadDataError: missing or malformed file, or no such entry.
    """
    path = data_file(SYSTEM_PROMPTS_FILE, data_dir)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entry = data[topic]
        return str(entry["app"]), str(entry["system_prompt"])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WorkloadDataError(f"cannot read {str(path)!r}: {exc}") from None
    except (IndexError, KeyError, TypeError):
        raise WorkloadDataError(f"{path}: no entry {topic} with 'app' and 'system_prompt'") from None


def messages_for(system_prompt: str, question: str) -> list[dict]:
    """The chat request of one question: ``[system, user]`` messages."""
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


# -- shares -------------------------------------------------------------------------------------

def pair_similarities(pairs: Sequence[Pair], embedder: Embedder, cache_dir: str | os.PathLike | None = None,
                      progress: Progress | None = None) -> np.ndarray:
    """Cosine of each pair's two questions as the router would embed them: float32 ``[len(pairs)]``
    in [-1, 1]. Every distinct question text is embedded once (see :func:`embed_texts`)."""
    texts = [embed_text_for([{"role": "user", "content": q}]) for p in pairs for q in (p.a, p.b)]
    unique = sorted(set(texts))
    row = {t: i for i, t in enumerate(unique)}
    vecs = embed_texts(unique, embedder, cache_dir, progress)
    a = vecs[[row[t] for t in texts[0::2]]]
    b = vecs[[row[t] for t in texts[1::2]]]
    return np.einsum("ij,ij->i", a, b).astype(np.float32)


def threshold_shares(similarities: np.ndarray, duplicate: Sequence[bool],
                     thresholds: Sequence[float]) -> list[ShareRow]:
    """One :class:`ShareRow` per threshold: pairs with ``similarity >= threshold`` are served.

    Raises:
        ValueError: lengths differ, or a label class is empty.
    """
    sims = np.asarray(similarities, dtype=np.float64)
    dup = np.asarray(duplicate, dtype=bool)
    if sims.shape != dup.shape:
        raise ValueError(f"similarities {sims.shape} and duplicate {dup.shape} differ in length")
    n_dup, n_non = int(dup.sum()), int((~dup).sum())
    if not n_dup or not n_non:
        raise ValueError(f"need both duplicate and non-duplicate pairs, got {n_dup} and {n_non}")
    rows = []
    for t in thresholds:
        served = sims >= t
        d, nd = int((served & dup).sum()), int((served & ~dup).sum())
        rows.append(ShareRow(float(t), n_dup, n_non, d, nd, d / n_dup, nd / n_non, d / (d + nd) if d + nd else None))
    return rows


def draw_samples(similarities: np.ndarray, thresholds: Sequence[float], n: int,
                 seed: int = 0) -> dict[float, list[int]]:
    """Per threshold, up to ``n`` pair indices drawn uniformly without replacement from the pairs
    served at it: the first ``n`` served pairs of one ``random.Random(seed)`` shuffle of all
    indices, so that thresholds share pairs where they can (fewer model runs)."""
    order = list(range(len(similarities)))
    random.Random(seed).shuffle(order)
    sims = np.asarray(similarities, dtype=np.float64)
    return {float(t): [i for i in order if sims[i] >= t][:n] for t in thresholds}


# -- model sample -------------------------------------------------------------------------------

_scorer = None


def _rouge_scorer():
    global _scorer
    if _scorer is None:
        rouge_scorer = require_extra("rouge_score.rouge_scorer", "bench", "ROUGE-L")
        _scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    return _scorer


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F-measure in [0, 1] of two texts, by Google's ``rouge-score`` (the reference
    Python implementation of ROUGE-1.5.5: lower-cased ASCII word tokens, no stemming). Equal
    strings score 1.0; texts with no ASCII letter or digit give no tokens and score 0.0 unless
    equal.

    Raises:
        RuntimeError: ``rouge-score`` is not installed (names the pip command).
    """
    if candidate == reference:
        return 1.0
    return float(_rouge_scorer().score(reference, candidate)["rougeL"].fmeasure)


def run_pair(baseline, pair: Pair, similarity: float, system_prompt: str, config: EdgeSyncConfig,
             max_tokens: int = DEFAULT_MAX_TOKENS) -> SampleRecord:
    """Serve ``pair.b`` from donor ``pair.a`` in the approximate mode and compare with ``b``'s
    uncached answer.

    ``baseline`` is an ``EdgeSync`` without a store (its adapter is shared); ``config`` holds the
    approximate mode's settings (its ``store_path`` is replaced by a fresh temporary store that
    is deleted afterwards). Generation is greedy (temperature 0).

    Raises:
        ValueError: the prompt (with the system prompt) does not fit the context.
    """
    from edgesync_engines.request.router import EdgeSync

    msgs_a, msgs_b = messages_for(system_prompt, pair.a), messages_for(system_prompt, pair.b)
    uncached = baseline.generate(msgs_b, max_tokens=max_tokens, temperature=0.0)
    with tempfile.TemporaryDirectory(prefix="edgesync-fidelity-") as tmp:
        store = Path(tmp) / "store"
        cfg = dataclasses.replace(config, store_path=store)
        with EdgeSync(baseline.adapter, store=store, config=cfg) as es:
            donor = es.generate(msgs_a, max_tokens=max_tokens, temperature=0.0)
            approx = es.generate(msgs_b, max_tokens=max_tokens, temperature=0.0)
    identical = approx.tokens == uncached.tokens
    return SampleRecord(
        pair_index=pair.index,
        duplicate=pair.duplicate,
        similarity=float(similarity),
        hit=approx.hit,
        approximate=bool(approx.approximate),
        router_similarity=None if approx.similarity is None else float(approx.similarity),
        served=approx.hit == "exact",
        identical=identical,
        equals_donor_answer=approx.tokens == donor.tokens,
        common_prefix=common_prefix_len(approx.tokens, uncached.tokens),
        rouge_l=1.0 if identical else rouge_l(approx.text, uncached.text),
        prompt_tokens=approx.prompt_tokens,
        approx_ttft_ms=approx.ttft_ms,
        uncached_ttft_ms=uncached.ttft_ms,
        approx_text=approx.text,
        uncached_text=uncached.text,
        approx_tokens=list(approx.tokens),
        uncached_tokens=list(uncached.tokens),
    )


def approximate_config(threshold: float, base: EdgeSyncConfig | None = None) -> EdgeSyncConfig:
    """``base`` (default: :meth:`EdgeSyncConfig.load`) switched to the approximate mode at
    ``threshold``: reuse "semantic", semantic lookups on, cache on, greedy.

    Raises:
        ValueError: threshold outside (0, 1].
    """
    base = base or EdgeSyncConfig.load()
    return dataclasses.replace(base, reuse="semantic", semantic=True, cache_enabled=True, temperature=0.0,
                               similarity_exact=float(threshold),
                               similarity_partial=min(float(threshold), base.similarity_partial))


def summarize_samples(draws: dict[float, list[int]], records: dict[int, SampleRecord]) -> list[ThresholdSample]:
    """Per threshold, the :class:`ThresholdSample` of its drawn pairs' records. A record counts
    as served at ``t`` when it was served and, if approximately, at a router similarity >= t
    (the pair ran once, at the lowest threshold)."""
    out = []
    for t, idx in draws.items():
        recs = [records[i] for i in idx]
        served = [r for r in recs if r.served and (not r.approximate or (r.router_similarity or 0.0) >= t)]
        same = sum(r.identical for r in served)
        out.append(ThresholdSample(
            threshold=t, n=len(recs), served=len(served), duplicates=sum(r.duplicate for r in recs),
            identical=same, identical_share=same / len(served) if served else None,
            mean_rouge_l=statistics.fmean(r.rouge_l for r in served) if served else None,
            pair_indices=list(idx)))
    return out


def sample_fidelity(pairs: Sequence[Pair], similarities: np.ndarray, thresholds: Sequence[float], n: int,
                    system_prompt: str, seed: int = 0, max_tokens: int = DEFAULT_MAX_TOKENS, model=None,
                    config: EdgeSyncConfig | None = None,
                    progress: Progress | None = None) -> tuple[list[ThresholdSample], list[SampleRecord]]:
    """Run the model sample (see the module docstring): :func:`draw_samples`, then
    :func:`run_pair` once per distinct drawn pair, in the approximate mode at the lowest
    threshold, ``progress("sample", done, total)`` after each.

    Args:
        model: what ``EdgeSync`` accepts as ``model`` (None: the configured model).
        config: base settings (default :meth:`EdgeSyncConfig.load`).

    Returns:
        (per-threshold summaries in ``thresholds`` order, records in run order).

    Raises:
        ValueError: ``n`` < 0 or ``max_tokens`` < 1, or a prompt does not fit the context.
        RuntimeError: rouge-score missing. Model and store errors propagate.
    """
    from edgesync_engines.request.router import EdgeSync

    if n < 0 or max_tokens < 1:
        raise ValueError(f"n must be >= 0 and max_tokens >= 1, got {n} and {max_tokens}")
    draws = draw_samples(similarities, thresholds, n, seed)
    todo = list(dict.fromkeys(i for idx in draws.values() for i in idx))
    records: dict[int, SampleRecord] = {}
    if todo:
        _rouge_scorer()  # fail before the model runs when rouge-score is missing
        cfg = approximate_config(min(thresholds), config)
        with EdgeSync(model, store=False, config=cfg) as baseline:
            for done, i in enumerate(todo, start=1):
                records[i] = run_pair(baseline, pairs[i], float(similarities[i]), system_prompt, cfg, max_tokens)
                log.info("pair %d: sim %.3f hit %s identical %s", i, similarities[i], records[i].hit,
                         records[i].identical)
                if progress:
                    progress("sample", done, len(todo))
    return summarize_samples(draws, records), [records[i] for i in todo]

