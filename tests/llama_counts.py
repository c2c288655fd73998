"""Helpers the real-model tests share: chat messages, and the prompt tokens llama.cpp evaluated
according to its own perf counters (``LlamaCppAdapter.perf_counts``)."""

from __future__ import annotations


def chat(system: str, user: str) -> list[dict]:
    """A system message then a user message."""
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def decode_steps(generated: list[int], max_tokens: int) -> int:
    """Tokens decoding evaluated: every generated token but the last one when ``max_tokens``
    (not an end-of-generation token) stopped the request."""
    return len(generated) - (len(generated) == max_tokens)


def llama_prefilled(perf: dict, generated: list[int], max_tokens: int) -> int:
    """Prompt tokens llama.cpp evaluated: n_p_eval counts tokens of multi-token batches (it
    reports 0 as 1, and a multi-token batch is never 1 token), n_eval single-token
    evaluations, decode steps included."""
    n_p_eval = perf["n_p_eval"] if perf["n_p_eval"] > 1 else 0
    return n_p_eval + perf["n_eval"] - decode_steps(generated, max_tokens)
