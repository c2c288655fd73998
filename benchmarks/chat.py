"""``python benchmarks/chat.py``: interleaved multi-turn chat sessions against ``edgesync serve``
(one worker, idle-time storing on and off; a worker per session; one worker with a slot per
session), llama.cpp's own ``llama-server`` (one slot, a slot per session, and a slot per session
with flash attention off) and llama-cpp-python's server (RAM cache), every server restarted
halfway through, at one or more numbers of sessions in flight. Not a test: it prints tables of
figures measured in the same run, as ratios, and writes JSON.

Workload: the chat workload's sessions (:func:`edgesync_bench.bench_workloads.chat_sessions`,
seeded selection, the first ``--sessions``, each cut to its first ``--turns`` user turns, a turn
that would not fit ``--n-ctx`` with ``--max-tokens`` ending its session). Every session runs in
its own thread and sends its turns through the ``openai`` client, streamed, greedy (temperature
0, ``repeat_penalty`` 1), ``max_tokens`` ``--max-tokens`` (256), ``stream_options``
``include_usage``: turn k+1 only after the answer to turn k and a think time (``--think``, 3 s).
Each system's own answers are the assistant messages of its later prompts, as a real client's
would be, so the systems' prompts differ where their answers do. N sessions run at once and
interleave at the server; when one ends the next begins. ``--in-flight`` takes a comma list of
N (default ``1,2,4``): every system runs once per N, each on a fresh state, and the tables and
the JSON are given per N.

Restart: once half of the turns have been answered (half of those the uncached reference
conversation serves, see below), no new turn is admitted; when the turns in flight are answered
the server gets SIGTERM and is started again on the same state (EdgeSync: the same store), then
the sessions go on. A server that does not start (or restart) is reported as failed and the run
goes on with the next system.

Systems (``--systems``, default all), with N the sessions in flight: ``edgesync`` (``edgesync
serve --workers 1``, a fresh store, ``EDGESYNC_IDLE_STORE=1``), ``edgesync-no-idle`` (the same
with ``EDGESYNC_IDLE_STORE=0``), ``edgesync-workers`` (``--workers N``, sharing ``--threads``: a
request's prefill runs alone on all of them, decode steps split them), ``edgesync-slots``
(``--workers 1 --slots N``: one engine, N conversations in one llama.cpp context, a KV stream
per sequence, their decode steps batched; skipped when ``edgesync serve --help`` has no
``--slots``; the other EdgeSync systems are then given ``--slots 1``, its default being several
a worker), ``llama-server`` (``-np 1``, its defaults otherwise: ``cache_prompt`` on, the
default ``--cache-ram``), ``llama-server-np`` (``-np N``, ``-c`` = n_ctx x N; the peer of the
ratios), ``llama-server-np-fa-off`` (the same with ``-fa off``: its default ``auto`` turns flash
attention on here, EdgeSync's exact mode computes without it; the peer of first turns, the
same numerics), ``llama-cpp-python`` (``python -m llama_cpp.server`` with ``--cache true
--cache_type ram``, as ``benchmarks/serve.py`` starts it, plus ``--interrupt_requests false``:
its default ends a streamed answer early, empty or cut, whenever another request arrives).
All on the same GGUF, ``--threads`` threads and ``--n-ctx`` per sequence (EdgeSync:
``EDGESYNC_THREADS``, ``EDGESYNC_N_CTX``, per slot with ``--slots``). ``--llama-server``
names the binary (default ``build/llama-server`` in the checkout; ``make llama-server`` builds
it); when it is missing, its systems are skipped. Before the first system, the ``openai``
client's streamed path runs once against a throwaway local server, so that its first-request
costs fall on no system's first turns.

Model: ``--model`` (default EdgeSync's configured one). Its GGUF header is read first: without
``tokenizer.chat_template`` EdgeSync renders a chat with llama.cpp's built-in template of the
architecture if it has one (llama-server falls back to ChatML), and cannot at all otherwise
(``llama``: none), so the run stops there. A GGUF of random weights (``--random-weights``, or
found from its header: a ``*.random_weights`` key set, ``random`` in ``general.name`` or
``general.description``, or a file under a ``shaped-gguf`` or ``tiny-gguf`` directory) is
named as such above every table: its timings, bytes and identity are real, its answers
meaningless (and their near-tied logits likely make a numeric difference change an answer more
often than a trained model's would).

In this process, one uncached model (``EdgeSync(store=False)``, same GGUF, threads, context and
flash attention setting as EdgeSync's servers) gives:

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

Reported per N, per system and per kind of turn (``first``: turn 0; ``later``: a later turn,
before the restart or of a session begun after it; ``after-restart``: a later turn answered
after the restart of a session begun before it; ``first-after-restart``: a turn 0 sent after
it, if any): client TTFT (request sent to the first streamed content chunk) mean / p50 / p95,
the floor's and the hot floor's means and TTFT mean over each, the cached prompt tokens the
server reported (``usage.prompt_tokens_details.cached_tokens``; llama-server's
``timings.cache_n`` is kept in the JSON too), the share of answers identical to the fresh
uncached answer, and every system's mean TTFT as a ratio to its peer's in the same N:
``llama-server-np-fa-off`` for ``first`` and ``first-after-restart`` turns,
``llama-server-np`` for ``later`` and ``after-restart`` turns ("n/a" when the peer did not
run or had no such turns). Per N and system: the **aggregate decode rate**, tokens a second: the completion tokens
after each answer's first (``usage.completion_tokens`` - 1) summed over the answers, over the
seconds during which at least one answer was decoding: the union of every answer's interval
from its first to its last streamed content chunk, at the client (the restart falls in no
interval). llama-server's usage counts the end-of-generation token, which comes after the last
content chunk, so one token less is counted of its answers that ended on it; llama-cpp-python's
server sends no usage in a stream, so its answers count their content chunks (a chunk per
token). Its ratio to ``llama-server-np``'s; peak RSS of the server's process tree before and
after the restart and the larger's ratio to ``llama-server-np``'s; the share of identical
answers; and, when ``edgesync serve`` reports the ``edgesync_idle_wait_seconds`` histogram on
``GET /metrics``, its p95 estimated from the buckets (both server processes' counts summed;
"n/a" otherwise), and its ``edgesync_slots`` gauge (the conversations it answers at once) of
each server process. ``--json PATH`` writes every figure and every turn's record (its send, first
and last content chunk and end times in seconds from the system's start, completion tokens,
finish reason), keyed by N under ``in_flight``; ``--workdir DIR`` keeps each server's state and
log (``DIR/in-flight-N/SYSTEM``).

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
from edgesync_bench.serve import Server, commands, peak_rss_bytes, warm_client  # noqa: E402

SYSTEMS = ("edgesync", "edgesync-no-idle", "edgesync-workers", "edgesync-slots", "llama-server", "llama-server-np",
           "llama-server-np-fa-off", "llama-cpp-python")
LLAMA_BINARY = ("llama-server", "llama-server-np", "llama-server-np-fa-off")
#: The peer of every ratio but the first turns' (llama-server, a slot per session in flight).
PEER = "llama-server-np"
#: The peer of first turns: the same with flash attention off, the numerics EdgeSync computes with.
FIRST_PEER = "llama-server-np-fa-off"
KINDS = ("first", "later", "after-restart", "first-after-restart")
LATER_KINDS = ("later", "after-restart")
#: Servers whose ``usage.completion_tokens`` counts the end-of-generation token (llama-server:
#: 32 for an answer of 31 content chunks that ended on it; EdgeSync counts the answer's tokens).
COUNTS_STOP_TOKEN = LLAMA_BINARY
KIND_PEERS = {"first": FIRST_PEER, "first-after-restart": FIRST_PEER, "later": PEER, "after-restart": PEER}
IDLE_WAIT_METRIC = "edgesync_idle_wait_seconds"
#: ``edgesync serve``'s gauge of the conversations its workers answer at once, in all.
SLOTS_METRIC = "edgesync_slots"
MAX_THINK_S = 60.0
DEFAULT_IN_FLIGHT = "1,2,4"
#: A record's times, seconds from its system's start (module docstring).
TIME_KEYS = ("sent_s", "first_s", "last_s", "end_s")
#: GGUF metadata keys that, set true, mark random weights; and the directories random-weight
#: GGUFs are built into (tools/tiny_gguf.py's cache; the Llama-3.2-1B-shaped model's).
RANDOM_WEIGHT_KEYS = ("edgesync.random_weights", "general.random_weights")
RANDOM_WEIGHT_DIRS = ("shaped-gguf", "tiny-gguf")
RANDOM_WEIGHTS_NOTE = ("{name}: random weights. Timings, bytes and identity are real; the answers' text means nothing "
                       "(and their lengths are not a real model's).")
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


def gauge_value(text: str, name: str) -> float | None:
    """The value of the unlabelled Prometheus gauge ``name`` in a ``/metrics`` text, or None."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == name:
            return float(parts[1])
    return None


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


