"""The benchmark report: figures, targets, the simulated device profile, tables and plots.

:func:`build_report` turns the runner's records and per-system stats into one JSON-able dict
and writes ``report.json``, ``report.md`` and the PNG plots into the run's directory.
Figures are defined in :mod:`edgesync_bench.figures`; the simulated profile in
:mod:`edgesync_bench.device_profile`; the plots in :mod:`edgesync_bench.plots`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Sequence

from edgesync_bench.figures import group_records, ratio, same_requests, storage_figures, summarize, targets

log = logging.getLogger(__name__)

SYSTEM_ORDER = ("no-cache", "naive-string", "llama-ram", "llama-disk", "edgesync", "edgesync-warm", "edgesync-prefetch")
PLOTS = {"ttft": "ttft_distribution.png", "hits": "hits_by_kind.png", "bytes": "bytes_per_cached_prompt.png"}


def _f(v, fmt="{:.0f}", none="-") -> str:
    return none if v is None else fmt.format(v)


def _mb(v) -> str:
    return "-" if v is None else f"{v / 1e6:.2f}"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _systems(summaries: dict, workload: str) -> list[str]:
    present = {s for (w, s) in summaries if w == workload}
    extra = sorted(present - set(SYSTEM_ORDER), key=lambda s: (kv_suffix(s), not s.startswith("no-cache"), s))
    return [s for s in SYSTEM_ORDER if s in present] + extra


def kv_suffix(system: str) -> str:
    """``"@q8_0"`` for ``edgesync@q8_0`` (a lane of a further KV type), ``""`` otherwise."""
    return system[system.index("@"):] if "@" in system else ""


def kv_table(workload: str, storage: dict, summaries: dict, stats: dict, kv_types: Sequence) -> str:
    """Markdown table of EdgeSync's bytes on disk per cached prompt on one workload, one row
    per KV type (``edgesync`` runs the first, ``edgesync@TYPE`` the others), with ratios to the
    first: the store directory's allocated bytes and the stored fragment bytes (raw by default,
    zstd on request), each over the distinct prompts answered. ``ran`` is the KV type the engine really ran (an
    EdgeSync without the setting runs f16)."""
    first = kv_types[0] if kv_types else None
    rows = [("edgesync", first)] + [(f"edgesync@{t}", t) for t in kv_types[1:]]
    head = (f"| system | KV type asked / ran | cached prompts | on disk per cached prompt MB | vs {first or 'f16'} "
            f"| fragments per cached prompt MB | vs {first or 'f16'} | vs raw f16 KV | identical to no cache |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    base = storage.get((workload, "edgesync")) or {}
    base_frag = _per_prompt(base, "stored_compressed_bytes")
    for system, asked in rows:
        st = storage.get((workload, system))
        if not st:
            continue
        ran = ((stats.get(workload) or {}).get(system) or {}).get("kv_type")
        frag = _per_prompt(st, "stored_compressed_bytes")
        s = summaries.get((workload, system)) or {}
        lines.append(
            f"| {system} | {asked or 'f16 (default)'} / {ran or '?'} | {st.get('cached_prompts', '-')} "
            f"| {_mb(st.get('disk_bytes_per_prompt'))} "
            f"| {_f(ratio(st.get('disk_bytes_per_prompt'), base.get('disk_bytes_per_prompt')), '{:.3f}x')} "
            f"| {_mb(frag)} | {_f(ratio(frag, base_frag), '{:.3f}x')} | {_f(st.get('vs_raw_f16'), '{:.3f}x')} "
            f"| {_pct(s.get('identity'))} ({s.get('identity_n', 0)}) |")
    return "\n".join(lines)


def _per_prompt(st: dict, key: str) -> float | None:
    n = st.get("cached_prompts")
    return st[key] / n if st.get(key) is not None and n else None


def engine_notes(stats: dict, kv_types: Sequence) -> list[str]:
    """One line per lane that did not run as asked: an EdgeSync that served uncached (its
    ``cache_refusal``), or a KV type other than the one asked (an EdgeSync without the
    ``kv_type`` setting runs f16)."""
    notes = []
    for workload, lanes in stats.items():
        for system, st in (lanes or {}).items():
            if not isinstance(st, dict):
                continue
            if st.get("cache_refusal"):
                notes.append(f"- {workload}/{system}: served uncached: {st['cache_refusal']}")
            asked = kv_suffix(system)[1:] or (kv_types[0] if kv_types else None) or "f16"
            if st.get("kv_type") and st["kv_type"] != asked:
                notes.append(f"- {workload}/{system}: asked for KV type {asked}, the engine ran {st['kv_type']}")
    return notes


def model_line(meta: dict) -> str:
    """The report's model sentence: the GGUF's file and ``general.name``, its architecture, and
    the KV types (SmolLM2 when the run did not say)."""
    m = meta.get("model") or {}
    kv = [t or "f16 (default)" for t in (meta.get("kv_types") or [None])]
    if m.get("file"):
        what = f"{m['file']} ({m.get('name') or '?'}, {m.get('architecture') or '?'}"
        what += f", sliding window {m['sliding_window']})" if m.get("sliding_window") else ")"
    else:
        what = "SmolLM2-135M-Instruct Q4_1"
    return f"Model: {what} on llama.cpp, KV type {', '.join(kv)}, greedy, 16 new tokens."


def _vs_no_cache(s: dict) -> str:
    """Mean TTFT over no cache's on the requests both ran, with their count when that is not
    all of the system's requests (EdgeSync's 1,000 seed requests against no cache's 300)."""
    v = ratio(s.get("ttft_mean_same_requests"), s.get("no_cache_ttft_mean_same_requests"))
    n = s.get("same_requests")
    return _f(v, "{:.3f}x") + (f" ({n})" if v is not None and n != s["n"] else "")


