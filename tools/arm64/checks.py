"""The checks of make arm64-check, run inside the arm64 root under emulation by tools/arm64/run.sh:

    /opt/edgesync/venv/bin/python /src/edgesync/tools/arm64/checks.py [--results DIR] [--only a,b]

Steps, in order (each one runs whatever the others did; the exit status is 1 when one failed):

* ``sysinfo``: the machine, Python, llama-cpp-python and llama.cpp's ``llama_print_system_info``
  (NEON, FP16, DOTPROD: the wheel is built for armv8.2-a+fp16+dotprod);
* ``fast``: the fast test layer, ``pytest -m "not model and not server and not redis and not
  slow" tests benchmarks/tests`` (two xdist workers when pytest-xdist imports), counts from its
  JUnit XML;
* ``exact``: tools/arm64/exact_hit.py (uncached, miss, exact hit in a new process);
* ``page``: tools/arm64/page_check.py on the exact check's store, healthy and damaged, with one
  request served from a damaged copy;
* ``semantic``: tools/arm64/semantic_check.py (names what is missing instead of failing);
* ``redis``: when ARM64_REDIS_URL is set (run.sh starts a redis-server on the host's loopback),
  redis-py in the root pings it, sets and reads a key.

Each step's JSON goes to DIR (default /xfer/results, the host's ROOT/xfer/results), with
summary.json over all; the summary is printed at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

SRC = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STATUS = Path("/opt/edgesync/status")
FAST_MARKERS = "not model and not server and not redis and not slow"
STEPS = ("sysinfo", "fast", "exact", "page", "semantic", "redis")


def run(cmd: list[str], **kw) -> int:
    print(f"$ {shlex.join(cmd)}", flush=True)
    return subprocess.run(cmd, cwd=SRC, **kw).returncode


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def step_sysinfo(out: Path) -> dict:
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    flags = dict(part.strip().split(" = ", 1) for part in info.split("|") if " = " in part)
    flags = {k.split(":")[-1].strip(): v.strip() for k, v in flags.items()}
    wanted = ("NEON", "FP16_VA", "DOTPROD")
    missing = [f for f in wanted if flags.get(f) != "1"]
    source = (SRC / ".arm64-source").read_text().split() if (SRC / ".arm64-source").exists() else []
    return {"ok": platform.machine() == "aarch64" and not missing, "machine": platform.machine(),
            "python": platform.python_version(), "llama_cpp_python": llama_cpp.__version__,
            "system_info": info, "missing_flags": missing, "source": source, "cpus": os.cpu_count()}


def step_fast(out: Path) -> dict:
    xml = out / "fast.xml"
    workers = ["-n", "2"] if importlib.util.find_spec("xdist") else []
    cmd = [sys.executable, "-m", "pytest", "-q", *workers, "-m", FAST_MARKERS, f"--junitxml={xml}",
           "tests", "benchmarks/tests"]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": ""}
    rc = run(cmd, env=env)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: list[str] = []
    if xml.exists():
        root = ET.parse(xml).getroot()
        for suite in root.iter("testsuite"):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
        for case in root.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"ok": rc == 0, "exit": rc, "xdist_workers": 2 if workers else 0, "passed": passed,
            "failed": counts["failures"], "errors": counts["errors"], "skipped": counts["skipped"],
            "failed_tests": failed[:50]}


def step_script(name: str, args: list[str], out: Path) -> dict:
    dest = out / f"{name}.json"
    dest.unlink(missing_ok=True)
    rc = run([sys.executable, str(HERE / f"{name}.py"), *args, "--out", str(dest)])
    result = read_json(dest) or {"ok": False}
    return {**result, "exit": rc, "ok": result.get("ok") if rc == 0 else False}


def step_redis(out: Path) -> dict:
    url = os.environ.get("ARM64_REDIS_URL")
    if not url:
        return {"ok": None, "skipped": "ARM64_REDIS_URL not set (no redis-server on the host)"}
    import redis

    client = redis.Redis.from_url(url, socket_timeout=10)
    key = f"arm64-check:{os.getpid()}"
    client.set(key, platform.machine().encode(), ex=60)
    value = client.get(key)
    client.delete(key)
    info = client.info("server")
    return {"ok": value == platform.machine().encode(), "url": url, "redis_version": info.get("redis_version"),
            "server_arch_bits": info.get("arch_bits"), "server_os": info.get("os")}


def brief(summary: dict) -> list[str]:
    """One or a few lines a step."""
    lines = []
    for name, r in summary.items():
        if name not in STEPS:
            continue
        verdict = {True: "ok", False: "FAILED"}.get(r.get("ok"), "skipped")
        head = f"{name:9s} {verdict:7s} {r.get('seconds', 0):7.1f} s"
        if name == "sysinfo" and "system_info" in r:
            lines.append(f"{head}  {r['machine']}, Python {r['python']}, llama-cpp-python {r['llama_cpp_python']}")
            lines.append(f"{'':27s}{r['system_info']}")
        elif name == "fast" and "passed" in r:
            lines.append(f"{head}  {r['passed']} passed, {r['failed']} failed, {r['errors']} errors, "
                         f"{r['skipped']} skipped (xdist workers: {r['xdist_workers']})")
            lines += [f"{'':27s}FAILED {t}" for t in r["failed_tests"]]
        elif name == "exact" and "requests" in r:
            lines.append(head)
            for q in r["requests"]:
                lines.append(f"{'':27s}A {q['A']['hit']}, B {q['B']['hit']}, C {q['C']['hit']} "
                             f"(reused {q['C']['tokens_reused']}, prefilled {q['C']['tokens_prefilled']} "
                             f"of {q['C']['prompt_tokens']}); identical {q['identical']}: {q['text']!r}")
                lines += [f"{'':27s}WRONG {w}" for w in q["wrong"]]
        elif name == "page" and "cases" in r:
            lines.append(head)
            for case, c in r["cases"].items():
                lines.append(f"{'':27s}{case}: exit {c['exit']}, healthy {c['healthy']}, damage {c['damage']!r}")
            if r.get("served_from_damaged"):
                lines.append(f"{'':27s}served from the damaged copy: {r['served_from_damaged']}")
        elif name == "semantic":
            detail = ("missing: " + "; ".join(r["missing"])) if r.get("missing") else \
                f"{r.get('backend')}, paraphrases {r.get('paraphrase_similarity')} {r.get('wrong') or ''}"
            lines.append(f"{head}  {detail}")
        elif name == "redis":
            lines.append(f"{head}  {r.get('url') or r.get('skipped')} (redis {r.get('redis_version')})")
        else:
            lines.append(f"{head}  {r.get('error', '')}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("/xfer/results"))
    parser.add_argument("--only", help=f"comma-separated steps of {','.join(STEPS)}")
    args = parser.parse_args(argv)
    steps = args.only.split(",") if args.only else list(STEPS)
    out = args.results
    out.mkdir(parents=True, exist_ok=True)
    stores = out.parent / "stores"
    exact_store = stores / "exact-hit"
    actions = {
        "sysinfo": lambda: step_sysinfo(out),
        "fast": lambda: step_fast(out),
        "exact": lambda: step_script("exact_hit", ["--store", str(exact_store)], out),
        "page": lambda: step_script("page_check", ["--store", str(exact_store), "--work", str(stores / "page-check"),
                                                   "--serve", "--reference", str(out / "exact_hit.json")], out),
        "semantic": lambda: step_script("semantic_check", ["--missing", str(STATUS / "semantic-missing")], out),
        "redis": lambda: step_redis(out),
    }
    summary: dict[str, dict] = {}
    for name in steps:
        print(f"\n===== arm64-check: {name} =====", flush=True)
        start = time.monotonic()
        try:
            result = actions[name]()
        except Exception as exc:  # a step that breaks is that step's failure, not the run's end
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.monotonic() - start, 1)
        summary[name] = result
        (out / f"step-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        verdict = {True: "ok", False: "FAILED"}.get(result.get("ok"), "skipped")
        print(f"===== arm64-check: {name}: {verdict} in {result['seconds']} s =====", flush=True)
    for name in ("test-missing", "semantic-missing", "dev-missing"):
        path = STATUS / name
        if path.exists() and path.read_text().strip():
            summary.setdefault("not_installed", {})[name] = path.read_text().strip().splitlines()
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n===== arm64-check summary =====")
    for line in brief(summary):
        print(line)
    print(f"(every step's JSON: {out})")
    return 1 if any(r.get("ok") is False for k, r in summary.items() if k in STEPS) else 0


if __name__ == "__main__":
    sys.exit(main())
