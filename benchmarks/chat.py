"""``python benchmarks/chat.py``: interleaved multi-turn chat sessions against ``edgesync serve``
(idle-time storing on and off), llama.cpp's own ``llama-server`` (one slot, and one slot per
session) and llama-cpp-python's server (RAM cache), every server restarted halfway through. Not a
test: it prints tables of figures measured in the same run, as ratios, and writes JSON.

Workload: the chat workload's sessions (:func:`edgesync_bench.bench_workloads.chat_sessions`,
seeded selection, the first ``--sessions``, each cut to its first ``--turns`` user turns, a turn
that would not fit ``--n-ctx`` with ``--max-tokens`` ending its session). Every session runs in
its own thread and sends its turns through the ``openai`` client, streamed, greedy (temperature
0, ``repeat_penalty`` 1), ``max_tokens`` ``--max-tokens`` (256): turn k+1 only after the answer to turn k and a
think time (``--think``, 3 s). Each system's own answers are the assistant messages of its
later prompts, as a real client's would be, so the systems' prompts differ where their answers
do. ``--in-flight`` sessions (2) run at once and interleave at the server; when one ends the
next begins.

Restart: once half of the turns have been answered (half of those the uncached reference
conversation serves, see below), no new turn is admitted; when the turns in flight are answered
the server gets SIGTERM and is started again on the same state (EdgeSync: the same store), then
the sessions go on. A server that does not start (or restart) is reported as failed and the run
goes on with the next system.

Systems (``--systems``, default all): ``edgesync`` (``edgesync serve --workers 1``, a fresh
store, ``EDGESYNC_IDLE_STORE=1``), ``edgesync-no-idle`` (the same with ``EDGESYNC_IDLE_STORE=0``),
``edgesync-workers`` (``--workers`` = the sessions in flight, sharing ``--threads``: a request's
prefill runs alone on all of them, decode steps split them; EdgeSync's way to serve sessions at
once, beside llama-server's slots, which decode together),
``llama-server`` (``-np 1``, its defaults otherwise: ``cache_prompt`` on, the default
``--cache-ram``), ``llama-server-np`` (``-np`` = the sessions in flight, ``-c`` = n_ctx x slots),
``llama-cpp-python`` (``python -m llama_cpp.server`` with ``--cache true --cache_type ram``, as
``benchmarks/serve.py`` starts it, plus ``--interrupt_requests false``: its default ends a
streamed answer early, empty or cut, whenever another request arrives). All on the same GGUF,
``--threads`` threads and ``--n-ctx`` per sequence. ``--llama-server`` names the binary
(default ``build/llama-server`` in the checkout; ``make llama-server`` builds it); when it is
missing, its systems are skipped. Not in the default: ``llama-server-np-fa-off``, llama-server
``-np`` with ``-fa off`` (its default ``auto`` turns flash attention on here; EdgeSync's exact
mode computes without it), to tell the kernels' speed from the rest; it is never the peer of
the ratios. Before the first system, the ``openai`` client's streamed path runs once against a
throwaway local server, so that its first-request costs fall on no system's first turns.

In this process, one uncached model (``EdgeSync(store=False)``, same threads, context and flash
attention setting as EdgeSync's servers) gives:

- before the servers, the reference conversation (its own answers as the history): the turn
  count that places the restart, and a time estimate;
- after each system's run (its server stopped, so nothing competes for the cores): the fresh
  uncached answer to each of the system's prompts, and the **floor** of each later turn, both
  cached by the JSON of the messages (a prompt systems share is answered and measured once).
  The floor: with the conversation up to and including the previous answer live (the common
  token prefix of the new prompt and the previous prompt plus the answer's tokens, prefilled
  first, untimed) and then left idle for the think time, as a chat's live context is while its
  user types, the time ``LlamaCppAdapter.generate(tokens, n_past=K, max_tokens=1)`` takes to
  evaluate the turn's new tokens and sample the first token (the KV cache cleared before and
  after). The **hot floor** is the same evaluation again at once (the first K tokens kept): the
  threads still awake and the live KV in the CPU caches, as no server's context is after a
  think time; both are reported.

Reported per system and per kind of turn (``first``: turn 0; ``later``: a later turn, before the
restart or of a session begun after it; ``after-restart``: a later turn answered after the
restart of a session begun before it; ``first-after-restart``: a turn 0 sent after it, if any):
client TTFT (request sent to the first streamed content chunk) mean / p50 / p95, the floor's
and the hot floor's means and TTFT mean over each, the cached prompt tokens the server reported
(``usage.prompt_tokens_details.cached_tokens``; llama-server's ``timings.cache_n`` is kept in the
JSON too), the share of answers identical to the fresh uncached answer, and every system's mean
TTFT as a ratio to the best llama-server setting's of that kind. Per system: peak RSS of the
server's process tree before and after the restart, and, when ``edgesync serve`` reports the
``edgesync_idle_wait_seconds`` histogram on ``GET /metrics``, its p95 estimated from the buckets
(both server processes' counts summed; "n/a" otherwise). ``--json PATH`` writes every figure and
every turn's record; ``--workdir DIR`` keeps each server's state and log.

Needs the ``server`` extra (``edgesync serve``), the ``serve-bench`` extra (llama-cpp-python's
server), the ``test`` extra (``openai``) and, for the llama-server systems, ``make llama-server``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from the checkout
    sys.path.insert(0, str(ROOT))

from edgesync_bench.bench_workloads import ChatSession, adapter_token_counter, chat_sessions  # noqa: E402
from edgesync_bench.serve import Server, commands, peak_rss_bytes, send, warm_client  # noqa: E402

SYSTEMS = ("edgesync", "edgesync-no-idle", "edgesync-workers", "llama-server", "llama-server-np", "llama-cpp-python")
LLAMA_SERVERS = ("llama-server", "llama-server-np")
#: Not run by default: llama-server ``-np`` with flash attention off (``-fa off``), the setting
#: EdgeSync's exact mode computes with, to tell its kernels' speed from the rest.
DIAGNOSTIC_SYSTEMS = ("llama-server-np-fa-off",)
LLAMA_BINARY = (*LLAMA_SERVERS, *DIAGNOSTIC_SYSTEMS)
KINDS = ("first", "later", "after-restart", "first-after-restart")
LATER_KINDS = ("later", "after-restart")
IDLE_WAIT_METRIC = "edgesync_idle_wait_seconds"
MAX_THINK_S = 60.0
#: Rough cost of one answered turn on 2 busy cores, for the estimate printed before the
#: reference pass: about 1 s of prefill and template, and 25 ms per generated token.
GUESS_TURN_S, GUESS_TOKEN_S = 1.0, 0.025
#: Start, warm-up and stop of one server, seconds (twice per system).
GUESS_START_S = 15.0


# -- pure logic (benchmarks/tests/test_chat_bench.py) ------------------------------------------------------

def turn_kind(turn: int, after_restart: bool, session_began_before_restart: bool) -> str:
    """The kind of a turn (module docstring): ``first``, ``later``, ``after-restart`` or
    ``first-after-restart``."""
    if turn == 0:
        return "first-after-restart" if after_restart else "first"
    return "after-restart" if after_restart and session_began_before_restart else "later"


def ttft_stats(values: list[float]) -> dict | None:
    """Mean, median (p50) and p95 (nearest rank) of ``values``, or None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    n = len(ordered)
    p50 = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return {"mean": sum(ordered) / n, "p50": p50, "p95": ordered[min(n - 1, round(0.95 * (n - 1)))]}


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """The cumulative bucket counts ``{le: count}`` of the Prometheus histogram ``name`` in a
    ``/metrics`` text (series that differ in other labels summed); empty when it is absent."""
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if not line.startswith(name + "_bucket{"):
            continue
        le = re.search(r'le="([^"]+)"', line)
        if le is None:
            continue
        bound = math.inf if le.group(1) in ("+Inf", "Inf") else float(le.group(1))
        buckets[bound] = buckets.get(bound, 0.0) + float(line.rsplit(None, 1)[-1])
    return buckets


