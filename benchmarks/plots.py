"""PNG plots of the benchmark runner's records.

Inputs are the per-request records of ``results/<run>/requests.jsonl`` (format in
``benchmarks/runner.py``) or small summaries made from them. Every function writes one PNG
to the path the caller gives (file names are the caller's, so they are deterministic), closes
its figure, and returns the :class:`~pathlib.Path` written.

matplotlib is imported lazily inside the functions (it is in the project's ``bench`` extra,
not a core dependency) and always with the non-interactive ``Agg`` backend, so plotting works
with no display and never opens a window. Library code: nothing is printed.

Units: time in ms; sizes in bytes (axis labels say so).
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from edgesync_store.errors import require_extra

log = logging.getLogger(__name__)

HIT_KINDS = ("exact", "partial", "miss")
"""Stacked in this order by :func:`hits_by_kind` (``miss`` is a record's ``hit`` of None)."""

_HIT_COLOURS = {"exact": "#2c7a3f", "partial": "#8fcf7e", "miss": "#c9c9c9"}
_DPI = 110


def _pyplot():
    """matplotlib's pyplot on the Agg backend (imported here, not at module import)."""
    matplotlib = require_extra("matplotlib", "bench", "the benchmark's plots")
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _order(values: Iterable[str]) -> list[str]:
    """Distinct values in first-seen order."""
    return list(dict.fromkeys(values))


def _save(fig, plt, path: str | os.PathLike) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        # metadata Software=None keeps the matplotlib version out of the file
        fig.savefig(out, format="png", dpi=_DPI, metadata={"Software": None})
    finally:
        plt.close(fig)
    log.debug("wrote %s", out)
    return out


def _legend_or_empty(ax, has_data: bool, loc: str) -> None:
    """A small legend at ``loc``, or "no records" across an empty panel."""
    if has_data:
        ax.legend(fontsize=7, loc=loc)
    else:
        ax.text(0.5, 0.5, "no records", transform=ax.transAxes, ha="center")


def ttft_distribution(records: Iterable[Mapping], path: str | os.PathLike) -> Path:
    """ECDF of measured TTFT (ms, log x axis): one panel per workload, one line per system.

    Args:
        records: record dicts (uses ``workload``, ``system``, ``ttft_ms``).
        path: the PNG to write.

    Returns:
        the Path written. A workload with no records gets no panel; with no records at all
        the figure holds a single "no records" panel. TTFTs of 0 ms or less (a log axis
        cannot show them) are drawn at the smallest positive TTFT of the panel.

    Raises:
        KeyError: a record without ``workload``, ``system`` or ``ttft_ms``.
    """
    plt = _pyplot()
    data: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        data[r["workload"]][r["system"]].append(float(r["ttft_ms"]))
    workloads = list(data) or ["no records"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 4.2), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        systems = data.get(workload, {})
        positive = [v for vs in systems.values() for v in vs if v > 0]
        floor = min(positive) if positive else 1.0
        for system, values in systems.items():
            xs = sorted(max(v, floor) for v in values)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=f"{system} (n={len(xs):,})")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_title(workload)
        ax.set_xlabel("TTFT (ms, log scale)")
        ax.set_ylabel("share of requests with TTFT <= x")
        ax.grid(True, which="both", alpha=0.3)
        _legend_or_empty(ax, bool(systems), "lower right")
    fig.suptitle("Time to first token, per workload (ECDF)")
    fig.tight_layout()
    return _save(fig, plt, path)


def _hit_counts(summary_or_records) -> dict[str, dict[str, dict[str, int]]]:
    """``{workload: {system: {"exact", "partial", "miss"}}}`` from any accepted input shape."""
    if isinstance(summary_or_records, Mapping):
        return {w: {s: {t: int(c.get(t, 0)) for t in HIT_KINDS} for s, c in systems.items()}
                for w, systems in summary_or_records.items()}
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for row in summary_or_records:
        cell = counts.setdefault(row["workload"], {}).setdefault(row["system"], dict.fromkeys(HIT_KINDS, 0))
        if any(t in row for t in HIT_KINDS):  # a summary row
            for t in HIT_KINDS:
                cell[t] += int(row.get(t, 0))
        else:  # a record
            hit = row.get("hit")
            cell[hit if hit in ("exact", "partial") else "miss"] += 1
    return counts


