"""A simulated device profile: the seed design's constants applied to our request stream and our
router's decisions.

The seed design (the published EdgeSync proposal this project implements) gives a table measured
on a Snapdragon 685 together with the per-operation constants it says produced it
(:class:`SeedConstants`). This module applies those constants to the *same request stream* we
ran (the ``seed`` workload of :mod:`edgesync_bench.bench_workloads`) and to the *decisions our
systems actually made* (``prompt_tokens``, ``tokens_reused``, ``hit``, ``source`` and
``lookup_ms`` of each record in ``results/<run>/requests.jsonl``; the record format is in
``benchmarks/runner.py``), and prints the result beside the seed design's published table
(:data:`SEED_TABLE`), so a reader sees whether its figures follow from its constants.
:func:`consistency_checks` also tests the published table against its own constants, with no
request stream at all.

Nothing here is measured: every millisecond is a constant times a count taken from a record.
The records' own ``ttft_ms`` are not used. Units: times in milliseconds (ms); sizes in MB =
10^6 bytes (the seed design says "about 6 MB per fragment" without saying which MB; this module reads
it as 10^6 bytes, so one token of KV is 6e6 / 128 = 46,875 bytes).

The per-request model (:func:`simulated_ttft`)::

    TTFT = prefill_ms_per_token * (prompt_tokens - tokens_reused)   # the part not reused
         + decode_ms_per_token                                      # the first token (1 step)
         + hnsw_search_ms          if the record ran a semantic lookup (lookup_ms not null)
         + inject_ms_per_mb * injected_MB,
    injected_MB = tokens_reused / fragment_tokens * fragment_mb     # 6 MB per 128-token fragment

One decode step is counted because time to *first token* includes producing that token: after
the prefill, the model still runs one forward step to sample it (the seed design's 18.4 ms/token).

A naive-string hit (``source == "answer"``: the stored answer is returned, no model runs) is
simulated as :data:`NAIVE_HIT_MS` = 0 ms: no prefill, no decode (the first token is stored), no
injection (no KV is restored), and no HNSW search (an exact-text lookup is a hash-table probe;
the seed design gives no constant for it and it is microseconds, against milliseconds for everything
else). Its TTFT is therefore a lower bound.

Tokens reused from llama-cpp-python's live context (``source == "context"``) are not injected
(they are already in place): no injection cost. Any other reuse (``"store"``, ``"cache"``) is.

Memory traffic (the seed design's "memory bandwidth" column is not defined there; this module
reports two explicit readings, both relative to no cache on the *same* requests, i.e. to
prefilling every prompt token of the system's own records):

* ``prefill_work_pct``: prompt tokens prefilled / all prompt tokens x 100 (compute work, and
  the weight and activation traffic that goes with it);
* ``kv_traffic_pct``: (KV bytes written by prefill + KV bytes injected from a store or cache) /
  (KV bytes no cache writes) x 100, with the seed design's 46,875 bytes of KV per token for both. An
  injected token moves as many KV bytes as prefilling it writes, so reuse does not lower this
  one; only a naive-string hit (nothing computed, nothing moved) does.

The first token's decode writes the same KV for every system that runs the model and is left
out of both. Energy is **not simulated**: the seed design gives no energy constant (per token, per MB
or per second), so any mAh figure would be invented; the output says "not simulated".
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

log = logging.getLogger(__name__)

MB = 1_000_000
"""Bytes in one MB as this module uses it (10^6, not MiB)."""

NAIVE_HIT_MS = 0.0
"""Simulated TTFT of a naive-string hit, ms (see the module docstring for why 0)."""

SIM_SYSTEMS = ("no-cache", "naive-string", "edgesync")
"""Systems :func:`simulate` profiles by default (``edgesync`` = the cold, first process)."""

SEED_ROW_FOR_SYSTEM = {"no-cache": "no cache", "naive-string": "naive string cache",
                       "edgesync": "fragment cache"}
"""Which published seed row each of our systems is compared with."""


@dataclass(frozen=True)
class SeedConstants:
    """The seed design's per-operation constants (its claims; not measured here).

    Source: the seed design's claims: "prefill
    6.8 ms/token, decode 18.4 ms/token, HNSW search 3.2 ms, injection 0.029 ms/MB, about 6 MB
    per fragment (128 tokens, 12 layers, Q4_K_M)", on a Snapdragon 685.

    Attributes:
        prefill_ms_per_token: ms to prefill one prompt token.
        decode_ms_per_token: ms for one decode step (one generated token).
        hnsw_search_ms: ms for one HNSW nearest-neighbour search.
        inject_ms_per_mb: ms to inject one MB (10^6 bytes) of KV into the model's cache.
        fragment_mb: MB (10^6 bytes) of KV per fragment.
        fragment_tokens: tokens per fragment.
    """

    prefill_ms_per_token: float = 6.8
    decode_ms_per_token: float = 18.4
    hnsw_search_ms: float = 3.2
    inject_ms_per_mb: float = 0.029
    fragment_mb: float = 6.0
    fragment_tokens: int = 128

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of KV per token implied by the fragment size (6e6 / 128 = 46,875)."""
        return self.fragment_mb * MB / self.fragment_tokens

    def injected_mb(self, tokens: float) -> float:
        """MB (10^6 bytes) of KV injected to reuse ``tokens`` tokens."""
        return tokens / self.fragment_tokens * self.fragment_mb


