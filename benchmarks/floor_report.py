"""The figures, verdicts and tables of ``benchmarks/floor.py`` (pure: no model, no store).

:func:`verdicts` turns the measured figures into the acceptance rows of issue 17 ("hits at the
physical floor"), each a ratio or a bound from the same run; :func:`group_profile` sums a
cProfile of exact hits into the steps of the hit path; :func:`render` prints both.

Figures (``fig[workload]``, workload ``"seed"`` or ``"doc"``), every time in ms, sizes in bytes:

* ``exact``: ``ttft_ms`` (the engine's TTFT of every timed exact repeat), ``wall_ttft_ms`` (call to
  first streamed piece), ``hits`` (count by hit kind), ``identical`` / ``n`` (hits whose greedy
  tokens equal the uncached run's);
* ``floor``: ``ms`` (tokenize + evaluate the last prompt token with the other n - 1 in the live
  context + sample one token, one per exact repeat);
* ``partial``: per repeated ask (``asks_per_prompt`` - 1 per new prompt, interleaved; the
  first ask stores its chunk) ``ttft_ms``, and its bound measured right after it:
  ``floor_ms``, ``uncovered_prefill_ms`` (evaluating the tokens between the injected prefix and
  the last prompt token, in the request's own batches, on top of the prefix in the live
  context); per new prompt ``uncovered_tokens``, ``tokens_reused``; ``hits``, ``identical`` /
  ``n`` over every ask;
* ``store_back``: per new prompt ``ms`` (answer's last piece to the end of the request),
  ``bytes`` (stored fragment bytes added), ``fragments``;
* ``new_process``: ``warm`` and ``uncached`` runs of a new ``edgesync generate`` process
  (``ttft_ms``, ``wall_s``, ``peak_rss_bytes``, ``hit``, ``identical``) and ``warm_hit_ttft_ms``
  (this process's exact-hit TTFT p50 of the same prompts).
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Sequence

from edgesync_bench.figures import percentile

EXACT_OVER_FLOOR = 1.5
"""Issue 17, acceptance 1: exact-hit TTFT p50 at most 1.5x the floor's p50."""
PARTIAL_SLACK_MS = 5.0
"""Acceptance 2: a partial hit's TTFT p50 at most floor + prefill of the uncovered tokens + 5 ms."""
NEW_PROCESS_OVER_WARM = 1.5
"""Acceptance 3: a new process's first exact hit at most 1.5x the warm exact hit's TTFT."""
RSS_SLACK_BYTES = 64_000_000
"""Acceptance 3: peak RSS of the new process at most the uncached one's + 64 MB (10^6 bytes)."""
WALL_OVER_UNCACHED = 0.6
"""Acceptance 3: the new process's wall time at most 0.6x the uncached process's."""

PROFILE_GROUPS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("tokenize", (("router.py", "prompt_tokens"),)),
    ("walk", (("plan.py", "plan_reuse"),)),
    ("fetch", (("execute.py", "fetched"),)),
    ("assemble/inject", (("protocol.py", "inject_fragment"), ("llamacpp.py", "inject_fragment"))),
    ("eval", (("llama.py", "eval"),)),
    ("sample", (("llama.py", "sample"),)),
    ("after first token", (("storeback.py", "record_hits"), ("storeback.py", "store_new"),
                           ("storeback.py", "index_prompt"))),
)
"""Profile groups: (file name, function) whose cumulative times make each step of an exact hit.
``walk`` is planning (the prefix walk, and the semantic lookup where it runs); ``fetch`` reading,
checking and decoding the fragments (RAM tier first); ``assemble/inject`` building the engine's
state and handing it to llama.cpp; ``eval`` llama.cpp evaluating the last prompt token;
``after first token`` the work a request does once its first token is out. The functions are
disjoint (none calls another), so the sums do not overlap; what none covers is ``other``."""


