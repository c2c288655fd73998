"""KV across kernel sets: does KV written by one llama.cpp build or architecture ever serve
another as an exact hit? Run by ``make arm64-check`` (x86_64 against aarch64 under emulation,
and the x86_64 AVX2 wheel against a ``GGML_NATIVE`` build of this machine), not by CI.

    python tools/kernel_check.py write --store DIR [--remote-url redis://...] --out writer.json
    python tools/kernel_check.py read --store DIR [--remote-url ...] --writer writer.json --out reader.json

``write`` answers a few chat prompts (SmolLM2, greedy) through ``EdgeSync`` with a store (and the
remote tier when given), so their KV is stored, and records the engine's kernel digest, its
``llama_print_system_info`` and a SHA-256 over the K and V of each prompt as this build computed
it. ``read``, in another build or architecture, on the writer's store (or on a new local store
behind the same remote tier): its own KV of each prompt (do the bits agree with the writer's?),
an uncached answer, the answer from the store, and the same prompt again (its own exact hit).

The verdict, printed as JSON (exit status 1 when it fails, 2 for bad input):

* the answer from the store is token-identical to the uncached one;
* the writer's KV is found in the store (or behind the remote tier), and it was an exact hit
  exactly when the writer's kernel digest is this one's and every KV bit agreed (a miss
  otherwise, nothing refused, no traceback); a writer of another model is refused;
* the second asking is an exact hit on the reader's own KV (the store works there).

Kernel digests that differ while the KV bits agree are reported (``shareable_but_apart``): the
check then keeps KV apart that could have been shared, which is safe.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
from pathlib import Path

from edgesync_store.schema import Namespace

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ("How do I keep basil alive on a windowsill?", "What should I pack for a two-day hike?")
MAX_TOKENS = 8


class CheckError(Exception):
    """Bad input or a check that cannot be made: one line, exit status 2."""


def prompts(path: Path, n: int) -> list[list[dict]]:
    """``n`` chat prompts: a system prompt of ``system_prompts.json`` and a question each."""
    try:
        rows = json.loads(path.read_text())
        [rows[i]["system_prompt"] for i in range(n)]
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise CheckError(f"--prompts {path}: not the workload's system_prompts.json ({exc}); "
                         "pass --prompts or set EDGESYNC_WORKLOADS") from None
    return [[{"role": "system", "content": rows[i]["system_prompt"]}, {"role": "user", "content": QUESTIONS[i]}]
            for i in range(n)]


def open_engine(store, remote_url: str | None, prefix: str):
    """``EdgeSync`` on SmolLM2 with ``store`` (a path, or False: uncached) and the remote tier."""
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_engines.request.router import EdgeSync

    overrides = {"remote_url": remote_url, "remote_prefix": prefix} if remote_url and store else {}
    return EdgeSync(store=store, config=EdgeSyncConfig.load(overrides))


def kv_digest(es, messages: list[dict]) -> tuple[str, list[int]]:
    """SHA-256 hex over the K and V this build computes for the prompt (the live KV after an
    uncached answer, extracted as fragments), and the answer's tokens."""
    result = es.generate(messages, max_tokens=MAX_TOKENS)
    tokens = es.prompt_tokens(messages)
    digest = hashlib.sha256()
    for f in es.adapter.extract_fragments(tokens, [(0, len(tokens))]):
        digest.update(f.keys.tobytes())
        digest.update(f.values.tobytes())
    return digest.hexdigest(), list(result.tokens)


def engine_facts(es) -> dict:
    import llama_cpp

    return {"machine": platform.machine(), "kernels": es.adapter.namespace.kernels,
            "namespace": es.adapter.namespace.to_dict(),
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
            "lib_dir": os.environ.get("LLAMA_CPP_LIB_PATH") or str(Path(llama_cpp.__file__).parent / "lib")}


def write(args) -> dict:
    chats = prompts(args.prompts, args.n)
    es = open_engine(str(args.store), args.remote_url, args.prefix)
    try:
        facts = engine_facts(es)
        rows = []
        for messages in chats:
            result = es.generate(messages, max_tokens=MAX_TOKENS)
            rows.append({"tokens": list(result.tokens), "hit": result.hit, "written": result.fragments_written})
        flush = getattr(es.store, "flush", None)
        if args.remote_url and (flush is None or not flush(30.0)):
            raise CheckError(f"the remote tier {args.remote_url} did not take the fragments (see the warnings above)")
    finally:
        es.close()
    bare = open_engine(False, None, args.prefix)
    try:
        for row, messages in zip(rows, chats):
            row["kv"], _ = kv_digest(bare, messages)
    finally:
        bare.close()
    return {**facts, "prompts": rows}


