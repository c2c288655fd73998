"""The architecture matrix: which model architectures EdgeSync caches exactly and which it
serves uncached (and why), each row a tiny random-weight model that ``tools/tiny_gguf.py``
builds and converts with llama.cpp's own ``convert_hf_to_gguf.py``.

:data:`ROWS` is the one table: ``tests/test_arch_matrix.py`` runs every row through the real
llama.cpp adapter and ``EdgeSync`` and asserts the outcome it observes equals the row's
``expected``; docs/engines.md's architecture table is ``python tools/arch_matrix.py --markdown``.

Every model shares SmolLM2's vocabulary (49,152 IDs) and tokenizer, so one prompt is one token
sequence for all of them; the weights are random (``torch.manual_seed(seed)``), so the text is
meaningless, but greedy tokens of cached and uncached runs must still be identical.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

EXACT = "exact reuse"
"""The outcome of a row whose miss stores fragments and whose later requests inject them."""
REFUSED = "refused: "
"""Prefix of the outcome of a row served uncached; the rest is ``adapter.cache_refusal``."""
VOCAB = 49152
"""SmolLM2's vocabulary size: every tiny model uses its tokenizer."""
_TOKENS = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
           "initializer_range": 0.2}
"""Every row's config: SmolLM2's special token IDs (<|im_start|>, <|im_end|>), so configs agree
with the tokenizer, and weights of std 0.2: at transformers' 0.02 attention scores are nearly
flat, and the models tried with tied embeddings repeated the last prompt token whatever the
context, so greedy tokens would not show whether the KV a test injects is right."""
_TWO_PARTS = ("two cache parts (global + sliding window, window 64): the window's KV is read block by block "
              "during the prefill, and every part is injected at positions 0..N-1 (full-size window cache)")
_RECURRENT = "recurrent or hybrid memory holds no per-token KV to cut"
_ONE_CACHE = "one KV cache, f16 rows per layer and token, as SmolLM2's"


@dataclass(frozen=True)
class ArchRow:
    """One architecture of the matrix.

    Attributes:
        name: short name, also the cache file's stem (``<name>-<key>.gguf``).
        hf_config: the transformers config class (``transformers.<hf_config>``).
        config: its keyword arguments (tiny sizes; SmolLM2's vocabulary and special tokens).
        summary: what the config is, for people (docs/engines.md).
        expected: :data:`EXACT` or :data:`REFUSED` + the adapter's ``cache_refusal``.
        note: why an exact row is exact (docs/engines.md; a refused row's reason is its ``expected``).
        vocab_writer: ``"module:Class"`` of a converter class whose ``set_vocab`` reads only a
            SentencePiece ``tokenizer.model``; the builder gives it the converter's own GPT-2
            BPE writer (``_set_vocab_gpt2``) for SmolLM2's tokenizer.json. None: as shipped.
        embedding_scale: factor on the random token embeddings. Gemma ties its output
            layer to them and multiplies them by sqrt(hidden): at the common init the last
            token's own embedding wins every greedy step whatever the context, so a test of
            its KV would see the same token repeated; 0.1 lets the context decide.
        seed: ``torch.manual_seed`` for the random weights.
    """

    name: str
    hf_config: str
    config: dict = field(hash=False)
    summary: str
    expected: str
    note: str = ""
    vocab_writer: str | None = None
    embedding_scale: float = 1.0
    seed: int = 0

    def config_kwargs(self) -> dict:
        """The config's keyword arguments with SmolLM2's vocabulary and special tokens."""
        return {**_TOKENS, **self.config}


ROWS: tuple[ArchRow, ...] = (
    ArchRow(
        "llama3", "LlamaConfig",
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 131072,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
        "Llama 3: 2 layers, 4 heads / 2 KV heads of 16, rope_scaling llama3 (a `rope_freqs` tensor)",
        EXACT, _ONE_CACHE),
    ArchRow(
        "qwen2", "Qwen2Config",
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 4096},
        "Qwen2: 2 layers, 4 heads / 2 KV heads of 16, Q/K/V biases",
        EXACT, _ONE_CACHE),
    ArchRow(
        "qwen3", "Qwen3Config",
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096},
        "Qwen3: 2 layers, 4 heads / 2 KV heads of 32 (head_dim > hidden/heads), Q/K norms",
        EXACT, _ONE_CACHE),
    ArchRow(
        "phi3", "Phi3Config",
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
         "sliding_window": 64},
        "Phi-3: 2 layers, 4 heads of 16, fused QKV and gate/up, sliding_window 64",
        EXACT,
        "llama.cpp 0.3.36 runs Phi-3 with full attention (its Phi sliding window is disabled): one KV cache"),
    ArchRow(
        "mistral-swa", "MistralConfig",
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096, "sliding_window": 64},
        "Mistral: 2 layers, 4 heads / 2 KV heads of 16, sliding_window 64",
        EXACT,
        "the converter writes Mistral as `llama` without its window: llama.cpp attends to every token, one KV cache"),
    ArchRow(
        "gemma2", "Gemma2Config",
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 64,
         "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "max_position_embeddings": 4096},
        "Gemma 2: 4 layers alternating sliding (window 64) and global, 4 heads / 2 KV heads of 16, "
        "attention and final soft-capping",
        EXACT, _TWO_PARTS,
        vocab_writer="conversion.gemma:Gemma2Model", embedding_scale=0.1),
    ArchRow(
        "gemma3", "Gemma3TextConfig",
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 64,
         "max_position_embeddings": 4096},
        "Gemma 3: 6 layers, 5 sliding (window 64, local RoPE base) to 1 global, 4 heads / 2 KV heads of 16, Q/K norms",
        EXACT, _TWO_PARTS, embedding_scale=0.1),
    ArchRow(
        "mamba", "MambaConfig",
        {"hidden_size": 64, "num_hidden_layers": 2, "state_size": 16, "expand": 2, "conv_kernel": 4},
        "Mamba: 2 selective state-space layers, d_inner 128, state 16 (recurrent, no attention)",
        REFUSED + "mamba: " + _RECURRENT),
    ArchRow(
        "lfm2", "Lfm2Config",
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 4096,
         "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
        "LFM2: 4 layers, short convolutions and attention (2 + 2), 4 heads / 2 KV heads of 16",
        REFUSED + "lfm2: " + _RECURRENT),
)
"""The matrix, one row per architecture (names unique)."""


def row(name: str) -> ArchRow:
    """The row called ``name``.

    Raises:
        KeyError: no such row.
    """
    for r in ROWS:
        if r.name == name:
            return r
    raise KeyError(f"no architecture row {name!r}; rows: {', '.join(r.name for r in ROWS)}")


def markdown_table() -> str:
    """docs/engines.md's architecture table: one line per row of :data:`ROWS`, in order, ending with a
    newline."""
    lines = ["| model | tiny config (random weights) | EdgeSync on llama.cpp | why |", "|---|---|---|---|"]
    for r in ROWS:
        if r.expected == EXACT:
            outcome, why = EXACT, r.note
        else:
            outcome, why = "served uncached", r.expected[len(REFUSED):]
        lines.append(f"| `{r.name}` | {r.summary} | {outcome} | {why} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python tools/arch_matrix.py --markdown | --json``: print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="docs/engines.md's table")
    parser.add_argument("--json", action="store_true", help="the rows as JSON")
    args = parser.parse_args(argv)
    if args.json:
        print(json.dumps([r.__dict__ for r in ROWS], indent=1))
    else:
        print(markdown_table(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