SEED = SeedConstants()
"""The seed design's constants."""


@dataclass(frozen=True)
class SeedRow:
    """One row of the seed design's published table.

    Attributes:
        system: the seed design's name for the system.
        ttft_ms: mean time to first token, ms (the seed writes "~1,800").
        hit_rate: fraction of requests that hit, 0..1.
        memory_bandwidth_pct: memory bandwidth relative to no cache, percent (undefined by the seed design).
        energy_mah: energy for the 1,000 requests, mAh.
    """

    system: str
    ttft_ms: float
    hit_rate: float
    memory_bandwidth_pct: float
    energy_mah: float


SEED_TABLE: tuple[SeedRow, ...] = (
    SeedRow("no cache", 1800.0, 0.0, 100.0, 253.0),
    SeedRow("naive string cache", 1600.0, 0.12, 88.0, 222.0),
    SeedRow("fragment cache", 350.0, 0.70, 35.0, 88.0),
)
"""The seed design's published table (Snapdragon 685, 1,000 requests over 8 clusters x 64 prompts x 4
variants), as published."""


@dataclass(frozen=True)
class SeedWorkloadShape:
    """The seed design's description of its workload: requests drawn over clusters x prompts x variants."""

    clusters: int = 8
    prompts_per_cluster: int = 64
    variants: int = 4
    requests: int = 1000


SEED_WORKLOAD = SeedWorkloadShape()
"""The seed design's workload as it describes it."""


def _seed_row(name: str, table: Sequence[SeedRow]) -> SeedRow:
    for row in table:
        if row.system == name:
            return row
    raise KeyError(f"no seed row named {name!r}")


def _lookup_ms(record: Mapping) -> float | None:
    """The record's semantic-lookup time (top level, else ``detail["lookup_ms"]``), or None."""
    value = record.get("lookup_ms")
    if value is None:
        value = (record.get("detail") or {}).get("lookup_ms")
    return value


