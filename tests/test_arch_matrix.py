"""The architecture matrix (tools/arch_matrix.py): every row's tiny random-weight GGUF, built by
llama.cpp's own converter (tools/tiny_gguf.py, cached), served through the real
``LlamaCppAdapter`` and ``EdgeSync`` with a real store; the outcome observed must be the row's
``expected``, and every answer token-identical to an uncached run of the same model.

Exact-reuse rows: a miss stores fragments; a NEW adapter and ``EdgeSync`` on that store answer
the same prompt as an exact hit with at most one prompt token evaluated (llama.cpp's own
counters), then a new question after the same ~330-token system prompt as a partial hit.
Refused rows: every request is answered uncached, with one warning naming the reason and
nothing stored. The prompts (system_prompts.json row 0 and two questions, over 300 tokens) are
longer than the 64-token windows of the sliding-window rows.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.router import EdgeSync
from tests.llama_counts import chat, llama_prefilled

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import arch_matrix  # noqa: E402
import tiny_gguf  # noqa: E402

ADAPTER_LOG = "edgesync_engines.adapters.llamacpp"
MAX_TOKENS = 16
N_CTX = 1024
QUESTIONS = ("How do I improve my English?", "What is the best way to learn the periodic table?")


@pytest.fixture(scope="module")
def ggufs() -> dict[str, Path]:
    """Every row's GGUF, built once into the cache directory (seconds each)."""
    return {r.name: tiny_gguf.build(r) for r in arch_matrix.ROWS}


@pytest.fixture(scope="module")
def config() -> EdgeSyncConfig:
    """Exact reuse only: no semantic lookup (nothing here needs meaning), no background jobs."""
    return EdgeSyncConfig.load({"semantic": False, "jobs": False})


@pytest.fixture(scope="module")
def prompts(system_prompts) -> list[list[dict]]:
    """Two questions after the same system prompt (the study app's), then the first question
    after another app's system prompt (a control: the answer must depend on the context the
    cache supplies, or identical tokens would prove nothing)."""
    return [chat(system_prompts[0], q) for q in QUESTIONS] + [chat(system_prompts[1], QUESTIONS[0])]


def new_adapter(path: Path, config: EdgeSyncConfig) -> LlamaCppAdapter:
    return LlamaCppAdapter(path, n_ctx=N_CTX, n_threads=config.n_threads)


def answer(es: EdgeSync, prompt) -> tuple:
    """The result of one request and the prompt tokens llama.cpp evaluated for it."""
    es.adapter.reset_perf()
    result = es.generate(prompt, max_tokens=MAX_TOKENS)
    return result, llama_prefilled(es.adapter.perf_counts(), result.tokens, MAX_TOKENS)


def uncached_answers(adapter: LlamaCppAdapter, prompts) -> list[list[int]]:
    """The reference: greedy tokens of each prompt with no cache at all."""
    es = EdgeSync(adapter, store=False)
    return [es.generate(p, max_tokens=MAX_TOKENS).tokens for p in prompts]


def observe_reuse(path: Path, config: EdgeSyncConfig, prompts, store_dir: Path, reference) -> str:
    """Miss in one EdgeSync, then exact and partial hits in a new adapter and EdgeSync on the
    same store; asserts identity and llama.cpp's counts, returns the outcome observed."""
    first = new_adapter(path, config)
    try:
        with EdgeSync(first, store=store_dir, config=config) as es:
            miss, miss_evaluated = answer(es, prompts[0])
    finally:
        first.close()
    second = new_adapter(path, config)
    try:
        with EdgeSync(second, store=store_dir, config=config) as es:
            exact, exact_evaluated = answer(es, prompts[0])
            partial, partial_evaluated = answer(es, prompts[1])
    finally:
        second.close()
    assert miss.prompt_tokens > 300 and len(reference[0]) >= 1
    assert [miss.tokens, exact.tokens, partial.tokens] == [reference[0], reference[0], reference[1]]
    assert miss.hit == "miss" and miss.fragments_written >= 2
    assert miss_evaluated == miss.prompt_tokens
    kinds = f"{miss.hit}/{exact.hit}/{partial.hit}"
    if kinds != "miss/exact/partial":
        return f"no reuse: hits {kinds}"
    assert exact.tokens_reused == exact.prompt_tokens - 1 and exact.bytes_read > 0
    assert exact_evaluated <= 1
    assert partial.tokens_reused >= 128  # the first chunk of the shared system prompt at least
    assert partial_evaluated == partial.tokens_prefilled == partial.prompt_tokens - partial.tokens_reused
    return arch_matrix.EXACT