def sampled_lines(sampled: dict) -> list[str]:
    """The report's "What was sampled" lines from the runner's ``meta["sampled"]``."""
    lines = []
    for workload, d in (sampled or {}).items():
        if workload == "seed":
            lines.append(f"- seed: {d['requests']} requests ({d['distinct_prompts']} distinct prompts) for EdgeSync "
                         f"(cold and warm); the first {d['no_cache_and_peers_requests']} of them "
                         f"({d['no_cache_and_peers_distinct_prompts']} distinct prompts) for no cache, naive string, "
                         f"LlamaRAMCache and LlamaDiskCache, dealt in turn with EdgeSync's; {d['selection']}.")
        elif workload == "doc-qa":
            lines.append(f"- doc-qa: {d['passages']} passages, {d['questions']} questions, every system: "
                         f"{d['selection']}: {', '.join(d['doc_ids'])}.")
        elif workload == "chat":
            lines.append(f"- chat: {d['sessions']} sessions, {d['user_turns']} user turns in the data (the turns "
                         f"each system served are its requests column), every system: {d['selection']}: "
                         f"{', '.join(d['session_ids'])}.")
    return lines


def main_table(workload: str, summaries: dict, storage: dict) -> str:
    """Markdown table of one workload: one row per system (see :mod:`edgesync_bench.figures`)."""
    head = ("| system | requests | TTFT p50 ms | TTFT p95 ms | TTFT mean ms | vs no cache (same requests) "
            "| first-seen mean ms "
            "| repeat mean ms | exact / partial / miss | not prefilled | bytes read / req MB "
            "| stored per cached prompt MB (vs raw f16 KV) | CPU s / req | peak RSS MB | identical to no cache |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for system in _systems(summaries, workload):
        s = summaries[(workload, system)]
        st = storage.get((workload, system)) or {}
        per = st.get("disk_bytes_per_prompt")
        where = "disk"
        if per is None and st.get("ram_bytes_per_prompt") is not None:
            per, where = st["ram_bytes_per_prompt"], "RAM"
        stored = "-" if per is None else f"{per / 1e6:.2f} {where} ({st['vs_raw_f16']:.2f}x)"
        h = s["hits"]
        lines.append(
            f"| {system} | {s['n']} | {_f(s['ttft_ms']['p50'])} | {_f(s['ttft_ms']['p95'])} "
            f"| {_f(s['ttft_ms']['mean'])} "
            f"| {_vs_no_cache(s)} "
            f"| {_f(s['first_seen_ttft_ms']['mean'])} "
            f"| {_f(s['repeat_ttft_ms']['mean'])} | {h['exact']} / {h['partial']} / {h['miss']} "
            f"| {_pct(s['not_prefilled_share'])} | {_mb(s['bytes_read_per_request'])} | {stored} "
            f"| {_f(s['cpu_s_per_request'], '{:.2f}')} "
            f"| {_f(None if s['peak_rss_bytes'] is None else s['peak_rss_bytes'] / 1e6)} "
            f"| {_pct(s.get('identity'))} ({s.get('identity_n', 0)}) |")
    return "\n".join(lines)


def targets_table(rows: Sequence[dict]) -> str:
    """Markdown table of the benchmark's targets (:func:`edgesync_bench.figures.targets`)."""
    lines = ["| target (seed workload) | this run | limit | met | measured as |", "|---|---|---|---|---|"]
    for r in rows:
        met = "n/a" if r["met"] is None else ("yes" if r["met"] else "**no**")
        lines.append(f"| {r['target']} | {_f(r['value'], '{:.3f}')} | {r['limit']:.3f} | {met} | {r['how']} |")
    return "\n".join(lines)


def prefetch_table(summaries: dict, stats: dict) -> tuple[str, dict]:
    """Prefetch on (``edgesync-prefetch``) against off (``edgesync``) on doc-QA and chat."""
    lines = ["| workload | TTFT mean off / on ms | TTFT p50 off / on ms | on / off (mean) | fragments injected from "
             "the RAM tier | prediction top-1 / top-3 (predictions) |", "|---|---|---|---|---|---|"]
    out = {}
    for workload in ("doc-qa", "chat"):
        off, on = summaries.get((workload, "edgesync")), summaries.get((workload, "edgesync-prefetch"))
        if not off or not on:
            continue
        pst = ((stats.get(workload) or {}).get("edgesync-prefetch") or {}).get("prefetch") or {}
        row = {"off_mean": off["ttft_ms"]["mean"], "on_mean": on["ttft_ms"]["mean"], "off_p50": off["ttft_ms"]["p50"],
               "on_p50": on["ttft_ms"]["p50"], "ram_tier_hits": on.get("ram_tier_hits"),
               "top1": pst.get("top1"), "top3": pst.get("topk"), "predictions": pst.get("predictions"),
               "prefetcher": pst}
        out[workload] = row
        lines.append(f"| {workload} | {_f(row['off_mean'])} / {_f(row['on_mean'])} "
                     f"| {_f(row['off_p50'])} / {_f(row['on_p50'])} "
                     f"| {_f(ratio(row['on_mean'], row['off_mean']), '{:.3f}x')} | {row['ram_tier_hits']} "
                     f"| {_pct(row['top1'])} / {_pct(row['top3'])} ({row['predictions']}) |")
    return "\n".join(lines), out


def _plots(records: Sequence[dict], summaries: dict, storage: dict, out: Path) -> dict[str, str]:
    try:
        from edgesync_bench import plots
    except ImportError as exc:  # matplotlib missing: the report still gets written
        log.warning("no plots: %s", exc)
        return {}
    written = {}
    rows = [{"system": s, "workload": w,
             "bytes_on_disk_per_prompt": st.get("disk_bytes_per_prompt") or st.get("ram_bytes_per_prompt"),
             "raw_f16_kv_per_prompt": st.get("raw_f16_kv_per_prompt")}
            for (w, s), st in storage.items() if (st.get("disk_bytes_per_prompt") or st.get("ram_bytes_per_prompt"))]
    jobs = [("ttft", lambda p: plots.ttft_distribution(records, p)),
            ("hits", lambda p: plots.hits_by_kind(records, p)),
            ("bytes", lambda p: plots.bytes_per_cached_prompt(rows, p))]
    for key, fn in jobs:
        try:
            written[key] = str(fn(out / PLOTS[key]).name)
        except Exception as exc:  # a plot failing must not lose the figures
            log.warning("plot %s failed: %s", key, exc)
    return written


def build_report(records: Sequence[dict], stats: dict[str, dict], meta: dict, out: Path) -> dict[str, Any]:
    """Compute every figure, write ``report.json``, ``report.md`` and the plots into ``out``.

    Args:
        records: the runner's per-request records.
        stats: ``{workload: {system: worker stats}}``.
        meta: run information (sizes, threads, times, energy availability, errors).
        out: the run's directory.

    Returns the report dict (``meta``, ``summaries``, ``storage``, ``targets``, ``prefetch``,
    ``device_profile``, ``plots``, ``markdown``).
    """
    out = Path(out)
    groups = group_records(records)
    summaries: dict[tuple[str, str], dict] = {}
    storage: dict[tuple[str, str], dict] = {}
    for (workload, system), rs in groups.items():
        ref = groups.get((workload, "no-cache" + kv_suffix(system)))  # the same KV type's reference
        # seed and doc-QA: equal prompt keys are equal messages, so no cache's answer to a prompt
        # is the reference for EdgeSync's requests after the 300 no cache ran
        s = summaries[(workload, system)] = summarize(rs, ref, by_prompt=workload in ("seed", "doc-qa"))
        s["ram_tier_hits"] = sum((r.get("detail") or {}).get("ram_tier_hits") or 0 for r in rs)
        if ref:  # "vs no cache": both means over the requests both ran
            mine, theirs = same_requests(rs, ref), same_requests(ref, rs)
            s["same_requests"] = len(mine)
            s["ttft_mean_same_requests"] = sum(r["ttft_ms"] for r in mine) / len(mine) if mine else None
            s["no_cache_ttft_mean_same_requests"] = (sum(r["ttft_ms"] for r in theirs) / len(theirs)
                                                     if theirs else None)
        storage[(workload, system)] = storage_figures(rs, (stats.get(workload) or {}).get(system))
    tgt = targets(summaries, storage, groups)
    pf_md, pf = prefetch_table(summaries, stats)
    try:
        from edgesync_bench import device_profile

        sim = device_profile.simulate([r for r in records if r["workload"] == "seed"], device_profile.SeedConstants())
        sim_md = device_profile.render_markdown(sim)
    except Exception as exc:  # reported, never fatal for the measured figures
        log.warning("device profile failed: %s", exc)
        sim, sim_md = {"error": str(exc)}, f"(device profile failed: {exc})"
    plot_files = _plots(records, summaries, storage, out)
    sizes = meta.get("sizes", {})
    md = [f"# EdgeSync benchmark, {meta.get('started_utc', '')}", "",
          f"Run: {meta.get('wall_s', 0) / 60:.1f} min on {meta.get('cpu_count')} cores, llama.cpp threads per worker: "
          f"{meta.get('threads') or 'all'}; load average at start {meta.get('loadavg_start')}, "
          f"at end {meta.get('loadavg_end')}. "
          f"Sizes: {sizes}. {model_line(meta)} "
          "TTFT: call to first streamed token, chat template and tokenization included, every system.", ""]
    if meta.get("sampled"):
        md += ["What was sampled (fixed seeds; every comparison with no cache is over the requests both ran):", "",
               *sampled_lines(meta["sampled"]), ""]
    kv_types = meta.get("kv_types") or [None]
    notes = engine_notes(stats, kv_types)
    if notes:
        md += ["Systems that did not run as asked (their figures are what they ran):", "", *notes, ""]
    for workload in ("seed", "doc-qa", "chat"):
        if any(w == workload for w, _ in summaries):
            md += [f"## {workload}", "", main_table(workload, summaries, storage), "",
                   f"EdgeSync's bytes on disk per cached prompt ({workload}):", "",
                   kv_table(workload, storage, summaries, stats, kv_types), ""]
    quick = sizes.get("seed", 1000) < 1000
    md += ["## Targets", "",
           *(["(A small run: too few requests for these ratios to mean anything; `make bench` for the real ones.)", ""]
             if quick else []),
           targets_table(tgt), "", "## Prefetch (N-gram, RAM tier)", "", pf_md, "",
           "## Simulated device profile", "", sim_md, "",
           "## Energy", "", f"{meta.get('energy')}", "",
           "## Plots", "", *[f"- `{name}`" for name in plot_files.values()], ""]
    if meta.get("errors"):
        md += ["## Errors", "", *[f"- {e}" for e in meta["errors"]], ""]
    markdown = "\n".join(md)
    report = {
        "meta": meta,
        "summaries": {f"{w}/{s}": v for (w, s), v in summaries.items()},
        "storage": {f"{w}/{s}": v for (w, s), v in storage.items()},
        "stats": stats,
        "targets": tgt,
        "prefetch": pf,
        "device_profile": sim,
        "plots": plot_files,
        "markdown": markdown,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "report.md").write_text(markdown)
    return report