def p50(xs: Sequence[float]) -> float | None:
    """Median (linear interpolation); None for no values."""
    return percentile(list(xs), 50)


def p95(xs: Sequence[float]) -> float | None:
    """95th percentile (linear interpolation); None for no values."""
    return percentile(list(xs), 95)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _row(criterion: str, workload: str, value: float | None, limit: float | None, how: str, unit: str = "x",
         at_least: bool = False) -> dict:
    met = None if value is None or limit is None else (value >= limit if at_least else value <= limit)
    return {"criterion": criterion, "workload": workload, "value": value, "limit": limit, "unit": unit,
            "op": ">=" if at_least else "<=", "met": met, "how": how}


def partial_bound_ms(partial: Mapping[str, Any]) -> float | None:
    """The bound of acceptance 2: p50 of the floors + p50 of the uncovered prefills + 5 ms (None
    without figures)."""
    f, u = p50(partial.get("floor_ms") or []), p50(partial.get("uncovered_prefill_ms") or [])
    return None if f is None or u is None else f + u + PARTIAL_SLACK_MS


def new_process_figures(np_fig: Mapping[str, Any]) -> dict[str, float | None]:
    """Medians over the prompts of the new-process runs: ``warm_ttft_ms``, ``warm_hit_ttft_ms``
    (in-process), ``warm_rss_bytes``, ``uncached_rss_bytes``, ``warm_wall_s``,
    ``uncached_wall_s`` (None where no run succeeded)."""
    warm = [r for r in np_fig.get("warm") or [] if r.get("ok")]
    unc = [r for r in np_fig.get("uncached") or [] if r.get("ok")]
    return {
        "warm_ttft_ms": p50([r["ttft_ms"] for r in warm]),
        "warm_hit_ttft_ms": p50(np_fig.get("warm_hit_ttft_ms") or []),
        "warm_rss_bytes": p50([r["peak_rss_bytes"] for r in warm]),
        "uncached_rss_bytes": p50([r["peak_rss_bytes"] for r in unc]),
        "warm_wall_s": p50([r["wall_s"] for r in warm]),
        "uncached_wall_s": p50([r["wall_s"] for r in unc]),
    }


def verdicts(fig: Mapping[str, Mapping[str, Any]]) -> list[dict]:
    """The acceptance rows of issue 17 for every workload in ``fig`` (module docstring): each
    ``criterion``, ``workload``, ``value``, ``limit``, ``unit``, ``op`` (``<=`` or ``>=``),
    ``met`` (None when a figure is missing) and ``how``."""
    rows = []
    for w, f in fig.items():
        ex, fl, pa = f.get("exact") or {}, f.get("floor") or {}, f.get("partial") or {}
        rows.append(_row("exact-hit TTFT p50 / floor p50", w, _ratio(p50(ex.get("ttft_ms") or []),
                                                                      p50(fl.get("ms") or [])),
                         EXACT_OVER_FLOOR, "every timed repeat, prompts interleaved"))
        rows.append(_row("exact hits identical to uncached", w, _ratio(ex.get("identical"), ex.get("n")), 1.0,
                         f"{ex.get('identical')} of {ex.get('n')} hits, greedy tokens", unit="share",
                         at_least=True))
        rows.append(_row("partial-hit TTFT p50 (ms) / floor + uncovered prefill + 5 ms", w,
                         p50(pa.get("ttft_ms") or []), partial_bound_ms(pa),
                         f"{len(pa.get('ttft_ms') or [])} new prompts; bound = p50 floor + p50 prefill of "
                         f"{p50(pa.get('uncovered_tokens') or [])} uncovered tokens (p50) + {PARTIAL_SLACK_MS:g} ms",
                         unit="ms"))
        if pa.get("n"):
            rows.append(_row("partial hits identical to uncached", w, _ratio(pa.get("identical"), pa.get("n")), 1.0,
                             f"{pa.get('identical')} of {pa.get('n')}", unit="share", at_least=True))
        npf = f.get("new_process")
        if npf:
            m = new_process_figures(npf)
            k = len(npf.get("warm") or [])
            rows.append(_row("new process: first exact hit TTFT / warm hit TTFT", w,
                             _ratio(m["warm_ttft_ms"], m["warm_hit_ttft_ms"]), NEW_PROCESS_OVER_WARM,
                             f"medians over {k} prompts, `edgesync generate`, default settings"))
            rss_limit = None if m["uncached_rss_bytes"] is None else (m["uncached_rss_bytes"] + RSS_SLACK_BYTES) / 1e6
            rows.append(_row("new process: peak RSS (MB) / uncached + 64 MB", w,
                             None if m["warm_rss_bytes"] is None else m["warm_rss_bytes"] / 1e6, rss_limit,
                             "ru_maxrss of the child (os.wait4)", unit="MB"))
            rows.append(_row("new process: wall time / uncached wall time", w,
                             _ratio(m["warm_wall_s"], m["uncached_wall_s"]), WALL_OVER_UNCACHED,
                             "start to exit, interpreter and model load included"))
    return rows