def simulated_ttft(record: Mapping, constants: SeedConstants = SEED) -> dict:
    """The simulated TTFT of one request and its parts, from the record's decisions.

    Args:
        record: one record of ``requests.jsonl`` (needs ``prompt_tokens``, ``tokens_reused``;
            uses ``source``, ``hit`` and ``lookup_ms`` when present).
        constants: the per-operation constants.

    Returns:
        ``{"ttft_ms", "prefill_ms", "decode_ms", "search_ms", "inject_ms", "prefilled_tokens",
        "injected_mb", "answer_hit"}`` (ms, tokens, MB = 10^6 bytes). ``answer_hit`` is True
        for a naive-string hit (the stored answer returned), simulated as :data:`NAIVE_HIT_MS`.

    Raises:
        ValueError: ``tokens_reused`` outside ``0..prompt_tokens``.
    """
    prompt = int(record["prompt_tokens"])
    reused = int(record.get("tokens_reused") or 0)
    if not 0 <= reused <= prompt:
        raise ValueError(f"tokens_reused {reused} outside 0..{prompt} (request {record.get('request_id')!r})")
    if record.get("source") == "answer":
        return {"ttft_ms": NAIVE_HIT_MS, "prefill_ms": 0.0, "decode_ms": 0.0, "search_ms": 0.0,
                "inject_ms": 0.0, "prefilled_tokens": 0, "injected_mb": 0.0, "answer_hit": True}
    prefilled = prompt - reused
    injected = constants.injected_mb(reused) if record.get("source") != "context" else 0.0
    parts = {
        "prefill_ms": prefilled * constants.prefill_ms_per_token,
        "decode_ms": constants.decode_ms_per_token,
        "search_ms": constants.hnsw_search_ms if _lookup_ms(record) is not None else 0.0,
        "inject_ms": injected * constants.inject_ms_per_mb,
    }
    return {"ttft_ms": sum(parts.values()), **parts, "prefilled_tokens": prefilled,
            "injected_mb": injected, "answer_hit": False}


def _summarise(system: str, records: Sequence[Mapping], constants: SeedConstants) -> dict:
    per = [simulated_ttft(r, constants) for r in records]
    ttft = np.array([p["ttft_ms"] for p in per], dtype=float)
    prompt_tokens = sum(int(r["prompt_tokens"]) for r in records)
    prefilled = sum(p["prefilled_tokens"] for p in per)
    injected_mb = sum(p["injected_mb"] for p in per)
    full_kv_mb = constants.injected_mb(prompt_tokens)  # KV bytes no cache writes, MB
    hits = [r.get("hit") for r in records]
    n = len(records)
    return {
        "system": system,
        "n": n,
        "index_min": min(int(r.get("index", 0)) for r in records),
        "index_max": max(int(r.get("index", 0)) for r in records),
        "ttft_ms": {"mean": float(ttft.mean()), "p50": float(np.percentile(ttft, 50)),
                    "p95": float(np.percentile(ttft, 95))},
        "hit_rate": sum(h is not None for h in hits) / n,
        "exact_rate": sum(h == "exact" for h in hits) / n,
        "partial_rate": sum(h == "partial" for h in hits) / n,
        "semantic_lookups": sum(_lookup_ms(r) is not None for r in records),
        "prompt_tokens": prompt_tokens,
        "prefilled_tokens": prefilled,
        "injected_mb": injected_mb,
        "prefill_work_pct": 100.0 * prefilled / prompt_tokens if prompt_tokens else math.nan,
        "kv_traffic_pct": (100.0 * (constants.injected_mb(prefilled) + injected_mb) / full_kv_mb
                           if full_kv_mb else math.nan),
        "energy": "not simulated (the seed gives no energy constant)",
        "per_request": [{"index": r.get("index"), "request_id": r.get("request_id"), **p}
                        for r, p in zip(records, per)],
    }