def merge_buckets(*parts: dict[float, float]) -> dict[float, float]:
    """Bucket counts of several processes' histograms, summed per bound."""
    out: dict[float, float] = {}
    for part in parts:
        for bound, count in part.items():
            out[bound] = out.get(bound, 0.0) + count
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's ``histogram_quantile``: the ``q`` quantile of cumulative ``{le: count}``,
    linear within the bucket that holds it (from 0 for the first); the largest finite bound
    when it falls in the ``+Inf`` bucket; None when the histogram has no observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


# -- the in-process model: token counts, reference answers, floors ---------------------------------

class Reference:
    """One uncached EdgeSync (``store=False``) in this process: token counts for the sessions'
    context cut-off (thread-safe), fresh answers and floors, each cached by the messages' JSON."""

    def __init__(self, threads: int, n_ctx: int, max_tokens: int, flash_attn: bool = False,
                 pause_s: float = 0.0) -> None:
        from edgesync_engines.config import EdgeSyncConfig
        from edgesync_engines.request.router import EdgeSync

        settings = {"n_threads": threads, "n_ctx": n_ctx, "flash_attn": flash_attn}
        self.es = EdgeSync(store=False, config=EdgeSyncConfig.load(settings))
        self.max_tokens, self.pause_s = max_tokens, pause_s
        self.lock = threading.Lock()
        self.counter = adapter_token_counter(self.es.adapter)
        self.answers: dict[str, str] = {}
        self.floors: dict[str, dict] = {}

    def count_tokens(self, messages) -> int:
        with self.lock:
            return self.counter(messages)

    def answer(self, messages: list[dict]) -> str:
        """The fresh uncached greedy answer to ``messages``."""
        key = json.dumps(messages)
        if key not in self.answers:
            with self.lock:
                self.answers[key] = self.es.generate(messages, max_tokens=self.max_tokens, temperature=0).text
        return self.answers[key]

    def floor(self, messages: list[dict]) -> dict:
        """The floor of a later turn (module docstring), after ``pause_s`` seconds idle:
        ``floor_ms``, ``floor_hot_ms``, ``live_tokens`` (K) and ``new_tokens`` (evaluated in
        each timed part)."""
        from edgesync_store.schema import common_prefix_len

        key = json.dumps(messages)
        if key in self.floors:
            return self.floors[key]
        adapter = self.es.adapter
        with self.lock, adapter.lock:
            tokens = self.es.prompt_tokens(messages)
            history = self.es.prompt_tokens(messages[:-2]) + adapter.tokenize(messages[-2]["content"], add_bos=False)
            k = min(common_prefix_len(tokens, history), len(tokens) - 1)
            adapter.clear_kv_cache()
            if k:
                adapter.prefill(tokens[:k])
            time.sleep(self.pause_s)
            ms = [self._timed_rest(tokens, k) for _ in range(2)]  # after the pause, then at once
            adapter.clear_kv_cache()
        self.floors[key] = {"floor_ms": ms[0], "floor_hot_ms": ms[1], "live_tokens": k, "new_tokens": len(tokens) - k}
        return self.floors[key]

    def _timed_rest(self, tokens: list[int], k: int) -> float:
        """Milliseconds to evaluate ``tokens[k:]`` on the live first ``k`` and sample a token."""
        t0 = time.perf_counter()
        for _token in self.es.adapter.generate(tokens, n_past=k, max_tokens=1, temperature=0.0):
            pass
        return (time.perf_counter() - t0) * 1000

    def close(self) -> None:
        self.es.close()


