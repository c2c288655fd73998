"""``python -m edgesync_bench.long_context``: EdgeSync's hits on long documents (1K to 32K tokens)
against their floor, in new processes and with the page cache dropped, and beside the tools users
pick to keep a long context across restarts (llama-server's slot files, hearth-llm). Not a test:
it prints tables, writes every figure with ``--json`` and a log-log plot of TTFT against prompt
tokens (``--plot``, default ``docs/long_context.png``). ``docs/long-context.md`` describes it.

Models (``--models``, comma list): ``smollm2`` (EdgeSync's default model, SmolLM2-135M-Instruct
Q4_1, up to 8K: its trained context), ``gemma3-270m`` (Gemma 3 270M Q4_K_M, up to 32K), and the
random-weight shapes of ``tools/shaped_gguf.py``: ``llama-3.1-8b-kv`` (Llama-3.1-8B's KV cache,
128 KiB a token, on narrow weights; up to 32K) and ``llama-3.2-1b`` (only when named). A shape's
GGUF is never built here: when it is not in shaped_gguf's cache the model is skipped with the
command that builds it. Every figure of a random-weight model says "random weights": its
timings, bytes and identity are real, its answers' text meaningless. Default: the first three;
``--quick``: ``smollm2`` at 1K, 2K and 4K, the peers at 2K.

Prompts, per model and size (``--sizes``, default 1K, 2K, 4K, 8K, 16K, 32K; a model's
largest is its trained context less :data:`CTX_MARGIN`, or ``--limit MODEL=SIZE``): the passages
of ``doc_qa.jsonl`` in one fixed random order (``random.Random(0)``), concatenated as floor.py's
doc-QA message (system ``DOC_QA_SYSTEM_PROMPT``, user ``Passage (title):`` blocks, then
``Question: <q>``) while the prompt, rendered with the model's chat template, stays within the
size, then the next passage cut after as many words as still fit (so a prompt is within a few
tokens of its size); question 1 is the first passage's first question, question 2 its second.
The context (``n_ctx``) of every process and server at a size is the size plus
:data:`CTX_MARGIN`.

Per model and size (a fresh store in a temporary directory for each):

1. Uncached: ``EdgeSync(store=False)`` on the same loaded model answers question 1
   (``--max-tokens`` greedy tokens): the reference answer, and a cold prefill's TTFT.
2. Miss: ``EdgeSync`` on the fresh store asks the same prompt (the KV cache emptied first): its
   TTFT (engine's) is the cold prefill; its store-back is the time after the answer.
3. Floor, in the same process on the same bytes: tokenization plus the evaluation of the last
   prompt token with the other n - 1 live, as floor.py measures it (median of
   :data:`LAST_TOKEN_REPEATS`), plus one copy of the prompt's KV into llama.cpp's cache: the
   sequence's state (``llama_state_seq_get_data`` after the prefill, in RAM) given back to
   ``llama_state_seq_set_data``, timed (median of :data:`FLOOR_REPEATS`).
4. The same context as a llama-server slot file (``llama_state_seq_save_file``), kept for 6.
5. New processes (this one's EdgeSync closed first): each opens the same store and asks the same
   prompt (an exact hit): two with the store's pages in the page cache (read through first), then
   two each after ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file under the store (fsync'd
   first; the store's resident bytes before each run are measured with ``mincore``). Per run:
   the request's TTFT, launch to first token, model and store load time, peak RSS (the
   process's ``ru_maxrss``), bytes read, answer identical to the miss's and the uncached one's.
6. llama-server (``build/llama-server``, ``-np 1``, same ``n_ctx``, threads, flash attention
   off) holding the same context: the slot file of 4 restored (``POST /slots/0?action=restore``)
   and the same prompt's tokens sent to ``/completion``; its peak RSS (``VmHWM``) against the
   hit process's, its restore time and whether its answer equals ours.
7. Bytes: the store directory's allocated bytes and its fragments' bytes, per prompt token,
   beside the f16 KV bytes a token (layers x KV heads x head sizes x 2 bytes) and the
   sequence state's bytes a token.

Peers, at one size per model (``--peer-size``, default 4K, ``--quick`` 2K; the size must be one
that ran), on the same prompts, threads and ``n_ctx``: ``edgesync serve`` (a fresh store),
``llama-server-slots`` (``build/llama-server --slot-save-path DIR -np 1``: after each answer
``POST /slots/0?action=save`` to one file, and after a restart ``action=restore`` before the next
request, its time counted in that request's TTFT, as users drive it) and ``hearth`` (hearth-llm
0.1.1 from ``build/hearth-venv``, ``make hearth-llm``, ``hearth serve --model GGUF --ctx N
--cache-dir DIR -- -t THREADS -fa off``, its ``llama-server`` found on PATH with ``build/``
first). Both llama-servers run with flash attention off, the numerics of EdgeSync's default;
a GGUF without a chat template gets llama.cpp's built-in one of its architecture
(``--no-jinja --chat-template NAME``), as EdgeSync renders it. Scenario
(:data:`SCENARIO`): question 1 (a cold prefill everywhere); a full restart (SIGTERM, start again
on the same state); question 2 about the same document; question 1 again; a second restart; a
follow-up turn (question 1, the server's own answer, question 2). Per step: client TTFT (the
``openai`` client, streamed, greedy), the prompt tokens the server reports, its answer identical
to a fresh prefill's (``EdgeSync(store=False)`` in this process, after the servers stopped); per
system: start-up time to ``/health`` (each start), bytes on disk per document token, peak RSS of
the server's process tree.

Time: before each size after the first, its cost is predicted from the previous size's (its
seconds x (tokens ratio) ^ :data:`GROWTH`), and before the peers theirs from the size's cold
prefill and model load (:func:`predict_peer_seconds`); a size that would overrun the model's
share of ``--budget-min`` (the time left over the models left) is cut, with the larger ones,
and peers that would are skipped; the output says so. ``--quick`` aims at under 10 minutes, the
default run at under 45 on 2 cores.

Needs the ``server`` extra, the ``test`` extra (``openai``), ``make llama-server`` and ``make
hearth-llm`` (a missing peer is skipped, said so). Run it alone on the machine: two cores shared
with anything else slow every figure.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_SIZES = (1024, 2048, 4096)
PEER_SIZE, QUICK_PEER_SIZE = 4096, 2048
BUDGET_MIN, QUICK_BUDGET_MIN = 45.0, 10.0
MAX_TOKENS = 16
THREADS = 2
CTX_MARGIN = 256
"""Context beyond a size's prompt: the answer, and in the peers' follow-up turn the answer and
question 2. A model's largest prompt is its trained context less this."""
FLOOR_REPEATS = 3
"""Timed copies (``llama_state_seq_set_data``) of the floor; the median is taken."""
LAST_TOKEN_REPEATS = 5
"""Timed last-token evaluations of the floor; the median is taken (on two shared cores a single
evaluation is now and then descheduled for seconds)."""
HIT_PROCESSES = 2
"""New processes per page-cache state (warm, dropped)."""
GROWTH = 1.5
"""A size's predicted cost: the previous size's seconds x (tokens / previous tokens) ** GROWTH
(a prefill on a CPU costs more a token as the context grows)."""
PASSAGE_SEED = 0
SLOT_FILE = "doc.bin"
PEER_SYSTEMS = ("edgesync", "llama-server-slots", "hearth")
SCENARIO = ("q1", "restart", "q2", "q1-again", "restart", "follow-up")
"""The peers' scenario: asks (by prompt) and full restarts, in order."""
LLAMA_SERVER = ROOT / "build" / "llama-server"
HEARTH = ROOT / "build" / "hearth-venv" / "bin" / "hearth"
DEFAULT_PLOT = ROOT / "docs" / "long_context.png"
RANDOM_NOTE = "random weights"