def hits_by_kind(summary_or_records, path: str | os.PathLike) -> Path:
    """Stacked bars of exact / partial / miss shares (% of requests) per system, one panel per workload.

    Args:
        summary_or_records: one of

            * record dicts (``workload``, ``system``, ``hit`` of ``"exact"``, ``"partial"`` or None);
            * summary rows ``{"workload", "system", "exact", "partial", "miss"}`` (counts);
            * a mapping ``{workload: {system: {"exact": n, "partial": n, "miss": n}}}``.
        path: the PNG to write.

    Returns:
        the Path written. Bars are shares so that systems that ran different numbers of
        requests compare; each bar's label carries its request count.
    """
    plt = _pyplot()
    counts = _hit_counts(summary_or_records)
    workloads = list(counts) or ["no records"]
    most = max((len(counts.get(w, {})) for w in workloads), default=1)
    fig, axes = plt.subplots(1, len(workloads), figsize=(max(4.5, 1.1 * most + 1.5) * len(workloads), 4.4),
                             squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        systems = counts.get(workload, {})
        names = list(systems)
        bottoms = [0.0] * len(names)
        for kind in HIT_KINDS:
            shares = []
            for name in names:
                total = sum(systems[name].values())
                shares.append(100.0 * systems[name][kind] / total if total else 0.0)
            ax.bar(range(len(names)), shares, bottom=bottoms, color=_HIT_COLOURS[kind], label=kind,
                   edgecolor="white", linewidth=0.5)
            bottoms = [b + s for b, s in zip(bottoms, shares)]
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([f"{n}\n(n={sum(systems[n].values()):,})" for n in names], rotation=30,
                           ha="right", fontsize=7)
        ax.set_ylim(0, 100)
        ax.set_ylabel("% of requests")
        ax.set_title(workload)
        _legend_or_empty(ax, bool(names), "upper left")
    fig.suptitle("Hit kind per request")
    fig.tight_layout()
    return _save(fig, plt, path)


def bytes_per_cached_prompt(rows: Sequence[Mapping], path: str | os.PathLike) -> Path:
    """Grouped bars (log y, bytes) of bytes on disk per cached prompt, with the raw f16 KV size.

    Args:
        rows: dicts ``{"system", "workload", "bytes_on_disk_per_prompt",
            "raw_f16_kv_per_prompt"}`` (bytes; either may be None). One group per workload,
            one bar per system; the raw f16 KV of the same prompts is a black tick on each bar
            (the reference: what the KV would take uncompressed at 16 bits).
        path: the PNG to write.

    Returns:
        the Path written. A bar of 0 or None bytes (a system that stores nothing) cannot be
        drawn on a log axis: it is left out and labelled "0" / "n/a" at the axis floor (a
        system with no drawable bar has no legend entry).
    """
    plt = _pyplot()
    workloads = _order(r["workload"] for r in rows) or ["no rows"]
    systems = _order(r["system"] for r in rows)
    by_key = {(r["workload"], r["system"]): r for r in rows}
    width = 0.8 / max(len(systems), 1)
    values = [v for r in rows for v in (r.get("bytes_on_disk_per_prompt"), r.get("raw_f16_kv_per_prompt"))
              if v is not None and v > 0]
    floor = min(values) / 4 if values else 1.0
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(workloads) * max(len(systems), 1) ** 0.5 + 2), 4.6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    raw_labelled = False
    for j, system in enumerate(systems):
        xs, hs = [], []
        for i, workload in enumerate(workloads):
            row = by_key.get((workload, system))
            if row is None:
                continue
            x = i - 0.4 + width * (j + 0.5)
            disk = row.get("bytes_on_disk_per_prompt")
            if disk is not None and disk > 0:
                xs.append(x)
                hs.append(float(disk))
            else:
                ax.text(x, floor * 1.1, "0" if disk == 0 else "n/a", ha="center", va="bottom", fontsize=7)
            raw = row.get("raw_f16_kv_per_prompt")
            if raw is not None and raw > 0:
                ax.plot([x - width * 0.45, x + width * 0.45], [raw, raw], color="black", linewidth=2, zorder=3,
                        label=None if raw_labelled else "raw f16 KV")
                raw_labelled = True
        if xs:
            ax.bar(xs, hs, width=width * 0.9, color=colours[j % len(colours)], label=system)
    ax.set_yscale("log")
    ax.set_ylim(floor, max(values) * 2 if values else 10.0)
    ax.set_xlim(-0.5, len(workloads) - 0.5)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads)
    ax.set_ylabel("bytes per cached prompt (log scale)")
    ax.set_title("Bytes per cached prompt (disk; RAM for llama-ram) vs raw f16 KV")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    if rows:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, plt, path)