def make_sessions(count_tokens, n_sessions: int, turns: int, max_tokens: int, n_ctx: int) -> list[ChatSession]:
    """Fresh chat sessions: the workload's first ``n_sessions``, each cut to ``turns`` user turns."""
    return [ChatSession(s.session_id, s.user_turns[:turns], count_tokens, index=s.index, max_tokens=max_tokens,
                        n_ctx=n_ctx)
            for s in chat_sessions(count_tokens, n_sessions=n_sessions, max_tokens=max_tokens, n_ctx=n_ctx)]


def reference_pass(ref: Reference, args, progress) -> dict:
    """The reference conversation (its own answers as the history), session after session: the
    number of turns it serves and the seconds it took. Its answers stay in ``ref``'s cache."""
    t0 = time.perf_counter()
    sessions = make_sessions(ref.count_tokens, args.sessions, args.turns, args.max_tokens, args.n_ctx)
    task = progress.add_task("reference conversation", total=sum(s.n_turns for s in sessions))
    turns = 0
    for session in sessions:
        while (turn := session.next_prompt()) is not None:
            session.record_answer(ref.answer(list(turn.as_messages())))
            turns += 1
            progress.advance(task)
    return {"turns": turns, "seconds": time.perf_counter() - t0}


# -- the sessions and the restart -----------------------------------------------------------------

class Aborted(Exception):
    """The system's run was stopped (a request or a restart failed)."""