def simulate(records: Iterable[Mapping], constants: SeedConstants = SEED, *, workload: str = "seed",
             systems: Sequence[str] = SIM_SYSTEMS, table: Sequence[SeedRow] = SEED_TABLE,
             rel_tol: float = 0.10) -> dict:
    """Apply the seed design's constants to our records of one workload, per system.

    Args:
        records: record dicts of ``requests.jsonl`` (any workloads and systems; others are skipped).
        constants: the per-operation constants (default: the seed design's).
        workload: which workload's records to use (default ``"seed"``, the seed design's workload).
        systems: which systems to profile, when present (default :data:`SIM_SYSTEMS`).
        table: the published table to compare with (default :data:`SEED_TABLE`).
        rel_tol: relative tolerance of the consistency checks that compare two figures.

    Returns:
        ``{"constants": {...}, "workload", "systems": {name: summary}, "seed_table": [...],
        "consistency": [rows], "energy": "not simulated ..."}``. A summary holds ``n``, the
        request ``index`` range, ``ttft_ms`` ``{"mean", "p50", "p95"}`` (ms), ``hit_rate``,
        ``exact_rate``, ``partial_rate`` (fractions), ``semantic_lookups``, ``prompt_tokens``,
        ``prefilled_tokens``, ``injected_mb`` (MB = 10^6 bytes), ``prefill_work_pct`` and
        ``kv_traffic_pct`` (percent of no cache on the same requests, see the module
        docstring), ``energy`` (the string "not simulated ...") and ``per_request`` (each
        request's :func:`simulated_ttft` with its ``index`` and ``request_id``). Systems
        with no records are absent. Systems may cover different requests (the slower ones
        run the first 300 of the seed workload): compare ``n`` and the index range.
    """
    chosen: dict[str, list[Mapping]] = {name: [] for name in systems}
    for r in records:
        if r.get("workload") == workload and r.get("system") in chosen:
            chosen[r["system"]].append(r)
    summaries = {name: _summarise(name, sorted(rs, key=lambda r: int(r.get("index", 0))), constants)
                 for name, rs in chosen.items() if rs}
    if len({(s["n"], s["index_min"], s["index_max"]) for s in summaries.values()}) > 1:
        log.info("simulated systems cover different requests: %s",
                 {k: (s["n"], s["index_min"], s["index_max"]) for k, s in summaries.items()})
    return {
        "constants": asdict(constants),
        "workload": workload,
        "systems": summaries,
        "seed_table": [asdict(row) for row in table],
        "consistency": consistency_checks(constants, table, summaries, rel_tol=rel_tol),
        "energy": "not simulated: the seed gives no energy constant",
    }


def _row(claim: str, implied: str, holds: bool, why: str) -> dict:
    return {"claim": claim, "implied": implied, "holds": bool(holds), "why": why}


def _expected_distinct(draws: int, population: int) -> float:
    """Expected number of distinct items in ``draws`` uniform independent draws from ``population``."""
    return population * (1.0 - (1.0 - 1.0 / population) ** draws)


def consistency_checks(constants: SeedConstants = SEED, table: Sequence[SeedRow] = SEED_TABLE,
                       simulated: Mapping[str, Mapping] | None = None, *, rel_tol: float = 0.10,
                       shape: SeedWorkloadShape = SEED_WORKLOAD) -> list[dict]:
    """What the seed design's constants imply for its own published table, and whether the table agrees.

    Every figure is computed from ``constants``, ``table`` and ``shape``; ``holds`` says whether
    the published figure is consistent with what they imply. Checks:

    1. the no-cache TTFT implies a prompt length (TTFT minus one decode step, over the prefill rate);
    2. the naive-string TTFT from its hit rate (misses pay the no-cache TTFT, hits
       :data:`NAIVE_HIT_MS`), within ``rel_tol``;
    3. the fragment-cache TTFT from its hit rate, at best: misses pay the no-cache TTFT plus one
       HNSW search, hits reuse the *whole* prompt (decode + search + injection of the implied
       prompt's KV). The published TTFT must be at least this lower bound;
    4. the hit rate the fragment-cache TTFT would need under the same best case (must not
       exceed the published rate);
    5. how much of their prompt the non-hits would have to reuse for the published TTFT to
       hold (holds when that is a fraction in 0..1: the table then needs "misses" to be
       partial reuses);
    6. the memory-bandwidth column against the hit rates, under the prefill-work reading
       (1 - hit rate at full reuse is the least prefill share; the published share must be
       at least that) -- the KV-bytes reading gives 100% for any KV reuse, see the module
       docstring;
    7. the naive-string hit rate against the repeats the workload allows: expected share of
       repeated prompts in ``requests`` uniform independent draws over clusters x prompts x
       variants (an assumption: the seed design does not say how it drew);
    8. the energy column against the bandwidth column (energy is not simulated; this only
       says whether the published energy is proportional to the published bandwidth, within
       ``rel_tol``);
    9. with ``simulated`` (summaries of :func:`simulate`): our stream's simulated no-cache
       mean TTFT against the published 1,800 ms, within ``rel_tol``.

    Returns:
        a list of ``{"claim", "implied", "holds", "why"}`` rows (strings and a bool).
    """
    c = constants
    nc = _seed_row("no cache", table)
    ns = _seed_row("naive string cache", table)
    fc = _seed_row("fragment cache", table)
    prompt = (nc.ttft_ms - c.decode_ms_per_token) / c.prefill_ms_per_token
    rows = _ttft_checks(c, nc, ns, prompt, rel_tol)
    rows += _fragment_cache_checks(c, nc, fc, prompt)
    rows += _column_checks(c, table, nc, ns, fc, shape, rel_tol)
    if simulated and "no-cache" in simulated:
        rows.append(_stream_check(simulated["no-cache"], nc, prompt, rel_tol))
    return rows