@dataclass(frozen=True)
class ModelSpec:
    """A model of the benchmark: ``limit`` its largest size by default, ``shape`` its
    ``tools/shaped_gguf.py`` shape (random weights), ``default`` in the full run's models."""

    name: str
    limit: int
    shape: str | None = None
    default: bool = True

    @property
    def random_weights(self) -> bool:
        return self.shape is not None


MODELS = (ModelSpec("smollm2", 8192), ModelSpec("gemma3-270m", 32768),
          ModelSpec("llama-3.1-8b-kv", 32768, shape="llama-3.1-8b-kv"),
          ModelSpec("llama-3.2-1b", 32768, shape="llama-3.2-1b", default=False))
MODEL_NAMES = tuple(m.name for m in MODELS)


# -- pure logic (benchmarks/tests/test_long_context.py) --------------------------------------------

def parse_size(text: str) -> int:
    """``"8K"`` -> 8192, ``"1000"`` -> 1000 (tokens); ValueError for anything else or below 64."""
    t = text.strip().upper()
    try:
        value = int(t[:-1]) * 1024 if t.endswith("K") else int(t)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (tokens, or a number of K, e.g. 8K)") from None
    if value < 64:
        raise ValueError(f"size {text!r} is below 64 tokens")
    return value


def size_label(tokens: int) -> str:
    """8192 -> ``"8K"``; a size that is not a whole number of K keeps its digits."""
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def parse_sizes(text: str) -> tuple[int, ...]:
    """An argparse type: a comma list of sizes, ascending, repeats dropped."""
    try:
        return tuple(sorted({parse_size(p) for p in text.split(",") if p.strip()}))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_limit(text: str) -> tuple[str, int]:
    """An argparse type: ``MODEL=SIZE``."""
    name, _, size = text.partition("=")
    if name not in MODEL_NAMES or not size:
        raise argparse.ArgumentTypeError(f"expected MODEL=SIZE with MODEL one of {', '.join(MODEL_NAMES)}, "
                                         f"got {text!r}")
    try:
        return name, parse_size(size)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_models(text: str) -> tuple[str, ...]:
    """An argparse type: a comma list of model names, in the order given."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in MODEL_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown model {', '.join(unknown) or '(none)'}; "
                                         f"choose from {', '.join(MODEL_NAMES)}")
    return names


def size_plan(sizes: Sequence[int], n_ctx_train: int | None, limit: int) -> tuple[list[dict], list[dict]]:
    """(the sizes that may run: ``label``, ``target`` (prompt tokens at most), ``n_ctx``; the sizes
    cut: ``label``, ``reason``). A size above ``limit`` is cut; a size whose prompt and
    :data:`CTX_MARGIN` exceed the trained context runs with the largest prompt that fits, unless
    that prompt is no larger than the previous size's (then it is cut)."""
    run, cut = [], []
    top = n_ctx_train - CTX_MARGIN if n_ctx_train else None
    for size in sorted(sizes):
        if size > limit:
            cut.append({"label": size_label(size), "reason": f"above this model's limit ({size_label(limit)})"})
            continue
        target = min(size, top) if top else size
        if run and target <= run[-1]["target"]:
            cut.append({"label": size_label(size), "reason": f"beyond the model's trained context ({n_ctx_train:,})"})
            continue
        run.append({"label": size_label(size), "target": target, "n_ctx": target + CTX_MARGIN})
    return run, cut


def passage_order(n: int, seed: int = PASSAGE_SEED) -> list[int]:
    """The fixed random order of ``n`` passages (``random.Random(seed)``)."""
    return random.Random(seed).sample(range(n), n)


def doc_messages(rows: Sequence[Mapping], question: str) -> list[dict]:
    """floor.py's doc-QA message over ``rows`` asking ``question``."""
    from edgesync_bench.floor import doc_messages as floor_doc_messages

    return floor_doc_messages(rows, question)


def doc_prompts(rows: Sequence[Mapping], count_tokens: Callable[[list[dict]], int],
                targets: Sequence[int]) -> dict[int, dict]:
    """Per target: ``q1`` and ``q2`` (messages asking the first passage's first and second
    question over the passages in :func:`passage_order`, the first passage moved to the front if
    it has fewer than two questions: as many whole passages as keep the ``q1`` prompt within the
    target, then the next one cut after as many words as still fit), ``tokens`` (the ``q1``
    prompt's token count), ``passages`` (whole ones), ``cut_words`` (words of the cut one, 0 for
    none), ``filled`` (False when the data ran out below the target). A target that not even the
    first passage fits is left out. ``count_tokens(messages)`` counts a prompt."""
    order = [rows[i] for i in passage_order(len(rows))]
    first = next((r for r in order if len(r["questions"]) >= 2), None)
    if first is None:
        raise ValueError("no passage of doc_qa.jsonl has two questions")
    order.remove(first)
    order.insert(0, first)
    q1, q2 = first["questions"][0], first["questions"][1]
    out: dict[int, dict] = {}
    counts: list[int] = []  # counts[k - 1]: tokens of the q1 prompt over the first k passages
    for target in sorted(targets):
        while (not counts or counts[-1] <= target) and len(counts) < len(order):
            counts.append(count_tokens(doc_messages(order[:len(counts) + 1], q1)))
        fits = [k for k, c in enumerate(counts, 1) if c <= target]
        if not fits:
            continue
        k = fits[-1]
        picked, tokens, words = list(order[:k]), counts[k - 1], 0
        if k < len(order):
            words, tokens, cut = _cut_passage(order[:k], order[k], q1, target, count_tokens, tokens)
            if words:
                picked.append(cut)
        out[target] = {"q1": doc_messages(picked, q1), "q2": doc_messages(picked, q2), "tokens": tokens,
                       "passages": k, "cut_words": words, "filled": k < len(order)}
    return out


def _cut_passage(whole: Sequence[Mapping], nxt: Mapping, question: str, target: int,
                 count_tokens: Callable[[list[dict]], int], tokens: int) -> tuple[int, int, dict]:
    """(words, prompt tokens, the passage) of the longest word prefix of ``nxt`` that keeps the
    prompt over ``whole`` and it within ``target`` (0 words: ``tokens`` unchanged)."""
    words = nxt["context"].split()
    lo, hi, best = 0, len(words), (0, tokens, dict(nxt))
    while lo < hi:  # the largest w with count(w) <= target, count rising with w
        mid = (lo + hi + 1) // 2
        cut = {**nxt, "context": " ".join(words[:mid])}
        n = count_tokens(doc_messages([*whole, cut], question))
        if n <= target:
            lo, best = mid, (mid, n, cut)
        else:
            hi = mid - 1
    return best


def follow_up(q1: list[dict], answer: str, q2: list[dict]) -> list[dict]:
    """The follow-up turn: question 1's messages, its answer, then question 2 alone (its
    ``Question:`` line, the document being in the conversation already)."""
    question = q2[-1]["content"].rsplit("\n\n", 1)[-1]
    return [*q1, {"role": "assistant", "content": answer}, {"role": "user", "content": question}]