class Gate:
    """Admission of turns around the restart. Phases: ``before`` (turns admitted), ``draining``
    (``threshold`` turns answered: none admitted; the restart waits for those in flight),
    ``after`` (the restarted server's client; turns admitted again)."""

    def __init__(self, threshold: int, n_sessions: int) -> None:
        self.cond = threading.Condition()
        self.threshold, self.active = threshold, n_sessions
        self.in_flight = self.answered = 0
        self.midway = 0  # sessions with a turn answered and another to come
        self.phase = "before"
        self.client = self.model_id = None
        self.error: str | None = None

    def admit(self) -> tuple[object, str, bool]:
        """Wait until a turn may be sent: (client, model id, sent after the restart)."""
        with self.cond:
            self.cond.wait_for(lambda: self.error is not None or self.phase != "draining")
            if self.error is not None:
                raise Aborted(self.error)
            self.in_flight += 1
            return self.client, self.model_id, self.phase == "after"

    def answered_one(self, midway: int = 0) -> None:
        """A turn was answered; ``midway`` +1 when its session now has begun and goes on, -1
        when a session counted so ends. The restart comes once ``threshold`` turns are answered
        and some session is midway, so that later turns fall on both sides of it."""
        with self.cond:
            self.in_flight -= 1
            self.answered += 1
            self.midway += midway
            if self.phase == "before" and self.answered >= self.threshold and self.midway > 0:
                self.phase = "draining"
            self.cond.notify_all()

    def session_over(self, midway: int = 0) -> None:
        with self.cond:
            self.active -= 1
            self.midway += midway
            self.cond.notify_all()

    def fail(self, message: str) -> None:
        with self.cond:
            self.error = self.error or message
            self.cond.notify_all()

    def restart_due(self) -> bool:
        """Wait until the restart is due (True) or every session has ended or failed first (False)."""
        with self.cond:
            self.cond.wait_for(lambda: self.error is not None or self.active == 0
                               or (self.phase == "draining" and self.in_flight == 0))
            return self.error is None and self.active > 0 and self.phase == "draining"

    def resume(self, client, model_id: str, phase: str = "after") -> None:
        with self.cond:
            self.client, self.model_id, self.phase = client, model_id, phase
            self.cond.notify_all()



@dataclass
class Plan:
    """What every system's run shares: the options, the GGUF, the in-process model, the number
    of answered turns that triggers the restart, the work directory and the progress display."""

    args: argparse.Namespace
    model: Path
    ref: Reference
    threshold: int
    work: Path
    progress: object

    def sessions(self) -> list[ChatSession]:
        a = self.args
        return make_sessions(self.ref.count_tokens, a.sessions, a.turns, a.max_tokens, a.n_ctx)


def run_session(session: ChatSession, gate: Gate, plan: Plan, records: list, task,
                seats: threading.Semaphore) -> None:
    """One client: each turn sent once the previous answer and the think time are over, the
    server's own answer recorded as the history. The session holds one of ``seats``
    (``--in-flight``) from its first turn to its last."""
    began_before, counted = None, False
    seats.acquire()
    try:
        while (turn := session.next_prompt()) is not None:
            client, model_id, after = gate.admit()
            messages = list(turn.as_messages())
            r = send(client, model_id, messages, max_tokens=plan.args.max_tokens)
            session.record_answer(r["text"])
            step = (not counted and not session.done) - (counted and session.done)
            counted = counted != bool(step)
            gate.answered_one(midway=step)
            began_before = (not after) if began_before is None else began_before
            records.append({"session": session.index, "session_id": session.session_id, "turn": turn.turn,
                            "kind": turn_kind(turn.turn, after, began_before), "after_restart": after,
                            "prompt_tokens": turn.prompt_tokens, "messages": messages, **r})
            plan.progress.advance(task)
            if not session.done:
                time.sleep(plan.args.think)
    except Aborted:
        pass
    except Exception as exc:  # the server's or the connection's: stop this system's run
        gate.fail(f"session {session.index}: {type(exc).__name__}: {exc}")
    finally:
        seats.release()
        gate.session_over(midway=-1 if counted else 0)


# -- the servers ----------------------------------------------------------------------------------

def llama_server_command(binary: Path, model: Path, threads: int, n_ctx: int, slots: int) -> list[str]:
    """llama-server with its defaults, ``slots`` slots of ``n_ctx`` each (``-c`` is the total)."""
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", "{port}", "-t", str(threads),
            "-c", str(n_ctx * slots), "-np", str(slots), "--metrics"]


