"""``python benchmarks/serve.py``: ``edgesync serve`` side by side with llama-cpp-python's own
OpenAI server (``python -m llama_cpp.server``, same GGUF, ``cache: true`` with ``cache_type:
disk``, and again with its RAM cache), each restarted halfway through, on the same chat-workload
requests sent by the same ``openai`` client. Not a test: it prints ratios and writes JSON.

Requests: the chat workload's sessions (:func:`edgesync_bench.bench_workloads.chat_sessions`, seeded
selection, first ``--sessions``), each turn's prompt the conversation so far. The answers in
those prompts are computed once here with ``EdgeSync(store=False)`` (greedy), so every server is
sent exactly the same message lists. Order: turn 0 of every session, then turn 1 of every
session, ..., so that later turns, which extend earlier prompts, fall on both sides of the
restart. ``max_tokens`` 16, temperature 0.

Per server: a fresh state (new store directory, new working directory for the peer's
``.cache/llama_cache``), the first half of the requests, a restart (SIGTERM, start again on the
same state), the second half. TTFT is measured by the client from sending the request to the
first streamed content chunk. Reported per server: TTFT mean/p50/p95 over the run and after the
restart, prompt tokens the server reported as cached (``usage.prompt_tokens_details``; the peer
reports none), and the peak RSS of its process tree (server and workers) in each half. Then the
ratios of EdgeSync's mean TTFT to the better peer's, whole run and after the restart (the issue's
targets: at most 1/2 and 1/5).

Needs the ``serve-bench`` extra (the ``server`` extra of llama-cpp-python's packages, not a
rebuild of it) and the ``test`` extra (``openai``).

``--startup`` measures the start-up instead, against llama.cpp's own ``llama-server`` (``build/``,
``--llama-server``): the seconds from starting each server's process until ``GET /health``
answers 200 (asked every 10 ms; both answer 200 only once the model is loaded), ``--runs`` times
each (default 5), alternating, then the medians and their ratio. ``llama-server -m GGUF -t 2 -c
4096`` against ``edgesync serve`` with the options a user would give (``--model``, ``--store``, the
defaults otherwise: the console script beside this Python, one worker per 2 CPUs, its slots),
on a new store each run, then again on a store that holds a conversation (a restart: the page
check runs, the latest hit is rehearsed). Before each run it waits up to 60 s for the CPUs to be
idle (other processes' load slows both servers' evaluations); the JSON records each run's
busy share of the CPUs just before it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from the checkout
    sys.path.insert(0, str(ROOT))

from edgesync_bench.bench_workloads import adapter_token_counter, chat_sessions  # noqa: E402

MAX_TOKENS = 16
SYSTEMS = ("edgesync", "llama-disk", "llama-ram")


def build_requests(n_sessions: int, n_ctx: int, threads: int) -> list[list[dict]]:
    """The chat turns, interleaved by turn index, with EdgeSync's uncached greedy answers in
    their history."""
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_engines.request.router import EdgeSync

    with EdgeSync(store=False, config=EdgeSyncConfig.load({"n_threads": threads})) as es:
        by_session = []
        for session in chat_sessions(adapter_token_counter(es.adapter), n_sessions=n_sessions,
                                     max_tokens=MAX_TOKENS, n_ctx=n_ctx):
            turns = []
            while (turn := session.next_prompt()) is not None:
                turns.append(turn.as_messages())
                session.record_answer(es.generate(turns[-1], max_tokens=MAX_TOKENS).text)
            by_session.append(turns)
    longest = max(len(t) for t in by_session)
    return [t[j] for j in range(longest) for t in by_session if j < len(t)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux ``/proc``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def peak_rss_bytes(pid: int) -> int:
    """Sum of the peak resident set (VmHWM) of ``pid``'s process tree, bytes."""
    total = 0
    for p in tree_pids(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


class Server:
    """One server process: ``command`` (with ``{port}``) run in ``cwd``; :meth:`start` waits until
    ``ready_path`` (default ``/v1/models``) answers 200, asking every ``poll_s`` seconds."""

    def __init__(self, command: list[str], cwd: Path, env: dict, ready_path: str = "/v1/models",
                 poll_s: float = 0.3) -> None:
        self.command, self.cwd, self.env, self.ready_path, self.poll_s = command, cwd, env, ready_path, poll_s
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self, log) -> "Server":
        self.port = free_port()
        cmd = [c.format(port=self.port) for c in self.command]
        self.proc = subprocess.Popen(cmd, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=log)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = Path(log.name).read_text()[-800:]
                raise RuntimeError(f"{' '.join(cmd[:4])} did not start:\n{tail}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{self.ready_path}", timeout=2):
                    return self
            except OSError:
                time.sleep(self.poll_s)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def commands(system: str, model: Path, threads: int, n_ctx: int, state: Path,
             max_tokens: int = MAX_TOKENS) -> tuple[list[str], Path]:
    """The command line (``{port}`` left to fill) and working directory of a system (``edgesync``,
    ``llama-disk`` or ``llama-ram``); ``max_tokens`` is EdgeSync's ``--max-tokens-limit``."""
    py = sys.executable
    if system == "edgesync":
        return [py, "-m", "edgesync_engines.app.cli", "serve", "--port", "{port}", "--workers", "1", "--model",
                str(model), "--store", str(state / "store"), "--max-tokens-limit", str(max_tokens)], ROOT
    cache_type = "disk" if system == "llama-disk" else "ram"
    return [py, "-m", "llama_cpp.server", "--model", str(model), "--port", "{port}", "--n_ctx", str(n_ctx),
            "--n_threads", str(threads), "--n_threads_batch", str(threads),  # its batch default is every core
            "--cache", "true", "--cache_type", cache_type], state