def _ttft_checks(c: SeedConstants, nc: SeedRow, ns: SeedRow, prompt: float, rel_tol: float) -> list[dict]:
    """Checks 1 and 2 of :func:`consistency_checks`."""
    rows: list[dict] = []
    # 1. prompt length implied by the no-cache TTFT
    rows.append(_row(
        f"no cache: TTFT {nc.ttft_ms:,.0f} ms",
        f"{prompt:,.0f}-token prompts ({prompt / c.fragment_tokens:.2f} fragments of {c.fragment_tokens})",
        prompt > 0,
        f"({nc.ttft_ms:,.0f} - {c.decode_ms_per_token} ms decode of the first token) / "
        f"{c.prefill_ms_per_token} ms per token = {prompt:,.1f} prompt tokens"))

    # 2. naive string cache TTFT from its hit rate
    naive = (1 - ns.hit_rate) * nc.ttft_ms + ns.hit_rate * NAIVE_HIT_MS
    rows.append(_row(
        f"naive string cache: TTFT {ns.ttft_ms:,.0f} ms at {ns.hit_rate:.0%} hits",
        f"{naive:,.0f} ms",
        abs(naive - ns.ttft_ms) <= rel_tol * ns.ttft_ms,
        f"{1 - ns.hit_rate:.0%} misses x {nc.ttft_ms:,.0f} ms + {ns.hit_rate:.0%} hits x "
        f"{NAIVE_HIT_MS:g} ms = {naive:,.0f} ms, {abs(naive - ns.ttft_ms) / ns.ttft_ms:.1%} from the "
        f"published figure (tolerance {rel_tol:.0%})"))
    return rows


def _fragment_cache_checks(c: SeedConstants, nc: SeedRow, fc: SeedRow, prompt: float) -> list[dict]:
    """Checks 3 to 5 of :func:`consistency_checks` (the fragment cache's TTFT and hit rate)."""
    rows: list[dict] = []
    # 3. fragment cache TTFT lower bound at its hit rate
    hit_ms = c.decode_ms_per_token + c.hnsw_search_ms + c.inject_ms_per_mb * c.injected_mb(prompt)
    miss_ms = nc.ttft_ms + c.hnsw_search_ms
    bound = (1 - fc.hit_rate) * miss_ms + fc.hit_rate * hit_ms
    misses_alone = (1 - fc.hit_rate) * nc.ttft_ms
    rows.append(_row(
        f"fragment cache: TTFT {fc.ttft_ms:,.0f} ms at {fc.hit_rate:.0%} hits",
        f">= {bound:,.0f} ms",
        fc.ttft_ms >= bound,
        f"the {1 - fc.hit_rate:.0%} misses alone add {1 - fc.hit_rate:.2f} x {nc.ttft_ms:,.0f} = "
        f"{misses_alone:,.0f} ms to the mean; even if every hit reused the whole prompt it would "
        f"cost {hit_ms:.1f} ms (decode {c.decode_ms_per_token} + search {c.hnsw_search_ms} + "
        f"injection {c.inject_ms_per_mb * c.injected_mb(prompt):.2f})"
        + ("" if fc.ttft_ms >= bound else f", so the mean cannot be below {bound:,.0f} ms unless "
           f"the misses are partial hits")))

    # 4. hit rate needed for the published fragment-cache TTFT
    needed = (miss_ms - fc.ttft_ms) / (miss_ms - hit_ms)
    rows.append(_row(
        f"fragment cache: {fc.hit_rate:.0%} hits give {fc.ttft_ms:,.0f} ms",
        f"{fc.ttft_ms:,.0f} ms needs >= {needed:.1%} full-prompt hits",
        needed <= fc.hit_rate,
        f"solve (1 - h) x {miss_ms:,.1f} + h x {hit_ms:.1f} = {fc.ttft_ms:,.0f} for h"))

    # 5. reuse the non-hits would need
    # mean = h*hit_ms + (1-h)*(decode + search + (1-r)*prompt*prefill + inject(r*prompt))
    per_token_saving = c.prefill_ms_per_token - c.inject_ms_per_mb * c.fragment_mb / c.fragment_tokens
    miss_budget = (fc.ttft_ms - fc.hit_rate * hit_ms) / (1 - fc.hit_rate) if fc.hit_rate < 1 else math.nan
    r = (miss_ms - miss_budget) / (prompt * per_token_saving)
    rows.append(_row(
        f"fragment cache: {fc.ttft_ms:,.0f} ms with {1 - fc.hit_rate:.0%} non-hits",
        f"the non-hits must reuse {r:.0%} of their prompt ({r * prompt:,.0f} tokens)",
        0.0 <= r <= 1.0,
        f"each non-hit may cost at most {miss_budget:,.1f} ms on average against {miss_ms:,.1f} ms for "
        f"a full prefill; {'possible only if the non-hits are partial reuses' if 0 <= r <= 1 else 'impossible'}"))
    return rows


