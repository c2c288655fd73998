"""The page check on a healthy store and on damaged copies of it (make arm64-check).

    python tools/arm64/page_check.py --store DIR [--work DIR] [--serve] [--out FILE.json]

DIR is a store some process wrote (the exact-hit check's). Each case runs ``edgesync check
COPY --json`` on its own copy of it:

* healthy: the copy as it is; exit 0, ``healthy`` true;
* meta-root: the newest LMDB meta page's root page number of the main database, its bytes flipped;
* root-page: the header of that root page (flags, lower and upper bounds), its bytes flipped;
* every-page: the same header bytes of every page after the two meta pages, flipped.

A damaged copy must be reported damaged (exit 1, ``healthy`` false, the damage named), and the
process must end normally: no signal, no traceback. With ``--serve``, one request is then asked
of the meta-root copy with ``edgesync generate --json``: it must be answered (uncached, with one
warning), token-identical to an uncached answer (exact_hit.py's, given ``--reference``). Prints
a one-line JSON summary; exit status 1 when a case fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exact_hit import QUESTIONS, edgesync, generate, write_summary  # noqa: E402  (this directory's check)

PAGEHDRSZ = 16
META = struct.Struct("<QHHHH" "IIQQ")  # page header, then mm_magic, mm_version, mm_address, mm_mapsize
DB = struct.Struct("<IHHQQQQQ")  # MDB_db: pad (the page size in the free DB's), flags, depth, 4 counts, root
MAIN_ROOT = META.size + DB.size + DB.size - 8  # offset of mm_dbs[MAIN_DBI].md_root in a meta page
TAIL = struct.Struct("<QQ")  # mm_last_pg, mm_txnid
HEADER_FLAGS = slice(10, 16)  # mp_flags, mp_lower, mp_upper of a page header


def newest_meta(data: bytes) -> tuple[int, int, int, int]:
    """``(page size, offset of the newest meta page, its main root page, its last page)``."""
    psize = DB.unpack_from(data, META.size)[0]
    best = None
    for offset in (0, psize):
        *_, root = DB.unpack_from(data, offset + META.size + DB.size)
        last_pg, txnid = TAIL.unpack_from(data, offset + META.size + 2 * DB.size)
        if best is None or txnid > best[0]:
            best = (txnid, offset, root, last_pg)
    return psize, best[1], best[2], best[3]


def flip(buf: bytearray, start: int, stop: int) -> None:
    for i in range(start, stop):
        buf[i] ^= 0xFF


def damage(data_file: Path, case: str) -> str:
    """Flip the bytes of ``case`` in ``data_file``; what was flipped."""
    buf = bytearray(data_file.read_bytes())
    psize, meta, root, last_pg = newest_meta(buf)
    if case == "meta-root":
        flip(buf, meta + MAIN_ROOT, meta + MAIN_ROOT + 8)
        what = f"main root page number in the meta page at {meta} (page size {psize}, root {root})"
    elif case == "root-page":
        flip(buf, root * psize + HEADER_FLAGS.start, root * psize + HEADER_FLAGS.stop)
        what = f"header of the main root page {root}"
    elif case == "every-page":
        for pgno in range(2, last_pg + 1):
            flip(buf, pgno * psize + HEADER_FLAGS.start, pgno * psize + HEADER_FLAGS.stop)
        what = f"headers of pages 2..{last_pg}"
    else:
        raise ValueError(case)
    data_file.write_bytes(bytes(buf))
    return what


def run_check(store: Path) -> dict:
    proc = subprocess.run([*edgesync(), "check", str(store), "--json"], capture_output=True, text=True)
    try:
        report = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        report = None
    return {"exit": proc.returncode, "report": report, "traceback": "Traceback" in proc.stderr,
            "stderr": proc.stderr.strip()[-500:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", type=Path, required=True, help="a store a process wrote (copied, never changed)")
    parser.add_argument("--work", type=Path, help="where the copies go (default: a temporary directory)")
    parser.add_argument("--serve", action="store_true", help="also answer a request on a damaged copy")
    parser.add_argument("--reference", type=Path,
                        help="--serve: exact_hit.py's JSON, whose uncached answer is the reference (else one is run)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, help="write the JSON summary here too")
    args = parser.parse_args(argv)
    if not (args.store / "data.mdb").is_file():
        raise SystemExit(f"{args.store}: no data.mdb (run tools/arm64/exact_hit.py --store {args.store} first)")
    work = args.work or Path(tempfile.mkdtemp(prefix="edgesync-page-check-"))

    cases, ok = {}, True
    for case in ("healthy", "meta-root", "root-page", "every-page"):
        copy = work / case
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(args.store, copy)
        flipped = None if case == "healthy" else damage(copy / "data.mdb", case)
        r = run_check(copy)
        report = r["report"] or {}
        expected = (0, True) if case == "healthy" else (1, False)
        good = ((r["exit"], report.get("healthy")) == expected and not r["traceback"]
                and (case == "healthy" or bool(report.get("damage"))))
        ok = ok and good
        cases[case] = {"ok": good, "exit": r["exit"], "healthy": report.get("healthy"),
                       "damage": report.get("damage"), "flipped": flipped, "traceback": r["traceback"]}
        if not good:
            cases[case]["stderr"] = r["stderr"]
        print(f"page_check: {case}: exit {r['exit']}, healthy {report.get('healthy')}, "
              f"damage {report.get('damage')!r}", file=sys.stderr, flush=True)

    served = None
    if args.serve:
        question = QUESTIONS[0]
        if args.reference:
            reference = json.loads(args.reference.read_text())
            row = next(r for r in reference["requests"] if r["question"] == question)
            uncached, max_tokens = row["tokens"], reference["max_tokens"]
        else:
            uncached, max_tokens = generate(question, args.max_tokens, None)["tokens"], args.max_tokens
        answer = generate(question, max_tokens, work / "meta-root")
        served = {"hit": answer["hit"], "tokens_reused": answer["tokens_reused"],
                  "identical": answer["tokens"] == uncached, "seconds": answer["seconds"]}
        served["ok"] = served["identical"] and answer["tokens_reused"] == 0
        ok = ok and served["ok"]
    summary = {"check": "page_check", "ok": ok, "store": str(args.store), "cases": cases,
               "served_from_damaged": served}
    return write_summary(summary, args.out)


if __name__ == "__main__":
    sys.exit(main())
