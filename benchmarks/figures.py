"""The figures of the benchmark report, computed from per-request records.

Input: the records the runner writes (one dict per answered request; fields in
:mod:`edgesync_bench.runner`), plus each system's end-of-run ``stats`` (``edgesync_bench.worker``).
Everything here is pure Python over those dicts; units: ms, bytes, seconds.

Per system and workload (:func:`summarize`):

* ``n``; TTFT ``p50`` / ``p95`` / ``mean`` (ms), and the same for ``first_seen`` prompts (the
  first time this system's process saw the prompt) and for ``repeats``;
* ``hits``: requests by hit kind (``exact``, ``partial``, ``miss``) and ``hit_rate`` (exact +
  partial over all), ``by_source`` (store, cache, context, answer);
* ``exact_hit_ttft_ms`` / ``hit_ttft_ms``: mean TTFT of exact hits / of any hit;
* ``not_prefilled_share``: prompt tokens not prefilled over all prompt tokens;
* ``bytes_read`` total and per request (what reuse read from the store or cache);
* ``cpu_s_per_request`` (user + sys of the worker) and ``peak_rss_bytes``;
* ``identity``: share of requests whose generated tokens equal no cache's for the same request
  (matched by ``request_id``; on seed and doc-QA, where equal ``prompt_key`` means equal
  messages, a request no cache did not run is matched with no cache's answer to the same
  prompt: no cache clears its KV before every request, so its greedy answer depends on the
  prompt alone), over the requests that have a reference; ``identity_n`` how many;
* storage (:func:`storage_figures`): bytes per cached prompt on disk (EdgeSync: the store
  directory's allocated bytes over the distinct prompts it cached; LlamaDiskCache: its
  directory over its entries) and RAM (LlamaRAMCache), against the raw f16 KV of a cached
  prompt (its prompt tokens minus the last, which is never stored, times the model's
  ``kv_bytes_per_token``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable, Sequence

HIT_KINDS = ("exact", "partial", "miss")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default); None for no
    values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ttft(records: Sequence[dict]) -> dict:
    xs = [r["ttft_ms"] for r in records]
    return {"n": len(xs), "p50": percentile(xs, 50), "p95": percentile(xs, 95), "mean": _mean(xs)}


def group_records(records: Iterable[dict]) -> dict[tuple[str, str], list[dict]]:
    """Records by (workload, system), each list in request order."""
    out: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        out[(r["workload"], r["system"])].append(r)
    for rs in out.values():
        rs.sort(key=lambda r: r["index"])
    return dict(out)


def identity_against(records: Sequence[dict], reference: Sequence[dict],
                     by_prompt: bool = False) -> tuple[float | None, int]:
    """(share of ``records`` whose ``tokens`` equal the reference's for the same ``request_id``,
    how many were compared). With ``by_prompt``, a request the reference did not run is
    compared with the reference's first answer to the same ``prompt_key``; otherwise (and when
    the reference never answered that prompt) it is left out."""
    ref = {r["request_id"]: r["tokens"] for r in reference}
    by_key: dict[str, list] = {}
    if by_prompt:
        for r in reference:
            by_key.setdefault(r["prompt_key"], r["tokens"])
    pairs = []
    for r in records:
        want = ref.get(r["request_id"])
        if want is None:
            want = by_key.get(r["prompt_key"])
        if want is not None:
            pairs.append((r["tokens"], want))
    if not pairs:
        return None, 0
    return sum(a == b for a, b in pairs) / len(pairs), len(pairs)


def same_requests(records: Sequence[dict], reference: Sequence[dict]) -> list[dict]:
    """The ``records`` whose ``request_id`` the reference ran too, in order."""
    ids = {r["request_id"] for r in reference}
    return [r for r in records if r["request_id"] in ids]


def summarize(records: Sequence[dict], reference: Sequence[dict] | None = None,
              by_prompt: bool = False) -> dict[str, Any]:
    """Figures of one system on one workload (see the module docstring). ``reference``: no
    cache's records of the same workload, for ``identity`` (``by_prompt``: see
    :func:`identity_against`)."""
    first = [r for r in records if r["first_seen"]]
    repeats = [r for r in records if not r["first_seen"]]
    hits = {t: sum((r["hit"] or "miss") == t for r in records) for t in HIT_KINDS}
    sources: dict[str, int] = defaultdict(int)
    for r in records:
        if r.get("source"):
            sources[r["source"]] += 1
    prompt = sum(r["prompt_tokens"] for r in records)
    reused = sum(r["tokens_reused"] for r in records)
    exact = [r["ttft_ms"] for r in records if r["hit"] == "exact"]
    anyhit = [r["ttft_ms"] for r in records if r["hit"] in ("exact", "partial")]
    lookups = [r["lookup_ms"] for r in records if r.get("lookup_ms") is not None]
    out: dict[str, Any] = {
        "n": len(records),
        "ttft_ms": _ttft(records),
        "first_seen_ttft_ms": _ttft(first),
        "repeat_ttft_ms": _ttft(repeats),
        "hits": hits,
        "hit_rate": (hits["exact"] + hits["partial"]) / len(records) if records else None,
        "by_source": dict(sources),
        "exact_hit_ttft_ms": _mean(exact),
        "exact_hits": len(exact),
        "hit_ttft_ms": _mean(anyhit),
        "hit_ttft_ms_by_source": {src: _mean([r["ttft_ms"] for r in records
                                              if r["hit"] in ("exact", "partial") and r.get("source") == src])
                                  for src in sorted({r.get("source") for r in records if r["hit"]} - {None})},
        "not_prefilled_share": reused / prompt if prompt else None,
        "prompt_tokens": prompt,
        "tokens_reused": reused,
        "bytes_read": sum(r["bytes_read"] for r in records),
        "bytes_read_per_request": _mean([r["bytes_read"] for r in records]),
        "cpu_s_per_request": _mean([r["cpu_s"] for r in records]),
        "peak_rss_bytes": max((r["rss_peak_bytes"] for r in records), default=None),
        "semantic_lookups": len(lookups),
        "lookup_ms_mean": _mean(lookups),
        "total_ms_mean": _mean([r["total_ms"] for r in records]),
        "wall_s": sum(r["total_ms"] for r in records) / 1000.0,
    }
    if reference is not None:
        out["identity"], out["identity_n"] = identity_against(records, reference, by_prompt)
    return out


def storage_figures(records: Sequence[dict], stats: dict | None) -> dict[str, Any]:
    """Bytes per cached prompt and against raw f16 KV, for one system and workload.

    ``cached_prompts``: distinct ``prompt_key`` answered (EdgeSync stores every answered
    prompt's chunks; the naive cache every answer) or, for llama-cpp-python's caches, the
    entries they hold at the end. ``raw_f16_kv_per_prompt``: mean over the distinct prompts of
    (prompt tokens - 1) x ``kv_bytes_per_token``. ``disk_bytes_per_prompt`` /
    ``ram_bytes_per_prompt`` and ``vs_raw_f16`` (their ratio to the raw KV; below 1 is smaller).
    For EdgeSync also ``fragment_compression``: stored (raw or zstd) over raw bytes of the fragments
    themselves, i.e. what compression alone gives before prefix sharing.
    """
    if not stats or not records:
        return {}
    bpt = stats.get("kv_bytes_per_token")
    prompts: dict[str, int] = {}
    for r in records:
        prompts.setdefault(r["prompt_key"], r["prompt_tokens"])
    raw = _mean([(n - 1) * bpt for n in prompts.values()]) if bpt else None
    out: dict[str, Any] = {"raw_f16_kv_per_prompt": raw, "distinct_prompts": len(prompts)}
    if "store_disk_bytes" in stats:
        n = len(prompts)
        out.update(cached_prompts=n, disk_bytes=stats["store_disk_bytes"],
                   disk_bytes_per_prompt=stats["store_disk_bytes"] / n if n else None)
        st = stats.get("store") or {}
        if st.get("raw_bytes"):
            out["fragment_compression"] = st["compressed_bytes"] / st["raw_bytes"]
            out["stored_fragments"] = st.get("fragments")
            out["stored_compressed_bytes"] = st["compressed_bytes"]
            out["stored_raw_bytes"] = st["raw_bytes"]
    elif "cache_disk_bytes" in stats:
        n = stats.get("cache_entries") or 0
        out.update(cached_prompts=n, disk_bytes=stats["cache_disk_bytes"],
                   disk_bytes_per_prompt=stats["cache_disk_bytes"] / n if n else None)
    elif "cache_bytes" in stats:
        n = stats.get("cache_entries") or 0
        # LlamaRAMCache.cache_size counts llama_state_size only, not the entry's scores array
        # (n_tokens x n_vocab float32), so it understates the RAM by about 10x: prefer the
        # entries' full size, else the mean size of the entries the cache loaded
        loaded = [r["bytes_read"] for r in records if r.get("source") == "cache" and r["bytes_read"]]
        if stats.get("cache_entry_bytes"):
            ram, how = stats["cache_entry_bytes"], "entries' state + scores + input ids"
        elif loaded and n:
            ram, how = n * sum(loaded) / len(loaded), "entries x mean size of a loaded entry"
        else:
            ram, how = stats["cache_bytes"], "llama-cpp-python cache_size (state only)"
        out.update(cached_prompts=n, ram_bytes=ram, ram_bytes_how=how, cache_size_reported=stats["cache_bytes"],
                   ram_bytes_per_prompt=ram / n if n else None)
    per = out.get("disk_bytes_per_prompt") or out.get("ram_bytes_per_prompt")
    out["vs_raw_f16"] = per / raw if per is not None and raw else None
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; None when either is missing or ``b`` is 0."""
    if a is None or b in (None, 0):
        return None
    return a / b


def targets(summaries: dict[tuple[str, str], dict], storage: dict[tuple[str, str], dict],
            groups: dict[tuple[str, str], list[dict]] | None = None) -> list[dict]:
    """The benchmark's targets on the seed workload, each a ratio from this run: rows of ``target``,
    ``value`` (the ratio), ``limit``, ``met`` (None when a figure is missing), ``how`` and
    ``requests`` (how many of EdgeSync's requests the ratio is over).

    With ``groups`` (:func:`group_records`) every TTFT ratio is over comparable requests: cold
    EdgeSync's records restricted to the requests no cache ran (the first 300 of its 1,000 in
    a full run), and for the exact-hit target to those LlamaDiskCache ran. Without it, over each
    system's summary as given."""
    def get(system: str) -> dict:
        return summaries.get(("seed", system), {})

    es, nc, disk = get("edgesync"), get("no-cache"), get("llama-disk")
    es_nc, es_disk = es, es
    if groups is not None and groups.get(("seed", "edgesync")):
        recs = groups[("seed", "edgesync")]
        if groups.get(("seed", "no-cache")):
            es_nc = summarize(same_requests(recs, groups[("seed", "no-cache")]))
        if groups.get(("seed", "llama-disk")):
            es_disk = summarize(same_requests(recs, groups[("seed", "llama-disk")]))
    n_nc, n_disk = es_nc.get("n"), es_disk.get("n")
    rows = [
        ("EdgeSync mean TTFT / no cache mean TTFT", ratio((es_nc.get("ttft_ms") or {}).get("mean"),
                                                          (nc.get("ttft_ms") or {}).get("mean")), 1 / 5,
         f"cold EdgeSync and no cache over the same {n_nc} seed requests (the ones no cache ran)", n_nc),
        ("EdgeSync first-seen TTFT / no cache TTFT (mean)",
         ratio((es_nc.get("first_seen_ttft_ms") or {}).get("mean"), (nc.get("ttft_ms") or {}).get("mean")), 1 / 3,
         f"prompts EdgeSync's process had not seen before among those {n_nc} requests "
         f"({(es_nc.get('first_seen_ttft_ms') or {}).get('n')}), against every no-cache request", n_nc),
        ("EdgeSync exact-hit TTFT / LlamaDiskCache hit TTFT (mean)",
         ratio(es_disk.get("exact_hit_ttft_ms"), disk.get("hit_ttft_ms")), 1 / 3,
         f"EdgeSync's exact hits ({es_disk.get('exact_hits')}) among the {n_disk} requests LlamaDiskCache ran; "
         "LlamaDiskCache: mean TTFT of every request it served with >= 64 reused tokens, whatever the "
         "source (in one process its hits come from the live context: it pops each entry it looks up)", n_disk),
        ("EdgeSync bytes on disk per cached prompt / raw f16 KV",
         (storage.get(("seed", "edgesync")) or {}).get("vs_raw_f16"), 1 / 2,
         f"store directory's allocated bytes over distinct cached prompts (all {es.get('n')} requests)", es.get("n")),
    ]
    return [{"target": t, "value": v, "limit": lim, "met": None if v is None else v <= lim, "how": how,
             "requests": n}
            for t, v, lim, how, n in rows]