def warm_client() -> None:
    """Run the ``openai`` client's streamed chat path once in this process, against a
    throwaway local HTTP server that answers one chunk: what the client builds at its first
    streamed request (lazy imports, request and chunk models; measured in docs/benchmarks.md)
    then counts against no system's first turns."""
    import http.server
    import threading

    import openai

    chunk = {"id": "warm", "object": "chat.completion.chunk", "created": 0, "model": "warm",
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": "warm"}, "finish_reason": None}]}
    body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with http.server.HTTPServer(("127.0.0.1", 0), Handler) as httpd:
        thread = threading.Thread(target=httpd.handle_request, daemon=True)
        thread.start()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{httpd.server_port}/v1", api_key="unused", max_retries=0,
                               timeout=30)
        send(client, "warm", [{"role": "user", "content": "warm"}], max_tokens=1)
        thread.join(30)


def send(client, model_id: str, messages: list[dict], max_tokens: int = MAX_TOKENS) -> dict:
    """One streamed request: client-side TTFT (ms) at the first content chunk, cached tokens, the
    answer's text and the ``timings`` object llama.cpp's llama-server adds, or the ``edgesync``
    object of ``edgesync serve`` (None from others).
    ``repeat_penalty`` 1 (llama_cpp.server's default is 1.1; EdgeSync ignores the field) makes
    every server decode greedily, so that their answers can be compared."""
    start = time.perf_counter()
    ttft, cached, timings, parts = None, None, None, []
    for chunk in client.chat.completions.create(model=model_id, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                extra_body={"repeat_penalty": 1.0}):
        usage = getattr(chunk, "usage", None)
        if usage is not None and usage.prompt_tokens_details is not None:
            cached = usage.prompt_tokens_details.cached_tokens
        extra = chunk.model_extra or {}
        timings = extra.get("timings") or extra.get("edgesync") or timings
        for choice in chunk.choices:
            if choice.delta.content:
                if ttft is None:
                    ttft = (time.perf_counter() - start) * 1000
                parts.append(choice.delta.content)
    return {"ttft_ms": ttft if ttft is not None else (time.perf_counter() - start) * 1000,
            "cached_tokens": cached, "text": "".join(parts), "timings": timings}


def run_system(system: str, requests: list[list[dict]], model: Path, threads: int, n_ctx: int, work: Path,
               progress, task) -> dict:
    """Both halves of one system, with the restart between them."""
    import openai

    state = work / system
    state.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EDGESYNC_THREADS": str(threads), "EDGESYNC_N_CTX": str(n_ctx)}
    cmd, cwd = commands(system, model, threads, n_ctx, state)
    half = len(requests) // 2
    records, rss = [], []
    with open(state / "server.log", "w") as log:
        for part in (requests[:half], requests[half:]):
            server = Server(cmd, cwd, env).start(log)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused",
                                   max_retries=0, timeout=600)
            model_id = client.models.list().data[0].id
            try:
                for messages in part:
                    records.append({**send(client, model_id, messages), "after_restart": len(records) >= half})
                    progress.advance(task)
                rss.append(peak_rss_bytes(server.proc.pid))
            finally:
                server.stop()
    return {"records": records, "peak_rss_bytes": rss}


def summarize(system: str, run: dict) -> dict:
    """TTFT statistics (ms), cached tokens and RSS of one system's run."""
    def stats(values):
        ordered = sorted(values)
        return {"mean": statistics.fmean(ordered), "p50": statistics.median(ordered),
                "p95": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]}

    recs = run["records"]
    cached = [r["cached_tokens"] for r in recs if r["cached_tokens"] is not None]
    return {"system": system, "requests": len(recs), "ttft_ms": stats([r["ttft_ms"] for r in recs]),
            "ttft_after_restart_ms": stats([r["ttft_ms"] for r in recs if r["after_restart"]]),
            "cached_tokens": sum(cached) if cached else None, "peak_rss_bytes": run["peak_rss_bytes"]}