def server_for(system: str, plan: Plan, state: Path) -> Server:
    """The :class:`edgesync_bench.serve.Server` of a system (not started)."""
    a = plan.args
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EDGESYNC_THREADS": str(a.threads), "EDGESYNC_N_CTX": str(a.n_ctx)}
    if system.startswith("edgesync"):
        cmd, cwd = commands("edgesync", plan.model, a.threads, a.n_ctx, state, max_tokens=a.max_tokens)
        env["EDGESYNC_IDLE_STORE"] = "0" if system == "edgesync-no-idle" else "1"
        env["EDGESYNC_FLASH_ATTN"] = "1" if a.flash_attn else "0"
        if system == "edgesync-workers":  # one engine per session in flight, sharing the threads
            cmd[cmd.index("--workers") + 1] = str(min(a.sessions, a.in_flight))
        return Server(cmd, cwd, env, ready_path="/health")
    if system in LLAMA_BINARY:
        slots = 1 if system == "llama-server" else min(a.sessions, a.in_flight)
        cmd = llama_server_command(a.llama_server, plan.model, a.threads, a.n_ctx, slots)
        if system == "llama-server-np-fa-off":
            cmd += ["-fa", "off"]
        return Server(cmd, state, env, ready_path="/health")
    cmd, cwd = commands("llama-ram", plan.model, a.threads, a.n_ctx, state)
    # its default cuts a streamed answer off when another request arrives; queue them instead
    return Server([*cmd, "--interrupt_requests", "false"], cwd, env)


def connect(server: Server):
    """An ``openai`` client of a started server, and the model id it serves."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                           timeout=600)
    return client, client.models.list().data[0].id


def running(server: Server) -> bool:
    return server.proc is not None and server.proc.poll() is None


def stop_measured(server: Server, system: str) -> dict:
    """Peak RSS of the server's process tree and (EdgeSync) its idle-wait buckets; then SIGTERM."""
    out = {"peak_rss_bytes": peak_rss_bytes(server.proc.pid), "idle_wait_buckets": {}}
    if system.startswith("edgesync"):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
                out["idle_wait_buckets"] = histogram_buckets(r.read().decode(), IDLE_WAIT_METRIC)
        except OSError:
            pass
    server.stop()
    return out


def start(server: Server, log, gate: Gate, phase: str) -> None:
    """Start (or restart) the server and let the sessions use it; a process left running by a
    failed start is stopped."""
    try:
        gate.resume(*connect(server.start(log)), phase=phase)
    except BaseException:
        if running(server):
            server.stop()
        raise


def run_system(system: str, plan: Plan) -> dict:
    """One system's sessions, with the restart once ``plan.threshold`` turns are answered."""
    state = plan.work / system
    state.mkdir(parents=True)
    server = server_for(system, plan, state)
    sessions = plan.sessions()
    gate = Gate(plan.threshold, len(sessions))
    records, halves, restarted, detail = [], [], False, None
    with open(state / "server.log", "w") as log:
        try:
            start(server, log, gate, "before")
        except Exception as exc:  # the next system runs
            return {"records": [], "halves": [], "restarted": False, "error": "did not start", "error_detail": str(exc)}
        task = plan.progress.add_task(system, total=sum(s.n_turns for s in sessions))
        seats = threading.Semaphore(plan.args.in_flight)
        threads = [threading.Thread(target=run_session, args=(s, gate, plan, records, task, seats), daemon=True)
                   for s in sessions]
        try:
            for t in threads:
                t.start()
            if gate.restart_due():
                halves.append(stop_measured(server, system))
                try:
                    start(server, log, gate, "after")
                    restarted = True
                except Exception as exc:
                    gate.fail("did not restart")
                    detail = str(exc)
            for t in threads:
                t.join()
        finally:
            if running(server):
                halves.append(stop_measured(server, system))
    return {"records": records, "halves": halves, "restarted": restarted, "error": gate.error, "error_detail": detail}


def check_answers(run: dict, plan: Plan) -> None:
    """Each record's answer compared with the fresh uncached one (``identical``); each later
    turn's floor. Run with the system's server stopped."""
    task = plan.progress.add_task("  fresh answers, floors", total=len(run["records"]))
    for rec in run["records"]:
        rec["identical"] = rec["text"] == plan.ref.answer(rec["messages"])
        if rec["kind"] in LATER_KINDS:
            rec.update(plan.ref.floor(rec["messages"]))
        plan.progress.advance(task)