def predict_seconds(history: Sequence[tuple[int, float]], tokens: int, growth: float = GROWTH) -> float | None:
    """A size's predicted cost from the last measured (tokens, seconds); None without one."""
    if not history:
        return None
    n, s = history[-1]
    return s * (tokens / n) ** growth


def predict_peer_seconds(prefill_s: float, start_s: float, systems: Sequence[str]) -> float:
    """The peers' predicted cost at a size whose cold prefill took ``prefill_s`` and whose model
    loaded in ``start_s``: a cold question 1 per system, hearth's question 2 after the restart (it
    has no snapshot of that message list), three fresh answers (question 2 and up to two
    follow-up turns, the systems' answers to question 1 being the history), three starts per
    system."""
    prefills = len(systems) + ("hearth" in systems) + (3 if systems else 0)
    return prefills * prefill_s + 3 * len(systems) * start_s


def median(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def size_ratios(fig: Mapping) -> dict:
    """A size's ratios: each new process's TTFT (warm and dropped, first and second) over the
    floor, the miss over the first warm hit, the hit process's peak RSS over llama-server's, and
    bytes per token over the f16 KV's."""
    floor_ms = (fig.get("floor") or {}).get("floor_ms")
    procs = fig.get("new_process") or {}
    out: dict[str, Any] = {}
    for cache in ("warm", "dropped"):
        runs = procs.get(cache) or []
        out[f"hit_{cache}_over_floor"] = [_ratio(r.get("ttft_ms"), floor_ms) for r in runs]
    warm = procs.get("warm") or []
    first = warm[0].get("ttft_ms") if warm else None
    out["miss_over_hit"] = _ratio((fig.get("miss") or {}).get("ttft_ms"), first)
    rss = [r.get("peak_rss_bytes") for r in warm if r.get("peak_rss_bytes")]
    ls = (fig.get("llama_server") or {}).get("peak_rss_bytes")
    out["hit_rss_over_llama_server"] = _ratio(max(rss) if rss else None, ls)
    b = fig.get("bytes") or {}
    kv = b.get("kv_f16_per_token")
    out["store_dir_over_kv"] = _ratio(b.get("store_dir_per_token"), kv)
    out["fragments_over_kv"] = _ratio(b.get("fragments_per_token"), kv)
    return out


def identity(fig: Mapping) -> dict:
    """Whether every new process's answer equals the miss's and the uncached run's (None when
    one of them is missing)."""
    miss = (fig.get("miss") or {}).get("tokens")
    ref = (fig.get("uncached") or {}).get("tokens")
    runs = [r for cache in ("warm", "dropped") for r in (fig.get("new_process") or {}).get(cache) or []]
    answered = [r["tokens"] for r in runs if r.get("tokens") is not None]
    return {"miss_equals_uncached": None if miss is None or ref is None else miss == ref,
            "hits_equal_miss": sum(t == miss for t in answered) if miss is not None else None,
            "hits_equal_uncached": sum(t == ref for t in answered) if ref is not None else None,
            "hits": len(answered), "hit_processes": len(runs)}


def series(report: Mapping) -> list[dict]:
    """The plot's lines: per model ``miss``, ``hit`` (the first new process, page cache warm),
    ``hit, page cache dropped`` and ``floor``, each a list of (prompt tokens, TTFT ms)."""
    out = []
    for name, m in (report.get("models") or {}).items():
        label = f"{name} ({RANDOM_NOTE})" if m.get("random_weights") else name
        kinds: dict[str, list] = {"miss": [], "hit (new process)": [], "hit, page cache dropped": [], "floor": []}
        for fig in m.get("sizes") or []:
            n = fig.get("prompt_tokens")
            procs = fig.get("new_process") or {}
            values = {"miss": (fig.get("miss") or {}).get("ttft_ms"),
                      "hit (new process)": _first(procs.get("warm")),
                      "hit, page cache dropped": _first(procs.get("dropped")),
                      "floor": (fig.get("floor") or {}).get("floor_ms")}
            for kind, v in values.items():
                if n and v:
                    kinds[kind].append((n, v))
        out += [{"model": label, "kind": k, "points": pts} for k, pts in kinds.items() if pts]
    return out


def _first(runs: Sequence[Mapping] | None) -> float | None:
    return runs[0].get("ttft_ms") if runs else None


def _ms(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v / 1000:.1f} s" if v >= 10_000 else f"{v:.0f}"


def _x(v: float | None, fmt: str = "{:.1f}x") -> str:
    return "n/a" if v is None else fmt.format(v)


def _mib(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 2**20:,.0f}"


def _pair(runs: Sequence[Mapping] | None, key: str, fmt: Callable[[Any], str]) -> str:
    """``key`` of each run (1st, 2nd), comma-separated."""
    return ", ".join(fmt(r.get(key)) for r in runs or []) or "n/a"


def model_heading(name: str, m: Mapping) -> str:
    facts = m.get("facts") or {}
    note = f", {RANDOM_NOTE.upper()} (timings, bytes and identity real; text meaningless)" if m.get(
        "random_weights") else ""
    return f"## {name}: {facts.get('file', '?')}{note}"


def ttft_table(m: Mapping) -> str:
    """The TTFT table of one model: per size miss, hits in new processes, floor and ratios."""
    out = ["| size | prompt tokens | uncached / miss TTFT (ms) | hit TTFT, new process, cache warm: 1st, 2nd (ms) | "
           "cache dropped: 1st, 2nd (ms) | launch to first token, warm / dropped (s) | floor = last token + KV copy "
           "(ms) | hit / floor: warm 1st, 2nd / dropped 1st, 2nd | miss / 1st hit | "
           "hits identical to miss / uncached |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for fig in m.get("sizes") or []:
        if fig.get("error"):
            out.append(f"| {fig['label']} | {fig.get('prompt_tokens') or 'n/a'} | error: {fig['error']} "
                       "| | | | | | | |")
            continue
        procs, fl, r, ident = fig.get("new_process") or {}, fig.get("floor") or {}, fig.get("ratios") or {}, \
            fig.get("identity") or {}
        warm, dropped = procs.get("warm") or [], procs.get("dropped") or []
        over = [", ".join(_x(v) for v in r.get(f"hit_{c}_over_floor") or []) or "n/a" for c in ("warm", "dropped")]
        launch = (f"{_pair(warm, 'launch_to_first_token_s', lambda v: _x(v, '{:.2f}'))} / "
                  f"{_pair(dropped, 'launch_to_first_token_s', lambda v: _x(v, '{:.2f}'))}")
        out.append(
            f"| {fig['label']} | {fig['prompt_tokens']:,} | {_ms((fig.get('uncached') or {}).get('ttft_ms'))} / "
            f"{_ms((fig.get('miss') or {}).get('ttft_ms'))} | {_pair(warm, 'ttft_ms', _ms)} | "
            f"{_pair(dropped, 'ttft_ms', _ms)} | {launch} | "
            f"{_x(fl.get('last_token_ms'), '{:.1f}')} + {_x(fl.get('copy_ms'), '{:.1f}')} = "
            f"{_x(fl.get('floor_ms'), '{:.1f}')} | {over[0]} / {over[1]} | "
            f"{_x(r.get('miss_over_hit'), '{:.0f}x')} | {ident.get('hits_equal_miss', 'n/a')} / "
            f"{ident.get('hits_equal_uncached', 'n/a')} of {ident.get('hit_processes', 0)}"
            + ("" if ident.get("miss_equals_uncached") in (True, None) else " (miss differs from uncached!)") + " |")
    return "\n".join(out)


def resource_table(m: Mapping) -> str:
    """The memory and bytes table of one model."""
    out = ["| size | hit processes' peak RSS (MiB) | llama-server holding the same context: peak RSS (MiB), restore "
           "(ms) | RSS hit / llama-server | store dir / fragments / seq state / f16 KV, bytes a token | "
           "store dir / KV | store resident before the runs, warm / dropped (MiB) |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for fig in m.get("sizes") or []:
        if fig.get("error"):
            continue
        procs, ls, b, r = fig.get("new_process") or {}, fig.get("llama_server") or {}, fig.get("bytes") or {}, \
            fig.get("ratios") or {}
        warm = procs.get("warm") or []
        reused = (f" (reused {ls['cache_n']:,} of {ls['cache_n'] + ls['prompt_n']:,} tokens)"
                  if ls.get("cache_n") is not None and ls.get("prompt_n") is not None else "")
        ls_cell = (f"{_mib(ls.get('peak_rss_bytes'))}, {_x(ls.get('restore_ms'), '{:.0f}')}{reused}"
                   if not ls.get("error") else f"n/a ({ls['error']})")
        resident = (f"{_pair(warm, 'resident_before_bytes', _mib)} / "
                    f"{_pair(procs.get('dropped'), 'resident_before_bytes', _mib)}")
        out.append(f"| {fig['label']} | {_pair(warm, 'peak_rss_bytes', _mib)} | {ls_cell} | "
                   f"{_x(r.get('hit_rss_over_llama_server'), '{:.2f}')} | "
                   f"{_x(b.get('store_dir_per_token'), '{:,.0f}')} / {_x(b.get('fragments_per_token'), '{:,.0f}')} / "
                   f"{_x(b.get('state_per_token'), '{:,.0f}')} / {_x(b.get('kv_f16_per_token'), '{:,.0f}')} | "
                   f"{_x(r.get('store_dir_over_kv'), '{:.2f}')} | {resident} |")
    return "\n".join(out)


def peer_table(peers: Mapping) -> str:
    """The peers' table at one size: per system, each step's client TTFT and identity."""
    steps = [s for s in SCENARIO if s != "restart"]
    head = " | ".join(f"{s} TTFT (ms)" for s in steps)
    out = [f"| system | start-ups to /health (s) | {head} | identical to a fresh prefill | prompt tokens reported "
           "| disk bytes a document token | peak RSS (MiB) |",
           "|---|---:|" + "---:|" * len(steps) + "---:|---:|---:|---:|"]
    for name, s in (peers.get("systems") or {}).items():
        if s.get("error") and not s.get("steps"):
            out.append(f"| {name} | {s['error']} |" + " |" * (len(steps) + 4))
            continue
        by = {st["step"]: st for st in s.get("steps") or []}
        cells = []
        for step in steps:
            st = by.get(step)
            if st is None:
                cells.append("n/a")
                continue
            extra = f" (restore {st['restore_ms']:.0f})" if st.get("restore_ms") is not None else ""
            cells.append(f"{_ms(st['ttft_ms'])}{extra}")
        same = [st.get("identical") for st in s.get("steps") or [] if st.get("identical") is not None]
        again = by.get("q1-again", {}).get("equals_own_q1")
        own = "" if again is None else f" (q1 again = its own q1: {'yes' if again else 'no'})"
        reported = sorted({st.get("prompt_tokens_reported") for st in s.get("steps") or []
                           if st.get("prompt_tokens_reported")})
        out.append(f"| {name} | {' / '.join(f'{x:.2f}' for x in s.get('startup_s') or []) or 'n/a'} | "
                   f"{' | '.join(cells)} | {sum(same)} of {len(same)}{own} | "
                   f"{', '.join(f'{x:,}' for x in reported) or 'n/a'} | "
                   f"{_x(s.get('disk_bytes_per_token'), '{:,.0f}')} | {_mib(s.get('peak_rss_bytes'))} |"
                   + (f" error: {s['error']}" if s.get("error") else ""))
    return "\n".join(out)


def render(report: Mapping) -> str:
    """Every table, per model, as printed."""
    parts = []
    for name, m in (report.get("models") or {}).items():
        parts.append(model_heading(name, m))
        if m.get("skipped"):
            parts.append(f"skipped: {m['skipped']}")
            continue
        parts.append(ttft_table(m))
        parts.append(resource_table(m))
        for c in m.get("cut") or []:
            parts.append(f"{c['label']}: not run, {c['reason']}")
        peers = m.get("peers")
        if peers:
            tokens = f" ({peers['prompt_tokens']:,} tokens)" if peers.get("prompt_tokens") else ""
            parts.append(f"### Peers at {peers['label']}{tokens}: question 1, restart, question 2, question 1 again, "
                         "restart, follow-up turn" + (f" ({RANDOM_NOTE})" if m.get("random_weights") else ""))
            parts.append(peer_table(peers) if not peers.get("skipped") else f"skipped: {peers['skipped']}")
    return "\n\n".join(parts) + "\n"


# -- page cache ------------------------------------------------------------------------------------

def store_files(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*") if p.is_file())


def drop_page_cache(root: Path) -> int:
    """fsync and ``posix_fadvise(POSIX_FADV_DONTNEED)`` every file under ``root`` (the kernel then
    drops their clean pages that no process maps); the files done."""
    n = 0
    for p in store_files(root):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def warm_page_cache(root: Path) -> int:
    """Read every file under ``root`` through (into the page cache); the bytes read."""
    total = 0
    for p in store_files(root):
        with open(p, "rb", buffering=0) as fh:
            while chunk := fh.read(8 << 20):
                total += len(chunk)
    return total


def resident_bytes(root: Path) -> int | None:
    """Bytes of the files under ``root`` in the page cache (``mincore`` of a read-only mapping,
    which faults nothing in); None where ``mincore`` is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    for p in store_files(root):
        size = p.stat().st_size
        if not size:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                total += sum(b & 1 for b in vec) * page
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total


# -- models ----------------------------------------------------------------------------------------

def shaped_path(shape: str) -> Path:
    """Where ``tools/shaped_gguf.py`` keeps the shape's GGUF (it may not exist; nothing is built)."""
    tools = str(ROOT / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    import shaped_gguf

    return shaped_gguf.gguf_path(shaped_gguf.shape(shape))


def resolve_model(spec: ModelSpec) -> tuple[Path | None, str | None]:
    """(the GGUF, None) or (None, why it is skipped)."""
    from edgesync_engines.adapters.model_files import default_model_path, gemma3_model_path

    if spec.name == "smollm2":
        return default_model_path(), None
    if spec.name == "gemma3-270m":
        return gemma3_model_path(), None
    path = shaped_path(spec.shape)
    if path.is_file():
        return path, None
    return None, (f"{spec.shape} is not built yet ({path} is missing); this benchmark never builds it: "
                  f"`python tools/shaped_gguf.py {spec.shape}` does (after `make llama-quantize`)")


def model_facts(path: Path) -> dict:
    """The GGUF's file, architecture, trained context, chat template (present) and the built-in
    template EdgeSync renders with when it has none."""
    import llama_cpp

    from edgesync_engines.adapters.gguf_header import read_header
    from edgesync_engines.adapters.llamacpp_model import builtin_template_for

    header = read_header(path)
    md, arch = header.metadata, header.architecture
    template = bool(md.get("tokenizer.chat_template"))
    return {"path": str(path), "file": Path(path).name, "architecture": arch, "general_name": md.get("general.name"),
            "n_ctx_train": md.get(f"{arch}.context_length"), "chat_template": template,
            "builtin_template": None if template else builtin_template_for(llama_cpp, arch)}


def edgesync_config(path: Path, n_ctx: int, threads: int, store: Path | None = None):
    from edgesync_engines.config import EdgeSyncConfig

    settings: dict[str, Any] = {"n_threads": threads, "n_ctx": n_ctx, "model_path": str(path), "flash_attn": False}
    if store is not None:
        settings["store_path"] = str(store)
    return EdgeSyncConfig.load(settings)


def token_counter(path: Path, threads: int, n_ctx: int):
    """(count_tokens(messages), close): an uncached EdgeSync that only tokenizes."""
    from edgesync_bench.bench_workloads import adapter_token_counter
    from edgesync_engines.request.router import EdgeSync

    es = EdgeSync(store=False, config=edgesync_config(path, n_ctx, threads))
    return adapter_token_counter(es.adapter), es.close


# -- the in-process measurements -------------------------------------------------------------------

def kv_floor(es, messages: list[dict], repeats: int = FLOOR_REPEATS, slot_file: Path | None = None,
             last_repeats: int = LAST_TOKEN_REPEATS) -> dict:
    """The floor of a prompt the live context holds (module docstring, step 3), and the slot file
    of step 4: ``last_token_ms`` (median), ``copy_ms`` (median ``llama_state_seq_set_data``),
    ``floor_ms`` (their sum), every repeat, ``state_bytes``; ``slot_file_bytes``."""
    import llama_cpp

    from edgesync_bench.floor import floor_ms

    last = [floor_ms(es, messages) for _ in range(last_repeats)]
    adapter = es.adapter
    out: dict[str, Any] = {"last_token_ms_each": last, "last_token_ms": median(last)}
    with adapter.lock:
        tokens = es.prompt_tokens(messages)
        n, ctx, seq = len(tokens), adapter.llm.ctx, adapter.seq
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), seq, n, -1)  # the prompt's cells alone
        size = llama_cpp.llama_state_seq_get_size(ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        if llama_cpp.llama_state_seq_get_data(ctx, buf, size, seq) != size:
            raise RuntimeError("llama_state_seq_get_data wrote a short state")
        copies = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            read = llama_cpp.llama_state_seq_set_data(ctx, buf, size, seq)
            copies.append((time.perf_counter() - t0) * 1000)
            if read != size:
                raise RuntimeError(f"llama_state_seq_set_data read {read} of {size} bytes")
        del buf
        adapter.llm.n_tokens = n
        if slot_file is not None:
            arr = (llama_cpp.llama_token * n)(*tokens)
            out["slot_file_bytes"] = int(llama_cpp.llama_state_seq_save_file(ctx, str(slot_file).encode(), seq, arr, n))
    out.update(copy_ms_each=copies, copy_ms=median(copies), state_bytes=size, tokens=n)
    out["floor_ms"] = out["last_token_ms"] + out["copy_ms"]
    return out


def in_process(path: Path, plan: Mapping, prompt: list[dict], store: Path, args, slot_file: Path) -> dict:
    """Steps 1-4 and 7's in-process figures of one size."""
    from edgesync_bench.floor import stored_bytes, timed_request
    from edgesync_bench.worker import kv_bytes_per_token, wait_for_warm_up
    from edgesync_engines.request.router import EdgeSync

    cfg = edgesync_config(path, plan["n_ctx"], args.threads, store)
    t0 = time.perf_counter()
    es = EdgeSync(store=store, config=cfg)
    load_s = time.perf_counter() - t0
    wait_for_warm_up()
    uncached = EdgeSync(model=es.adapter, store=False, config=cfg)
    try:
        es.adapter.clear_kv_cache()
        ref = timed_request(uncached, prompt, args.max_tokens)
        es.adapter.clear_kv_cache()
        miss = timed_request(es, prompt, args.max_tokens)
        fl = kv_floor(es, prompt, slot_file=slot_file)
        fragments = stored_bytes(es)
        kv = kv_bytes_per_token(es.adapter.llm)
    finally:
        uncached.close()
        es.close()
    keep = ("ttft_ms", "wall_ttft_ms", "after_ms", "hit", "tokens", "text", "prompt_tokens", "tokens_reused",
            "bytes_read")
    return {"load_s": load_s, "uncached": {k: ref[k] for k in keep}, "miss": {k: miss[k] for k in keep},
            "floor": fl, "fragment_bytes": fragments, "kv_f16_per_token": kv}


CHILD = ("import sys; from edgesync_bench.long_context import child_main; sys.exit(child_main(sys.argv[1]))")


def child_main(spec_file: str) -> int:
    """A new process's exact hit (module docstring, step 5): open the store of ``spec_file``'s
    spec, ask its messages once, print one JSON line."""
    from edgesync_bench.floor import timed_request
    from edgesync_bench.worker import wait_for_warm_up
    from edgesync_engines.request.router import EdgeSync

    spec = json.loads(Path(spec_file).read_text())
    cfg = edgesync_config(Path(spec["model"]), spec["n_ctx"], spec["threads"], Path(spec["store"]))
    t0 = time.perf_counter()
    es = EdgeSync(store=spec["store"], config=cfg)
    load_s = time.perf_counter() - t0
    wait_for_warm_up()
    try:
        called = time.time()
        r = timed_request(es, spec["messages"], spec["max_tokens"])
    finally:
        es.close()
    print(json.dumps({"ttft_ms": r["ttft_ms"], "wall_ttft_ms": r["wall_ttft_ms"], "hit": r["hit"],
                      "tokens": r["tokens"], "prompt_tokens": r["prompt_tokens"], "tokens_reused": r["tokens_reused"],
                      "bytes_read": r["bytes_read"], "load_s": load_s,
                      "first_token_unix": called + r["wall_ttft_ms"] / 1000}), flush=True)
    return 0


def hit_process(path: Path, plan: Mapping, prompt: list[dict], store: Path, args, cache: str) -> dict:
    """One new process's exact hit with the store's pages warm or dropped first."""
    from edgesync_bench.floor import run_child

    if cache == "dropped":
        drop_page_cache(store)
    else:
        warm_page_cache(store)
    resident = resident_bytes(store)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory(prefix="edgesync-lc-child-") as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"model": str(path), "n_ctx": plan["n_ctx"], "threads": args.threads,
                                    "store": str(store), "messages": prompt, "max_tokens": args.max_tokens}))
        launched = time.time()
        run = run_child([str(spec)], env, command=[sys.executable, "-c", CHILD])
    res = run.pop("result")
    out = {"cache": cache, "resident_before_bytes": resident, **run}
    if res is not None:
        out.update(res)
        out["launch_to_first_token_s"] = res["first_token_unix"] - launched
    return out


def llama_server_holding(path: Path, facts: Mapping, plan: Mapping, slot_dir: Path, tokens_ref: list[int] | None,
                         n_prompt: int, args) -> dict:
    """Step 6: llama-server restores the slot file and answers the same prompt's tokens."""
    from edgesync_bench.serve import Server, peak_rss_bytes

    if not args.llama_server.is_file():
        return {"error": f"{args.llama_server} not found (`make llama-server`)"}
    cmd = llama_server_args(args.llama_server, path, facts, plan["n_ctx"], args.threads) + ["--slot-save-path",
                                                                                             str(slot_dir)]
    server = Server(cmd, slot_dir, dict(os.environ), ready_path="/health", poll_s=0.05)
    with open(slot_dir.parent / f"llama-server-{plan['label']}.log", "w") as logf:
        try:
            server.start(logf)
        except RuntimeError as exc:
            return {"error": f"did not start: {str(exc)[-300:]}"}
        try:
            restore = post_json(server.port, "/slots/0?action=restore", {"filename": SLOT_FILE})
            body = {"prompt": tokens_of_slot(slot_dir / SLOT_FILE, n_prompt), "n_predict": args.max_tokens,
                    "temperature": 0.0, "repeat_penalty": 1.0, "cache_prompt": True, "id_slot": 0,
                    "return_tokens": True}
            done = post_json(server.port, "/completion", body)
            rss = peak_rss_bytes(server.proc.pid)
        except (OSError, ValueError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            server.stop()
    t = done["body"].get("timings") or {}
    answer = done["body"].get("tokens")
    return {"peak_rss_bytes": rss, "restore_ms": restore["ms"], "n_restored": restore["body"].get("n_restored"),
            "completion_ms": done["ms"], "cache_n": t.get("cache_n"), "prompt_n": t.get("prompt_n"),
            "tokens": answer, "equals_miss": None if tokens_ref is None or answer is None else answer == tokens_ref}


def tokens_of_slot(path: Path, n: int) -> list[int]:
    """The prompt tokens a ``llama_state_seq_save_file`` file starts with (magic, version, count,
    tokens)."""
    import numpy as np

    head = np.fromfile(path, dtype=np.uint32, count=3 + n)
    if int(head[2]) != n:
        raise ValueError(f"{path}: {int(head[2])} tokens, expected {n}")
    return [int(t) for t in head[3:3 + n].view(np.int32)]


def post_json(port: int, path: str, body: Mapping, timeout: float = 3600) -> dict:
    """POST JSON to a local server: ``ms`` (client time) and the reply's ``body``."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        data = r.read()
    return {"ms": (time.perf_counter() - t0) * 1000, "body": json.loads(data) if data else {}}


def llama_server_args(binary: Path, model: Path, facts: Mapping, n_ctx: int, threads: int) -> list[str]:
    """llama-server with one slot of ``n_ctx``, ``threads`` threads and flash attention off (the
    numerics of EdgeSync's default), and llama.cpp's built-in chat template of the architecture
    for a GGUF without one (as EdgeSync renders it)."""
    from edgesync_bench.chat import llama_server_command

    return [*llama_server_command(binary, model, threads, n_ctx, 1), "-fa", "off", *template_args(facts)]


def template_args(facts: Mapping) -> list[str]:
    if facts.get("chat_template") or not facts.get("builtin_template"):
        return []
    return ["--no-jinja", "--chat-template", facts["builtin_template"]]


def measure_size(path: Path, facts: Mapping, plan: Mapping, prompt: Mapping, work: Path, args, say) -> dict:
    """Every figure of one model and size (module docstring, steps 1-7)."""
    from edgesync_bench.worker import dir_disk_bytes

    base = work / plan["label"]
    store, slots = base / "store", base / "slots"
    slots.mkdir(parents=True)
    fig: dict[str, Any] = {"label": plan["label"], "target": plan["target"], "n_ctx": plan["n_ctx"],
                           "passages": prompt["passages"], "prompt_tokens": prompt["tokens"]}
    say(f"  {plan['label']}: uncached, miss and floor ({prompt['tokens']:,} tokens)")
    fig.update(in_process(path, plan, prompt["q1"], store, args, slots / SLOT_FILE))
    fig["prompt_tokens"] = fig["miss"]["prompt_tokens"]
    n = fig["prompt_tokens"]
    fig["bytes"] = {"store_dir": dir_disk_bytes(store), "fragments": fig.pop("fragment_bytes"),
                    "state": fig["floor"]["state_bytes"], "kv_f16_per_token": fig.pop("kv_f16_per_token")}
    b = fig["bytes"]
    b.update(store_dir_per_token=b["store_dir"] / n, fragments_per_token=b["fragments"] / n,
             state_per_token=b["state"] / n)
    fig["new_process"] = {}
    for cache in ("warm", "dropped"):
        say(f"  {plan['label']}: {HIT_PROCESSES} new processes, page cache {cache}")
        fig["new_process"][cache] = [hit_process(path, plan, prompt["q1"], store, args, cache)
                                     for _ in range(HIT_PROCESSES)]
    say(f"  {plan['label']}: llama-server holding the same context")
    fig["llama_server"] = llama_server_holding(path, facts, plan, slots, fig["miss"]["tokens"], n, args)
    fig["identity"] = identity(fig)
    fig["ratios"] = size_ratios(fig)
    return fig


# -- peers -----------------------------------------------------------------------------------------

@dataclass
class Peer:
    """One system of the peers' scenario: its server (not started), state directory, whether it
    is driven by slot save/restore, and where its stored bytes are."""

    name: str
    server: Any
    state: Path
    slot_restore: bool = False
    bytes_dir: Path | None = None


def peer_systems(path: Path, facts: Mapping, n_ctx: int, work: Path, args, say, has_slots: bool) -> list[Peer]:
    """The peers that can run (a missing binary is said and skipped)."""
    from edgesync_bench.serve import Server, commands, free_port

    out = []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EDGESYNC_THREADS": str(args.threads), "EDGESYNC_N_CTX": str(n_ctx),
           "EDGESYNC_FLASH_ATTN": "0"}
    for name in args.peers:
        state = work / name
        state.mkdir(parents=True)
        if name == "edgesync":
            cmd, cwd = commands("edgesync", path, args.threads, n_ctx, state, max_tokens=args.max_tokens)
            if has_slots:
                cmd += ["--slots", "1"]
            out.append(Peer(name, Server(cmd, cwd, env, ready_path="/health", poll_s=0.05), state,
                            bytes_dir=state / "store"))
        elif not args.llama_server.is_file():
            say(f"  {name}: skipped, {args.llama_server} not found (`make llama-server`)")
        elif name == "llama-server-slots":
            cmd = llama_server_args(args.llama_server, path, facts, n_ctx, args.threads) + ["--slot-save-path",
                                                                                             str(state)]
            out.append(Peer(name, Server(cmd, state, dict(os.environ), ready_path="/health", poll_s=0.05), state,
                            slot_restore=True, bytes_dir=state))
        elif not args.hearth.is_file():
            say(f"  {name}: skipped, {args.hearth} not found (`make hearth-llm`)")
        else:
            cache = state / "cache"
            cmd = [str(args.hearth), "serve", "--model", str(path), "--ctx", str(n_ctx), "--cache-dir", str(cache),
                   "--port", "{port}", "--upstream-port", str(free_port()), "--", "-t", str(args.threads),
                   "-fa", "off", *template_args(facts)]
            henv = {**os.environ, "PATH": os.pathsep.join([str(args.llama_server.parent), os.environ.get("PATH", "")])}
            out.append(Peer(name, Server(cmd, state, henv, ready_path="/health", poll_s=0.05), state,
                            bytes_dir=cache))
    return out


def scenario_prompts(step: str, prompt: Mapping, answers: Mapping[str, str]) -> list[dict]:
    """The messages of a scenario step (``answers``: the system's own answer by step)."""
    if step in ("q1", "q1-again"):
        return prompt["q1"]
    if step == "q2":
        return prompt["q2"]
    return follow_up(prompt["q1"], answers["q1"], prompt["q2"])


def stored_file_bytes(root: Path | None) -> int:
    """Bytes a system keeps on disk: an EdgeSync store's allocated bytes; slot files' sizes (logs
    and hearth's manifest left out)."""
    from edgesync_bench.worker import dir_disk_bytes

    if root is None or not root.exists():
        return 0
    if (root / "data.mdb").exists() or any(root.glob("**/*.mdb")):
        return dir_disk_bytes(root)
    return sum(p.stat().st_size for p in store_files(root) if p.suffix not in (".log", ".json", ".tmp"))


def run_peer(peer: Peer, prompt: Mapping, args, say) -> dict:
    """One system's scenario (module docstring)."""
    from edgesync_bench.chat import connect, running, stream_answer
    from edgesync_bench.serve import peak_rss_bytes

    out: dict[str, Any] = {"steps": [], "startup_s": [], "peak_rss_by_start": [], "saves": [], "error": None}
    answers: dict[str, str] = {}
    server = peer.server

    def start(logf) -> tuple:
        t0 = time.perf_counter()
        server.start(logf)
        out["startup_s"].append(time.perf_counter() - t0)
        return connect(server)

    def stop() -> None:
        if running(server):
            out["peak_rss_by_start"].append(peak_rss_bytes(server.proc.pid))
            server.stop()

    with open(peer.state / "server.log", "w") as logf:
        try:
            client, model_id = start(logf)
            restore_due = False
            for step in SCENARIO:
                if step == "restart":
                    stop()
                    client, model_id = start(logf)
                    restore_due = peer.slot_restore
                    continue
                messages = scenario_prompts(step, prompt, answers)
                restore_ms = None
                if restore_due:
                    restore_ms = post_json(server.port, "/slots/0?action=restore", {"filename": SLOT_FILE})["ms"]
                    restore_due = False
                say(f"    {peer.name}: {step}")
                r = stream_answer(client, model_id, messages, max_tokens=args.max_tokens)
                answers.setdefault(step, r["text"])
                rec = {"step": step, "messages": messages, "ttft_ms": r["ttft_ms"] + (restore_ms or 0.0),
                       "stream_ttft_ms": r["ttft_ms"], "restore_ms": restore_ms, "text": r["text"],
                       "prompt_tokens_reported": r["usage_prompt_tokens"], "cached_tokens": r["cached_tokens"],
                       "timings": r["timings"]}
                out["steps"].append(rec)
                if peer.slot_restore:
                    saved = post_json(server.port, "/slots/0?action=save", {"filename": SLOT_FILE})
                    out["saves"].append({"step": step, "ms": saved["ms"], "n_saved": saved["body"].get("n_saved")})
        except Exception as exc:  # a server that fails: the others still run
            out["error"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
        finally:
            stop()
    out["peak_rss_bytes"] = max(out["peak_rss_by_start"], default=None)
    out["disk_bytes"] = stored_file_bytes(peer.bytes_dir)
    out["disk_bytes_per_token"] = out["disk_bytes"] / prompt["tokens"] if prompt["tokens"] else None
    return out


def run_peers(path: Path, facts: Mapping, plan: Mapping, prompt: Mapping, uncached_text: str | None, work: Path,
              args, say, has_slots: bool) -> dict:
    """Every peer's scenario at one size, then the fresh answers of their prompts and identity."""
    from edgesync_bench.chat import Reference

    out: dict[str, Any] = {"label": plan["label"], "n_ctx": plan["n_ctx"], "prompt_tokens": prompt["tokens"],
                           "systems": {}}
    peers = peer_systems(path, facts, plan["n_ctx"], work, args, say, has_slots)
    for peer in peers:
        say(f"  peers at {plan['label']}: {peer.name}")
        out["systems"][peer.name] = run_peer(peer, prompt, args, say)
    say(f"  peers at {plan['label']}: fresh answers")
    ref = Reference(args.threads, plan["n_ctx"], args.max_tokens, flash_attn=False, model=path)
    try:
        if uncached_text is not None:  # the size's uncached run answered question 1 already
            ref.answers[json.dumps(prompt["q1"])] = uncached_text
        for s in out["systems"].values():
            own = {st["step"]: st["text"] for st in s["steps"]}
            for st in s["steps"]:
                st["identical"] = st["text"] == ref.answer(st["messages"])
                if st["step"] == "q1-again" and "q1" in own:
                    st["equals_own_q1"] = st["text"] == own["q1"]
                st.pop("messages")
    finally:
        ref.close()
    return out


# -- the run ---------------------------------------------------------------------------------------

def run_model(spec: ModelSpec, args, work: Path, budget_s: float, say, has_slots: bool) -> dict:
    """Every size (as the budget allows) and the peers of one model."""
    from edgesync_bench.workloads import DOC_QA_FILE, data_file, read_jsonl

    m: dict[str, Any] = {"random_weights": spec.random_weights, "sizes": [], "cut": [], "skipped": None}
    path, why = resolve_model(spec)
    if path is None:
        m["skipped"] = why
        say(f"{spec.name}: skipped, {why}")
        return m
    facts = m["facts"] = model_facts(path)
    if not facts["chat_template"] and not facts["builtin_template"]:
        m["skipped"] = f"{facts['file']} has no chat template and llama.cpp no built-in one for {facts['architecture']}"
        return m
    limit = dict(args.limit).get(spec.name, spec.limit)
    plans, m["cut"] = size_plan(args.sizes, facts["n_ctx_train"], limit)
    if not plans:
        return m
    t_model = time.perf_counter()
    count, close = token_counter(path, args.threads, 1024)  # counting needs the tokenizer, not the context
    try:
        prompts = doc_prompts(read_jsonl(data_file(DOC_QA_FILE)), count, [p["target"] for p in plans])
    finally:
        close()
    history: list[tuple[int, float]] = []
    for i, plan in enumerate(plans):
        prompt = prompts.get(plan["target"])
        if prompt is None or (i and prompt["tokens"] <= m["sizes"][-1]["prompt_tokens"]):
            m["cut"].append({"label": plan["label"], "reason": f"{DOC_QA_FILE} holds no longer prompt"})
            continue
        left = budget_s - (time.perf_counter() - t_model)
        guess = predict_seconds(history, prompt["tokens"])
        if guess is not None and guess > left:
            m["cut"].append({"label": plan["label"], "reason": f"predicted {guess / 60:.1f} min > "
                             f"{max(left, 0) / 60:.1f} min left of this model's share of --budget-min"})
            m["cut"] += [{"label": later["label"], "reason": f"larger than {plan['label']}, cut for time"}
                         for later in plans[i + 1:]]
            say(f"{spec.name}: {plan['label']} and larger cut (predicted {guess / 60:.1f} min, "
                f"{max(left, 0) / 60:.1f} min left)")
            break
        say(f"{spec.name} {plan['label']}" + (f" (predicted {guess / 60:.1f} min)" if guess else ""))
        t0 = time.perf_counter()
        work.mkdir(parents=True, exist_ok=True)
        sub = Path(tempfile.mkdtemp(prefix=f"{spec.name}-{plan['label']}-", dir=work))
        try:
            fig = measure_size(path, facts, plan, prompt, sub, args, say)
        except Exception as exc:  # this size's figures are lost; the next size may still run
            log.exception("%s %s failed", spec.name, plan["label"])
            fig = {"label": plan["label"], "target": plan["target"], "prompt_tokens": prompt["tokens"],
                   "error": f"{type(exc).__name__}: {exc}"}
        fig["seconds"] = time.perf_counter() - t0
        m["sizes"].append(fig)
        history.append((prompt["tokens"], fig["seconds"]))
        if plan["label"] == size_label(args.peer_size) and args.peers and not fig.get("error"):
            prefill_s = median([fig["uncached"]["ttft_ms"], fig["miss"]["ttft_ms"]]) / 1000
            guess, left = predict_peer_seconds(prefill_s, fig["load_s"], args.peers), \
                budget_s - (time.perf_counter() - t_model)
            if guess > left:
                m["peers"] = {"label": plan["label"], "skipped": f"predicted {guess / 60:.1f} min > "
                              f"{max(left, 0) / 60:.1f} min left of this model's share of --budget-min"}
                say(f"{spec.name} {plan['label']}: peers skipped, {m['peers']['skipped']}")
            else:
                say(f"{spec.name} {plan['label']}: peers (predicted {guess / 60:.1f} min)")
                t1 = time.perf_counter()
                m["peers"] = run_peers(path, facts, plan, prompt, _text(fig), sub / "peers", args, say, has_slots)
                m["peers"]["seconds"] = time.perf_counter() - t1
        if not args.keep:
            shutil.rmtree(sub, ignore_errors=True)
    if args.peers and "peers" not in m and size_label(args.peer_size) in [p["label"] for p in plans]:
        m["peers"] = {"label": size_label(args.peer_size), "skipped": "that size did not run (see above)"}
    return m


def _text(fig: Mapping) -> str | None:
    """The size's uncached answer text (None when it did not run)."""
    return (fig.get("uncached") or {}).get("text")


def run(args, say) -> dict:
    """Every model (module docstring); the JSON-able report."""
    from edgesync_bench.chat import serve_has_slots

    t0, load0 = time.perf_counter(), os.getloadavg()
    specs = [s for name in args.models for s in MODELS if s.name == name]
    has_slots = serve_has_slots() if "edgesync" in args.peers else False
    report: dict[str, Any] = {"models": {}}
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="edgesync-long-context-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        for i, spec in enumerate(specs):
            left = args.budget_min * 60 - (time.perf_counter() - t0)
            share = left / (len(specs) - i)
            say(f"== {spec.name}: {share / 60:.1f} min of the budget")
            report["models"][spec.name] = run_model(spec, args, workdir / spec.name, share, say, has_slots)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report["meta"] = {"models": list(args.models), "sizes": [size_label(s) for s in args.sizes],
                      "peer_size": size_label(args.peer_size), "peers": list(args.peers), "threads": args.threads,
                      "max_tokens": args.max_tokens, "budget_min": args.budget_min, "quick": args.quick,
                      "cpu_count": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                      "wall_s": time.perf_counter() - t0, "loadavg_start": load0, "loadavg_end": os.getloadavg()}
    return report


def build_parser() -> argparse.ArgumentParser:
    from edgesync_engines.app.cli_common import int_at_least

    p = argparse.ArgumentParser(prog="python -m edgesync_bench.long_context", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="smollm2 only, 1K-4K, peers at 2K, a 10-minute budget (under 10 minutes on 2 cores)")
    p.add_argument("--models", type=parse_models, default=None,
                   help=f"comma list of {', '.join(MODEL_NAMES)} (default: "
                        f"{', '.join(m.name for m in MODELS if m.default)}; --quick: smollm2)")
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help="prompt sizes, tokens or K (default 1K,2K,4K,8K,16K,32K; --quick 1K,2K,4K)")
    p.add_argument("--limit", type=parse_limit, action="append", default=[], metavar="MODEL=SIZE",
                   help="a model's largest size (defaults: " + ", ".join(f"{m.name} {size_label(m.limit)}"
                                                                          for m in MODELS) + "); repeatable")
    p.add_argument("--peer-size", type=parse_size, default=None,
                   help=f"the size of the peers' scenario (default {size_label(PEER_SIZE)}, --quick "
                        f"{size_label(QUICK_PEER_SIZE)}); 0 peers with --peers none")
    p.add_argument("--peers", default=",".join(PEER_SYSTEMS),
                   help=f"comma list of {', '.join(PEER_SYSTEMS)}, or none (default all)")
    p.add_argument("--budget-min", type=float, default=None,
                   help=f"minutes for the whole run, shared by the models; a size predicted to overrun its model's "
                        f"share is cut, with the larger ones (default {BUDGET_MIN:g}, --quick {QUICK_BUDGET_MIN:g})")
    p.add_argument("--threads", type=int_at_least(1), default=THREADS, help=f"CPU threads of every engine "
                                                                             f"(default {THREADS})")
    p.add_argument("--max-tokens", type=int_at_least(1), default=MAX_TOKENS,
                   help=f"greedy tokens per answer (default {MAX_TOKENS})")
    p.add_argument("--llama-server", type=Path, default=LLAMA_SERVER, help="llama-server binary (default "
                                                                           "build/llama-server)")
    p.add_argument("--hearth", type=Path, default=HEARTH, help="hearth command (default build/hearth-venv/bin/hearth)")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument("--plot", type=Path, default=None,
                   help="the TTFT plot (default docs/long_context.png; --quick: none unless given)")
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    p.add_argument("--workdir", type=Path, default=None, help="work here (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep each size's stores, slot files and logs (--workdir)")
    return p


def resolve_args(args) -> argparse.Namespace:
    """Fill the defaults that depend on ``--quick``."""
    q = args.quick
    args.models = args.models or (("smollm2",) if q else tuple(m.name for m in MODELS if m.default))
    args.sizes = args.sizes or (QUICK_SIZES if q else SIZES)
    args.peer_size = args.peer_size or (QUICK_PEER_SIZE if q else PEER_SIZE)
    args.budget_min = args.budget_min if args.budget_min is not None else (QUICK_BUDGET_MIN if q else BUDGET_MIN)
    peers = [p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "none"]
    unknown = [p for p in peers if p not in PEER_SYSTEMS]
    if unknown:
        raise SystemExit(f"--peers: unknown {', '.join(unknown)}; choose from {', '.join(PEER_SYSTEMS)} or none")
    args.peers = tuple(peers)
    if args.plot is None and not q:
        args.plot = DEFAULT_PLOT
    if args.no_plot:
        args.plot = None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run; print the tables; write ``--json`` and the plot."""
    args = resolve_args(build_parser().parse_args(argv))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    if args.json is not None and (args.json.is_dir() or not args.json.resolve().parent.is_dir()):
        sys.stderr.write(f"error: --json {args.json}: not a file in an existing directory\n")
        return 2

    def say(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    report = run(args, say)
    sys.stdout.write(render(report))
    meta = report["meta"]
    sys.stdout.write(f"\n{meta['wall_s'] / 60:.1f} min, {meta['threads']} threads, load average "
                     f"{meta['loadavg_start'][0]:.2f} -> {meta['loadavg_end'][0]:.2f}\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    if args.plot:
        from edgesync_bench.plots import ttft_against_prompt_tokens

        ttft_against_prompt_tokens(series(report), args.plot,
                                   title=f"TTFT against prompt tokens ({meta['threads']} threads)")
        sys.stdout.write(f"plot: {args.plot}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
