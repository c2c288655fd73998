"""Models whose KV EdgeSync cannot cut are served uncached, with the reason, never a traceback:
the real Gemma 3 270M (a two-part sliding-window cache) and SmolLM2 with q8_0 KV."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
from edgesync_engines.adapters.model_files import default_model_path, gemma3_model_path
from edgesync_engines.app import run_report
from edgesync_engines.request.router import EdgeSync

ROOT = Path(__file__).resolve().parents[1]
ADAPTER_LOG = "edgesync_engines.adapters.llamacpp"
GEMMA_TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    """The Gemma 3 270M GGUF, assembled once from its part packages into the user cache dir."""
    return gemma3_model_path()


def _long_prompt(study_prompt: str, question: str) -> str:
    """A raw Gemma-format prompt well over the 64-token minimum (so a store would cache it)."""
    return GEMMA_TURN.format(f"{study_prompt}\n\n{question}")


def _refusal_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == ADAPTER_LOG and r.levelno == logging.WARNING]


def test_gemma3_served_uncached_with_reason(gemma_path, study_prompt, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=ADAPTER_LOG)
    adapter = LlamaCppAdapter(gemma_path, n_ctx=1024, n_threads=1)
    try:
        assert adapter.namespace is None
        assert "sliding-window attention (window 512 tokens)" in adapter.cache_refusal
        store_dir = tmp_path / "store"
        prompt = _long_prompt(study_prompt, "How do I improve my English?")
        with EdgeSync(adapter, store=store_dir) as es:
            assert es.store is None and es.uncached_reason == adapter.cache_refusal
            first = es.generate(prompt, max_tokens=8)
            second = es.generate(prompt, max_tokens=8)
        baseline = EdgeSync(adapter, store=False).generate(prompt, max_tokens=8)
    finally:
        adapter.close()
    assert first.prompt_tokens > 64
    assert len(baseline.tokens) >= 1 and baseline.text.strip()
    for r in (first, second):
        assert r.tokens == baseline.tokens
        assert r.tier == "miss" and r.tokens_reused == 0 and r.tokens_prefilled == r.prompt_tokens
        assert r.bytes_read == 0 and r.fragments_written == 0
        assert r.uncached_reason == adapter.cache_refusal
        assert r.to_dict()["uncached_reason"] == adapter.cache_refusal
        assert r.ttft_ms > 0
    assert baseline.uncached_reason is None  # store=False asked for no cache: nothing to explain
    assert not store_dir.exists()  # the store was never opened, let alone written
    assert len(_refusal_warnings(caplog)) == 1


def test_quantized_kv_llama_served_uncached(study_prompt, tmp_path, caplog):
    import llama_cpp

    caplog.set_level(logging.WARNING, logger=ADAPTER_LOG)
    path = default_model_path()
    # a quantized V cache needs flash attention in llama.cpp
    llama = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_threads=1, n_threads_batch=1,
                            type_k=llama_cpp.GGML_TYPE_Q8_0, type_v=llama_cpp.GGML_TYPE_Q8_0,
                            flash_attn=True, verbose=False)
    try:
        adapter = LlamaCppAdapter(llama, model_path=path)
        assert adapter.cache_refusal == "quantized KV (type_k q8_0, type_v q8_0): only f16 and f32 KV are cut"
        messages = [{"role": "system", "content": study_prompt},
                    {"role": "user", "content": "How do I improve my English?"}]
        store_dir = tmp_path / "store"
        with EdgeSync(adapter, store=store_dir) as es:
            cached = es.generate(messages, max_tokens=8)
        uncached = EdgeSync(adapter, store=False).generate(messages, max_tokens=8)
        adapter.close()
    finally:
        llama.close()
    assert cached.prompt_tokens > 64 and len(uncached.tokens) == 8
    assert cached.tokens == uncached.tokens
    assert cached.uncached_reason == adapter.cache_refusal and uncached.uncached_reason is None
    assert cached.tokens_reused == 0 and cached.fragments_written == 0
    assert not store_dir.exists()
    assert len(_refusal_warnings(caplog)) == 1


def test_cli_generate_on_gemma3(gemma_path, study_prompt, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), EDGESYNC_MODEL=str(gemma_path), EDGESYNC_THREADS="1",
               EDGESYNC_N_CTX="1024")
    proc = subprocess.run(
        [sys.executable, "-m", "edgesync_engines.app.cli", "generate",
         _long_prompt(study_prompt, "How do I improve my English?"), "--raw", "--store", str(tmp_path / "s"),
         "--max-tokens", "8"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "Traceback" not in proc.stderr
    summary = proc.stderr.strip().splitlines()[-1]
    assert summary.startswith("[miss] prompt ")
    assert "UNCACHED: gemma3: sliding-window attention (window 512 tokens)" in summary
    assert not (tmp_path / "s").exists()


def test_run_table_names_the_reason():
    record = {"prompt_key": "k", "uncached": _result_dict(), "edgesync": _result_dict()}
    summary = run_report.summarize([record])
    table = run_report.render_table(summary, None, "t", uncached_reason="quantized KV (type_k q8_0, type_v q8_0)")
    cells = [str(c) for col in table.columns for c in col._cells]
    assert "UNCACHED: quantized KV (type_k q8_0, type_v q8_0)" in cells
    plain = run_report.render_table(summary, None, "t")
    assert "disabled" in [str(c) for col in plain.columns for c in col._cells]


def _result_dict() -> dict:
    return {"tokens": [1, 2], "tier": "miss", "ttft_ms": 10.0, "total_ms": 20.0, "prompt_tokens": 80,
            "tokens_reused": 0, "tokens_prefilled": 80, "bytes_read": 0, "lookup_ms": None}
