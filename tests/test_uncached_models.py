"""Models and contexts whose KV EdgeSync cannot cut are served uncached, with the reason and one
warning, never a traceback: a user-supplied ``llama_cpp.Llama`` of Gemma 3 built without a
full-size sliding-window cache, SmolLM2 with q5_0 / q4_1 KV, and (through ``edgesync generate``
and ``edgesync run``) a tiny recurrent Mamba GGUF of the architecture matrix. A file that is not
a GGUF, or a truncated one, fails with one clear line and a non-zero exit.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgesync_bench import run_report
from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
from edgesync_engines.adapters.model_files import default_model_path, gemma3_model_path
from edgesync_engines.request.router import EdgeSync

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import arch_matrix  # noqa: E402
import tiny_gguf  # noqa: E402

ADAPTER_LOG = "edgesync_engines.adapters.llamacpp"
MAX_TOKENS = 8
QUESTION = "How do I improve my English?"
MAMBA_REASON = arch_matrix.row("mamba").expected[len(arch_matrix.REFUSED):]


def chat(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _refusal_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == ADAPTER_LOG and r.levelno == logging.WARNING]


def _served_uncached(llm, path: Path, messages, store_dir: Path) -> tuple:
    """Two requests through ``EdgeSync(model=llm)`` on a store path, and the uncached reference
    of the same Llama; returns (results, reference, reason)."""
    with EdgeSync(llm, store=store_dir) as es:
        reason = es.adapter.cache_refusal
        assert es.adapter.namespace is None and reason
        assert es.store is None and es.uncached_reason == reason
        assert es.adapter.model_path == path  # read from the Llama itself
        results = [es.generate(messages, max_tokens=MAX_TOKENS) for _ in range(2)]
        reference = EdgeSync(es.adapter, store=False).generate(messages, max_tokens=MAX_TOKENS)
    return results, reference, reason


def _assert_uncached(results, reference, reason, store_dir: Path, caplog) -> None:
    assert len(reference.tokens) >= 1 and reference.uncached_reason is None
    for r in results:
        assert r.prompt_tokens > 64
        assert r.tokens == reference.tokens
        assert r.hit == "miss" and r.tokens_reused == 0 and r.tokens_prefilled == r.prompt_tokens
        assert r.bytes_read == 0 and r.fragments_written == 0
        assert r.uncached_reason == reason and r.to_dict()["uncached_reason"] == reason
        assert r.ttft_ms > 0
    assert not store_dir.exists()  # the store was never opened, let alone written
    warnings = _refusal_warnings(caplog)
    assert len(warnings) == 1 and reason in warnings[0].getMessage()


@pytest.mark.model
def test_user_gemma_llama_without_swa_full(study_prompt, tmp_path, caplog):
    import llama_cpp

    caplog.set_level(logging.WARNING, logger=ADAPTER_LOG)
    path = gemma3_model_path()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=1024, swa_full=False,
                          verbose=False)
    try:
        results, reference, reason = _served_uncached(llm, path, chat(study_prompt, QUESTION), tmp_path / "s")
    finally:
        llm.close()
    assert reason == ("gemma3: sliding-window attention (window 512 tokens) without a full-size window cache: "
                      "build the Llama with swa_full=True to cache it")
    _assert_uncached(results, reference, reason, tmp_path / "s", caplog)


@pytest.mark.model
@pytest.mark.parametrize("kv", ["q5_0", "q4_1"])
def test_user_llama_with_unsupported_kv_type(kv, study_prompt, tmp_path, caplog):
    import llama_cpp

    caplog.set_level(logging.WARNING, logger=ADAPTER_LOG)
    path = default_model_path()
    ggml = getattr(llama_cpp, f"GGML_TYPE_{kv.upper()}")
    # a quantized V cache needs flash attention in llama.cpp
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=1024,
                          type_k=ggml, type_v=ggml, flash_attn=True, verbose=False)
    try:
        results, reference, reason = _served_uncached(llm, path, chat(study_prompt, QUESTION), tmp_path / "s")
    finally:
        llm.close()
    assert reason == f"KV types type_k {kv}, type_v {kv}: only equal f16, f32, q8_0, q4_0 are cut"
    _assert_uncached(results, reference, reason, tmp_path / "s", caplog)


# -- the commands --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mamba_path() -> Path:
    """The architecture matrix's tiny random-weight Mamba GGUF (built once, cached)."""
    return tiny_gguf.build(arch_matrix.row("mamba"))


