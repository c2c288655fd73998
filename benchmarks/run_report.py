"""Summary and table of ``edgesync run``: the uncached pass against the EdgeSync pass.

Pure functions over per-request records (no engine, no printing). A record is the dict
:func:`request_record` builds: ``request_id``, ``prompt_key``, ``group`` and the two results
(``GenerationResult.to_dict()``) under ``"uncached"`` and ``"edgesync"``.

A *repeat* is a request whose ``prompt_key`` appeared earlier in the same list of records; the
others are *first-seen*. Times are milliseconds, sizes bytes, shares fractions in [0, 1].
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from edgesync_store.commands.units import format_bytes

PASSES = ("uncached", "edgesync")
HIT_KINDS = ("exact", "partial", "miss")


def request_record(request, uncached, edgesync) -> dict[str, Any]:
    """One record from a workload ``Request`` and its two ``GenerationResult``s."""
    return {
        "request_id": request.request_id,
        "prompt_key": request.prompt_key,
        "group": request.group,
        "uncached": uncached.to_dict(),
        "edgesync": edgesync.to_dict(),
    }


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def _repeat_flags(records: Sequence[dict]) -> list[bool]:
    seen: set[str] = set()
    flags = []
    for rec in records:
        flags.append(rec["prompt_key"] in seen)
        seen.add(rec["prompt_key"])
    return flags


def _pass_summary(records: Sequence[dict], name: str, repeats: list[bool]) -> dict[str, Any]:
    results = [rec[name] for rec in records]
    ttft = [r["ttft_ms"] for r in results]
    prompt = sum(r["prompt_tokens"] for r in results)
    reused = sum(r["tokens_reused"] for r in results)
    first = [t for t, rep in zip(ttft, repeats) if not rep]
    again = [t for t, rep in zip(ttft, repeats) if rep]
    identical = None
    if name != "uncached" and records:
        identical = sum(rec[name]["tokens"] == rec["uncached"]["tokens"] for rec in records) / len(records)
    return {
        "requests": len(results),
        "hits": {kind: sum(r["hit"] == kind for r in results) for kind in HIT_KINDS},
        "ttft_ms": {
            "p50": float(np.percentile(ttft, 50)) if ttft else None,
            "p95": float(np.percentile(ttft, 95)) if ttft else None,
            "mean": _mean(ttft),
        },
        "first_seen": len(first),
        "repeats": len(again),
        "ttft_first_seen_mean_ms": _mean(first),
        "ttft_repeat_mean_ms": _mean(again),
        "total_ms_mean": _mean([r["total_ms"] for r in results]),
        "prompt_tokens": prompt,
        "tokens_reused": reused,
        "reuse_share": reused / prompt if prompt else 0.0,
        "tokens_prefilled": sum(r["tokens_prefilled"] for r in results),
        "bytes_read": sum(r["bytes_read"] for r in results),
        "generated_tokens": sum(len(r["tokens"]) for r in results),
        "identical_share": identical,
        "fragments_written": sum(r.get("fragments_written", 0) for r in results),
        "approximate": sum(bool(r.get("approximate")) for r in results),
        "semantic_lookups": len(lookups := [r["lookup_ms"] for r in results if r.get("lookup_ms") is not None]),
        "lookup_ms_mean": _mean(lookups),
        "donor_nominated": sum(r.get("donor") is not None for r in results),
        **_convertible_summary(records, name),
    }


def _agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Share of ``b``'s generated tokens that ``a`` reproduces before their first difference
    (1.0 for equal lists; two empty lists agree)."""
    same = 0
    for x, y in zip(a, b):
        if x != y:
            break
        same += 1
    longest = max(len(a), len(b))
    return same / longest if longest else 1.0


