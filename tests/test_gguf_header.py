"""The GGUF header reader (``adapters/gguf_header.py``) on the real SmolLM2 GGUF, without the
``gguf`` package that only the ``onnx`` extra installs (no model is loaded: only its header is read)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from edgesync_engines.adapters.gguf_header import GGML_BLOCKS, VALUE_ARRAY, VALUE_FORMATS, VALUE_STRING, read_header
from edgesync_engines.adapters.model_files import default_model_path

CHILD = """
import json, sys
sys.modules["gguf"] = None  # as in a core install: importing gguf raises ImportError
from edgesync_engines.adapters.gguf_header import read_header
h = read_header(sys.argv[1])
print(json.dumps({"version": h.version, "arch": h.metadata.get("general.architecture"),
                  "n_tensors": len(h.tensors), "data_end": h.data_end,
                  "vocab": h.array_lengths.get("tokenizer.ggml.tokens")}))
"""


def test_the_constants_are_the_gguf_packages():
    gguf = pytest.importorskip("gguf")
    sizes = {int(k): tuple(v) for k, v in gguf.GGML_QUANT_SIZES.items()}
    assert GGML_BLOCKS == sizes
    T = gguf.GGUFValueType
    assert (VALUE_STRING, VALUE_ARRAY) == (int(T.STRING), int(T.ARRAY))
    assert set(VALUE_FORMATS) == {int(t) for t in T} - {int(T.STRING), int(T.ARRAY)}


def test_the_header_reads_the_same_without_the_gguf_package():
    path = default_model_path()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    header = read_header(path)
    assert doc == {"version": header.version, "arch": "llama", "n_tensors": len(header.tensors),
                   "data_end": header.data_end, "vocab": header.array_lengths["tokenizer.ggml.tokens"]}
    assert header.data_end <= path.stat().st_size == header.file_size