def _column_checks(c: SeedConstants, table: Sequence[SeedRow], nc: SeedRow, ns: SeedRow, fc: SeedRow,
                   shape: SeedWorkloadShape, rel_tol: float) -> list[dict]:
    """Checks 6 to 8 of :func:`consistency_checks` (bandwidth, repeats, energy columns)."""
    rows: list[dict] = []
    # 6. memory bandwidth vs hit rates (prefill-work reading)
    for row in (ns, fc):
        least = 100.0 * (1 - row.hit_rate)
        rows.append(_row(
            f"{row.system}: memory bandwidth {row.memory_bandwidth_pct:g}% at {row.hit_rate:.0%} hits",
            f">= {least:g}% as prefill work; 100% as KV bytes ({c.kv_bytes_per_token:,.0f} B per token "
            f"computed or injected)" if row is fc else f">= {least:g}% as prefill work",
            row.memory_bandwidth_pct >= least - 1e-9,
            f"with full-prompt hits the prefilled share is 1 - hit rate = {least:g}%; "
            f"the published {row.memory_bandwidth_pct:g}% "
            + ("is consistent with that reading" if row.memory_bandwidth_pct >= least - 1e-9
               else "is below it")
            + ("; injecting a fragment moves the KV bytes prefilling it would write, so as KV "
               "traffic a fragment hit saves nothing" if row is fc else "")))

    # 7. naive-string hit rate vs the repeats the workload allows
    population = shape.clusters * shape.prompts_per_cluster * shape.variants
    distinct = _expected_distinct(shape.requests, population)
    repeat_rate = 1 - distinct / shape.requests
    rows.append(_row(
        f"naive string cache: {ns.hit_rate:.0%} hits over {shape.requests:,} requests of "
        f"{shape.clusters} x {shape.prompts_per_cluster} x {shape.variants} prompts",
        f"~{repeat_rate:.1%} exact repeats expected (uniform draws)",
        ns.hit_rate <= repeat_rate,
        f"{shape.requests:,} uniform independent draws over {population:,} prompt texts give "
        f"{distinct:,.0f} distinct texts on average; only repeats can hit an exact-text cache "
        f"(the seed does not say how it drew: an assumption)"))

    # 8. energy vs bandwidth (energy itself is not simulated)
    ratios = [(row, row.energy_mah / nc.energy_mah * 100) for row in table]
    worst = max(abs(e - row.memory_bandwidth_pct) / max(row.memory_bandwidth_pct, 1e-9) for row, e in ratios)
    rows.append(_row(
        "energy " + " / ".join(f"{row.energy_mah:g}" for row in table) + " mAh",
        "energy share of no cache " + " / ".join(f"{e:.1f}%" for _, e in ratios)
        + " vs memory bandwidth " + " / ".join(f"{row.memory_bandwidth_pct:g}%" for row in table),
        worst <= rel_tol,
        "not simulated (no energy constant); "
        + (f"the published energy is proportional to the published bandwidth within {worst:.1%}: "
           "it follows from that column, whether or not it was measured apart"
           if worst <= rel_tol else
           f"the published energy departs from the bandwidth column by up to {worst:.1%}")))
    return rows


