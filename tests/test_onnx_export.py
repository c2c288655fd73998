"""Damaged, foreign and missing ONNX exports are refused with a message that names the file,
by the adapter, by `edgesync generate --engine onnx` and by `export-onnx`; bad settings too.
Damaged copies are made from the real export (large files linked, small ones rewritten)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from edgesync_engines.adapters.model_files import ModelLoadError, default_model_path
from edgesync_engines.adapters.onnx_export import (
    META_FILE,
    MODEL_FILE,
    TOKENIZER_FILE,
    ExportError,
    clean_leftovers,
    export_gguf,
    is_gguf,
    open_export,
)
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


def test_a_truncated_gguf_is_refused_with_an_export_error(tmp_path):
    """A file with the GGUF magic and nothing after it (FAKE: a truncated download) passes the
    magic check; transformers' reader then fails inside, and that becomes an ExportError naming
    the file, with no export left behind."""
    truncated = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as model:
        truncated.write_bytes(model.read(10))
    assert is_gguf(truncated)
    with pytest.raises(ExportError, match="cannot load this GGUF") as info:
        export_gguf(truncated, root=tmp_path / "onnx")
    assert str(truncated) in str(info.value)
    assert not any((tmp_path / "onnx").iterdir())


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
