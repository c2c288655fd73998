"""tools/shaped_gguf.py without building anything: the shape table's figures (the real models'
parameter counts and KV bytes per token), the config handed to transformers, the cache key and
path, and the command's refusal of an unknown shape."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import shaped_gguf  # noqa: E402

ONE_B = shaped_gguf.shape("llama-3.2-1b")
EIGHT_B = shaped_gguf.shape("llama-3.1-8b-kv")


def test_names_are_unique_and_default_is_in_the_table():
    names = [s.name for s in shaped_gguf.SHAPES]
    assert len(names) == len(set(names))
    assert all(shaped_gguf.shape(n) for n in shaped_gguf.DEFAULT_SHAPES)
    with pytest.raises(KeyError, match="no shape 'nope'"):
        shaped_gguf.shape("nope")


def test_llama_3_2_1b_figures():
    # The Hub's parameter count of meta-llama/Llama-3.2-1B (tied output layer counted once).
    assert ONE_B.n_params() == 1_235_814_400
    assert ONE_B.num_attention_heads * ONE_B.head_dim == ONE_B.hidden_size
    assert ONE_B.kv_bytes_per_token() == 16 * 8 * 64 * 2 * 2 == 32 * 1024
    assert ONE_B.quant == "Q4_K_M"
    assert ONE_B.vocab_size == shaped_gguf.LLAMA3_VOCAB == 128256


def test_llama_3_1_8b_kv_figures():
    # meta-llama/Llama-3.1-8B: 8,030,261,248 parameters, untied output layer; the shape narrows
    # the hidden size, attention heads and FFN and keeps the KV cache (layers, KV heads, head size)
    assert EIGHT_B.real_n_params() == 8_030_261_248
    assert EIGHT_B.real_values == {"hidden_size": 4096, "num_attention_heads": 32, "intermediate_size": 14336,
                                   "initializer_range": 0.02}
    assert EIGHT_B.n_params() == 248_807_936
    assert (EIGHT_B.num_hidden_layers, EIGHT_B.num_key_value_heads, EIGHT_B.head_dim) == (32, 8, 128)
    assert EIGHT_B.kv_bytes_per_token() == 128 * 1024
    # 8 query heads, one per KV head; head size set apart from hidden / heads (64)
    assert EIGHT_B.num_attention_heads == EIGHT_B.num_key_value_heads
    assert EIGHT_B.hidden_size // EIGHT_B.num_attention_heads != EIGHT_B.head_dim
    kw = EIGHT_B.config_kwargs()
    assert kw["head_dim"] == 128 and kw["vocab_size"] == 128256 and kw["tie_word_embeddings"] is False
    assert kw["max_position_embeddings"] == 131072 and kw["rope_parameters"]["factor"] == 8.0
    assert kw["initializer_range"] == 0.1 and "real_values" not in kw
    # Q4_K_M's K-quants take rows of a multiple of 256 values: every matrix's input width
    for width in (EIGHT_B.hidden_size, EIGHT_B.num_attention_heads * EIGHT_B.head_dim, EIGHT_B.intermediate_size):
        assert width % 256 == 0


def test_real_values_are_labels_not_bytes():
    assert ONE_B.real_values == {} and ONE_B.real_n_params() == ONE_B.n_params()
    relabelled = dataclasses.replace(EIGHT_B, real_values={})
    assert shaped_gguf.model_key(relabelled) == shaped_gguf.model_key(EIGHT_B)


def test_config_kwargs_are_llama_config_json_values():
    kw = ONE_B.config_kwargs()
    assert kw["vocab_size"] == 128256 and kw["tie_word_embeddings"] is True
    assert kw["hidden_size"] == 2048 and kw["intermediate_size"] == 8192 and kw["num_hidden_layers"] == 16
    assert (kw["num_attention_heads"], kw["num_key_value_heads"], kw["head_dim"]) == (32, 8, 64)
    assert kw["max_position_embeddings"] == 131072 and kw["rms_norm_eps"] == 1e-5
    assert kw["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}
    assert (kw["bos_token_id"], kw["eos_token_id"]) == (1, 2)  # SmolLM2's tokenizer
    kw["rope_parameters"]["factor"] = 1.0  # a copy: the table is not changed through it
    assert ONE_B.rope["factor"] == 32.0


def test_cache_key_follows_what_makes_the_bytes():
    key = shaped_gguf.model_key(ONE_B)
    assert len(key) == 16 and key == shaped_gguf.model_key(dataclasses.replace(ONE_B))
    changed = [dataclasses.replace(ONE_B, quant="Q8_0"), dataclasses.replace(ONE_B, seed=1),
               dataclasses.replace(ONE_B, dtype="float16"), dataclasses.replace(ONE_B, embedding_scale=0.5),
               dataclasses.replace(ONE_B, num_hidden_layers=17), dataclasses.replace(ONE_B, rope=EIGHT_B.rope)]
    keys = {shaped_gguf.model_key(s) for s in changed}
    assert len(keys) == len(changed) and key not in keys
    # name and source are labels, not bytes
    assert shaped_gguf.model_key(dataclasses.replace(ONE_B, source="elsewhere")) == key


def test_gguf_path_is_in_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGESYNC_SHAPED_GGUF_DIR", str(tmp_path))
    path = shaped_gguf.gguf_path(ONE_B)
    assert path == tmp_path / f"llama-3.2-1b-q4_k_m-{shaped_gguf.model_key(ONE_B)}.gguf"
    assert shaped_gguf.gguf_path(dataclasses.replace(ONE_B, quant="Q8_0")).name.startswith("llama-3.2-1b-q8_0-")
    monkeypatch.delenv("EDGESYNC_SHAPED_GGUF_DIR")
    assert shaped_gguf.cache_dir() == Path.home() / ".cache" / "edgesync" / "shaped-gguf"


def test_command_refuses_an_unknown_shape_before_building(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("EDGESYNC_SHAPED_GGUF_DIR", str(tmp_path))
    assert shaped_gguf.main(["nope"]) == 1
    assert "no shape 'nope'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_missing_quantizer_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGESYNC_LLAMA_QUANTIZE", str(tmp_path / "llama-quantize"))
    with pytest.raises(shaped_gguf.ShapedGGUFError, match="make llama-quantize"):
        shaped_gguf.quantize_path()