def _stream_check(ours: Mapping, nc: SeedRow, prompt: float, rel_tol: float) -> dict:
    """Check 9 of :func:`consistency_checks`: our stream's simulated no-cache TTFT (``ours``, a
    :func:`simulate` summary) against the published one."""
    # 9. our stream against the published no-cache TTFT
    mean = ours["ttft_ms"]["mean"]
    tokens = ours["prompt_tokens"] / ours["n"]
    return _row(
        f"no cache: TTFT {nc.ttft_ms:,.0f} ms on the seed's stream",
        f"{mean:,.0f} ms on our stream (mean {tokens:,.0f} prompt tokens)",
        abs(mean - nc.ttft_ms) <= rel_tol * nc.ttft_ms,
        f"our seed-workload prompts average {tokens:,.0f} tokens against the {prompt:,.0f} the "
        f"published TTFT implies ({(mean - nc.ttft_ms) / nc.ttft_ms:+.1%}, tolerance {rel_tol:.0%})")


def render_markdown(sim: Mapping) -> str:
    """Markdown: the simulated table beside the seed design's published one, then the consistency rows.

    Args:
        sim: the result of :func:`simulate`.

    Returns:
        markdown text (ms; percent; MB = 10^6 bytes).
    """
    c = sim["constants"]
    table = {row["system"]: row for row in sim["seed_table"]}
    lines = [
        f"### Simulated device profile ({sim['workload']} workload)",
        "",
        f"Seed constants: prefill {c['prefill_ms_per_token']} ms/token, decode {c['decode_ms_per_token']} "
        f"ms/token (one step counted: TTFT includes the first token), HNSW search {c['hnsw_search_ms']} ms, "
        f"injection {c['inject_ms_per_mb']} ms/MB, {c['fragment_mb']} MB (10^6 B) per "
        f"{c['fragment_tokens']}-token fragment. Naive-string hits: {NAIVE_HIT_MS:g} ms. "
        "Energy: not simulated (no constant).",
        "",
        "| system | n | simulated (seed constants, our request stream and our router's decisions): "
        "TTFT mean / p50 / p95 ms | hit rate (exact / partial) | prefill work % | KV traffic % | energy "
        "| seed published: TTFT ms | hit rate | memory bandwidth % | energy mAh |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for name, s in sim["systems"].items():
        seed = table.get(SEED_ROW_FOR_SYSTEM.get(name, ""), None)
        t = s["ttft_ms"]
        lines.append(
            f"| {name} | {s['n']:,} | {t['mean']:,.0f} / {t['p50']:,.0f} / {t['p95']:,.0f} "
            f"| {s['hit_rate']:.1%} ({s['exact_rate']:.1%} / {s['partial_rate']:.1%}) "
            f"| {s['prefill_work_pct']:.1f} | {s['kv_traffic_pct']:.1f} | not simulated "
            + (f"| {seed['ttft_ms']:,.0f} ({seed['system']}) | {seed['hit_rate']:.0%} "
               f"| {seed['memory_bandwidth_pct']:g} | {seed['energy_mah']:g} |" if seed else "| - | - | - | - |"))
    lines += ["", "Consistency of the seed's table with its own constants:", "",
              "| claim | implied | holds | why |", "|---|---|---|---|"]
    for row in sim["consistency"]:
        lines.append(f"| {row['claim']} | {row['implied']} | {'yes' if row['holds'] else '**no**'} | {row['why']} |")
    return "\n".join(lines) + "\n"
