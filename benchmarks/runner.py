"""The benchmark runner: every system on every workload, one worker process each.

``edgesync bench [--quick] [--limit N] [--model GGUF] [--kv-type TYPE[,TYPE...]] [--json FILE]
[--out DIR]`` and ``make bench`` call :func:`main`.

Model and KV type: every system runs ``--model`` (default: EdgeSync's configured model,
SmolLM2-135M-Instruct Q4_1; e.g. Gemma 3 270M) with the first ``--kv-type`` (default: not set,
f16): the llama-cpp-python systems on their own context, EdgeSync through ``EDGESYNC_KV_TYPE``
in its worker's environment. Each further KV type adds two lanes, ``no-cache@TYPE`` (its
identity reference) and ``edgesync@TYPE`` (cold, its own store), so that the report sets
EdgeSync's bytes on disk per cached prompt of each type side by side, as ratios to the first.

Workloads (:mod:`edgesync_bench.bench_workloads`, fixed seeds): ``seed`` (1,000 requests), ``doc-qa``
(10 passages, the first 10 of the 40 that ``random.Random(0)`` draws, each passage's questions
in turn: 48 questions) and ``chat`` (10 sessions drawn the same way, 29 user turns; each turn's
prompt is the conversation so far with the system's own earlier answers). ``max_tokens`` 16.
:data:`FULL` holds the sizes; the report's "What was sampled" section lists them.

Systems (:mod:`edgesync_bench.systems`): ``no-cache``, ``naive-string``, ``llama-ram``,
``llama-disk``, ``edgesync`` (cold: a new store), then ``edgesync-warm`` (a second process on
the cold run's store, after the cold process has closed it). On ``doc-qa`` and ``chat``
also ``edgesync-prefetch`` (cold, its own store, N-gram prefetch into the RAM tier on), so
that prefetch on and off are measured side by side. EdgeSync (cold and warm) runs the full seed
workload; no cache, naive string, LlamaRAMCache and LlamaDiskCache its first 300
(:data:`~edgesync_bench.bench_workloads.SLOW_SYSTEM_LIMIT`), dealt in turn with EdgeSync's first
300. Every comparison with no cache is over the requests both ran (:mod:`edgesync_bench.figures`).

Why these sizes (the hour of ``make bench`` on 2 cores): the 1,000-request run took 99
minutes, 62 of them seed, where no cache (about 2.0 s a request: a 340-token prefill and 16
tokens) alone took about 33. With no cache and the peers on 300 requests the seed workload takes
about 36 minutes, EdgeSync's 2 x 1,000 requests (about 0.25 s each) about 9 of them; doc-QA on
10 of its 40 passages and chat on 10 of its 40 sessions take about 5 minutes each, about 47 in
all.
EdgeSync's TTL is 1e9 s, so nothing expires during a run.

Dealing: each system has its own worker process (:mod:`edgesync_bench.worker`); request ``i`` is
sent to every system in turn, starting with a different system for each ``i`` (round robin),
and only one request runs at a time, so that machine drift hits every system alike.
``edgesync-warm`` runs after the others, alone.

Per request the runner keeps one record (JSON line in ``requests.jsonl``): ``workload``,
``system``, ``index``, ``request_id``, ``prompt_key``, ``group``, ``first_seen`` (the first
time this system's process got this prompt), the worker's ``Answer`` fields (``ttft_ms``,
``total_ms``, ``prompt_tokens``, ``tokens_reused``, ``hit``, ``source``, ``bytes_read``,
``tokens``, ``text``), ``lookup_ms``, ``cpu_s``, ``rss_peak_bytes``, ``prefetch_wait_ms``,
``energy_j`` (None where the energy probe has nothing to read) and ``detail``.

Output (``--out``, default ``results/bench-<UTC time>/``, git-ignored): ``requests.jsonl``,
``report.json`` (every figure), ``report.md`` (the tables), PNG plots, and one log file per
worker in ``workers/``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent

WORKLOADS = ("seed", "doc-qa", "chat")
RAG = "rag"
"""Run alone, in this process (:mod:`edgesync_bench.cli_rag`), not by the worker lanes."""
BASE_SYSTEMS = ("no-cache", "naive-string", "llama-ram", "llama-disk", "edgesync")
SLOW_SYSTEMS = ("no-cache", "naive-string", "llama-ram", "llama-disk")
"""The lanes that run only the first ``Sizes.seed_others`` seed requests (``no-cache@TYPE`` too)."""


@dataclass(frozen=True)
class Sizes:
    """How much of each workload a run takes.

    ``seed``: requests run by EdgeSync (cold and warm); ``seed_others``: the first of those run
    by no cache, naive string, LlamaRAMCache and LlamaDiskCache; ``doc_qa_passages``;
    ``chat_sessions`` (every system)."""

    seed: int
    seed_others: int
    doc_qa_passages: int
    chat_sessions: int


# bench_workloads' SLOW_SYSTEM_LIMIT, BENCH_DOC_QA_PASSAGES and BENCH_CHAT_SESSIONS (not imported
# here: the edgesync command builds this parser for every subcommand)
FULL = Sizes(seed=1000, seed_others=300, doc_qa_passages=10, chat_sessions=10)
QUICK = Sizes(seed=16, seed_others=8, doc_qa_passages=2, chat_sessions=2)


def limited(sizes: Sizes, limit: int | None) -> Sizes:
    """``sizes`` with every figure capped at ``limit`` (seed requests for every system, doc-QA
    passages, chat sessions); ``sizes`` itself when ``limit`` is None."""
    if limit is None:
        return sizes
    return Sizes(*(min(v, limit) for v in (sizes.seed, sizes.seed_others, sizes.doc_qa_passages,
                                           sizes.chat_sessions)))


class WorkerError(RuntimeError):
    """A worker process died, did not start, or replied out of protocol."""


@dataclass
class Lane:
    """One system's worker process on one workload, and what the runner knows of it."""

    label: str
    kind: str
    workdir: Path
    limit: int | None = None
    config: dict | None = None
    model: Path | None = None
    kv_type: str | None = None
    proc: subprocess.Popen | None = None
    seen: set = field(default_factory=set)
    sessions: list = field(default_factory=list)
    stats: dict | None = None
    errors: list = field(default_factory=list)

    def start(self, threads: int | None, log_dir: Path) -> None:
        """Start the worker and wait until its model is loaded.

        Raises:
            WorkerError: the worker failed to start (its log file says why).
        """
        cmd = [sys.executable, "-m", "edgesync_bench.worker", "--system", self.kind, "--workdir", str(self.workdir)]
        if threads:
            cmd += ["--threads", str(threads)]
        if self.config:
            cmd += ["--config", json.dumps(self.config)]
        if self.model is not None:
            cmd += ["--model", str(self.model)]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.label}.log"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        if self.kv_type is not None:
            from edgesync_bench.systems import KV_TYPE_ENV

            cmd += ["--kv-type", self.kv_type]
            env[KV_TYPE_ENV] = self.kv_type
        with open(self.log_path, "ab") as log_file:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                                         text=True, bufsize=1, cwd=str(ROOT), env=env)
        ready = self._read()
        if not ready.get("ok"):
            raise WorkerError(f"{self.label}: worker did not start: {ready.get('error')}: {ready.get('message')}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise WorkerError(f"{self.label}: worker exited ({code}); see {self.log_path}")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise WorkerError(f"{self.label}: unreadable reply {line[:200]!r}; see {self.log_path}") from None

    def call(self, cmd: dict) -> dict:
        """Send one command, return the reply (``ok`` False replies are returned, not raised).

        Raises:
            WorkerError: the worker is gone.
        """
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerError(f"{self.label}: worker is gone ({exc}); see {self.log_path}") from None
        return self._read()

    def close(self) -> None:
        """Let the worker exit (end of its input closes the system); kill it after 60 s."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            proc.stdin.close()  # the worker closes its system at end of input and exits
        except OSError:
            pass
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            log.warning("%s: worker did not exit within 60 s; killed", self.label)
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _energy_probe():
    from edgesync_bench.energy import EnergyProbe

    probe = EnergyProbe()
    return probe if probe.available() else None, probe.reason


class Runner:
    """Runs the plan and collects records. See the module docstring.

    Args:
        out: output directory (created).
        sizes: :data:`FULL` or :data:`QUICK` (or custom :class:`Sizes`).
        workloads: names from :data:`WORKLOADS`.
        threads: llama.cpp threads per worker (None: ``EDGESYNC_THREADS`` or all cores).
        progress: a ``rich.progress.Progress`` or None.
        model: the GGUF every system loads (None: EdgeSync's configured model).
        kv_types: ``systems.KV_TYPES`` names; the first for every system (None: not set, f16),
            each further one for an extra ``no-cache@TYPE`` and ``edgesync@TYPE`` lane.
    """

    def __init__(self, out: Path, sizes: Sizes, workloads: Sequence[str] = WORKLOADS,
                 threads: int | None = None, progress=None, model: Path | None = None,
                 kv_types: Sequence[str | None] = (None,)) -> None:
        unknown = [w for w in workloads if w not in WORKLOADS]
        if unknown:
            raise ValueError(f"workloads: unknown {unknown}; choose from {', '.join(WORKLOADS)}")
        if not kv_types or None in kv_types[1:] or len(set(kv_types)) != len(kv_types):
            raise ValueError(f"kv_types: distinct names, only the first may be None; got {list(kv_types)}")
        self.model, self.kv_types = model, list(kv_types)
        self.out, self.sizes, self.threads = Path(out).resolve(), sizes, threads
        self.workloads = list(dict.fromkeys(workloads))  # each once: a second pass would reuse the stores
        self.progress = progress
        self.records: list[dict] = []
        self.stats: dict[str, dict[str, dict]] = {}
        self.timings: dict[str, float] = {}
        self.sampled: dict[str, dict] = {}
        self.errors: list[str] = []
        self.probe, self.energy_reason = _energy_probe()
        self._fh = None

    # -- requests -----------------------------------------------------------------------------

    def lanes(self, workload: str) -> list[Lane]:
        """The worker lanes of ``workload`` (not started): every system, ``edgesync-prefetch`` on
        doc-QA and chat, two more per further KV type; on seed the :data:`SLOW_SYSTEMS` lanes stop
        after ``sizes.seed_others`` requests."""
        wd = self.out / "work" / workload
        others = self.sizes.seed_others if workload == "seed" else None
        first = dict(model=self.model, kv_type=self.kv_types[0])
        lanes = [Lane(name, name, wd / name, limit=others if name in SLOW_SYSTEMS else None, **first)
                 for name in BASE_SYSTEMS]
        if workload != "seed":
            lanes.append(Lane("edgesync-prefetch", "edgesync", wd / "edgesync-prefetch", config={"prefetch": True},
                              **first))
        for kv in self.kv_types[1:]:
            lanes += [Lane(f"{name}@{kv}", name, wd / f"{name}@{kv}", model=self.model, kv_type=kv,
                           limit=others if name in SLOW_SYSTEMS else None)
                      for name in ("no-cache", "edgesync")]
        return lanes

    def _ask(self, lane: Lane, workload: str, index: int, request, messages) -> dict | None:
        if self.probe:
            self.probe.start()
        reply = lane.call({"op": "answer", "messages": list(messages), "max_tokens": 16})
        energy = self.probe.stop() if self.probe else None
        if not reply.get("ok"):
            msg = f"{workload}/{lane.label}/{request.request_id}: {reply.get('error')}: {reply.get('message')}"
            lane.errors.append(msg)
            self.errors.append(msg)
            log.warning("%s", msg)
            return None
        a = reply["answer"]
        first = request.prompt_key not in lane.seen
        lane.seen.add(request.prompt_key)
        rec = {
            "workload": workload, "system": lane.label, "index": index, "request_id": request.request_id,
            "prompt_key": request.prompt_key, "group": request.group, "first_seen": first,
            "ttft_ms": a["ttft_ms"], "total_ms": a["total_ms"], "prompt_tokens": a["prompt_tokens"],
            "tokens_reused": a["tokens_reused"], "hit": a["hit"], "source": a["source"],
            "bytes_read": a["bytes_read"], "tokens": a["tokens"], "text": a["text"],
            "lookup_ms": (a.get("detail") or {}).get("lookup_ms"), "cpu_s": reply["cpu_s"],
            "rss_peak_bytes": reply["rss_peak_bytes"], "prefetch_wait_ms": reply.get("prefetch_wait_ms"),
            "energy_j": energy.rapl_total_joules if energy is not None and energy.available else None,
            "detail": a.get("detail") or {},
        }
        self.records.append(rec)
        self._fh.write(json.dumps(rec) + "\n")
        return rec

    def _advance(self, task) -> None:
        if self.progress is not None and task is not None:
            self.progress.advance(task)

    def _static_requests(self, workload: str) -> list:
        from edgesync_bench.bench_workloads import doc_qa_requests, seed_requests

        if workload == "seed":
            return seed_requests(self.sizes.seed)
        return doc_qa_requests(self.sizes.doc_qa_passages)

    def _finish(self, lane: Lane) -> None:
        """Collect a lane's end-of-run stats and let its worker exit (frees its memory)."""
        if lane.proc is None:
            return
        try:
            reply = lane.call({"op": "stats"})
            lane.stats = reply.get("stats") if reply.get("ok") else {"error": reply.get("message")}
        except WorkerError as exc:
            lane.stats = {"error": str(exc)}
            self.errors.append(str(exc))
        lane.close()

    def _deal_static(self, workload: str, lanes: list[Lane], requests: list, task) -> None:
        for i, req in enumerate(requests):
            for k in range(len(lanes)):
                lane = lanes[(i + k) % len(lanes)]
                if lane.proc is None:
                    continue
                if lane.limit is not None and i >= lane.limit:
                    self._finish(lane)
                    continue
                self._ask(lane, workload, i, req, req.messages)
                self._advance(task)

    def _chat_sessions(self, lane: Lane) -> list:
        from edgesync_bench.bench_workloads import chat_sessions

        def count(messages) -> int:
            reply = lane.call({"op": "count", "messages": list(messages)})
            if not reply.get("ok"):
                raise WorkerError(f"{lane.label}: count failed: {reply.get('message')}")
            return int(reply["n"])

        return chat_sessions(count, self.sizes.chat_sessions)

    def _deal_chat(self, lanes: list[Lane], task) -> None:
        for lane in lanes:
            lane.sessions = self._chat_sessions(lane)
        index = 0
        for s in range(self.sizes.chat_sessions):
            step = 0
            while not all(lane.sessions[s].done for lane in lanes):
                for k in range(len(lanes)):
                    lane = lanes[(index + step + k) % len(lanes)]
                    session = lane.sessions[s]
                    if session.done:
                        continue
                    turn = session.next_prompt()
                    if turn is None:
                        continue
                    rec = self._ask(lane, "chat", index + step, turn, turn.as_messages())
                    session.record_answer(rec["text"] if rec else "")
                    self._advance(task)
                step += 1
            index += max(lane.sessions[s].n_turns for lane in lanes)

    def _chat_total(self) -> int:
        from edgesync_bench.bench_workloads import chat_sessions

        return sum(s.n_turns for s in chat_sessions(lambda m: 0, self.sizes.chat_sessions))

    def sample_note(self, workload: str, requests: list | None) -> dict:
        """What ``workload`` takes of its data, for the report's "What was sampled" section:
        counts, the selection seed and the rows chosen (``requests``: the seed or doc-QA
        requests; None for chat)."""
        from edgesync_bench.bench_workloads import N_CHAT_SESSIONS, N_DOC_QA_PASSAGES, SELECTION_SEED, chat_sessions

        if workload == "seed":
            others = min(self.sizes.seed_others, len(requests))
            return {"requests": len(requests), "distinct_prompts": len({r.prompt_key for r in requests}),
                    "no_cache_and_peers_requests": others,
                    "no_cache_and_peers_distinct_prompts": len({r.prompt_key for r in requests[:others]}),
                    "selection": "seed_workload(1000): random.Random(0), first N requests"}
        draw = {"seed": SELECTION_SEED, "drawn": N_DOC_QA_PASSAGES if workload == "doc-qa" else N_CHAT_SESSIONS}
        if workload == "doc-qa":
            ids = list(dict.fromkeys(r.group for r in requests))
            return {"passages": len(ids), "questions": len(requests), **draw, "doc_ids": ids,
                    "selection": f"the first {len(ids)} of random.Random({SELECTION_SEED}).sample(range(rows), "
                                 f"{max(len(ids), draw['drawn'])}) of doc_qa.jsonl, in file order"}
        sessions = chat_sessions(lambda m: 0, self.sizes.chat_sessions)
        return {"sessions": len(sessions), "user_turns": sum(s.n_turns for s in sessions), **draw,
                "session_ids": [s.session_id for s in sessions],
                "selection": f"the first {len(sessions)} of random.Random({SELECTION_SEED}).sample(range(rows), "
                             f"{max(len(sessions), draw['drawn'])}) of chat_sessions.jsonl, in file order"}

    # -- workloads ----------------------------------------------------------------------------

    def run_workload(self, workload: str) -> None:
        """Run every system on ``workload`` (round robin), then EdgeSync warm alone."""
        t0 = time.perf_counter()
        lanes = self.lanes(workload)
        if workload == "chat":
            n_chat = self._chat_total()
            total = n_chat * (len(lanes) + 1)
            requests = None
        else:
            requests = self._static_requests(workload)
            total = sum(len(requests) if lane.limit is None else min(lane.limit, len(requests))
                        for lane in lanes) + len(requests)
        self.sampled[workload] = self.sample_note(workload, requests)
        task = self.progress.add_task(workload, total=total) if self.progress is not None else None
        warm = Lane("edgesync-warm", "edgesync", self.out / "work" / workload / "edgesync", model=self.model,
                    kv_type=self.kv_types[0])
        try:
            for lane in lanes:
                lane.start(self.threads, self.out / "workers" / workload)
            if workload == "chat":
                self._deal_chat(lanes, task)
            else:
                self._deal_static(workload, lanes, requests, task)
            for lane in lanes:
                self._finish(lane)
            warm.start(self.threads, self.out / "workers" / workload)
            if workload == "chat":
                self._deal_chat([warm], task)
            else:
                self._deal_static(workload, [warm], requests, task)
            self._finish(warm)
        except WorkerError as exc:  # the figures so far are kept; the report says what failed
            msg = f"{workload}: stopped early: {exc}"
            log.error("%s", msg)
            self.errors.append(msg)
        finally:
            for lane in [*lanes, warm]:
                lane.close()
        if self.progress is not None and task is not None:
            self.progress.update(task, completed=total)
        self.stats[workload] = {lane.label: lane.stats for lane in [*lanes, warm]}
        self.timings[workload] = time.perf_counter() - t0

    def run(self, model_info: dict | None = None) -> dict[str, Any]:
        """Run every workload; return the report dict (also written to ``out``). ``model_info``
        (:func:`model_info`) goes into the report's ``meta["model"]``."""
        self.out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        load0 = os.getloadavg()
        with open(self.out / "requests.jsonl", "w") as fh:
            self._fh = fh
            for workload in self.workloads:
                self.run_workload(workload)
                fh.flush()
        from edgesync_bench.bench_report import build_report

        meta = {
            "started_utc": started, "wall_s": time.perf_counter() - t0, "workload_wall_s": self.timings,
            "sizes": self.sizes.__dict__, "threads": self.threads, "cpu_count": os.cpu_count(),
            "machine": platform.machine(), "python": platform.python_version(),
            "loadavg_start": load0, "loadavg_end": os.getloadavg(),
            "energy": self.energy_reason if self.probe is None else "measured: " + self.energy_reason,
            "errors": self.errors, "model": model_info or {"path": str(self.model) if self.model else None},
            "kv_types": self.kv_types, "sampled": self.sampled,
        }
        return build_report(self.records, self.stats, meta, self.out)


def _default_out() -> Path:
    return ROOT / "results" / time.strftime("bench-%Y%m%d-%H%M%S", time.gmtime())


def _positive(text: str) -> int:
    """A whole number >= 1 (``--threads``, ``--limit``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _kv_types(text: str) -> list[str]:
    from edgesync_bench.systems import KV_TYPES

    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in KV_TYPES]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: distinct names from {', '.join(KV_TYPES)}, comma-separated")
    return names


def env_kv_types() -> list[str | None]:
    """``[EDGESYNC_KV_TYPE]`` when it is set (so that the peers run the KV type EdgeSync will
    read from the environment), else ``[None]``.

    Raises:
        ValueError: a value that is not a KV type name.
    """
    from edgesync_bench.systems import KV_TYPE_ENV

    raw = os.environ.get(KV_TYPE_ENV, "").strip()
    if not raw:
        return [None]
    try:
        (name,) = _kv_types(raw)
    except (argparse.ArgumentTypeError, ValueError):
        raise ValueError(f"{KV_TYPE_ENV}={raw!r}: not one KV type name (f16, f32, q8_0, q4_0)") from None
    return [name]


def model_info(path: Path | None) -> dict:
    """What the report says of the model: ``path``, ``file``, ``bytes``, ``name``
    (``general.name``), ``architecture`` and ``sliding_window`` from the GGUF header
    (``path`` None: EdgeSync's configured model).

    Raises:
        ValueError: no such file, or not a readable GGUF (one line naming the file).
    """
    from edgesync_engines.adapters.gguf_header import GGUFHeaderError, read_header
    from edgesync_engines.adapters.model_files import ModelNotFoundError, default_model_path

    try:
        resolved = Path(path) if path is not None else default_model_path()
        header = read_header(resolved)
    except (FileNotFoundError, ModelNotFoundError) as exc:
        raise ValueError(f"--model {path}: no such file ({exc})" if path is not None else str(exc)) from None
    except (GGUFHeaderError, OSError) as exc:
        raise ValueError(f"--model: {exc}") from None
    return {"path": str(resolved.resolve()), "file": resolved.name, "bytes": header.file_size,
            "name": header.metadata.get("general.name"), "architecture": header.architecture,
            "sliding_window": header.arch_value("attention.sliding_window")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``edgesync bench`` (shared with ``python -m edgesync_bench.runner``)."""
    parser.add_argument("--quick", action="store_true",
                        help=f"a small run (seed {QUICK.seed}/{QUICK.seed_others}, {QUICK.doc_qa_passages} passages, "
                             f"{QUICK.chat_sessions} chat sessions; under 5 minutes)")
    parser.add_argument("--limit", type=_positive, default=None,
                        help="cap every size at N: seed requests (every system), doc-QA passages, chat sessions")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated: seed,doc-qa,chat; or rag alone (documents reuse, every system in "
                             "this process: benchmarks/rag_fidelity.py)")
    parser.add_argument("--curve-limit", type=_positive, default=None, metavar="N",
                        help="rag: recompute shares other than the default on the first N requests only")
    parser.add_argument("--model", type=Path, default=None,
                        help="GGUF every system runs (default: EDGESYNC_MODEL or SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--kv-type", type=_kv_types, default=None, metavar="TYPE[,TYPE...]",
                        help="KV element type (f16, f32, q8_0, q4_0) of every system (EdgeSync: EDGESYNC_KV_TYPE); "
                             "each further type adds no-cache@TYPE and edgesync@TYPE, compared by bytes per cached "
                             "prompt (default: not set, f16)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default results/bench-<UTC time>)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report's JSON to this file")
    parser.add_argument("--threads", type=_positive, default=None,
                        help="llama.cpp threads per worker (default: EDGESYNC_THREADS or all cores)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark for parsed ``args``; print the report's main tables. Returns the exit
    status (0, or 1 when a request failed)."""
    from rich.console import Console

    from edgesync_engines.app.cli_common import progress_bar

    sizes = limited(QUICK if args.quick else FULL, args.limit)
    out = args.out or _default_out()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if RAG in workloads:
        return _run_rag(args, workloads, out)
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        raise ValueError(f"--workloads: unknown {unknown or args.workloads!r}; choose from {', '.join(WORKLOADS)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: exists and is not an empty directory; choose a new directory")
    if args.json is not None and (args.json.is_dir() or not args.json.resolve().parent.is_dir()):
        raise ValueError(f"--json {args.json}: not a file in an existing directory")
    from edgesync_bench.bench_workloads import chat_sessions, doc_qa_requests, seed_requests
    from edgesync_engines.config import EdgeSyncConfig

    EdgeSyncConfig.load()  # a bad EDGESYNC_* setting fails here, not in every worker
    model = model_info(args.model)  # a missing or unreadable GGUF too
    kv_types = args.kv_type or env_kv_types()

    # read every selected workload's data now, not after an hour of the first one
    checks = {"seed": lambda: seed_requests(1), "doc-qa": lambda: doc_qa_requests(1),
              "chat": lambda: chat_sessions(lambda m: 0, 1)}
    for w in workloads:
        checks[w]()
    console = Console(stderr=True)
    with progress_bar("{task.description:>7}", console=console, disable=args.no_progress) as progress:
        report = Runner(out, sizes, workloads, args.threads, progress, model=args.model,
                        kv_types=kv_types).run(model)
    sys.stdout.write((Path(out).resolve() / "report.md").read_text())
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    out = Path(out).resolve()
    console.print(f"report: {out / 'report.md'}  json: {out / 'report.json'}  "
                  f"wall {report['meta']['wall_s'] / 60:.1f} min")
    return 1 if report["meta"]["errors"] else 0


def _run_rag(args: argparse.Namespace, workloads: list[str], out: Path) -> int:
    """``--workloads rag``: :func:`edgesync_bench.cli_rag.run_bench` (one process, not
    the worker lanes); ValueError for bad input."""
    from edgesync_bench.cli_rag import run_bench
    from edgesync_engines.app.cli_common import CommandError

    if workloads != [RAG]:
        raise ValueError("--workloads rag runs alone (every system side by side in one process): "
                         "edgesync bench --workloads rag")
    args.out = out
    try:
        return run_bench(args)
    except CommandError as exc:
        raise ValueError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m edgesync_bench.runner`` (same as ``edgesync bench``)."""
    parser = argparse.ArgumentParser(prog="python -m edgesync_bench.runner", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    from edgesync_bench.workloads import WorkloadDataError

    try:
        return run_from_args(args)
    except (WorkerError, WorkloadDataError, ValueError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