def group_profile(entries: Iterable[tuple[str, str, float]], n_hits: int, total_ms: float) -> dict[str, float]:
    """ms per hit of each :data:`PROFILE_GROUPS` step, ``other`` (the rest of ``total_ms``) and
    ``total``.

    Args:
        entries: ``(file path, function name, cumulative seconds)`` of every profiled function
            (``pstats.Stats(...).stats`` gives ``(file, line, name) -> (cc, nc, tt, ct, callers)``).
        n_hits: how many hits the profile covers (>= 1).
        total_ms: their total wall time under the profiler.

    Raises:
        ValueError: ``n_hits`` < 1.
    """
    if n_hits < 1:
        raise ValueError(f"n_hits: must be >= 1, got {n_hits}")
    sums = {name: 0.0 for name, _ in PROFILE_GROUPS}
    wanted = {pat: name for name, pats in PROFILE_GROUPS for pat in pats}
    for path, func, cum_s in entries:
        name = wanted.get((os.path.basename(path), func))
        if name is not None:
            sums[name] += cum_s * 1000
    out = {name: ms / n_hits for name, ms in sums.items()}
    out["other"] = max(total_ms - sum(sums.values()), 0.0) / n_hits
    out["total"] = total_ms / n_hits
    return out


def _mb(b: float | None) -> float | None:
    return None if b is None else b / 1e6


def _fmt(v, spec: str = "{:.1f}") -> str:
    return "-" if v is None else spec.format(v)


def figures_table(fig: Mapping[str, Mapping[str, Any]]) -> str:
    """A plain-text table of the main figures, one row per workload."""
    head = (f"{'workload':<9}{'prompts':>8}{'tokens p50':>11}{'exact p50/p95':>16}{'floor p50/p95':>16}"
            f"{'exact/floor':>12}{'partial p50':>12}{'bound p50':>10}{'uncov. tok':>11}{'prefill ms':>11}"
            f"{'store-back ms':>14}{'KB/new prompt':>14}")
    lines = [head, "-" * len(head)]
    for w, f in fig.items():
        ex, fl, pa, sb = (f.get(k) or {} for k in ("exact", "floor", "partial", "store_back"))
        lines.append(
            f"{w:<9}{f.get('prompts', 0):>8}{_fmt(p50(f.get('prompt_tokens') or []), '{:.0f}'):>11}"
            f"{_fmt(p50(ex.get('ttft_ms') or [])) + ' / ' + _fmt(p95(ex.get('ttft_ms') or [])):>16}"
            f"{_fmt(p50(fl.get('ms') or [])) + ' / ' + _fmt(p95(fl.get('ms') or [])):>16}"
            f"{_fmt(_ratio(p50(ex.get('ttft_ms') or []), p50(fl.get('ms') or [])), '{:.2f}x'):>12}"
            f"{_fmt(p50(pa.get('ttft_ms') or [])):>12}{_fmt(partial_bound_ms(pa)):>10}"
            f"{_fmt(p50(pa.get('uncovered_tokens') or []), '{:.0f}'):>11}"
            f"{_fmt(p50(pa.get('uncovered_prefill_ms') or [])):>11}"
            f"{_fmt(p50(sb.get('ms') or [])):>14}"
            f"{_fmt(None if not sb.get('bytes') else sum(sb['bytes']) / len(sb['bytes']) / 1e3, '{:.0f}'):>14}")
    return "\n".join(lines)


