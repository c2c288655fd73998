"""``python -m edgesync_bench.store_fuzz [--trials 200] [--quick] [--json OUT]``: flip random
bits at random offsets of real stores and ask the stored prompts again. Not a test (never run by
CI): it answers whether a damaged store can take the process down or change an answer.

A real store is made first: EdgeSync (the configured model, SmolLM2 through llama.cpp by
default) answers a few chat prompts on a new store, which stores their KV; the uncached answers
are the reference. Each trial copies that store, flips 1 to 16 random bits, at offsets in the
first 64 KiB (LMDB's meta pages and the tree pages written first) for half of the trials and
anywhere in ``data.mdb`` for the other half, and asks every prompt again through EdgeSync on
the copy. The trials run in a worker process (this module with ``--worker``) that loads the
model once; when it dies of a signal, the trial counts as killed and a new worker takes the
next one.

Per trial outcome: ``identical`` (every answer the reference's tokens), ``wrong`` (some answer
differs), ``killed`` (the worker died of a signal), ``failed`` (an exception took it down),
with how many trials the page check judged damaged (served uncached) and how many reused KV
from the damaged copy (a refused blob or head falls back to prefill). Wrong, killed and failed must all be 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIRST_REGION = 64 * 1024
"""Half of the trials flip bits in the first 64 KiB of ``data.mdb``."""
PROMPTS = [
    [{"role": "system", "content": "You are the support assistant of Northwind Cloud Storage. " * 12},
     {"role": "user", "content": "How do I reset my password?"}],
    [{"role": "system", "content": "You are a careful travel planner who answers briefly. " * 12},
     {"role": "user", "content": "What should I pack for three days in Lisbon?"}],
]
MAX_TOKENS = 12


def worker() -> int:
    """Read one JSON request per stdin line, ``{"store": path or null}``, answer every prompt on
    it and print ``{"tokens": [...], "reused": n, "cached": bool}``; the model loads once."""
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_engines.request.loading import adapter_for
    from edgesync_engines.request.router import EdgeSync

    cfg = EdgeSyncConfig.load({})
    adapter, _ = adapter_for(None, cfg)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        store = json.loads(line)["store"]
        es = EdgeSync(adapter, store=store if store else False, config=cfg)
        try:
            results = [es.generate(m, max_tokens=MAX_TOKENS) for m in PROMPTS]
            print(json.dumps({"tokens": [r.tokens for r in results], "reused": sum(r.tokens_reused for r in results),
                              "cached": es.store is not None}), flush=True)
        finally:
            es.close()
    return 0


class Worker:
    """The ``--worker`` child; :meth:`ask` returns its answer, or None when it died of a signal
    (the exit status, negative, in :attr:`died`)."""

    def __init__(self) -> None:
        self.died = 0
        self.proc = subprocess.Popen([sys.executable, "-m", "edgesync_bench.store_fuzz", "--worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        json.loads(self.proc.stdout.readline())

    def ask(self, store: Path | None) -> dict | None:
        self.proc.stdin.write(json.dumps({"store": str(store) if store else None}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if line:
            return json.loads(line)
        self.died = self.proc.wait()
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def flip_bits(data_file: Path, rng: random.Random, first_region: bool) -> list[tuple[int, int]]:
    """Flip 1-16 random bits of ``data_file`` in place; returns ``(offset, bit)`` of each."""
    size = data_file.stat().st_size
    span = min(size, FIRST_REGION) if first_region else size
    flips = [(rng.randrange(span), rng.randrange(8)) for _ in range(rng.randint(1, 16))]
    with open(data_file, "r+b") as f:
        for offset, bit in flips:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << bit)]))
    return flips


def run(trials: int, seed: int, work: Path) -> dict:
    """The fuzz run (module docstring); returns the figures."""
    rng = random.Random(seed)
    base = work / "base"
    w = Worker()
    reference = w.ask(None)["tokens"]
    first = w.ask(base)  # stores the prompts' KV
    again = w.ask(base)
    assert first["tokens"] == reference and again["tokens"] == reference and again["reused"] > 0, \
        "the healthy store does not reproduce the uncached answers"
    counts = {"trials": trials, "identical": 0, "wrong": 0, "killed": 0, "failed": 0, "judged_damaged": 0,
              "reused_kv": 0}
    killed = []
    t0 = time.perf_counter()
    for i in range(trials):
        copy = work / f"trial{i}"
        shutil.copytree(base, copy, ignore=shutil.ignore_patterns("lock.mdb"))
        flips = flip_bits(copy / "data.mdb", rng, first_region=i % 2 == 0)
        got = w.ask(copy)
        if got is None:  # killed by a signal, or an exception took the worker down
            counts["killed" if w.died < 0 else "failed"] += 1
            killed.append({"trial": i, "exit": signal.Signals(-w.died).name if w.died < 0 else w.died,
                           "flips": flips})
            w = Worker()
        else:
            counts["identical" if got["tokens"] == reference else "wrong"] += 1
            counts["judged_damaged"] += not got["cached"]
            counts["reused_kv"] += got["reused"] > 0
        shutil.rmtree(copy, ignore_errors=True)
        if (i + 1) % 10 == 0:  # progress, on stderr: the figures so far
            print(f"{i + 1} trials: " + ", ".join(f"{k} {v}" for k, v in counts.items() if k != "trials"),
                  file=sys.stderr, flush=True)
    w.close()
    counts["seconds"] = round(time.perf_counter() - t0, 1)
    counts["lost_trials"] = killed
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgesync_bench.store_fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200, help="trials (default 200)")
    parser.add_argument("--quick", action="store_true", help="20 trials")
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker()
    trials = 20 if args.quick else args.trials
    with tempfile.TemporaryDirectory(prefix="edgesync-fuzz-") as tmp:
        figures = run(trials, args.seed, Path(tmp))
    print(f"{figures['trials']} trials (half in the first 64 KiB), {figures['seconds']} s: "
          f"{figures['identical']} identical answers, {figures['wrong']} wrong answers, "
          f"{figures['killed']} processes killed by a signal, {figures['failed']} by an exception; "
          f"{figures['judged_damaged']} stores judged damaged "
          f"(served uncached), {figures['reused_kv']} trials reused KV from the damaged copy")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    for lost in figures["lost_trials"]:
        print(f"  trial {lost['trial']}: the worker exited with {lost['exit']}; bits flipped at {lost['flips']}")
    return 0 if figures["wrong"] == figures["killed"] == figures["failed"] == 0 else 1


if __name__ == "__main__":
    # exact mode alone: the semantic lookup would load an embedder in every trial's EdgeSync
    os.environ.setdefault("EDGESYNC_JOBS", "0")
    os.environ.setdefault("EDGESYNC_SEMANTIC", "0")
    os.environ.setdefault("EDGESYNC_THREADS", "1")  # spinning threads crawl on a shared 2-core machine
    raise SystemExit(main())
