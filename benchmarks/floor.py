"""How close EdgeSync's hits are to the physical floor, in one process and one run.

``python -m edgesync_bench.floor [--quick] [--seed-prompts N] [--doc-prompts N] [--repeats R]
[--threads N] [--profile] [--json FILE]``

Not a test: it prints a table of ratios (issue 17's acceptance, :mod:`edgesync_bench.floor_report`)
and writes every figure with ``--json``. On the real model (EdgeSync's configured model,
SmolLM2-135M-Instruct Q4_1) through llama.cpp, a real store in a temporary directory, EdgeSync
with default settings (``--threads`` aside).

Prompts, per workload:

* ``seed``: the first N distinct prompts of the seed workload (an app's ~330-token system
  prompt and a question, about 342 tokens); the new prompts of the partial hits are the next
  distinct prompts of the workload whose system prompt is among those N.
* ``doc``: doc-QA prompts of about 1,000 tokens (``--doc-tokens``): the doc-QA message
  (system ``DOC_QA_SYSTEM_PROMPT``, user ``Passage (title):\\n<context>`` blocks, then
  ``Question: <q>``) over passages of ``doc_qa.jsonl`` taken in ``random.Random(0)`` order until
  the prompt reaches the size, asking the first passage's first question; the new prompt of
  its partial hit asks that passage's second question. (The benchmark's doc-QA prompts hold one
  passage, median 225 tokens; these are longer to show how a hit's cost grows with its size.)

Measured, per workload:

1. Uncached reference: every prompt answered by ``EdgeSync(model=<the same adapter>,
   store=False)`` (the project's own uncached path), ``--max-tokens`` greedy tokens.
2. Store: each prompt asked once (a miss, or a partial hit of its system prompt): the
   store-back cost per new prompt, the time from the answer's last text piece to the end of the
   request (store-back and indexing run there, after the answer) and the stored fragment bytes
   it added.
3. Exact hits: ``--repeats`` rounds over the prompts, interleaved (A B C A B C ...), so the live
   context never holds the prompt asked; TTFT is the engine's (``GenerationResult.ttft_ms``:
   chat template and tokenization included); identity against the uncached run.
4. The floor, after each exact hit, on the adapter the hit left holding the prompt: tokenize
   (``EdgeSync.prompt_tokens``) + ``adapter.generate(tokens, n_past=n - 1, max_tokens=1)``, which
   checks that the live sequence holds the first n - 1 tokens, cuts it back to them, evaluates
   the last token alone (as every request does) and samples one token.
5. Partial hits: each new prompt asked once (its system prompt or passages are stored), then
   ``max(3, repeats // 2)`` more times in interleaved rounds with the fragments its store-back
   added deleted before each ask (each ask a partial hit of the same chain); TTFT p50 over
   those asks against floor + prefill of the uncovered tokens + 5 ms, each bound measured once
   right after its ask. The uncovered prefill is measured on
   the same adapter with the prompt in the live context: ``prefill(tokens, n_past=r)`` (cut back
   to the r injected tokens, evaluate the rest in the request's own batches and the last token
   alone) minus ``prefill(tokens, n_past=n - 1)`` (the last token alone); the p50s of
   the floor and of the prefill over every ask.
6. With ``--profile``: cProfile of exact hits (``max_tokens`` 1), grouped into tokenize, walk,
   fetch, assemble/inject, eval, sample, after first token, other.
7. New process: right after each workload's figures (this process stays open and idle),
   ``edgesync generate --json`` in a child process on the warm store (an exact hit) and with
   ``--no-cache``, alternately, for the first ``--process-prompts`` prompts of the workload:
   first-request TTFT, wall time from start to exit and peak RSS (``ru_maxrss`` from
   ``os.wait4``). Right after, because this machine kind's host reclaims page cache left
   untouched for about a minute (DAMON ``pageout``), after which a first hit reads its blobs
   from disk.

Run it under the project's CPU lock on a shared machine, with ``EDGESYNC_THREADS=1`` or
``--threads``: every figure is a ratio to one measured in the same run, yet other processes
still add noise to both.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
import platform
import pstats
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = {"seed_prompts": 20, "doc_prompts": 8, "repeats": 10, "process_prompts": 3}
QUICK = {"seed_prompts": 4, "doc_prompts": 2, "repeats": 3, "process_prompts": 1}
DOC_TOKENS = 1000
MAX_TOKENS = 16
PROFILE_ROUNDS = 5


# -- prompts --------------------------------------------------------------------------------------

def seed_prompt_sets(n: int) -> tuple[list[list[dict]], list[list[dict]]]:
    """(the first ``n`` distinct prompts of the seed workload, up to ``n`` later distinct prompts
    whose system prompt is among theirs), as chat messages.

    Raises:
        WorkloadDataError: the workload's data is missing or malformed.
    """
    from edgesync_bench.bench_workloads import seed_requests

    distinct: dict[str, Any] = {}
    for r in seed_requests():
        distinct.setdefault(r.prompt_key, r)
    order = list(distinct.values())
    exact = order[:n]
    groups = {r.group for r in exact}
    new = [r for r in order[n:] if r.group in groups][:n]
    return [r.as_messages() for r in exact], [r.as_messages() for r in new]


def doc_messages(rows: Sequence[dict], question: str) -> list[dict]:
    """The doc-QA chat messages over several passages: system ``DOC_QA_SYSTEM_PROMPT``, user
    ``Passage (title):\\n<context>`` blocks separated by a blank line, then ``Question: <q>``."""
    from edgesync_bench.workloads import DOC_QA_SYSTEM_PROMPT

    passages = "\n\n".join(f"Passage ({r['title']}):\n{r['context']}" for r in rows)
    return [{"role": "system", "content": DOC_QA_SYSTEM_PROMPT},
            {"role": "user", "content": f"{passages}\n\nQuestion: {question}"}]


def doc_prompt_sets(n: int, count_tokens, target_tokens: int = DOC_TOKENS) -> tuple[list, list]:
    """(``n`` doc-QA prompts of about ``target_tokens`` tokens, the same prompts asking their
    first passage's second question instead of its first): see the module docstring.
    ``count_tokens(messages) -> int`` counts a prompt's tokens.

    Raises:
        ValueError: ``doc_qa.jsonl`` has too few passages for ``n`` prompts of that size.
    """
    from edgesync_bench.bench_workloads import SELECTION_SEED
    from edgesync_bench.workloads import DOC_QA_FILE, data_file, read_jsonl

    rows = read_jsonl(data_file(DOC_QA_FILE))
    order = random.Random(SELECTION_SEED).sample(range(len(rows)), len(rows))
    exact, new, pos = [], [], 0
    while len(exact) < n and pos < len(order):
        first = rows[order[pos]]
        pos += 1
        if len(first["questions"]) < 2:
            continue
        picked = [first]
        while count_tokens(doc_messages(picked, first["questions"][0])) < target_tokens and pos < len(order):
            picked.append(rows[order[pos]])
            pos += 1
        exact.append(doc_messages(picked, first["questions"][0]))
        new.append(doc_messages(picked, first["questions"][1]))
    if len(exact) < n:
        raise ValueError(f"--doc-prompts {n}: {DOC_QA_FILE} has passages for only {len(exact)} prompts of "
                         f"{target_tokens} tokens")
    return exact, new


# -- measurements ---------------------------------------------------------------------------------

def timed_request(es, messages: list[dict], max_tokens: int) -> dict:
    """One streamed ``es.generate``: the result's figures (its tokens and text among them), the
    wall TTFT (call to first piece) and ``after_ms`` (the answer's last piece to the end of the
    request: store-back, indexing)."""
    t0 = time.perf_counter()
    first = last = None
    stream = es.generate(messages, max_tokens=max_tokens, stream=True, temperature=0.0)
    with stream:
        for _piece in stream:
            last = time.perf_counter()
            first = first or last
        end = time.perf_counter()
    r = stream.result
    return {"ttft_ms": r.ttft_ms, "wall_ttft_ms": ((first or end) - t0) * 1000,
            "after_ms": (end - last) * 1000 if last is not None else r.total_ms - r.ttft_ms,
            "hit": r.hit, "tokens": list(r.tokens), "text": r.text, "prompt_tokens": r.prompt_tokens,
            "tokens_reused": r.tokens_reused, "bytes_read": r.bytes_read, "fragments_written": r.fragments_written,
            "ram_tier_hits": getattr(r, "ram_tier_hits", 0) or 0}


def floor_ms(es, messages: list[dict]) -> float:
    """The floor of one prompt whose first n - 1 tokens are in the live context (module
    docstring, step 4), ms.

    Raises:
        ValueError: the live sequence does not hold them (``adapter.generate``'s check).
    """
    with es.adapter.lock:
        t0 = time.perf_counter()
        tokens = es.prompt_tokens(messages)
        for _token in es.adapter.generate(tokens, len(tokens) - 1, 1, temperature=0.0):
            pass
        return (time.perf_counter() - t0) * 1000


def _timed_prefill(adapter, tokens: list[int], n_past: int) -> float:
    t0 = time.perf_counter()
    adapter.prefill(tokens, n_past)
    return (time.perf_counter() - t0) * 1000


def uncovered_prefill_ms(es, messages: list[dict], reused: int, repeats: int) -> tuple[float, float]:
    """(median floor ms, median prefill ms of the tokens ``reused..n-2``) of a prompt the live
    context holds (module docstring, step 5)."""
    from edgesync_bench.floor_report import p50

    adapter, floors, full, last = es.adapter, [], [], []
    with adapter.lock:
        tokens = es.prompt_tokens(messages)
        n = len(tokens)
        for _ in range(repeats):
            full.append(_timed_prefill(adapter, tokens, reused))
            last.append(_timed_prefill(adapter, tokens, n - 1))
            floors.append(floor_ms(es, messages))
    return p50(floors), max(p50(full) - p50(last), 0.0)


def stored_bytes(es) -> int:
    """Compressed bytes of every fragment in ``es``'s store."""
    from edgesync_store.commands.inventory import summary

    return int(summary(es.store)["compressed_bytes"])


class Bench:
    """One run: an EdgeSync with default settings on a store in ``workdir``, its uncached twin on
    the same adapter, and the figures (:mod:`edgesync_bench.floor_report`)."""

    def __init__(self, workdir: Path, threads: int | None, max_tokens: int, repeats: int, progress=None) -> None:
        from edgesync_bench.worker import wait_for_warm_up
        from edgesync_engines.config import EdgeSyncConfig
        from edgesync_engines.request.router import EdgeSync

        self.store_path = workdir / "store"
        self.cfg = EdgeSyncConfig.load({"n_threads": threads, "store_path": self.store_path})
        self.es = EdgeSync(store=self.store_path, config=self.cfg)
        wait_for_warm_up()  # a background warm-up must not run during the timings
        self.model = str(self.es.adapter.model_path)
        self.uncached = EdgeSync(model=self.es.adapter, store=False, config=self.cfg)
        self.max_tokens, self.repeats, self.progress = max_tokens, repeats, progress
        self.refs: dict[str, list[list[int]]] = {}
        """Uncached tokens of each workload's exact-hit prompts, by workload label."""

    def close(self) -> None:
        """Close both EdgeSyncs (the store stays on disk)."""
        self.uncached.close()
        self.es.close()

    def _bar(self, label: str, total: int):
        if self.progress is None:
            return None
        return self.progress.add_task(label, total=total)

    def _tick(self, task) -> None:
        if task is not None:
            self.progress.advance(task)

    def references(self, label: str, prompts: Sequence[list[dict]]) -> list[list[int]]:
        """Uncached greedy tokens of each prompt."""
        task, out = self._bar(f"{label}: uncached", len(prompts)), []
        for m in prompts:
            out.append(list(self.uncached.generate(m, max_tokens=self.max_tokens, temperature=0.0).tokens))
            self._tick(task)
        return out

    def store_new(self, prompt: list[dict], sb: dict) -> dict:
        """Ask a new prompt once; its store-back cost goes into ``sb``."""
        before = stored_bytes(self.es)
        r = timed_request(self.es, prompt, self.max_tokens)
        sb["ms"].append(r["after_ms"])
        sb["bytes"].append(stored_bytes(self.es) - before)
        sb["fragments"].append(r["fragments_written"])
        return r

    def workload(self, label: str, exact: Sequence[list[dict]], new: Sequence[list[dict]]) -> dict:
        """Every in-process figure of one workload (module docstring, steps 1-5)."""
        from edgesync_bench.worker import dir_disk_bytes

        refs, new_refs = self.references(label, exact), self.references(label + " new", new)
        self.refs[label] = refs
        sb: dict[str, list] = {"ms": [], "bytes": [], "fragments": [], "kind": []}
        disk0 = dir_disk_bytes(self.store_path)
        task = self._bar(f"{label}: store", len(exact))
        first = []
        for m in exact:
            first.append(self.store_new(m, sb))
            sb["kind"].append("first")
            self._tick(task)
        ex: dict[str, Any] = {"ttft_ms": [], "wall_ttft_ms": [], "first_round_ttft_ms": [], "hits": {},
                              "identical": 0, "n": 0, "ram_tier_hits": 0, "bytes_read": [],
                              "per_prompt_ttft_ms": [[] for _ in exact]}
        fl: dict[str, list] = {"ms": []}
        task = self._bar(f"{label}: exact hits", self.repeats * len(exact))
        for k in range(self.repeats):
            for i, m in enumerate(exact):  # interleaved: the live context holds the previous prompt
                r = timed_request(self.es, m, self.max_tokens)
                ex["hits"][r["hit"]] = ex["hits"].get(r["hit"], 0) + 1
                ex["n"] += 1
                ex["identical"] += r["tokens"] == refs[i]
                ex["ram_tier_hits"] += r["ram_tier_hits"]
                if r["hit"] == "exact":
                    ex["ttft_ms"].append(r["ttft_ms"])
                    ex["wall_ttft_ms"].append(r["wall_ttft_ms"])
                    ex["bytes_read"].append(r["bytes_read"])
                    ex["per_prompt_ttft_ms"][i].append(r["ttft_ms"])
                    if k == 0:
                        ex["first_round_ttft_ms"].append(r["ttft_ms"])
                fl["ms"].append(floor_ms(self.es, m))
                self._tick(task)
        pa = self.partials(label, new, new_refs, sb)
        sb["disk_bytes_delta"] = dir_disk_bytes(self.store_path) - disk0
        return {"prompts": len(exact), "prompt_tokens": [r["prompt_tokens"] for r in first],
                "first_hits": [r["hit"] for r in first], "exact": ex, "floor": fl, "partial": pa, "store_back": sb}

    def partials(self, label: str, new: Sequence[list[dict]], refs: Sequence[list[int]], sb: dict) -> dict:
        """Partial hits of new prompts (module docstring, step 5); their store-back goes into ``sb``.
        Each new prompt is asked once (its store-back measured), then ``max(3, repeats // 2)``
        more times in interleaved rounds, the fragments its store-back added deleted before
        each ask, so that every ask is a partial hit of the same shared chain; right after each
        of those asks its bound is measured once (floor, uncovered prefill), so that the asks and
        their bounds see the same machine (this machine kind's speed drifts by tens of percent
        over minutes)."""
        pa: dict[str, Any] = {"ttft_ms": [], "floor_ms": [], "uncovered_prefill_ms": [], "uncovered_tokens": [],
                              "tokens_reused": [], "prompt_tokens": [], "hits": {}, "identical": 0, "n": 0,
                              "asks_per_prompt": 1 + max(3, self.repeats // 2)}
        task = self._bar(f"{label}: partial hits", len(new) * (pa["asks_per_prompt"] - 1))
        ns = self.es.namespace

        def along(m: list[dict]) -> set[bytes]:
            return set(self.es.store.keys_along(ns, self.es.prompt_tokens(m)))

        shared = [along(m) for m in new]
        rounds = [[self.store_new(m, sb) for m in new]]
        sb["kind"].extend(["partial"] * len(new))
        added = [sorted(along(m) - before) for m, before in zip(new, shared)]  # deleted before each repeat
        bounds: list[list[tuple[float, float]]] = [[] for _ in new]
        for _ in range(1, pa["asks_per_prompt"]):
            row = []
            for i, (m, keys) in enumerate(zip(new, added, strict=True)):
                self.es.store.delete_many(keys)
                r = timed_request(self.es, m, self.max_tokens)
                row.append(r)
                if r["hit"] == "partial":  # the bound, measured right after (the live context holds m)
                    bounds[i].append(uncovered_prefill_ms(self.es, m, r["tokens_reused"], 1))
                self._tick(task)
            rounds.append(row)
        for i, ref in enumerate(refs):
            asks = [row[i] for row in rounds]
            for r in asks:
                pa["hits"][r["hit"]] = pa["hits"].get(r["hit"], 0) + 1
                pa["n"] += 1
                pa["identical"] += r["tokens"] == ref
            partial = [r for r in asks[1:] if r["hit"] == "partial"]
            pa["ttft_ms"].extend(r["ttft_ms"] for r in partial)
            pa["floor_ms"].extend(floor for floor, _ in bounds[i])
            pa["uncovered_prefill_ms"].extend(prefill for _, prefill in bounds[i])
            if partial:
                pa["uncovered_tokens"].append(partial[-1]["prompt_tokens"] - 1 - partial[-1]["tokens_reused"])
                pa["tokens_reused"].append(partial[-1]["tokens_reused"])
                pa["prompt_tokens"].append(partial[-1]["prompt_tokens"])
        return pa

    def profile(self, exact: Sequence[list[dict]], rounds: int = PROFILE_ROUNDS) -> dict:
        """cProfile of ``rounds`` interleaved exact rounds at ``max_tokens`` 1, grouped
        (:func:`edgesync_bench.floor_report.group_profile`), with the top functions by cumulative time."""
        from edgesync_bench.floor_report import group_profile

        prof, total = cProfile.Profile(), 0.0
        for _ in range(rounds):
            for m in exact:
                t0 = time.perf_counter()
                prof.enable()
                self.es.generate(m, max_tokens=1, temperature=0.0)
                prof.disable()
                total += time.perf_counter() - t0
        st = pstats.Stats(prof)
        entries = [(path, func, ct) for (path, _line, func), (_cc, _nc, _tt, ct, _callers) in st.stats.items()]
        top = sorted(entries, key=lambda e: -e[2])[:25]
        n = rounds * len(exact)
        return {"groups": group_profile(entries, n, total * 1000), "hits": n,
                "top": [{"function": f"{os.path.basename(path)}:{func}", "cum_ms_per_hit": ct * 1000 / n}
                        for path, func, ct in top]}


# -- a new process --------------------------------------------------------------------------------

def _edgesync_command() -> list[str]:
    """The ``edgesync`` console script beside this interpreter, else the module's ``main``."""
    script = Path(sys.executable).parent / "edgesync"
    if script.is_file():
        return [sys.executable, str(script)]
    return [sys.executable, "-c", "import sys; from edgesync_engines.app.cli import main; sys.exit(main())"]


LAUNCHER = """
import json, os, subprocess, sys, time
t0 = time.perf_counter()
child = subprocess.Popen(sys.argv[2:])
_pid, status, usage = os.wait4(child.pid, 0)
wall = time.perf_counter() - t0
with open(sys.argv[1], "w") as fh:
    json.dump({"exit": os.waitstatus_to_exitcode(status), "wall_s": wall, "maxrss_kib": usage.ru_maxrss}, fh)
"""
"""Runs a command and writes its exit status, wall time and ``ru_maxrss`` to a file. Why a
launcher: Linux keeps a process's peak RSS across ``exec`` (``ru_maxrss`` of a child forked by
this ~600 MB process would start at 600 MB), so the measured child is forked by this small one."""


def run_child(args: Sequence[str], env: dict, command: Sequence[str] | None = None) -> dict:
    """Run ``edgesync <args>`` (or ``command`` + ``args``) in a new process (through
    :data:`LAUNCHER`): ``ok``, ``wall_s`` (start to exit), ``peak_rss_bytes`` (its ``ru_maxrss``),
    ``result`` (the last line of its stdout that starts with ``{``, as JSON: ``edgesync generate
    --json``'s result object), ``error``."""
    with tempfile.TemporaryDirectory() as tmp:
        usage_file, err_file = Path(tmp) / "usage.json", Path(tmp) / "stderr"
        head = list(command) if command is not None else _edgesync_command()
        with open(err_file, "wb") as err:
            proc = subprocess.run([sys.executable, "-c", LAUNCHER, str(usage_file), *head, *args],
                                  stdout=subprocess.PIPE, stderr=err, env=env, cwd=str(ROOT), check=False)
        tail = err_file.read_text(errors="replace")[-400:]
        usage = json.loads(usage_file.read_text()) if usage_file.exists() else None
    lines = [line for line in proc.stdout.decode(errors="replace").splitlines() if line.startswith("{")]
    ok = usage is not None and usage["exit"] == 0 and bool(lines)
    return {"ok": ok, "wall_s": usage and usage["wall_s"],
            "peak_rss_bytes": usage and usage["maxrss_kib"] * 1024,  # Linux: KiB
            "result": json.loads(lines[-1]) if ok else None,
            "error": None if ok else f"exit {usage and usage['exit']}: {tail}"}


def new_process_runs(store: Path, prompts: Sequence[list[dict]], refs: Sequence[list[int]], max_tokens: int,
                     threads: int | None, progress=None) -> dict:
    """``edgesync generate`` on the warm store and ``--no-cache``, alternately, per prompt
    (chat messages ``[system, user]``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if threads:
        env["EDGESYNC_THREADS"] = str(threads)
    out: dict[str, list] = {"warm": [], "uncached": []}
    task = progress.add_task("new processes", total=2 * len(prompts)) if progress is not None else None
    for m, ref in zip(prompts, refs, strict=True):
        (system,), (user,) = [x["content"] for x in m if x["role"] == "system"], [x["content"] for x in m
                                                                                 if x["role"] == "user"]
        base = ["generate", "--json", "--max-tokens", str(max_tokens), "--temperature", "0", "--system", system]
        for kind, extra in (("warm", ["--store", str(store)]), ("uncached", ["--no-cache"])):
            run = run_child([*base, *extra, user], env)
            res = run.pop("result")
            if res is not None:
                run.update(ttft_ms=res["ttft_ms"], hit=res["hit"], identical=res["tokens"] == ref,
                           prompt_tokens=res["prompt_tokens"])
            else:
                log.warning("edgesync generate (%s) failed: %s", kind, run["error"])
            out[kind].append(run)
            if task is not None:
                progress.advance(task)
    return out


# -- the run ---------------------------------------------------------------------------------------

def run(args: argparse.Namespace, progress=None) -> dict:
    """Measure everything (module docstring); return the JSON-able report."""
    from edgesync_bench.floor_report import p50, verdicts

    sizes = {k: getattr(args, k) if getattr(args, k) is not None else (QUICK if args.quick else DEFAULTS)[k]
             for k in DEFAULTS}
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="edgesync-floor-"))
    t0, load0 = time.perf_counter(), os.getloadavg()
    bench = Bench(workdir, args.threads, args.max_tokens, sizes["repeats"], progress)
    fig, prompts, profile = {}, {}, {}
    try:
        def count(messages: list[dict]) -> int:
            return len(bench.es.prompt_tokens(messages))

        sets = {"seed": seed_prompt_sets(sizes["seed_prompts"]) if sizes["seed_prompts"] else None,
                "doc": (doc_prompt_sets(sizes["doc_prompts"], count, args.doc_tokens)
                        if sizes["doc_prompts"] else None)}
        for w, pair in sets.items():
            if pair is None:
                continue
            fig[w] = bench.workload(w, *pair)
            prompts[w] = pair[0]
            if args.profile:
                profile[w] = bench.profile(pair[0])
            # right after the workload, as an app relaunched after use (this process stays open,
            # idle): this machine kind's host reclaims page cache left untouched for a minute
            k = sizes["process_prompts"]
            np_fig = new_process_runs(bench.store_path, prompts[w][:k], bench.refs[w][:k], args.max_tokens,
                                      args.threads, progress)
            np_fig["warm_hit_ttft_ms"] = [p50(x) for x in fig[w]["exact"]["per_prompt_ttft_ms"][:k] if x]
            fig[w]["new_process"] = np_fig
    finally:
        bench.close()
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    meta = {"sizes": sizes, "max_tokens": args.max_tokens, "doc_tokens": args.doc_tokens,
            "threads": bench.cfg.n_threads, "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(), "model": bench.model,
            "wall_s": time.perf_counter() - t0, "loadavg_start": load0, "loadavg_end": os.getloadavg()}
    return {"meta": meta, "figures": fig, "verdicts": verdicts(fig),
            "profile": {w: p["groups"] for w, p in profile.items()}, "profile_top": {w: p["top"] for w, p in
                                                                                    profile.items()}}


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return value


def _positive(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The options (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m edgesync_bench.floor", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help=f"a small run: {QUICK['seed_prompts']} seed and {QUICK['doc_prompts']} doc prompts, "
                        f"{QUICK['repeats']} repeats, {QUICK['process_prompts']} new process each")
    p.add_argument("--seed-prompts", type=_count, help=f"distinct seed prompts (default {DEFAULTS['seed_prompts']})")
    p.add_argument("--doc-prompts", type=_count, help=f"doc-QA prompts (default {DEFAULTS['doc_prompts']})")
    p.add_argument("--repeats", type=_positive, help=f"timed exact rounds (default {DEFAULTS['repeats']})")
    p.add_argument("--process-prompts", type=_count,
                   help=f"prompts per workload run in a new process (default {DEFAULTS['process_prompts']})")
    p.add_argument("--doc-tokens", type=_positive, default=DOC_TOKENS,
                   help=f"doc-QA prompt size, tokens (default {DOC_TOKENS})")
    p.add_argument("--max-tokens", type=_positive, default=MAX_TOKENS,
                   help=f"tokens per answer (default {MAX_TOKENS})")
    p.add_argument("--threads", type=_positive, help="llama.cpp threads (default: EDGESYNC_THREADS or all cores)")
    p.add_argument("--profile", action="store_true", help="also profile exact hits (cProfile, grouped)")
    p.add_argument("--workdir", type=Path, help="keep the store here (default: a temporary directory, removed)")
    p.add_argument("--json", type=Path, help="write every figure to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m edgesync_bench.floor``: print the tables; 0, or 2 for bad input."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    from edgesync_bench.floor_report import render
    from edgesync_bench.workloads import WorkloadDataError
    from edgesync_engines.adapters.model_files import ModelLoadError, ModelNotFoundError
    from edgesync_engines.app.cli_common import progress_bar

    if args.json is not None and (args.json.is_dir() or not args.json.resolve().parent.is_dir()):
        sys.stderr.write(f"error: --json {args.json}: not a file in an existing directory\n")
        return 2
    try:
        with progress_bar("{task.description:>24}", disable=args.no_progress) as progress:
            report = run(args, progress)
    except (ValueError, WorkloadDataError, ModelNotFoundError, ModelLoadError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    sys.stdout.write(render(report["figures"], report["verdicts"], report["profile"]))
    meta = report["meta"]
    sys.stdout.write(f"\n{meta['wall_s'] / 60:.1f} min, llama.cpp threads {meta['threads'] or 'all'}, load average "
                     f"{meta['loadavg_start'][0]:.2f} -> {meta['loadavg_end'][0]:.2f}\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