def load_writer(path: Path) -> dict:
    """The writer's JSON, checked; CheckError naming what is wrong."""
    try:
        writer = json.loads(path.read_text())
        namespace = Namespace.from_dict(writer["namespace"])
        n = len(writer["prompts"])
        if not 1 <= n <= len(QUESTIONS) or not all("kv" in row for row in writer["prompts"]):
            raise ValueError(f"{n} prompts, expected 1 to {len(QUESTIONS)} with their KV digests")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckError(f"--writer {path}: not a kernel_check.py write result ({exc})") from None
    writer["namespace"] = namespace
    return writer


def read(args) -> dict:
    writer = load_writer(args.writer)
    chats = prompts(args.prompts, len(writer["prompts"]))
    bare = open_engine(False, None, args.prefix)
    try:
        facts = engine_facts(bare)
        own = [kv_digest(bare, messages) for messages in chats]
        mine = bare.adapter.namespace
    finally:
        bare.close()
    if mine.model_fingerprint != writer["namespace"].model_fingerprint:
        raise CheckError("the writer ran another model (fingerprint "
                         f"{writer['namespace'].model_fingerprint[:12]}, here {mine.model_fingerprint[:12]})")
    same_kernels = facts["kernels"] == writer["kernels"]
    es = open_engine(str(args.store), args.remote_url, args.prefix)
    rows, ok = [], True
    try:
        for (kv, uncached), messages, wrote in zip(own, chats, writer["prompts"]):
            # the writer's KV must be there, or a miss would prove nothing
            stored = es.store.prefix_walk(writer["namespace"], es.prompt_tokens(messages)).matched_tokens \
                if es.store is not None else 0
            if not stored:
                raise CheckError(f"the writer's KV is not in --store {args.store}"
                                 + (f" nor behind {args.remote_url}" if args.remote_url else ""))
            first = es.generate(messages, max_tokens=MAX_TOKENS)
            again = es.generate(messages, max_tokens=MAX_TOKENS)
            bits_agree = kv == wrote["kv"]
            row = {"writer_tokens_found": stored, "kv_bits_agree": bits_agree,
                   "hit": first.hit, "tokens_prefilled": first.tokens_prefilled,
                   "identical": list(first.tokens) == uncached, "again_hit": again.hit,
                   "again_identical": list(again.tokens) == uncached}
            # equal kernels and bits must hit; anything else must miss
            expected = "exact" if same_kernels and bits_agree else "miss"
            row["ok"] = (row["identical"] and row["again_identical"] and again.hit == "exact"
                         and first.hit == expected)
            ok = ok and row["ok"]
            rows.append(row)
    finally:
        es.close()
    apart = not same_kernels and all(r["kv_bits_agree"] for r in rows)
    facts.pop("namespace")
    return {**facts, "writer_machine": writer["machine"], "writer_kernels": writer["kernels"],
            "same_kernels": same_kernels, "shareable_but_apart": apart, "prompts": rows, "ok": ok}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("write", "read"))
    parser.add_argument("--store", type=Path, required=True, help="the local store directory")
    parser.add_argument("--remote-url", help="the shared remote tier (redis://host:port)")
    parser.add_argument("--prefix", default="kernel-check", help="the remote tier's key prefix")
    parser.add_argument("--writer", type=Path, help="read: the writer's JSON")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    parser.add_argument("--n", type=int, default=2, choices=range(1, len(QUESTIONS) + 1), help="write: prompts")
    workloads = Path(os.environ.get("EDGESYNC_WORKLOADS") or ROOT.parent / "shared" / "workloads")
    parser.add_argument("--prompts", type=Path, default=workloads / "system_prompts.json",
                        help="the workload's system_prompts.json (default: in $EDGESYNC_WORKLOADS or "
                             "../shared/workloads)")
    args = parser.parse_args(argv)
    if args.step == "read" and args.writer is None:
        parser.error("read needs --writer")
    try:
        report = write(args) if args.step == "write" else read(args)
    except CheckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0 if report.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