def _convertible_summary(records: Sequence[dict], name: str) -> dict[str, Any]:
    """Cross-engine hits of a pass (``convertible`` results: KV another engine wrote, converted)
    and how their outputs agree with the uncached ones: identical lists, same first token, and
    the mean :func:`_agreement`."""
    conv = [rec for rec in records if rec[name].get("convertible")]
    if not conv:
        return {"convertible": 0, "convertible_identical_share": None, "convertible_first_token_share": None,
                "convertible_agreement_mean": None}
    pairs = [(rec[name]["tokens"], rec["uncached"]["tokens"]) for rec in conv]
    return {
        "convertible": len(conv),
        "convertible_identical_share": sum(a == b for a, b in pairs) / len(pairs),
        "convertible_first_token_share": sum(a[:1] == b[:1] for a, b in pairs) / len(pairs),
        "convertible_agreement_mean": _mean([_agreement(a, b) for a, b in pairs]),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(records: Sequence[dict]) -> dict[str, Any]:
    """Per-pass summary of a run.

    Returns ``{"n_requests", "uncached": {...}, "edgesync": {...}, "ttft_ratio": {...}}``. Each
    pass has ``requests``, ``hits`` (exact/partial/miss), ``ttft_ms`` (p50/p95/mean,
    ``np.percentile``), ``first_seen``/``repeats`` counts and their TTFT means, ``total_ms_mean``,
    prompt-token totals (``prompt_tokens``, ``tokens_reused``, ``tokens_prefilled``),
    ``reuse_share``, ``bytes_read``, ``generated_tokens``, ``fragments_written`` and
    ``identical_share`` (requests whose generated token list equals the uncached one; None for
    the uncached pass itself), ``approximate`` (answers served from another prompt's KV),
    ``semantic_lookups`` and ``lookup_ms_mean`` (requests that ran the semantic lookup and its
    mean cost), ``donor_nominated`` (requests whose injected prefix a nominated donor reached),
    ``convertible`` (cross-engine hits: another engine's KV, converted) with the share of them
    whose output is identical to the uncached one, whose first token is, and the mean share of
    generated tokens equal before the first difference. ``ttft_ratio`` is edgesync / uncached
    for p50, p95, mean, first_seen and repeat.
    """
    repeats = _repeat_flags(records)
    out: dict[str, Any] = {"n_requests": len(records)}
    for name in PASSES:
        out[name] = _pass_summary(records, name, repeats)
    u, e = out["uncached"], out["edgesync"]
    out["ttft_ratio"] = {
        **{k: _ratio(e["ttft_ms"][k], u["ttft_ms"][k]) for k in ("p50", "p95", "mean")},
        "first_seen": _ratio(e["ttft_first_seen_mean_ms"], u["ttft_first_seen_mean_ms"]),
        "repeat": _ratio(e["ttft_repeat_mean_ms"], u["ttft_repeat_mean_ms"]),
    }
    return out


def request_rows(records: Sequence[dict]) -> list[dict[str, Any]]:
    """One JSON-able row per request (the EdgeSync pass's hit kind and reuse, both passes' TTFT)."""
    rows = []
    for rec, repeat in zip(records, _repeat_flags(records)):
        e, u = rec["edgesync"], rec["uncached"]
        rows.append({
            "request_id": rec["request_id"],
            "prompt_key": rec["prompt_key"],
            "repeat": repeat,
            "hit": e["hit"],
            "prompt_tokens": e["prompt_tokens"],
            "tokens_reused": e["tokens_reused"],
            "tokens_prefilled": e["tokens_prefilled"],
            "bytes_read": e["bytes_read"],
            "ttft_ms_uncached": u["ttft_ms"],
            "ttft_ms_edgesync": e["ttft_ms"],
            "identical": e["tokens"] == u["tokens"],
            "similarity": e.get("similarity"),
            "approximate": bool(e.get("approximate")),
            "convertible": bool(e.get("convertible")),
            "source_engine": e.get("source_engine"),
        })
    return rows


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def render_table(summary: dict[str, Any], store_stats: dict[str, Any] | None = None, title: str | None = None,
                 uncached_reason: str | None = None):
    """A rich Table of :func:`summarize`'s output: metric, uncached, edgesync, ratio.

    ``store_stats`` is ``FragmentStore.stats().to_dict()`` after the run (None: no store; with
    the shared remote tier it holds ``remote``, ``TieredStore.remote_stats()``, shown in five rows);
    ``uncached_reason`` why the EdgeSync pass ran without its store (``EdgeSync.uncached_reason``).
    """
    from rich.table import Table

    u, e, r = summary["uncached"], summary["edgesync"], summary["ttft_ratio"]
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("uncached", justify="right")
    table.add_column("edgesync", justify="right")
    table.add_column("ratio", justify="right")

    def hits(p: dict) -> str:
        return " / ".join(str(p["hits"][t]) for t in HIT_KINDS)

    table.add_row("requests", str(u["requests"]), str(e["requests"]), "")
    table.add_row("hits exact / partial / miss", hits(u), hits(e), "")
    for key in ("p50", "p95", "mean"):
        table.add_row(f"TTFT {key} (ms)", _ms(u["ttft_ms"][key]), _ms(e["ttft_ms"][key]), _x(r[key]))
    table.add_row(f"TTFT first-seen prompts, mean (ms, n={e['first_seen']})",
                  _ms(u["ttft_first_seen_mean_ms"]), _ms(e["ttft_first_seen_mean_ms"]), _x(r["first_seen"]))
    table.add_row(f"TTFT repeats, mean (ms, n={e['repeats']})",
                  _ms(u["ttft_repeat_mean_ms"]), _ms(e["ttft_repeat_mean_ms"]), _x(r["repeat"]))
    table.add_row("prompt tokens reused (share)", _pct(u["reuse_share"]), _pct(e["reuse_share"]), "")
    table.add_row("prompt tokens prefilled (total)", f"{u['tokens_prefilled']:,}", f"{e['tokens_prefilled']:,}", "")
    table.add_row("bytes read from store", "-", format_bytes(e["bytes_read"]), "")
    table.add_row("identical outputs vs uncached", "-", _pct(e["identical_share"]), "")
    table.add_row("fragments written", "-", f"{e['fragments_written']:,}", "")
    table.add_row("semantic lookups (mean ms)", "-", f"{e['semantic_lookups']:,} ({_ms(e['lookup_ms_mean'])})", "")
    table.add_row("nominated donor reached the prefix", "-", f"{e['donor_nominated']:,}", "")
    if e["approximate"]:
        table.add_row("APPROXIMATE answers (another prompt's KV)", "-", f"{e['approximate']:,}", "")
    if e["convertible"]:
        table.add_row("CROSS-ENGINE hits (another engine's KV, converted)", "-", f"{e['convertible']:,}", "")
        table.add_row("  of those: identical outputs vs uncached", "-", _pct(e["convertible_identical_share"]), "")
        table.add_row("  of those: same first token", "-", _pct(e["convertible_first_token_share"]), "")
        table.add_row("  of those: tokens equal before the first difference", "-",
                      _pct(e["convertible_agreement_mean"]), "")
    if store_stats is not None:
        table.add_row("store fragments (after run)", "-", f"{store_stats['fragments']:,}", "")
        table.add_row("store bytes on disk (after run)", "-", format_bytes(store_stats["disk_bytes"]), "")
        _remote_rows(table, store_stats.get("remote"))
    elif uncached_reason:
        table.add_row("store", "-", f"UNCACHED: {uncached_reason}", "")
    else:
        table.add_row("store", "-", "disabled", "")
    return table


def _remote_rows(table, remote: dict | None) -> None:
    """The shared remote tier's rows (``TieredStore.remote_stats()``), when the run had one."""
    if not remote:
        return
    table.add_row("remote tier: walks (reached further / chain split across both tiers)", "-",
                  f"{remote['walks']:,} ({remote['walk_gains']:,} / {remote['walk_splits']:,})", "")
    table.add_row("remote tier: fragments fetched (bytes)", "-",
                  f"{remote['hits']:,} ({format_bytes(remote['bytes_fetched'])})", "")
    table.add_row("remote tier: fragments written (bytes)", "-",
                  f"{remote['puts']:,} ({format_bytes(remote['bytes_written'])})", "")
    table.add_row("remote tier: errors (timeout / connection / OOM / other)", "-",
                  f"{remote['errors']:,} ({remote['timeout']} / {remote['connection']} / {remote['oom']} / "
                  f"{remote['other']})", "")
    table.add_row("remote tier: corrupt refused, unusable values, queue drops, calls skipped", "-",
                  f"{remote['corrupt']:,}, {remote.get('bad_values', 0):,}, {remote['queue_drops']:,}, "
                  f"{remote['skipped']:,}", "")
