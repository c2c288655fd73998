"""Acceptance: one process serves requests while another runs ``python -m edgesync_store.compact``
over the same store, again and again for a minute: no errors; every fragment that no rule
removed serves byte-identical KV; outputs identical to uncached runs.

Prompts: the seed workload (``seed_requests``: qqp_clusters.jsonl + system_prompts.json,
Random(0), README recipe), the first 3 distinct prompts of each of its first 2 topics (6 prompts
of 335-368 tokens sharing two 128-token chunks per topic), requested in a fixed
``random.Random(0)`` order that repeats them, so most requests after the first few are hits;
before them, once, the first prompt of the third topic.

The server (tests/proc_serve.py, real SmolLM2 through llama.cpp) stores every chunk as layer
halves or as 2 x 3 layer x KV-head groups, so the compactor has merges to do throughout. Its
fragments live 20 s (they expire during the minute unless promoted by 5 hits); those of the
once-answered prompt live 2 s, so the compactor has expired fragments to sweep within seconds of
the start, before the size budget is reached. The budget, 16 MiB, is below the ~26 MiB of the
prompts' fragments, so writes evict. Reference outputs and reference KV come from uncached runs
of the same prompts in this process (the ``adapter`` fixture).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edgesync_engines.adapters.kv_blocks import assemble_kv
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.router import EdgeSync
from edgesync_store.core.store import FragmentStore
from edgesync_store.schema import MIN_SPAN, prefix_hash

pytestmark = [pytest.mark.model]

TESTS = Path(__file__).parent
COMPACT_FOR_S = 60.0
MAX_TOKENS = 10
TTL_S = 20.0
ONCE_TTL_S = 2.0
MAX_BYTES = 16 * 1024 * 1024  # the 7 prompts' fragments take about 26 MiB


def pick_prompts(seed_requests, per_topic: tuple[int, ...]) -> list[list[dict]]:
    """The first ``per_topic[t]`` distinct prompts (by prompt_key) of the t-th topic met in
    workload order, topic after topic."""
    chosen: dict[str, dict[str, list[dict]]] = {}
    for req in seed_requests:
        group = chosen.get(req.group)
        if group is None:
            if len(chosen) == len(per_topic):
                continue
            group = chosen[req.group] = {}
        if len(group) < per_topic[list(chosen).index(req.group)] and req.prompt_key not in group:
            group[req.prompt_key] = req.as_messages()
    assert [len(g) for g in chosen.values()] == list(per_topic)
    return [messages for group in chosen.values() for messages in group.values()]


def wait_for_line(path: Path, proc: subprocess.Popen, key: str, timeout_s: float) -> None:
    """Poll the server's stdout file until a JSON line with ``key`` appears."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines():
            if line.startswith("{") and key in json.loads(line):
                return
        assert proc.poll() is None, f"server exited early with {proc.returncode}"
        time.sleep(0.1)
    raise AssertionError(f"server printed no {key!r} line within {timeout_s} s")


