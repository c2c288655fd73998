"""A bounded load test of ``edgesync serve --workers 2`` on loopback: 4 concurrent ``openai``
clients x 50 streamed chat requests from the seed and chat workloads, paced so that the run lasts
at least 2 minutes. Zero errors, and every answer equals the library's uncached one (computed
here with ``EdgeSync(store=False)``); TTFT p50/p95 (at the first streamed token) and throughput
are printed (run with ``-s`` to see them), not asserted."""

from __future__ import annotations

import os
import statistics
import threading
import time

import openai
import pytest

from edgesync_bench.bench_workloads import adapter_token_counter, chat_sessions
from edgesync_bench.workloads import seed_workload
from edgesync_engines.request.router import EdgeSync
from tests.serve_process import ServeProcess

pytestmark = [pytest.mark.model, pytest.mark.server]

CLIENTS = 4
PER_CLIENT = 50
MIN_SECONDS = 120.0
PACE_S = MIN_SECONDS / (PER_CLIENT - 1)  # request i of a client starts no earlier than i * PACE_S
MAX_TOKENS = 16
SEED_REQUESTS = 30
CHAT_SESSIONS = 3
THREADS = int(os.environ.get("EDGESYNC_THREADS", "1"))


def _chat_turns(reference: EdgeSync) -> list[tuple[list[dict], str]]:
    """The turns of the first chat sessions, each prompt holding the uncached answers to the
    turns before it (what a server whose answers equal those would be sent), with its answer."""
    turns = []
    for session in chat_sessions(adapter_token_counter(reference.adapter), n_sessions=CHAT_SESSIONS, seed=None,
                                 max_tokens=MAX_TOKENS, n_ctx=1024):
        while (turn := session.next_prompt()) is not None:
            answer = reference.generate(turn.as_messages(), max_tokens=MAX_TOKENS).text
            session.record_answer(answer)
            turns.append((turn.as_messages(), answer))
    return turns


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _client_run(base_url: str, model: str, requests: list[list[dict]], t0: float, out: dict) -> None:
    """One client: its requests in order, streamed, paced; answers, TTFTs and errors into ``out``."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    for i, messages in enumerate(requests):
        delay = t0 + i * PACE_S - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        start = time.monotonic()
        ttft, parts, usage = None, [], None
        try:
            for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                        stream=True, stream_options={"include_usage": True}):
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    if choice.delta.content:
                        if ttft is None:
                            ttft = time.monotonic() - start
                        parts.append(choice.delta.content)
        except openai.OpenAIError as exc:
            out["errors"].append(f"{type(exc).__name__}: {exc}")
            continue
        out["answers"].append((messages, "".join(parts)))
        out["ttft"].append(ttft if ttft is not None else time.monotonic() - start)
        out["tokens"] += usage.completion_tokens
        out["prompt_tokens"] += usage.prompt_tokens
        out["cached_tokens"] += usage.prompt_tokens_details.cached_tokens


def test_four_clients_fifty_requests_each(tmp_path):
    reference = EdgeSync(store=False)  # all cores: flash attention off, the thread count changes no bit
    chat = _chat_turns(reference)
    seed = [(r.as_messages(), None) for r in seed_workload(SEED_REQUESTS)]
    items = [m for m, _ in seed + chat]
    work = [items[i % len(items)] for i in range(CLIENTS * PER_CLIENT)]
    expected = {repr(m): a for m, a in chat}

    def compute_seed_references():  # beside the load: the uncached answers of the seed prompts
        for messages, _ in seed:
            if repr(messages) not in expected:
                expected[repr(messages)] = reference.generate(messages, max_tokens=MAX_TOKENS).text

    out = {"answers": [], "ttft": [], "errors": [], "tokens": 0, "prompt_tokens": 0, "cached_tokens": 0}
    with ServeProcess(tmp_path / "store", "--workers", "2", env={"EDGESYNC_THREADS": str(THREADS)}) as server:
        model = openai.OpenAI(base_url=server.base_url, api_key="unused").models.list().data[0].id
        refs = threading.Thread(target=compute_seed_references)
        refs.start()
        t0 = time.monotonic()
        clients = [threading.Thread(target=_client_run, args=(server.base_url, model, work[c::CLIENTS], t0, out))
                   for c in range(CLIENTS)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        elapsed = time.monotonic() - t0
        refs.join()
        assert server.stop() == 0
    reference.close()

    assert out["errors"] == []
    assert len(out["answers"]) == CLIENTS * PER_CLIENT
    wrong = [m[-1]["content"][:60] for m, a in out["answers"] if a != expected[repr(m)]]
    assert wrong == [], f"{len(wrong)} answers differ from the uncached ones"
    assert elapsed >= MIN_SECONDS
    assert out["cached_tokens"] > 0
    ttft_ms = [t * 1000 for t in out["ttft"]]
    print(f"\nload: {len(out['answers'])} requests in {elapsed:.1f} s ({len(out['answers']) / elapsed:.2f} req/s, "
          f"{out['tokens'] / elapsed:.1f} generated tokens/s); TTFT p50 {statistics.median(ttft_ms):.0f} ms, "
          f"p95 {_percentile(ttft_ms, 0.95):.0f} ms; cached {out['cached_tokens']} of {out['prompt_tokens']} "
          f"prompt tokens")