# -- figures --------------------------------------------------------------------------------------

def kind_summary(recs: list[dict]) -> dict:
    """The figures of one kind of turn of one system."""
    ttft = ttft_stats([r["ttft_ms"] for r in recs])
    floors = [r["floor_ms"] for r in recs if "floor_ms" in r]
    floor = sum(floors) / len(floors) if floors else None
    hot = [r["floor_hot_ms"] for r in recs if "floor_hot_ms" in r]
    hot_floor = sum(hot) / len(hot) if hot else None
    cached = [r["cached_tokens"] for r in recs if r["cached_tokens"] is not None]
    timing_cache = [r["timings"]["cache_n"] for r in recs if (r.get("timings") or {}).get("cache_n") is not None]
    return {"turns": len(recs), "ttft_ms": ttft, "floor_ms_mean": floor,
            "ttft_over_floor": ttft["mean"] / floor if floor else None,
            "floor_hot_ms_mean": hot_floor, "ttft_over_hot_floor": ttft["mean"] / hot_floor if hot_floor else None,
            "cached_tokens": sum(cached) if cached else None,
            "timings_cache_n": sum(timing_cache) if timing_cache else None,
            "prompt_tokens": sum(r["prompt_tokens"] for r in recs),
            "identical": sum(r["identical"] for r in recs) / len(recs)}


def summarize(system: str, run: dict) -> dict:
    """Per kind of turn (:func:`kind_summary`) and per system figures of one run."""
    recs = run["records"]
    kinds = {k: kind_summary(sub) for k in KINDS if (sub := [r for r in recs if r["kind"] == k])}
    idle = merge_buckets(*(h["idle_wait_buckets"] for h in run["halves"]))
    return {"system": system, "error": run["error"], "restarted": run["restarted"], "turns": len(recs),
            "identical": sum(r["identical"] for r in recs) / len(recs) if recs else None, "kinds": kinds,
            "peak_rss_bytes": [h["peak_rss_bytes"] for h in run["halves"]],
            "idle_wait_p95_s": histogram_quantile(0.95, idle),
            "idle_wait_buckets": [[str(b), c] for b, c in sorted(idle.items())]}


def best_llama_server(rows: list[dict], kind: str) -> dict | None:
    """The llama-server setting with the lowest mean TTFT on ``kind`` turns (None: none ran)."""
    peers = [r for r in rows if r["system"] in LLAMA_SERVERS and not r["error"] and kind in r["kinds"]]
    return min(peers, key=lambda r: r["kinds"][kind]["ttft_ms"]["mean"], default=None)


def ratios(rows: list[dict]) -> dict:
    """Every system's mean TTFT per kind over the best llama-server setting's, and that setting."""
    out = {}
    for kind in KINDS:
        best = best_llama_server(rows, kind)
        if best is None:
            continue
        base = best["kinds"][kind]["ttft_ms"]["mean"]
        out[kind] = {"peer": best["system"], **{r["system"]: r["kinds"][kind]["ttft_ms"]["mean"] / base
                                                 for r in rows if not r["error"] and kind in r["kinds"]}}
    return out