def test_serving_while_compacting_every_minute_stays_exact(adapter, seed_requests, tmp_path):
    prompts = pick_prompts(seed_requests, (3, 3, 1))
    once = len(prompts) - 1  # answered once, first, with fragments that live ONCE_TTL_S
    uncached = EdgeSync(adapter, store=False, config=EdgeSyncConfig.load({"jobs": False, "semantic": False}))

    # Reference: each prompt answered uncached, and the KV of all but its last token (what a
    # request injects) extracted from that uncached prefill.
    tokens, reference, ref_kv = [], [], []
    for messages in prompts:
        toks = uncached.prompt_tokens(messages)
        reference.append(uncached.generate(messages, max_tokens=MAX_TOKENS).tokens)
        ref_kv.append(adapter.extract_fragments(toks, [(0, len(toks) - 1)])[0])
        tokens.append(toks)
    assert all(len(ref) == MAX_TOKENS for ref in reference)

    store_dir = tmp_path / "store"
    stop_file = tmp_path / "stop"
    spec = tmp_path / "requests.json"
    rng = random.Random(0)
    spec.write_text(json.dumps({"prompts": prompts, "once": [once], "once_ttl_seconds": ONCE_TTL_S,
                                "order": [rng.randrange(once) for _ in range(1000)]}))
    out_path, err_path = tmp_path / "serve.out", tmp_path / "serve.err"
    env = {**os.environ, "EDGESYNC_THREADS": os.environ.get("EDGESYNC_THREADS", "1")}
    with open(out_path, "w") as out, open(err_path, "w") as err:
        server = subprocess.Popen(
            [sys.executable, str(TESTS / "proc_serve.py"), str(store_dir), str(spec), str(stop_file),
             str(MAX_TOKENS), str(TTL_S), str(MAX_BYTES)],
            stdout=out, stderr=err, env=env,
        )
    runs, compact_errors = [], []
    try:
        wait_for_line(out_path, server, "ready", 120)
        t0 = time.monotonic()
        while time.monotonic() - t0 < COMPACT_FOR_S:
            assert server.poll() is None, f"server exited during the minute: {err_path.read_text()[-3000:]}"
            proc = subprocess.run([sys.executable, "-m", "edgesync_store.compact", str(store_dir), "--json"],
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs.append(json.loads(proc.stdout))
            if "Traceback" in proc.stderr or "ERROR" in proc.stderr:
                compact_errors.append(proc.stderr)
        stop_file.touch()
        server.wait(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    stderr = err_path.read_text()
    assert server.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "ERROR" not in stderr and "CRITICAL" not in stderr, stderr[-3000:]
    assert compact_errors == []

    lines = [json.loads(line) for line in out_path.read_text().splitlines() if line.startswith("{")]
    served = [row for row in lines if "i" in row]
    (done,) = [row for row in lines if row.get("done")]
    assert done["requests"] == len(served) >= 12
    assert served[0]["prompt"] == once and served[0]["hit"] == "miss" and served[0]["fragments_written"] == 6

    # Outputs: every served answer equals the uncached answer of its prompt.
    mismatched = [row["i"] for row in served if row["tokens"] != reference[row["prompt"]]]
    assert mismatched == []
    kinds = [row["hit"] for row in served]
    hits = [row for row in served if row["tokens_reused"] > 0]
    assert len(hits) >= len(served) // 3 and "exact" in kinds and "miss" in kinds
    assert all(row["tokens_reused"] <= row["prompt_tokens"] - 1 for row in served)

    # The compactor: every run reported (none failed above), and they did real work.
    assert len(runs) >= 5
    assert all(run["dry_run"] is False for run in runs)
    done_runs = [run for run in runs if not run["skipped"]]
    assert done_runs, "every compaction was skipped"
    merged = sum(run["fragments_merged"] for run in done_runs)
    expired = sum(run["expired"] for run in done_runs)
    evicted = sum(run["evicted"] for run in done_runs)
    assert merged + expired + evicted > 0
    assert merged > 0  # every chunk the server writes is stored in groups
    assert expired > 0  # at least the once-answered prompt's fragments (ONCE_TTL_S), within seconds
    assert done["evictions"] + evicted > 0  # the budget was reached (writes or compaction evicted)
    assert done["dropped_corrupt"] == 0

    # Byte identity of every fragment still stored (live or expired but not yet swept).
    ns = adapter.namespace
    with FragmentStore(store_dir) as store:
        rows = list(store.iterate())
        assert rows, "the store is empty"
        checked = 0
        for key, head, _life, _nbytes in rows:
            assert head is not None
            frag = store.get(key)
            assert frag is not None and frag.namespace == ns
            s, e = frag.token_start, frag.token_end
            owners = [p for p, toks in enumerate(tokens)
                      if e <= len(toks) - 1 and np.array_equal(frag.token_ids, toks[s:e])
                      and frag.prefix_hash == prefix_hash(toks[:s])]
            assert owners, f"fragment [{s}, {e}) belongs to no prompt"
            ref = ref_kv[owners[0]]
            layers = list(frag.layers)
            cols = slice(frag.head_start * ns.head_dim, frag.head_end * ns.head_dim)
            assert np.array_equal(frag.keys, ref.keys[layers, s:e, cols])
            assert np.array_equal(frag.values, ref.values[layers, s:e, cols])
            checked += 1

        # What a request would inject now: the walk's fragments assembled, for every prompt the
        # store still serves.
        served_now = full_now = 0
        for p, toks in enumerate(tokens):
            walk = store.prefix_walk(ns, toks)
            target = adapter.usable_prefix(walk.matched_tokens, len(toks))
            if target < MIN_SPAN:
                continue
            frags = [store.get(k) for span in walk.spans if span.token_start < target for k in span.keys]
            assert all(f is not None for f in frags)
            k, v = assemble_kv(adapter.namespace, frags, target, toks)
            assert np.array_equal(k, ref_kv[p].keys[:, :target]) and np.array_equal(v, ref_kv[p].values[:, :target])
            served_now += 1
            full_now += target == len(toks) - 1
        assert store.stats().dropped_corrupt == 0
    assert checked == len(rows)
    assert served_now >= 1
    print(f"\nrequests {len(served)} (hits {len(hits)}, kinds {dict((k, kinds.count(k)) for k in set(kinds))}); "
          f"compactions {len(runs)} (skipped {len(runs) - len(done_runs)}): merged {merged}, expired {expired}, "
          f"evicted {evicted}; server evictions {done['evictions']} ({done['evicted_fragments']} fragments); "
          f"fragments checked {checked}; prompts served now {served_now} (whole {full_now}); "
          f"server warnings {stderr.count('WARNING')}")