def union_seconds(intervals) -> float:
    """The length of the union of ``(start, end)`` intervals: time covered by at least one."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def answer_tokens(rec: dict, counts_stop: bool = False) -> int | None:
    """The tokens an answer streamed: its ``usage.completion_tokens``, less the end-of-generation
    token when the server counts it (``counts_stop``) and the answer ended on it (``finish_reason``
    ``stop``); the content chunks when the server reported no usage (llama-cpp-python's server: a
    chunk per token, fewer only where a token ends inside a character); None without either."""
    if rec.get("completion_tokens") is not None:
        return rec["completion_tokens"] - (1 if counts_stop and rec.get("finish_reason") == "stop" else 0)
    return rec.get("content_chunks") or None


def decode_figures(recs: list[dict], counts_stop: bool = False) -> dict:
    """The aggregate decode rate of one system's answers (module docstring): ``tokens`` (each
    answer's :func:`answer_tokens` after its first, summed), ``busy_s`` (the union of the
    intervals from each answer's first to its last content chunk), ``tokens_per_s`` (None without
    any busy time), ``answers`` counted (those with a content chunk and a token count) and
    ``answers_without_usage`` (counted by their content chunks instead, or not at all)."""
    counted = [(r, n) for r in recs if r.get("first_s") is not None and (n := answer_tokens(r, counts_stop))]
    tokens = sum(max(n - 1, 0) for _, n in counted)
    busy = union_seconds((r["first_s"], r["last_s"]) for r, _ in counted)
    return {"tokens": tokens, "busy_s": busy, "tokens_per_s": tokens / busy if busy > 0 else None,
            "answers": len(counted), "answers_without_usage": sum(r.get("completion_tokens") is None for r in recs)}


def in_flight_values(text: str) -> tuple[int, ...]:
    """An argparse type: a comma list of sessions in flight (``1,2,4``), each >= 1, in the order
    given, repeats dropped."""
    values: list[int] = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"sessions in flight must be >= 1, got {value}")
        if value not in values:
            values.append(value)
    return tuple(values)


def random_weight_reason(metadata: dict, path: Path) -> str | None:
    """Why a GGUF is taken to hold random weights (module docstring), or None."""
    for key in RANDOM_WEIGHT_KEYS:
        if metadata.get(key) not in (None, False, 0, "", "0", "false", "False"):
            return f"{key} = {metadata[key]!r}"
    for key in ("general.name", "general.description"):
        if "random" in str(metadata.get(key) or "").lower():
            return f"{key} = {metadata[key]!r}"
    parts = [d for d in Path(path).parent.parts if d in RANDOM_WEIGHT_DIRS]
    return f"under a {parts[-1]} directory" if parts else None


def peer_ratios(rows: list[dict], peer: str, value) -> dict | None:
    """``value(row)`` of every system that ran over the ``peer`` system's, with ``peer`` named;
    None when the peer did not run or its value is None or 0. ``value`` may return None (left out)."""
    base_row = next((r for r in rows if r["system"] == peer and not r["error"]), None)
    base = value(base_row) if base_row is not None else None
    if not base:
        return None
    out: dict = {"peer": peer}
    for r in rows:
        v = None if r["error"] else value(r)
        if v is not None:
            out[r["system"]] = v / base
    return out


# -- the in-process model: token counts, reference answers, floors ---------------------------------

class Reference:
    """One uncached EdgeSync (``store=False``) in this process: token counts for the sessions'
    context cut-off (thread-safe), fresh answers and floors, each cached by the messages' JSON."""

    def __init__(self, threads: int, n_ctx: int, max_tokens: int, flash_attn: bool = False,
                 pause_s: float = 0.0, model: Path | None = None) -> None:
        from edgesync_engines.config import EdgeSyncConfig
        from edgesync_engines.request.router import EdgeSync

        settings = {"n_threads": threads, "n_ctx": n_ctx, "flash_attn": flash_attn}
        if model is not None:  # the servers' GGUF (else EdgeSync's configured one)
            settings["model_path"] = str(model)
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
    """What every system's run at one number of sessions in flight shares: the options, the
    GGUF, the in-process model, the number of answered turns that triggers the restart, the work
    directory, the progress display and the sessions in flight."""

    args: argparse.Namespace
    model: Path
    ref: Reference
    threshold: int
    work: Path
    progress: object
    in_flight: int = 2
    #: ``edgesync serve`` takes ``--slots`` (its default is then several per worker): the
    #: systems other than ``edgesync-slots`` are given ``--slots 1``.
    serve_slots: bool = False

    def sessions(self) -> list[ChatSession]:
        a = self.args
        return make_sessions(self.ref.count_tokens, a.sessions, a.turns, a.max_tokens, a.n_ctx)