def _cli(model: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), EDGESYNC_MODEL=str(model), EDGESYNC_THREADS="1",
               EDGESYNC_N_CTX="1024", EDGESYNC_SEMANTIC="0", EDGESYNC_JOBS="0")
    return subprocess.run([sys.executable, "-m", "edgesync_engines.app.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=timeout)


@pytest.mark.model
def test_cli_generate_on_recurrent_model(mamba_path, study_prompt, tmp_path):
    proc = _cli(mamba_path, "generate", QUESTION, "--system", study_prompt, "--store", str(tmp_path / "s"),
                "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    summary = proc.stderr.strip().splitlines()[-1]
    assert summary.startswith("[miss] prompt ") and ", reused 0," in summary
    assert summary.endswith(f"; UNCACHED: {MAMBA_REASON}")
    assert not (tmp_path / "s").exists()

    as_json = _cli(mamba_path, "generate", QUESTION, "--system", study_prompt, "--store", str(tmp_path / "s"),
                   "--max-tokens", "4", "--json")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["uncached_reason"] == MAMBA_REASON and doc["hit"] == "miss" and doc["fragments_written"] == 0
    assert len(doc["tokens"]) == 4


@pytest.mark.model
def test_cli_run_on_recurrent_model(mamba_path, tmp_path):
    out = tmp_path / "run.json"
    proc = _cli(mamba_path, "run", "seed", "--limit", "2", "--max-tokens", "4", "--store", str(tmp_path / "s"),
                "--json-out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    table = " ".join(proc.stdout.split())
    assert "UNCACHED: mamba: recurrent" in table
    doc = json.loads(out.read_text())
    assert doc["uncached_reason"] == MAMBA_REASON and doc["store"] is None and doc["store_path"] is None
    assert doc["n_requests"] == 2
    assert all(row["identical"] and row["hit"] == "miss" and row["tokens_reused"] == 0 for row in doc["requests"])
    assert not (tmp_path / "s").exists()


def _one_clear_line(proc: subprocess.CompletedProcess, *expected: str) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and proc.stdout.strip() == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("command", ["generate", "run"])
def test_cli_on_a_file_that_is_not_a_gguf(command, tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("these are my notes, not a model\n" * 50)
    args = ["generate", QUESTION] if command == "generate" else ["run", "seed", "--limit", "1"]
    line = _one_clear_line(_cli(bad, *args, "--store", str(tmp_path / "s"), timeout=120), "notes.gguf")
    assert line.startswith("error: cannot load the model: ")
    assert line.endswith("notes.gguf: not a GGUF file (it does not start with the GGUF magic)")
    assert not (tmp_path / "s").exists()


@pytest.mark.model
def test_adapter_names_what_is_wrong_with_a_model_file(mamba_path, tmp_path):
    """llama.cpp's own message is only "Failed to load model": the header says what is wrong."""
    from edgesync_engines.adapters.model_files import ModelLoadError

    vocab_only = tmp_path / "vocab.gguf"
    vocab_only.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16))  # no tensors, no metadata
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(mamba_path.read_bytes()[:-4096])
    for path, reason in ((tmp_path, "a directory, not a GGUF model file"),
                         (vocab_only, "no general.architecture: not a model GGUF"),
                         (cut, "truncated: its tensors need")):
        with pytest.raises(ModelLoadError, match=f"^{path}: {reason}"):
            LlamaCppAdapter(path, n_ctx=256)


@pytest.mark.model
@pytest.mark.parametrize("command", ["generate", "run"])
def test_cli_on_a_truncated_gguf(command, mamba_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    data = mamba_path.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    args = ["generate", QUESTION] if command == "generate" else ["run", "seed", "--limit", "1"]
    line = _one_clear_line(_cli(cut, *args, "--store", str(tmp_path / "s"), timeout=120), "cut.gguf")
    assert line.startswith("error: ")
    assert not (tmp_path / "s").exists()


def test_run_table_names_the_reason():
    record = {"prompt_key": "k", "uncached": _result_dict(), "edgesync": _result_dict()}
    summary = run_report.summarize([record])
    table = run_report.render_table(summary, None, "t", uncached_reason="KV types type_k q5_0, type_v q5_0")
    cells = [str(c) for col in table.columns for c in col._cells]
    assert "UNCACHED: KV types type_k q5_0, type_v q5_0" in cells
    plain = run_report.render_table(summary, None, "t")
    assert "disabled" in [str(c) for col in plain.columns for c in col._cells]


def _result_dict() -> dict:
    return {"tokens": [1, 2], "hit": "miss", "ttft_ms": 10.0, "total_ms": 20.0, "prompt_tokens": 80,
            "tokens_reused": 0, "tokens_prefilled": 80, "bytes_read": 0, "lookup_ms": None}


def test_adapter_refuses_unknown_kv_type():
    with pytest.raises(ValueError, match="kv_type: 'q5_0' is not one of f16, f32, q8_0, q4_0"):
        LlamaCppAdapter(default_model_path(), kv_type="q5_0")