def process_table(fig: Mapping[str, Mapping[str, Any]]) -> str:
    """A plain-text table of the new-process runs (medians over the prompts)."""
    head = (f"{'workload':<9}{'runs':>5}{'TTFT warm ms':>13}{'warm hit ms':>12}{'RSS warm MB':>12}"
            f"{'RSS uncached MB':>16}{'wall warm s':>12}{'wall uncached s':>16}")
    lines = [head, "-" * len(head)]
    for w, f in fig.items():
        if not f.get("new_process"):
            continue
        m = new_process_figures(f["new_process"])
        lines.append(f"{w:<9}{len(f['new_process'].get('warm') or []):>5}{_fmt(m['warm_ttft_ms']):>13}"
                     f"{_fmt(m['warm_hit_ttft_ms']):>12}{_fmt(_mb(m['warm_rss_bytes']), '{:.0f}'):>12}"
                     f"{_fmt(_mb(m['uncached_rss_bytes']), '{:.0f}'):>16}{_fmt(m['warm_wall_s'], '{:.2f}'):>12}"
                     f"{_fmt(m['uncached_wall_s'], '{:.2f}'):>16}")
    return "\n".join(lines)


def verdict_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text table of :func:`verdicts`."""
    head = f"{'criterion':<62}{'workload':<9}{'this run':>10}{'limit':>14}{'met':>5}"
    lines = [head, "-" * len(head)]
    for r in rows:
        spec = "{:.3f}" if r["unit"] in ("x", "share") else "{:.1f}"
        met = "n/a" if r["met"] is None else ("yes" if r["met"] else "NO")
        lines.append(f"{r['criterion']:<62}{r['workload']:<9}{_fmt(r['value'], spec):>10}"
                     f"{r['op'] + ' ' + _fmt(r['limit'], spec):>14}{met:>5}")
    return "\n".join(lines)


def profile_table(groups: Mapping[str, Mapping[str, float]]) -> str:
    """A plain-text table of :func:`group_profile` results by workload (ms per exact hit)."""
    names = [name for name, _ in PROFILE_GROUPS] + ["other", "total"]
    head = f"{'workload':<9}" + "".join(f"{n:>{max(len(n) + 2, 9)}}" for n in names)
    lines = [head, "-" * len(head)]
    for w, g in groups.items():
        lines.append(f"{w:<9}" + "".join(f"{_fmt(g.get(n), '{:.2f}'):>{max(len(n) + 2, 9)}}" for n in names))
    return "\n".join(lines)


def render(fig: Mapping[str, Mapping[str, Any]], rows: Sequence[Mapping[str, Any]],
           profile: Mapping[str, Mapping[str, float]] | None = None) -> str:
    """Everything ``floor.py`` prints: figures, new-process runs, verdicts and the profile."""
    parts = ["Exact and partial hits against the floor (ms; one process, one run)", "", figures_table(fig), "",
             "New process (`edgesync generate`, default settings): warm store (exact hit) vs uncached", "",
             process_table(fig), "", "Issue 17 acceptance (ratios from this run)", "", verdict_table(rows), ""]
    if profile:
        parts += ["Profile of an exact hit (cProfile, ms per hit, max_tokens 1; the profiler adds overhead)", "",
                  profile_table(profile), ""]
    return "\n".join(parts)