def stream_answer(client, model_id: str, messages: list[dict], max_tokens: int, clock=time.perf_counter) -> dict:
    """One streamed request, as :func:`edgesync_bench.serve.send` sends it (greedy,
    ``repeat_penalty`` 1, ``include_usage``), timed at the client by ``clock``: ``ttft_ms`` (to
    the first content chunk, or to the end without one), ``sent_s``, ``first_s``, ``last_s``
    (first and last content chunk; None without one), ``end_s`` (the stream's end),
    ``completion_tokens`` and ``usage_prompt_tokens`` (the usage's; None when none came),
    ``content_chunks``,
    ``finish_reason``, ``cached_tokens``, the answer's ``text`` and llama-server's ``timings``
    or ``edgesync serve``'s ``edgesync`` object."""
    sent = clock()
    first = last = cached = completion = prompt = timings = finish = None
    parts: list[str] = []
    for chunk in client.chat.completions.create(model=model_id, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                extra_body={"repeat_penalty": 1.0}):
        now = clock()
        usage = getattr(chunk, "usage", None)
        if usage is not None:
            completion, prompt = usage.completion_tokens, getattr(usage, "prompt_tokens", None)
            if usage.prompt_tokens_details is not None:
                cached = usage.prompt_tokens_details.cached_tokens
        extra = chunk.model_extra or {}
        timings = extra.get("timings") or extra.get("edgesync") or timings
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            if choice.delta is not None and choice.delta.content:
                first = now if first is None else first
                last = now
                parts.append(choice.delta.content)
    end = clock()
    return {"ttft_ms": ((first if first is not None else end) - sent) * 1000, "sent_s": sent, "first_s": first,
            "last_s": last, "end_s": end, "completion_tokens": completion, "usage_prompt_tokens": prompt,
            "content_chunks": len(parts),
            "finish_reason": finish, "cached_tokens": cached, "text": "".join(parts), "timings": timings}