def _cell(value, fmt: str = "{:.0f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def kind_table(kind: str, rows: list[dict], ratio: dict | None) -> str:
    """The Markdown table of one kind of turn, systems side by side."""
    cols = [r for r in rows if not r["error"] and kind in r["kinds"]]
    figs = [r["kinds"][kind] for r in cols]
    out = [f"| {kind} turns | " + " | ".join(r["system"] for r in cols) + " |", "|---|" + "---:|" * len(cols)]

    def line(label: str, cells) -> None:
        out.append(f"| {label} | " + " | ".join(cells) + " |")

    line("turns", [str(f["turns"]) for f in figs])
    line("TTFT mean / p50 / p95 (ms)", [" / ".join(f"{f['ttft_ms'][k]:.0f}" for k in ("mean", "p50", "p95"))
                                         for f in figs])
    if kind in LATER_KINDS:
        line("floor / hot floor mean (ms)", [f"{_cell(f['floor_ms_mean'])} / {_cell(f.get('floor_hot_ms_mean'))}"
                                              for f in figs])
        line("TTFT mean / floor mean (/ hot floor mean)",
             [f"{_cell(f['ttft_over_floor'], '{:.2f}')} ({_cell(f.get('ttft_over_hot_floor'), '{:.2f}')})"
              for f in figs])
    peer = "n/a" if ratio is None else ratio["peer"]
    line(f"mean TTFT / best llama-server's ({peer})",
         [_cell(None if ratio is None else ratio.get(r["system"]), "{:.2f}") for r in cols])
    line("cached tokens reported / prompt tokens",
         [f"{_cell(f['cached_tokens'], '{:,}')} / {f['prompt_tokens']:,}" for f in figs])
    line("answers identical to a fresh prefill", [f"{f['identical']:.0%}" for f in figs])
    return "\n".join(out)


def system_table(rows: list[dict]) -> str:
    """The Markdown table of the per-system figures."""
    out = ["| system | turns | identical | restarted | peak RSS before / after restart (MiB) | idle-wait p95 (s) |"
           " error |", "|---|---:|---:|---|---:|---:|---|"]
    for r in rows:
        rss = " / ".join(f"{b / 2**20:.0f}" for b in r["peak_rss_bytes"]) or "n/a"
        out.append(f"| {r['system']} | {r['turns']} | {_cell(r['identical'], '{:.0%}')} | "
                   f"{'yes' if r['restarted'] else 'no'} | {rss} | {_cell(r['idle_wait_p95_s'], '{:.3f}')} | "
                   f"{r['error'] or ''} |")
    return "\n".join(out)


def headline(rows: list[dict], by_kind: dict) -> list[str]:
    """EdgeSync's ratios to the best llama-server setting and its later turns' TTFT / floor."""
    out = []
    for r in rows:
        if not r["system"].startswith("edgesync") or r["error"]:
            continue
        parts = []
        for kind, label in (("later", "later turns"), ("after-restart", "after the restart"),
                            ("first", "first turns")):
            ratio = by_kind.get(kind, {}).get(r["system"])
            peer = by_kind[kind]["peer"] if ratio is not None else "no llama-server"
            parts.append(f"{label} {_cell(ratio, '{:.2f}')} ({peer})")
        later = r["kinds"].get("later", {})
        out.append(f"{r['system']}: mean TTFT / best llama-server's: {'; '.join(parts)}; "
                   f"later turns' TTFT / floor {_cell(later.get('ttft_over_floor'), '{:.2f}')} "
                   f"(/ hot floor {_cell(later.get('ttft_over_hot_floor'), '{:.2f}')})")
    return out


def report(rows: list[dict]) -> str:
    """Every table and the headline ratios, as printed."""
    by_kind = ratios(rows)
    parts = [kind_table(k, rows, by_kind.get(k)) for k in KINDS
             if any(not r["error"] and k in r["kinds"] for r in rows)]
    return "\n\n".join([*parts, system_table(rows), "\n".join(headline(rows, by_kind))])


# -- the command ----------------------------------------------------------------------------------

def think_seconds(text: str) -> float:
    """An argparse type: seconds in [0, MAX_THINK_S]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= MAX_THINK_S:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_THINK_S:g}] seconds, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from edgesync_engines.app.cli_common import int_at_least

    positive = int_at_least(1)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=positive, default=8, help="chat sessions (default 8)")
    p.add_argument("--in-flight", type=positive, default=2,
                   help="sessions in flight at once, interleaved at the server; the next starts when one ends "
                        "(default 2: with 3 s think time and 256-token answers one engine on 2 cores is then busy "
                        "most of the time; more saturates it, and every system's TTFT is then its queue)")
    p.add_argument("--turns", type=positive, default=4, help="user turns per session at most (default 4)")
    p.add_argument("--max-tokens", type=positive, default=256, help="new tokens per answer at most (default 256)")
    p.add_argument("--think", type=think_seconds, default=3.0,
                   help=f"a client's pause between an answer and its next turn, s (default 3, at most {MAX_THINK_S:g})")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, of {', '.join(SYSTEMS)} (default all), or the diagnostic "
                        f"{', '.join(DIAGNOSTIC_SYSTEMS)} (llama-server -np with flash attention off; never the peer "
                        "of the ratios)")
    p.add_argument("--threads", type=positive, default=2, help="CPU threads of every engine (default 2)")
    p.add_argument("--n-ctx", type=int_at_least(64), default=2048, help="context window per sequence (default 2048)")
    p.add_argument("--flash-attn", action="store_true",
                   help="EdgeSync's servers and its reference with llama.cpp flash attention (EDGESYNC_FLASH_ATTN=1, "
                        "llama-server's default here); answers are then compared with an uncached run with it on")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: EdgeSync's configured model)")
    p.add_argument("--llama-server", type=Path, default=ROOT / "build" / "llama-server",
                   help="llama.cpp's llama-server binary (default build/llama-server; `make llama-server`)")
    p.add_argument("--json", dest="json_out", type=Path, default=None, help="write every figure here")
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the servers' states and logs here (default: a temporary directory, removed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def chosen_systems(args, say) -> list[str]:
    """The systems asked for, less the llama-server ones when the binary is missing."""
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in (*SYSTEMS, *DIAGNOSTIC_SYSTEMS)]
    if unknown or not systems:
        raise SystemExit(f"--systems: unknown {', '.join(unknown) or '(none given)'}; choose from "
                         f"{', '.join((*SYSTEMS, *DIAGNOSTIC_SYSTEMS))}")
    if not args.llama_server.is_file() and any(s in LLAMA_BINARY for s in systems):
        say(f"{', '.join(s for s in systems if s in LLAMA_BINARY)}: skipped, {args.llama_server} not found "
            "(`make llama-server` builds it)")
        systems = [s for s in systems if s not in LLAMA_BINARY]
    return systems


def estimate_seconds(turns: int, turn_s: float, args, n_systems: int) -> float:
    """A rough run time: per system the longer of its turns served one after another and one
    session's own path (its turns and think times), about half as much again for the fresh
    answers and floors of its prompts, a think time per floor, and two server starts."""
    per_system = max(turns * turn_s, args.turns * (turn_s + args.think))
    return n_systems * (1.5 * per_system + turns * args.think + 2 * GUESS_START_S)


def run_all(args, systems: list[str], model: Path, progress) -> tuple[list[dict], dict, dict]:
    """The reference pass, then every system: (summaries, runs, reference figures)."""
    say = progress.console.print
    guess = estimate_seconds(args.sessions * args.turns, GUESS_TURN_S + GUESS_TOKEN_S * args.max_tokens, args,
                             len(systems))
    say(f"estimated run time: about {guess / 60:.0f} min (a guess; refined after the reference conversation)")
    ref = Reference(args.threads, args.n_ctx, args.max_tokens, args.flash_attn, pause_s=args.think)
    try:
        rp = reference_pass(ref, args, progress)
        turn_s = rp["seconds"] / max(rp["turns"], 1)
        rp["threshold"] = max(1, rp["turns"] // 2)
        to_go = estimate_seconds(rp["turns"], turn_s, args, len(systems))
        say(f"reference conversation: {rp['turns']} turns in {rp['seconds']:.0f} s; restart after "
            f"{rp['threshold']} answered turns; about {to_go / 60:.0f} min to go")
        rows, runs = [], {}
        warm_client()  # the client's first-request costs fall on no system
        with tempfile.TemporaryDirectory(prefix="edgesync-chat-bench-") as tmp:
            plan = Plan(args, model, ref, rp["threshold"], args.workdir or Path(tmp), progress)
            for system in systems:
                runs[system] = run = run_system(system, plan)
                if run["error"]:
                    log = plan.work / system / "server.log" if args.workdir else "run with --workdir DIR to keep it"
                    say(f"{system}: stopped, {run['error']} (server log: {log}); going on with the others")
                    if run["error_detail"]:
                        say(run["error_detail"])
                check_answers(run, plan)
                rows.append(summarize(system, run))
    finally:
        ref.close()
    return rows, runs, rp


def main(argv=None) -> int:
    """Run the benchmark; print the tables and ratios; write ``--json``."""
    from edgesync_engines.adapters.model_files import default_model_path
    from edgesync_engines.app.cli_common import progress_bar

    args = build_parser().parse_args(argv)
    model = args.model or default_model_path()
    with progress_bar(disable=args.no_progress) as progress:
        systems = chosen_systems(args, progress.console.print)
        rows, runs, rp = run_all(args, systems, model, progress)
    print(report(rows))
    if args.json_out:
        for run in runs.values():
            for rec in run["records"]:
                rec.pop("messages", None)
        options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json_out.write_text(json.dumps({"options": options, "model": str(model), "reference": rp,
                                             "summary": rows, "ratios": ratios(rows), "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