def table(rows: list[dict]) -> str:
    """The Markdown table of the summaries."""
    out = ["| server | requests | TTFT mean / p50 / p95 (ms) | after restart mean / p50 / p95 (ms) | "
           "cached tokens reported | peak RSS 1st / 2nd half (MiB) |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        t, a = r["ttft_ms"], r["ttft_after_restart_ms"]
        cached = "none" if r["cached_tokens"] is None else f"{r['cached_tokens']:,}"
        rss = " / ".join(f"{b / 2**20:.0f}" for b in r["peak_rss_bytes"])
        out.append(f"| {r['system']} | {r['requests']} | {t['mean']:.0f} / {t['p50']:.0f} / {t['p95']:.0f} | "
                   f"{a['mean']:.0f} / {a['p50']:.0f} / {a['p95']:.0f} | {cached} | {rss} |")
    return "\n".join(out)


STARTUP_POLL_S = 0.01
"""Seconds between two ``GET /health`` of the start-up measurement."""
IDLE_BUSY_SHARE = 0.1
"""Busy share of the CPUs under which a start-up run begins (:func:`wait_idle`)."""


def cpu_busy_share(seconds: float = 0.3) -> float | None:
    """The share of the CPUs' time spent busy over the next ``seconds`` (Linux ``/proc/stat``; None elsewhere)."""
    def read() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # idle and iowait

    try:
        total0, idle0 = read()
        time.sleep(seconds)
        total1, idle1 = read()
    except (OSError, ValueError, IndexError):
        return None
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def wait_idle(limit_s: float = 60.0) -> float | None:
    """Wait until the CPUs are idle (busy under :data:`IDLE_BUSY_SHARE`), at most ``limit_s``;
    returns the last busy share read."""
    deadline = time.monotonic() + limit_s
    while True:
        share = cpu_busy_share()
        if share is None or share < IDLE_BUSY_SHARE or time.monotonic() > deadline:
            return share


def health_ready_s(cmd: list[str], env: dict, port: int, timeout_s: float = 300.0) -> float:
    """Seconds from starting ``cmd`` until ``GET /health`` on ``port`` answers 200 (asked every
    :data:`STARTUP_POLL_S`; a server that accepts before it answers holds the request until it
    does); the process is stopped with SIGTERM after. RuntimeError when it exits or times out."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        while True:
            if proc.poll() is not None or time.perf_counter() - start > timeout_s:
                raise RuntimeError(f"{' '.join(cmd[:2])} did not answer /health: {proc.stderr.read()[-800:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout_s) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:  # refused, or llama-server's 503 while it loads
                pass
            time.sleep(STARTUP_POLL_S)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def edgesync_command() -> list[str]:
    """``edgesync``: the console script beside this Python, else ``python -m edgesync_engines.app.cli``."""
    script = Path(sys.executable).with_name("edgesync")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "edgesync_engines.app.cli"]


def startup_command(system: str, llama_server: Path, model: Path, store: Path, port: int | str) -> list[str]:
    """The command line of one start-up run: llama-server on 2 threads and a 4096-token context
    (the machine's 2 cores; EdgeSync's default context), or ``edgesync serve`` with its defaults."""
    if system == "llama-server":
        return [str(llama_server), "-m", str(model), "-t", "2", "-c", "4096", "--port", str(port)]
    return [*edgesync_command(), "serve", "--port", str(port), "--model", str(model), "--store", str(store)]


def fill_store(store: Path, model: Path) -> None:
    """Serve one chat request with ``edgesync serve`` on ``store`` and stop it: the store then holds a
    conversation, its latest hit hint and a data file the page check reads at the next start."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = Server(startup_command("edgesync", Path(), model, store, "{port}"), ROOT, env, ready_path="/health")
    body = json.dumps({"model": model.stem, "max_tokens": 8,
                       "messages": [{"role": "user", "content": "Name three primary colours."}]}).encode()
    with open(store.parent / "fill.log", "w") as log:
        server.start(log)
        try:
            request = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as r:
                r.read()
        finally:
            server.stop()


def startup(args) -> int:
    """``--startup``: seconds to ``/health`` 200 of llama-server and ``edgesync serve`` (new store,
    then a store with a conversation), ``--runs`` each, alternating; medians and ratios."""
    from edgesync_engines.adapters.model_files import default_model_path

    model = args.model or default_model_path()
    if not args.llama_server.is_file():
        raise SystemExit(f"no llama-server at {args.llama_server} (--llama-server)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cases = [("llama-server", None), ("edgesync", "new store"), ("edgesync", "store with data")]
    runs: dict[str, list[dict]] = {f"{s} ({c})" if c else s: [] for s, c in cases}
    with tempfile.TemporaryDirectory(prefix="edgesync-startup-bench-") as tmp:
        kept = Path(tmp) / "kept" / "store"
        kept.parent.mkdir()
        fill_store(kept, model)
        for i in range(args.runs):
            for system, case in cases:
                store = kept if case == "store with data" else Path(tmp) / f"new-{i}" / "store"
                port = free_port()
                busy = wait_idle()
                seconds = health_ready_s(startup_command(system, args.llama_server, model, store, port), env, port)
                runs[f"{system} ({case})" if case else system].append({"seconds": seconds, "cpu_busy_before": busy})
    medians = {name: statistics.median(r["seconds"] for r in rs) for name, rs in runs.items()}
    base = medians["llama-server"]
    print("| server | to /health 200, median (s) | runs (s) | / llama-server |\n|---|---:|---|---:|")
    for name, rs in runs.items():
        times = " ".join(f"{r['seconds']:.3f}" for r in rs)
        print(f"| {name} | {medians[name]:.3f} | {times} | {medians[name] / base:.2f} |")
    busy = [r["cpu_busy_before"] for rs in runs.values() for r in rs if r["cpu_busy_before"] is not None]
    if busy and max(busy) >= IDLE_BUSY_SHARE:
        print(f"\nnote: the CPUs were up to {max(busy):.0%} busy before a run (other processes); times are noisy")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model": str(model), "llama_server": str(args.llama_server),
                                                   "runs": runs, "medians_s": medians,
                                                   "ratios": {n: m / base for n, m in medians.items()}},
                                                  indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    """Run the comparison (or, with ``--startup``, the start-up's); print the table and ratios; write ``--json``."""
    from edgesync_engines.adapters.model_files import default_model_path
    from edgesync_engines.app.cli_common import progress_bar

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--startup", action="store_true",
                   help="measure the start-up instead: seconds to /health 200, beside llama.cpp's llama-server")
    p.add_argument("--runs", type=int, default=5, help="with --startup: starts of each server (default 5)")
    p.add_argument("--llama-server", type=Path, default=ROOT / "build" / "llama-server",
                   help="with --startup: llama.cpp's server binary (default build/llama-server)")
    p.add_argument("--sessions", type=int, default=10, help="chat sessions (default 10)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every engine (default 2)")
    p.add_argument("--n-ctx", type=int, default=1024,
                   help="context window (default 1024); a turn that does not fit ends its session")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: EdgeSync's configured model)")
    p.add_argument("--json", dest="json_out", default=None, help="write the results here")
    p.add_argument("--requests", type=Path, default=None,
                   help="reuse the request list saved in this file by an earlier run (written when absent)")
    args = p.parse_args(argv)
    if args.startup:
        return startup(args)
    model = args.model or default_model_path()
    if args.requests is not None and args.requests.is_file():
        requests = json.loads(args.requests.read_text())
    else:
        requests = build_requests(args.sessions, args.n_ctx, args.threads)
        if args.requests is not None:
            args.requests.write_text(json.dumps(requests))
    rows, runs = [], {}
    with tempfile.TemporaryDirectory(prefix="edgesync-serve-bench-") as tmp, progress_bar() as progress:
        for system in SYSTEMS:
            task = progress.add_task(system, total=len(requests))
            runs[system] = run_system(system, requests, model, args.threads, args.n_ctx, Path(tmp), progress, task)
            rows.append(summarize(system, runs[system]))
    by = {r["system"]: r for r in rows}
    peers = [by["llama-disk"], by["llama-ram"]]
    best = min(peers, key=lambda r: r["ttft_ms"]["mean"])
    best_after = min(peers, key=lambda r: r["ttft_after_restart_ms"]["mean"])
    after = "ttft_after_restart_ms"
    ratios = {"whole_run": by["edgesync"]["ttft_ms"]["mean"] / best["ttft_ms"]["mean"],
              "whole_run_peer": best["system"],
              "after_restart": by["edgesync"][after]["mean"] / best_after[after]["mean"],
              "after_restart_peer": best_after["system"]}
    same = sum(a["text"] == b["text"] for a, b in zip(runs["edgesync"]["records"], runs["llama-disk"]["records"]))
    print(table(rows))
    print(f"\nEdgeSync mean TTFT / best peer's ({ratios['whole_run_peer']}): {ratios['whole_run']:.2f} (target <= 0.5)")
    print(f"after the restart / best peer's ({ratios['after_restart_peer']}): {ratios['after_restart']:.2f} "
          f"(target <= 0.2)")
    print(f"answers equal to llama-disk's: {same} of {len(requests)}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"requests": len(requests), "sessions": args.sessions,
                                                   "threads": args.threads, "n_ctx": args.n_ctx, "model": str(model),
                                                   "summary": rows, "ratios": ratios, "answers_equal": same,
                                                   "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