def run_session(session: ChatSession, gate: Gate, plan: Plan, records: list, task,
                seats: threading.Semaphore, epoch: float = 0.0) -> None:
    """One client: each turn sent once the previous answer and the think time are over, the
    server's own answer recorded as the history. The session holds one of ``seats``
    (the sessions in flight) from its first turn to its last. Times are kept as seconds from ``epoch``."""
    began_before, counted = None, False
    seats.acquire()
    try:
        while (turn := session.next_prompt()) is not None:
            client, model_id, after = gate.admit()
            messages = list(turn.as_messages())
            r = stream_answer(client, model_id, messages, max_tokens=plan.args.max_tokens)
            for key in TIME_KEYS:
                r[key] = None if r[key] is None else r[key] - epoch
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
    n = min(a.sessions, plan.in_flight)  # sessions in flight at once
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EDGESYNC_THREADS": str(a.threads), "EDGESYNC_N_CTX": str(a.n_ctx)}
    if system.startswith("edgesync"):
        cmd, cwd = commands("edgesync", plan.model, a.threads, a.n_ctx, state, max_tokens=a.max_tokens)
        env["EDGESYNC_IDLE_STORE"] = "0" if system == "edgesync-no-idle" else "1"
        env["EDGESYNC_FLASH_ATTN"] = "1" if a.flash_attn else "0"
        if system == "edgesync-workers":  # one engine per session in flight, sharing the threads
            cmd[cmd.index("--workers") + 1] = str(n)
        if system == "edgesync-slots":  # one engine, a slot (KV stream, n_ctx) per session in flight
            cmd += ["--slots", str(n)]
        elif plan.serve_slots:  # one conversation at a time per engine, as before --slots
            cmd += ["--slots", "1"]
        return Server(cmd, cwd, env, ready_path="/health")
    if system in LLAMA_BINARY:
        slots = 1 if system == "llama-server" else n
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
    """Peak RSS of the server's process tree and (EdgeSync) its idle-wait buckets and the
    conversations it answers at once (``edgesync_slots``, None when not reported); then SIGTERM."""
    out = {"peak_rss_bytes": peak_rss_bytes(server.proc.pid), "idle_wait_buckets": {}, "slots": None}
    if system.startswith("edgesync"):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
                text = r.read().decode()
            out["idle_wait_buckets"] = histogram_buckets(text, IDLE_WAIT_METRIC)
            out["slots"] = gauge_value(text, SLOTS_METRIC)
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
        task = plan.progress.add_task(f"{system}, {plan.in_flight} in flight", total=sum(s.n_turns for s in sessions))
        seats = threading.Semaphore(plan.in_flight)
        epoch = time.perf_counter()
        threads = [threading.Thread(target=run_session, args=(s, gate, plan, records, task, seats, epoch),
                                    daemon=True)
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
    rss = [h["peak_rss_bytes"] for h in run["halves"]]
    return {"system": system, "error": run["error"], "restarted": run["restarted"], "turns": len(recs),
            "identical": sum(r["identical"] for r in recs) / len(recs) if recs else None, "kinds": kinds,
            "decode": decode_figures(recs, counts_stop=system in COUNTS_STOP_TOKEN),
            "peak_rss_bytes": rss, "peak_rss_max_bytes": max(rss, default=None),
            "slots_reported": [h.get("slots") for h in run["halves"]],
            "idle_wait_p95_s": histogram_quantile(0.95, idle),
            "idle_wait_buckets": [[str(b), c] for b, c in sorted(idle.items())]}


def _kind_ttft(kind: str):
    return lambda r: r["kinds"][kind]["ttft_ms"]["mean"] if kind in r["kinds"] else None


def ratios(rows: list[dict]) -> dict:
    """The ratios of one number of sessions in flight, each with its peer named (module
    docstring): ``ttft`` per kind of turn (mean TTFT over :data:`KIND_PEERS`'s),
    ``decode_tokens_per_s`` and ``peak_rss`` (over :data:`PEER`'s). A ratio whose peer did not
    run is left out."""
    out: dict = {"ttft": {}}
    for kind in KINDS:
        if (r := peer_ratios(rows, KIND_PEERS[kind], _kind_ttft(kind))) is not None:
            out["ttft"][kind] = r
    for name, value in (("decode_tokens_per_s", lambda r: r["decode"]["tokens_per_s"]),
                        ("peak_rss", lambda r: r["peak_rss_max_bytes"])):
        if (r := peer_ratios(rows, PEER, value)) is not None:
            out[name] = r
    return out


def _cell(value, fmt: str = "{:.0f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def _ratio_cell(ratio: dict | None, system: str) -> str:
    return _cell(None if ratio is None else ratio.get(system), "{:.2f}x")


def _missing_peer(rows: list[dict], peer: str) -> str:
    """Why a ratio to ``peer`` is missing: it did not run, or has no such turns or figure."""
    ran = any(r["system"] == peer and not r["error"] for r in rows)
    return f"{peer} has none" if ran else f"{peer} did not run"


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
    missing = "" if ratio is not None else f" ({_missing_peer(rows, KIND_PEERS[kind])})"
    line(f"mean TTFT / {KIND_PEERS[kind]}'s{missing}", [_ratio_cell(ratio, r["system"]) for r in cols])
    line("cached tokens reported / prompt tokens",
         [f"{_cell(f['cached_tokens'], '{:,}')} / {f['prompt_tokens']:,}" for f in figs])
    line("answers identical to a fresh prefill", [f"{f['identical']:.0%}" for f in figs])
    return "\n".join(out)


def system_table(rows: list[dict], by: dict) -> str:
    """The Markdown table of the per-system figures (``by``: :func:`ratios`)."""
    out = [f"| system | turns | identical | aggregate decode tok/s (/ {PEER}'s) | decode tokens / busy s | "
           f"restarted | peak RSS before / after restart (MiB) | peak RSS / {PEER}'s | idle-wait p95 (s) | "
           "edgesync_slots | error |", "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        rss = " / ".join(f"{b / 2**20:.0f}" for b in r["peak_rss_bytes"]) or "n/a"
        d = r.get("decode") or {}
        rate = f"{_cell(d.get('tokens_per_s'), '{:.1f}')} ({_ratio_cell(by.get('decode_tokens_per_s'), r['system'])})"
        chunks = f" ({d['answers_without_usage']} answers by chunks)" if d.get("answers_without_usage") else ""
        slots = " / ".join(_cell(v) for v in r.get("slots_reported") or []) if any(r.get("slots_reported") or []) \
            else "n/a"
        out.append(f"| {r['system']} | {r['turns']} | {_cell(r['identical'], '{:.0%}')} | {rate} | "
                   f"{d.get('tokens', 0):,} / {d.get('busy_s', 0.0):.1f}{chunks} | "
                   f"{'yes' if r['restarted'] else 'no'} | {rss} | {_ratio_cell(by.get('peak_rss'), r['system'])} | "
                   f"{_cell(r['idle_wait_p95_s'], '{:.3f}')} | {slots} | {r['error'] or ''} |")
    return "\n".join(out)


def headline(rows: list[dict], by: dict) -> list[str]:
    """Each EdgeSync system's ratios to its peers (:func:`ratios`), its later turns' TTFT over
    their floor and its share of identical answers."""
    out = []
    for r in rows:
        if not r["system"].startswith("edgesync") or r["error"]:
            continue
        parts = []
        for kind, label in (("first", "first turns"), ("later", "later turns"), ("after-restart", "after the restart")):
            ratio = by["ttft"].get(kind)
            peer = KIND_PEERS[kind] if ratio is not None else _missing_peer(rows, KIND_PEERS[kind])
            parts.append(f"{label} {_ratio_cell(ratio, r['system'])} ({peer})")
        later = r["kinds"].get("later", {})
        out.append(f"{r['system']}: mean TTFT, {'; '.join(parts)}; aggregate decode tok/s "
                   f"{_ratio_cell(by.get('decode_tokens_per_s'), r['system'])} and peak RSS "
                   f"{_ratio_cell(by.get('peak_rss'), r['system'])} {PEER}'s; later turns' TTFT / floor "
                   f"{_cell(later.get('ttft_over_floor'), '{:.2f}')} "
                   f"(/ hot floor {_cell(later.get('ttft_over_hot_floor'), '{:.2f}')}); answers identical "
                   f"{_cell(r['identical'], '{:.0%}')}")
    return out


def report(rows: list[dict], note: str | None = None) -> str:
    """Every table and the headline ratios of one number of sessions in flight, as printed;
    ``note`` (the random-weights line) first and again above the headline."""
    by = ratios(rows)
    parts = [kind_table(k, rows, by["ttft"].get(k)) for k in KINDS
             if any(not r["error"] and k in r["kinds"] for r in rows)]
    notes = [note] if note else []
    return "\n\n".join([*notes, *parts, system_table(rows, by), "\n".join([*notes, *headline(rows, by)])])


def report_all(results: dict[int, list[dict]], note: str | None = None) -> str:
    """:func:`report` per number of sessions in flight, each under its heading."""
    return "\n\n".join(f"## {n} in flight\n\n{report(rows, note)}" for n, rows in results.items())


def json_results(results: dict[int, list[dict]], runs: dict[int, dict]) -> dict:
    """The JSON's ``in_flight`` object: per number in flight (a string key), its summaries,
    ratios and runs."""
    return {str(n): {"summary": rows, "ratios": ratios(rows), "runs": runs.get(n, {})} for n, rows in results.items()}


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
    p.add_argument("--in-flight", type=in_flight_values, default=in_flight_values(DEFAULT_IN_FLIGHT),
                   help="sessions in flight at once, interleaved at the server (the next starts when one ends); a "
                        "comma list runs every system once per value, tables and JSON per value (default "
                        f"{DEFAULT_IN_FLIGHT}: one conversation alone, then as many as a llama-server -np N or "
                        "edgesync --slots N serves together)")
    p.add_argument("--turns", type=positive, default=4, help="user turns per session at most (default 4)")
    p.add_argument("--max-tokens", type=positive, default=256, help="new tokens per answer at most (default 256)")
    p.add_argument("--think", type=think_seconds, default=3.0,
                   help=f"a client's pause between an answer and its next turn, s (default 3, at most {MAX_THINK_S:g})")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, of {', '.join(SYSTEMS)} (default all; the ratios' peers are {PEER} and, "
                        f"for first turns, {FIRST_PEER})")
    p.add_argument("--threads", type=positive, default=2, help="CPU threads of every engine (default 2)")
    p.add_argument("--n-ctx", type=int_at_least(64), default=2048,
                   help="context window per sequence (per slot; default 2048)")
    p.add_argument("--flash-attn", action="store_true",
                   help="EdgeSync's servers and its reference with llama.cpp flash attention (EDGESYNC_FLASH_ATTN=1, "
                        "llama-server's default here); answers are then compared with an uncached run with it on")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: EdgeSync's configured model)")
    p.add_argument("--random-weights", action="store_true",
                   help="say above every table that the GGUF's weights are random (found from its header or "
                        "directory otherwise: module docstring)")
    p.add_argument("--llama-server", type=Path, default=ROOT / "build" / "llama-server",
                   help="llama.cpp's llama-server binary (default build/llama-server; `make llama-server`)")
    p.add_argument("--json", dest="json_out", type=Path, default=None, help="write every figure here")
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the servers' states and logs here (default: a temporary directory, removed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def serve_has_slots() -> bool:
    """Whether this checkout's ``edgesync serve`` takes ``--slots``."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "edgesync_engines.app.cli", "serve", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    return "--slots" in proc.stdout


def chosen_systems(args, say, has_slots=serve_has_slots) -> list[str]:
    """The systems asked for, less the llama-server ones when the binary is missing and
    ``edgesync-slots`` when ``edgesync serve`` has no ``--slots``."""
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise SystemExit(f"--systems: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SYSTEMS)}")
    if not args.llama_server.is_file() and any(s in LLAMA_BINARY for s in systems):
        say(f"{', '.join(s for s in systems if s in LLAMA_BINARY)}: skipped, {args.llama_server} not found "
            "(`make llama-server` builds it)")
        systems = [s for s in systems if s not in LLAMA_BINARY]
    if "edgesync-slots" in systems and not has_slots():
        say("edgesync-slots: skipped, `edgesync serve --help` has no --slots in this checkout")
        systems.remove("edgesync-slots")
    return systems


def model_facts(path: Path, random_flag: bool = False) -> dict:
    """What the report says of the GGUF: ``name`` (the file's), ``general_name``, ``architecture``,
    ``chat_template`` (present),
    ``vocab`` (tokens), ``random_weights`` and why (``--random-weights`` or
    :func:`random_weight_reason`)."""
    from edgesync_engines.adapters.gguf_header import GGUFHeaderError, read_header

    try:
        header = read_header(path)
    except (OSError, GGUFHeaderError) as exc:
        raise SystemExit(f"--model: {exc}") from None
    md = header.metadata
    reason = "--random-weights" if random_flag else random_weight_reason(md, path)
    return {"path": str(path), "name": Path(path).name, "general_name": md.get("general.name"),
            "architecture": header.architecture,
            "chat_template": bool(md.get("tokenizer.chat_template")),
            "vocab": header.array_lengths.get("tokenizer.ggml.tokens"),
            "random_weights": reason is not None, "random_weights_reason": reason}


def check_chat_template(facts: dict, say) -> None:
    """Stop when the GGUF has no chat template and llama.cpp none for its architecture (EdgeSync
    could not render a chat: every system would fail or each use another template); warn when
    EdgeSync would use llama.cpp's built-in one (llama-server uses ChatML then)."""
    if facts["chat_template"]:
        return
    import llama_cpp

    from edgesync_engines.adapters.llamacpp_model import builtin_template_for

    builtin = builtin_template_for(llama_cpp, facts["architecture"])
    if builtin is None:
        raise SystemExit(
            f"{facts['path']}: the GGUF has no tokenizer.chat_template, and llama.cpp has no built-in template for "
            f"its architecture ({facts['architecture']}): EdgeSync cannot render a chat with it (ValueError), "
            "llama-server would fall back to ChatML and llama-cpp-python to its own guess, so the systems would not "
            "see the same prompts. Write the tokenizer's template into the GGUF first (gguf-py's "
            "gguf_new_metadata.py --chat-template-config, or the converter given the tokenizer's "
            "tokenizer_config.json).")
    say(f"{facts['path']}: no tokenizer.chat_template; EdgeSync renders chats with llama.cpp's built-in "
        f"{builtin!r}, llama-server with ChatML: the systems' prompts may differ")


def estimate_seconds(turns: int, turn_s: float, args, n_systems: int) -> float:
    """A rough run time: per system and number in flight the longer of its turns served one
    after another and one session's own path (its turns and think times), about half as much
    again for the fresh answers and floors of its prompts, a think time per floor, and two server
    starts."""
    per_system = max(turns * turn_s, args.turns * (turn_s + args.think))
    return len(args.in_flight) * n_systems * (1.5 * per_system + turns * args.think + 2 * GUESS_START_S)


def run_all(args, systems: list[str], model: Path, progress, serve_slots: bool = False) -> tuple[dict, dict, dict]:
    """The reference pass, then every system at every number in flight: (summaries by number in
    flight, runs by number in flight, reference figures). ``serve_slots``: :attr:`Plan.serve_slots`."""
    say = progress.console.print
    guess = estimate_seconds(args.sessions * args.turns, GUESS_TURN_S + GUESS_TOKEN_S * args.max_tokens, args,
                             len(systems))
    say(f"estimated run time: about {guess / 60:.0f} min (a guess; refined after the reference conversation)")
    ref = Reference(args.threads, args.n_ctx, args.max_tokens, args.flash_attn, pause_s=args.think, model=model)
    results: dict[int, list[dict]] = {}
    runs: dict[int, dict] = {}
    try:
        rp = reference_pass(ref, args, progress)
        turn_s = rp["seconds"] / max(rp["turns"], 1)
        rp["threshold"] = max(1, rp["turns"] // 2)
        to_go = estimate_seconds(rp["turns"], turn_s, args, len(systems))
        say(f"reference conversation: {rp['turns']} turns in {rp['seconds']:.0f} s; restart after "
            f"{rp['threshold']} answered turns; about {to_go / 60:.0f} min to go (fewer as prompts repeat)")
        warm_client()  # the client's first-request costs fall on no system
        with tempfile.TemporaryDirectory(prefix="edgesync-chat-bench-") as tmp:
            for n in args.in_flight:
                work = (args.workdir or Path(tmp)) / f"in-flight-{n}"
                plan = Plan(args, model, ref, rp["threshold"], work, progress, in_flight=n, serve_slots=serve_slots)
                rows = results[n] = []
                runs[n] = {}
                for system in systems:
                    runs[n][system] = run = run_system(system, plan)
                    if run["error"]:
                        log = plan.work / system / "server.log" if args.workdir else "run with --workdir DIR to keep it"
                        say(f"{system} ({n} in flight): stopped, {run['error']} (server log: {log}); going on with "
                            "the others")
                        if run["error_detail"]:
                            say(run["error_detail"])
                    check_answers(run, plan)
                    rows.append(summarize(system, run))
    finally:
        ref.close()
    return results, runs, rp


def main(argv=None) -> int:
    """Run the benchmark; print the tables and ratios; write ``--json``."""
    from edgesync_engines.adapters.model_files import default_model_path
    from edgesync_engines.app.cli_common import progress_bar

    args = build_parser().parse_args(argv)
    model = args.model or default_model_path()
    facts = model_facts(model, args.random_weights)
    note = RANDOM_WEIGHTS_NOTE.format(name=facts["name"]) if facts["random_weights"] else None
    with progress_bar(disable=args.no_progress) as progress:
        check_chat_template(facts, progress.console.print)
        if note:
            progress.console.print(f"{note} ({facts['random_weights_reason']})")
        slots = serve_has_slots()
        systems = chosen_systems(args, progress.console.print, has_slots=lambda: slots)
        results, runs, rp = run_all(args, systems, model, progress, serve_slots=slots)
    print(report_all(results, note))
    if args.json_out:
        for by_system in runs.values():
            for run in by_system.values():
                for rec in run["records"]:
                    rec.pop("messages", None)
        options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json_out.write_text(json.dumps({"options": options, "model": str(model), "model_facts": facts,
                                             "reference": rp, "in_flight": json_results(results, runs)},
                                            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