def observe_refusal(adapter: LlamaCppAdapter, config: EdgeSyncConfig, prompts, store_dir: Path, reference) -> str:
    """Requests on an adapter that refused the cache: answered, uncached, nothing stored."""
    with EdgeSync(adapter, store=store_dir, config=config) as es:
        assert es.store is None and es.uncached_reason == adapter.cache_refusal
        results = [answer(es, p) for p in (prompts[0], prompts[0], prompts[1])]
    assert [r.tokens for r, _ in results] == [reference[0], reference[0], reference[1]]
    for r, evaluated in results:
        assert r.hit == "miss" and r.tokens_reused == 0 and r.fragments_written == 0 and r.bytes_read == 0
        assert r.uncached_reason == adapter.cache_refusal
        assert evaluated == r.prompt_tokens
    assert not store_dir.exists()
    return arch_matrix.REFUSED + adapter.cache_refusal


@pytest.mark.model
@pytest.mark.parametrize("row", arch_matrix.ROWS, ids=[r.name for r in arch_matrix.ROWS])
def test_architecture_outcome(row, ggufs, config, prompts, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=ADAPTER_LOG)
    path = ggufs[row.name]
    adapter = new_adapter(path, config)
    try:
        reference = uncached_answers(adapter, prompts)
        assert reference[0] != reference[1] and reference[0] != reference[2]  # answers follow the prompt
        if adapter.cache_refusal is None:
            adapter.close()
            outcome = observe_reuse(path, config, prompts, tmp_path / "store", reference)
        else:
            outcome = observe_refusal(adapter, config, prompts, tmp_path / "store", reference)
    finally:
        adapter.close()
    assert outcome == row.expected
    warnings = [r.getMessage() for r in caplog.records if r.name == ADAPTER_LOG and r.levelno >= logging.WARNING]
    if outcome.startswith(arch_matrix.REFUSED):
        assert len(warnings) == 1 and outcome[len(arch_matrix.REFUSED):] in warnings[0]
    else:
        assert warnings == []


@pytest.mark.model
def test_models_are_cached_and_keyed_by_config(ggufs):
    """A second build finds the same file; another config or seed is another file."""
    import dataclasses

    r = arch_matrix.ROWS[0]
    assert tiny_gguf.build(r) == ggufs[r.name] and ggufs[r.name].stat().st_size > 0
    assert len({p.name for p in ggufs.values()}) == len(arch_matrix.ROWS)
    other = dataclasses.replace(r, config={**r.config, "num_hidden_layers": 3})
    assert tiny_gguf.gguf_path(other) != ggufs[r.name]
    assert tiny_gguf.gguf_path(dataclasses.replace(r, seed=1)) != ggufs[r.name]


def test_docs_table_is_the_generated_one():
    """docs/engines.md's architecture table is exactly ``python tools/arch_matrix.py --markdown``."""
    doc = (ROOT / "docs" / "engines.md").read_text(encoding="utf-8")
    table = arch_matrix.markdown_table()
    assert table in doc
    assert len(table.splitlines()) == 2 + len(arch_matrix.ROWS)
    printed = subprocess.run([sys.executable, str(ROOT / "tools" / "arch_matrix.py"), "--markdown"],
                             capture_output=True, text=True, check=True).stdout
    assert printed == table


def test_missing_source_distribution_is_one_line(tmp_path):
    """Without the llama-cpp-python sdist the builder says what to run, in one line."""
    import os

    env = dict(os.environ, EDGESYNC_TINY_GGUF_DIR=str(tmp_path / "cache"),
               EDGESYNC_LLAMA_SDIST=str(tmp_path / "missing.tar.gz"), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "tiny_gguf.py"), "qwen2"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'missing.tar.gz'}: no llama-cpp-python {tiny_gguf.llama_version()} source "
        f"distribution (run `make build/llama_cpp_python-{tiny_gguf.llama_version()}.tar.gz`, "
        "or set EDGESYNC_LLAMA_SDIST)"]
