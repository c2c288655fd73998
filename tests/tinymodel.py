"""A tiny llama-architecture decoder with random weights, exported like the real one
(``onnx_export.export_model``) in seconds: another model with another KV-head layout, for the
compatibility tests. Its vocabulary is SmolLM2's (49,152 IDs) and so is its tokenizer.json, so
it runs the same prompts' token IDs. Not a fake of anything: a real ONNX Runtime decoder whose
KV is simply that of a different model."""

from __future__ import annotations

import hashlib
from pathlib import Path

N_LAYER, N_HEAD, N_HEAD_KV, HEAD_DIM = 2, 4, 2, 16


def build_tiny_export(out_dir: Path, tokenizer_json: Path, chat_template: str, source_fingerprint: str | None = None,
                      seed: int = 0) -> Path:
    """Export a random ``LlamaForCausalLM`` (2 layers, 2 KV heads of 16) to ``out_dir``, with
    the given tokenizer.json and chat template (the real model's, so prompts render alike).

    ``source_fingerprint`` defaults to a SHA-256 of the config and seed (a model of its own);
    passing the real GGUF's fingerprint makes an export that claims the real model but has
    another head layout.
    """
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from edgesync_engines.adapters.onnx_export import export_model

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=N_HEAD * HEAD_DIM, intermediate_size=128, num_hidden_layers=N_LAYER,
                      num_attention_heads=N_HEAD, num_key_value_heads=N_HEAD_KV, head_dim=HEAD_DIM,
                      max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    fingerprint = source_fingerprint or hashlib.sha256(f"tiny-llama/{cfg.to_json_string()}/{seed}".encode()).hexdigest()
    return export_model(
        model,
        Tokenizer.from_file(str(tokenizer_json)),
        Path(out_dir),
        {"source_fingerprint": fingerprint, "source_name": "tiny-random-llama", "chat_template": chat_template},
    )