def quality_vs_ttft(rows: Sequence[Mapping], path: str | os.PathLike, title: str = "") -> Path:
    """Answer quality against mean TTFT (ms): one line per measure (``f1`` against gold,
    ``rouge_l`` against full prefill) through the blend rows in share order, each point labelled
    with its share, and the other rows (full prefill, prefix-only, the noise floor) as marked
    points.

    Args:
        rows: dicts ``{"system", "share", "label", "n", "ttft_mean_ms", "f1", "rouge_l"}`` (the
            ``systems`` of :func:`edgesync_bench.rag_fidelity.summarize`); blend rows have
            ``system == "blend"`` and a share.
        path: the PNG to write.
        title: the figure's title (default: a generic one).

    Returns:
        the Path written.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    blend = sorted((r for r in rows if r.get("system") == "blend" and r.get("ttft_mean_ms") is not None),
                   key=lambda r: r["share"])
    others = [r for r in rows if r.get("system") != "blend" and r.get("ttft_mean_ms") is not None]
    styles = {"f1": ("F1 vs gold", "#1f77b4", "o"), "rouge_l": ("ROUGE-L vs full prefill", "#d62728", "s")}
    for key, (name, colour, marker) in styles.items():
        pts = [(r["ttft_mean_ms"], r[key], r) for r in blend if r.get(key) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=colour, label=f"blend: {name}")
            for x, y, r in pts:
                ax.annotate(f"{100 * r['share']:g}% (n={r['n']})", (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=colour)
        for r in others:
            if r.get(key) is not None:
                ax.scatter([r["ttft_mean_ms"]], [r[key]], marker="*" if r["system"] == "full-prefill" else "D",
                           s=90, color=colour, edgecolors="black", zorder=3)
                ax.annotate(f"{r['label']} (n={r['n']})", (r["ttft_mean_ms"], r[key]), textcoords="offset points",
                            xytext=(4, -10), fontsize=7)
    for r in others:
        ax.axvline(r["ttft_mean_ms"], color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("mean TTFT (ms)")
    ax.set_ylabel("answer quality (0 to 1)")
    ax.set_ylim(0, 1.05)
    ax.set_title(title or "Answer quality against TTFT across recompute shares")
    ax.grid(True, alpha=0.3)
    _legend_or_empty(ax, bool(blend or others), "lower right")
    fig.tight_layout()
    return _save(fig, plt, path)


_KIND_STYLES = (("-", "o"), ("--", "s"), ("-.", "v"), (":", "^"), ((0, (1, 3)), "D"))


def ttft_against_prompt_tokens(series: Sequence[Mapping], path: str | os.PathLike, title: str = "") -> Path:
    """TTFT (ms) against prompt tokens, both axes log scale: one colour per model, one line style
    and marker per kind (in first-seen order: e.g. miss, hit, floor).

    Args:
        series: dicts ``{"model", "kind", "points": [(prompt tokens, TTFT ms), ...]}``; points of
            0 or less (a log axis cannot show them) are left out.
        path: the PNG to write.
        title: the figure's title (default: a generic one).

    Returns:
        the Path written; with no points at all, a "no records" figure.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.8, 5.2))
    models = _order(s["model"] for s in series)
    kinds = _order(s["kind"] for s in series)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = False
    for s in series:
        pts = sorted((float(x), float(y)) for x, y in s["points"] if x > 0 and y > 0)
        if not pts:
            continue
        style, marker = _KIND_STYLES[kinds.index(s["kind"]) % len(_KIND_STYLES)]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle=style, marker=marker, markersize=4,
                color=colours[models.index(s["model"]) % len(colours)], label=f"{s['model']}: {s['kind']}")
        drawn = True
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (log scale)")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.set_title(title or "TTFT against prompt tokens")
    ax.grid(True, which="both", alpha=0.3)
    _legend_or_empty(ax, drawn, "upper left")
    fig.tight_layout()
    return _save(fig, plt, path)
