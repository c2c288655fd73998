"""Damaged, foreign and missing ONNX exports are refused with a message that names the file,
by the adapter, by `edgesync generate --engine onnx` and by `export-onnx`; bad settings too.
Damaged copies are made from the real export (large files linked, small ones rewritten).
Models the export does not handle (the real Gemma 3 270M; small GGUFs the gguf package writes
with one header field changed; the real GGUF cut short) are refused from the header, in one
line, before anything is loaded."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from edgesync_engines.adapters.gguf_header import read_header
from edgesync_engines.adapters.model_files import ModelLoadError, default_model_path
from edgesync_engines.adapters.onnx_export import (
    META_FILE,
    MODEL_FILE,
    TOKENIZER_FILE,
    ExportError,
    check_exportable,
    clean_leftovers,
    export_gguf,
    is_gguf,
    open_export,
)
from edgesync_engines.adapters.onnx_support import SUPPORTED_ARCHITECTURES, onnx_refusal
from edgesync_engines.adapters.onnxrt import OnnxRuntimeAdapter
from edgesync_engines.config import EdgeSyncConfig


def damaged_copy(onnx_export, root, meta=None, tokenizer=None, model_bytes=None):
    """A copy of the real export under ``root`` (the directory name the GGUF maps to), with
    ``edgesync.json`` changed by ``meta``, tokenizer.json replaced by ``tokenizer`` text, or
    model.onnx cut to ``model_bytes`` bytes."""
    out = root / onnx_export.name
    out.mkdir(parents=True)
    for name in (MODEL_FILE, MODEL_FILE + ".data", TOKENIZER_FILE):
        (out / name).symlink_to(onnx_export / name)
    data = json.loads((onnx_export / META_FILE).read_text())
    (out / META_FILE).write_text(json.dumps({**data, **(meta or {})}))
    if tokenizer is not None:
        (out / TOKENIZER_FILE).unlink()
        (out / TOKENIZER_FILE).write_text(tokenizer)
    if model_bytes is not None:
        (out / MODEL_FILE).unlink()
        (out / MODEL_FILE).write_bytes((onnx_export / MODEL_FILE).read_bytes()[:model_bytes])
    return out


@pytest.mark.model
@pytest.mark.parametrize("damage, message", [
    ({"tokenizer": '{"version": "1.0", "model": '}, "tokenizer.json: cannot load it"),
    ({"meta": {"n_layer": 29}}, "inputs do not match edgesync.json (n_layer 29)"),
    ({"meta": {"head_dim": 32}}, "past_key_values are"),
    ({"meta": {"n_layer": "thirty"}}, "n_layer must be a positive integer"),
    ({"meta": {"format": "something-else"}}, "this EdgeSync reads"),
    ({"model_bytes": 100_000}, "onnxruntime cannot load it"),
])
def test_a_damaged_export_is_refused_by_name(onnx_export, tmp_path, monkeypatch, damage, message):
    copy = damaged_copy(onnx_export, tmp_path / "onnx", **damage)
    with pytest.raises(ExportError, match=re.escape(message)):
        open_export(copy, n_threads=1)
    monkeypatch.setenv("EDGESYNC_ONNX_DIR", str(tmp_path / "onnx"))
    with pytest.raises(ExportError, match=re.escape(message)):
        OnnxRuntimeAdapter(default_model_path(), n_threads=1)
    proc = subprocess.run([sys.executable, "-m", "edgesync_engines.app.cli", "generate", "hi", "--engine", "onnx",
                           "--no-cache", "--max-tokens", "2"], capture_output=True, text=True,
                          env={**os.environ, "EDGESYNC_ONNX_DIR": str(tmp_path / "onnx")}, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: no usable ONNX export:") and message in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_export_refuses_a_non_gguf_and_an_unwritable_place_before_loading_anything(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    assert not is_gguf(text) and is_gguf(default_model_path())
    with pytest.raises(ExportError, match="not a GGUF file"):
        export_gguf(text, root=tmp_path / "onnx")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        OnnxRuntimeAdapter(text)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    t0 = time.perf_counter()
    for root in (blocker, "/proc/edgesync-nope"):
        with pytest.raises(ExportError, match="cannot write the export there"):
            export_gguf(default_model_path(), root=root)
    assert time.perf_counter() - t0 < 10  # refused before the GGUF is de-quantized (about 30 s)
    proc = subprocess.run([sys.executable, "-m", "edgesync_engines.app.cli", "export-onnx", "--out", str(blocker)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("cut, message", [
    (10, "not a readable GGUF: 10 bytes, less than a GGUF header"),
    (300_000, "not a readable GGUF: a string array runs past the end"),
    (5_000_000, "truncated: its tensors need 98362432 bytes, the file has 5000000"),
])
def test_a_truncated_gguf_is_refused_from_its_header(tmp_path, cut, message):
    """The real GGUF cut short (a truncated download): in its header, in its vocabulary, or in
    its weights. Each passes the magic check and is refused from the header, naming the file,
    before transformers reads it, with no export left behind."""
    truncated = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as model:
        truncated.write_bytes(model.read(cut))
    assert is_gguf(truncated)
    with pytest.raises(ExportError, match=re.escape(message)) as info:
        export_gguf(truncated, root=tmp_path / "onnx")
    assert str(info.value).startswith(f"cannot export to ONNX: {truncated}")
    assert not (tmp_path / "onnx").exists()


@pytest.mark.model
def test_a_sound_export_is_reused_and_an_unfinished_one_is_cleaned(onnx_export, tmp_path):
    assert export_gguf(default_model_path(), root=onnx_export.parent) == onnx_export  # no re-export
    old = tmp_path / f".{onnx_export.name}.abc123"
    new = tmp_path / f".{onnx_export.name}.def456"
    for d in (old, new):
        d.mkdir()
        (d / MODEL_FILE).write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert clean_leftovers(tmp_path) == 1
    assert not old.exists() and new.exists()  # a recent one may be another export in progress


def test_bool_and_engine_settings_are_checked():
    with pytest.raises(ValueError, match="allow_convertible: must be True or False, got 'false'"):
        EdgeSyncConfig.load({"allow_convertible": "false"})
    with pytest.raises(ValueError, match="jobs: must be True or False"):
        EdgeSyncConfig.load({"jobs": 2})
    assert EdgeSyncConfig.load({"engine": " ONNX "}).engine == "onnx"
    with pytest.raises(ValueError, match="engine: 'bogus' is not one of llamacpp, onnx"):
        EdgeSyncConfig.load({"engine": "bogus"})
    with pytest.raises(ValueError, match="EDGESYNC_ALLOW_CONVERTIBLE"):
        EdgeSyncConfig.load(environ={"EDGESYNC_ALLOW_CONVERTIBLE": "maybe"})


def tiny_gguf(path, arch="llama", kv=None, tensors=("token_embd.weight", "output_norm.weight"), tokenizer="gpt2"):
    """A small GGUF written by the gguf package itself (no weights worth the name): the header
    fields that decide what the export handles, and float32 zeros for ``tensors``."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_tokenizer_model(tokenizer)
    for key, value in (kv or {}).items():
        (w.add_string if isinstance(value, str) else w.add_uint32)(key.format(arch=arch), value)
    for name in tensors:
        w.add_tensor(name, np.zeros((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("build, reason", [
    (dict(kv={"general.type": "adapter"}), "a GGUF of type 'adapter', not a model"),
    (dict(tensors=()), "llama GGUF with no tensors (a vocabulary-only file?), not a model"),
    (dict(tensors=("blk.0.attn_q.weight",)), "without token_embd.weight: not a language model"),
    (dict(arch="mamba"), "architecture 'mamba': the ONNX export handles llama only"),
    (dict(arch="qwen2"), "architecture 'qwen2': the ONNX export handles llama only"),
    (dict(arch="mistral3", kv={"{arch}.attention.sliding_window": 4096}),
     "mistral3: sliding-window attention (window 4096 tokens) is not exported to ONNX"),
    (dict(kv={"{arch}.attention.sliding_window": 128}), "llama: sliding-window attention (window 128 tokens)"),
    (dict(kv={"{arch}.expert_count": 8}), "llama: a mixture of 8 experts"),
    (dict(tensors=("token_embd.weight", "rope_freqs.weight")), "llama: rope scaling (rope_freqs tensor)"),
    (dict(kv={"{arch}.rope.scaling.type": "yarn"}), "llama: rope scaling (yarn)"),
    (dict(kv={"{arch}.rope.dimension_count": 8}), "rotary embedding on 8 of 16 head dimensions"),
    (dict(tokenizer="llama"), "llama: tokenizer 'llama'; the onnx engine serves byte-level BPE (gpt2)"),
])
def test_a_gguf_the_export_does_not_handle_is_refused_in_one_line(tmp_path, build, reason):
    path = tiny_gguf(tmp_path / "model.gguf", **build)
    assert onnx_refusal(path) == f"{path}: {reason}" or reason in onnx_refusal(path)
    with pytest.raises(ExportError, match=re.escape(reason)) as info:
        export_gguf(path, root=tmp_path / "onnx")
    assert "\n" not in str(info.value) and not (tmp_path / "onnx").exists()


def test_the_supported_set_is_explicit_and_smollm2_is_in_it(tmp_path):
    assert SUPPORTED_ARCHITECTURES == ("llama",)
    assert onnx_refusal(default_model_path()) is None
    check_exportable(default_model_path())
    assert onnx_refusal(tiny_gguf(tmp_path / "ok.gguf")) is None  # a plain llama header passes
    header = read_header(default_model_path())  # what the check reads: SmolLM2's own header
    assert header.architecture == "llama" and header.arch_value("block_count") == 30
    assert header.array_lengths["tokenizer.ggml.tokens"] == 49152 and header.data_end == header.file_size


def test_export_onnx_refuses_gemma3_in_one_line_before_loading_it(tmp_path):
    """The real Gemma 3 270M (sliding window): `edgesync export-onnx` names the reason in one
    line, exit 2, no traceback, nothing written, in seconds (the torch load alone is ~30 s)."""
    from edgesync_engines.adapters.model_files import gemma3_model_path

    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "edgesync_engines.app.cli", "export-onnx", "--model",
                           str(gemma3_model_path()), "--out", str(tmp_path / "onnx")],
                          capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr == (f"error: cannot export to ONNX: {gemma3_model_path()}: gemma3: sliding-window attention "
                           "(window 512 tokens) is not exported to ONNX; the export handles llama with full "
                           "attention in every layer\n")
    assert not (tmp_path / "onnx").exists() and elapsed < 20
