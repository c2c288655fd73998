"""Build random-weight GGUFs with the shape of real models, quantized as users run them, once,
into a cache directory outside the repository.

What: :data:`SHAPES` is a table of named shapes. Each is a Llama-architecture transformers
config whose sizes are copied from the real model's ``config.json`` on the Hugging Face Hub
(``meta-llama/Llama-3.2-1B``, ``meta-llama/Llama-3.1-8B``): hidden size, layers, attention and
KV heads, head size, FFN size, vocabulary size (128,256), RoPE base and its ``llama3`` scaling
(the converter writes it as the ``rope_freqs`` tensor), context length, RMSNorm epsilon, tied
or untied output layer and ``initializer_range``; a shape may depart from some of them (its
``real_values``: the real model's values of what it changes). The weights are random, so a GGUF is
real for timings, bytes and identity only (its text is meaningless).

* ``llama-3.2-1b`` narrows nothing: the real model's tensors, byte sizes and KV-cache layout.
* ``llama-3.1-8b-kv`` is Llama-3.1-8B's KV cache on a narrow model. Copied: 32 layers, 8 KV
  heads of 128 (K and V 2 x 32 x 8 x 128 f16 values, 128 KiB a token, 4 GiB for 32K tokens),
  RoPE (base 500,000, ``llama3`` scaling, factor 8), context length 131,072, vocabulary,
  epsilon, untied output layer. Changed: hidden size 4,096 -> 512, attention heads 32 -> 8
  (head size 128 set apart from hidden / heads: the GGUF carries ``attention.key_length`` and
  ``value_length`` 128), FFN 14,336 -> 1,024; about 249 M parameters instead of 8.03 B, of
  which the vocabulary's two matrices are 131 M (little time: a prefill applies the output
  matrix only to the tokens whose logits are asked for, one a batch). Why:
  a prefill's cost is the weights' (2 x parameters FLOPs a token: about 14 GFLOPs for the
  8B's 7.0 B outside the embeddings, 4.6 x 10^14 FLOPs for 32K tokens) plus attention's over
  the KV (4 x query heads x head size FLOPs per layer for each pair of a query and an earlier
  token: 2.8 x 10^14 for the 8B at 32K). The narrow weights cost 0.23 GFLOPs a token and 8
  query heads (as many as KV heads, the fewest llama.cpp allows) a quarter of the 8B's
  attention (7 x 10^13 at 32K), so a 32K-token prefill runs on two cores in minutes, not
  hours, and what it measures is mostly the attention that the KV shape fixes. The KV bytes,
  positions and state layout (``llama_state_seq_*``) are the 8B's; the weights, file size and
  per-token weight cost are not. Its ``initializer_range`` is 0.1, not Llama's 0.02: at 0.02
  this narrow model's greedy decoding after Q4_K_M repeats one token (3 distinct in 32 steps of
  ``--check``), at 0.1 it has 32 distinct tokens in 32 steps and last logits of std 2.3.

How: the helpers of ``tools/tiny_gguf.py``, with nothing copied. A random model
(``torch.manual_seed(seed)``, transformers' own initialisation at the config's
``initializer_range``) saved with ``save_pretrained`` in bf16 (2.5 GB for 1.2 B parameters),
SmolLM2's tokenizer beside it, then llama.cpp's ``convert_hf_to_gguf.py --outtype f16`` from the
pinned llama-cpp-python source distribution, then ``llama-quantize`` built from the same
distribution (``make llama-quantize``: ``build/llama-quantize``; ``EDGESYNC_LLAMA_QUANTIZE``
overrides) to the shape's quantization (Q4_K_M, as published GGUFs of these models are run).

Vocabulary: there is no Llama 3 tokenizer here, so SmolLM2's (49,152 tokens) is used with the
config's ``vocab_size`` of 128,256; the converter pads the vocabulary to the config's size with
``[PAD<id>]`` tokens (type UNUSED), so the token embedding and output matrices, and
``n_vocab``, are Llama 3's. Token IDs 49,152 and up decode to nothing useful; greedy decoding of
the random weights picks them often (they are 62% of the vocabulary).

The converter writes ``add_bos_token`` false only for 49,152-token vocabularies, so llama.cpp
adds a BOS token (SmolLM2's ``<|im_start|>``, ID 1) to every prompt of these models, as Llama 3
adds its own.

Quantization: Q4_K_M for both (its K-quants take rows of a multiple of 256 values: every row
of both shapes is 512, 1,024, 2,048 or 8,192 long).

Scale: Llama's own ``initializer_range`` (0.02) gives a non-degenerate model at the real sizes:
``llama-3.2-1b`` in transformers and, after Q4_K_M, in llama.cpp (``--check``) has finite last
logits of std 0.9 and 32 distinct tokens in 32 greedy steps. So ``embedding_scale``
(tiny_gguf's factor on the token embeddings, also the tied output layer) stays 1.0; a shape
that needs it can set it. The ``llama-3.2-1b`` build takes about 100 s on 2 cores (weights 21 s,
converter 15 s, quantizer 63 s) and about 5 GB of disk at its peak (bf16 weights beside the f16 GGUF).

Models are cached as ``<cache>/<shape>-<quant>-<key>.gguf`` (``~/.cache/edgesync/shaped-gguf``;
``EDGESYNC_SHAPED_GGUF_DIR`` overrides), with ``<stem>.json`` beside it recording how long the
build took; the key hashes the shape (every config value, seed, embedding scale, weight dtype),
the quantization, the converter's output type, :data:`BUILDER_VERSION`, tiny_gguf's
``BUILDER_VERSION`` and the llama-cpp-python version, so a changed shape rebuilds. Files of
earlier keys stay until the directory is deleted (800 MB for ``llama-3.2-1b``).

Command: ``python tools/shaped_gguf.py [SHAPE ...] [--json] [--check]`` builds (or finds) the
models, ``llama-3.2-1b`` by default, and prints each path, size in bytes and build time;
``--check`` also loads each with llama-cpp-python and prints ``n_vocab``, greedy tokens and
prefill/decode speeds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_gguf  # noqa: E402  (a sibling module; tools/ is not a package)

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
BUILDER_VERSION = 1
"""Bump when the way shaped models are built changes (weights, converter or quantizer options)."""
LLAMA3_VOCAB = 128256
"""Llama 3's vocabulary size (``vocab_size`` of every Llama 3.x ``config.json``)."""
SMOLLM2_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
"""SmolLM2's special token IDs (<|im_start|>, <|im_end|>): the tokenizer is SmolLM2's."""


@dataclass(frozen=True)
class Shape:
    """One model shape: a Llama config with the real model's sizes.

    Attributes:
        name: short name, also the cache file's stem (``<name>-<quant>-<key>.gguf``).
        source: where the figures come from (the real model's ``config.json``).
        hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
            intermediate_size, vocab_size, max_position_embeddings, rms_norm_eps,
            tie_word_embeddings, initializer_range: the ``config.json`` values of the same names,
            except those named in ``real_values``.
        rope: ``rope_theta`` and ``rope_scaling`` of ``config.json`` in one dict (transformers'
            ``rope_parameters``).
        quant: the ``llama-quantize`` type of the final GGUF.
        seed: ``torch.manual_seed`` for the random weights.
        embedding_scale: factor on the random token embeddings (``tiny_gguf.save_random_weights``).
        dtype: the dtype the random weights are saved in before conversion (f16 GGUF either way).
        real_values: the real ``config.json`` values of the fields this shape changes (empty:
            none); a label, not part of the cache key.
    """

    name: str
    source: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rope: dict = field(hash=False)
    tie_word_embeddings: bool
    vocab_size: int = LLAMA3_VOCAB
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    quant: str = "Q4_K_M"
    seed: int = 0
    embedding_scale: float = 1.0
    dtype: str = "bfloat16"
    real_values: dict = field(default_factory=dict, hash=False)

    def config_kwargs(self) -> dict:
        """``transformers.LlamaConfig`` keyword arguments (SmolLM2's special token IDs)."""
        sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                 "tie_word_embeddings", "initializer_range")
        return {**SMOLLM2_TOKENS, **{k: getattr(self, k) for k in sizes}, "rope_parameters": dict(self.rope)}

    def n_params(self) -> int:
        """Parameters of the HF model (tied output layer counted once), as the Hub reports them."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attention = 2 * h * self.num_attention_heads * self.head_dim + 2 * h * kv
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + h + embeddings

    def real_n_params(self) -> int:
        """:meth:`n_params` of the real model: with the ``real_values`` put back."""
        return replace(self, **self.real_values, real_values={}).n_params()

    def kv_bytes_per_token(self, element_bytes: int = 2) -> int:
        """Bytes of K and V per token over all layers (default f16, llama.cpp's default cache type)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element_bytes


def _llama3_rope(factor: float) -> dict:
    """Llama 3.1/3.2's ``rope_theta`` and ``rope_scaling`` (``rope_type`` llama3)."""
    return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


SHAPES: tuple[Shape, ...] = (
    Shape("llama-3.2-1b", "meta-llama/Llama-3.2-1B config.json",
          hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
          intermediate_size=8192, rope=_llama3_rope(32.0), tie_word_embeddings=True),
    Shape("llama-3.1-8b-kv", "meta-llama/Llama-3.1-8B config.json: its KV cache (layers, KV heads, head size), "
          "RoPE, context length, vocabulary, epsilon and untied output; hidden size, attention heads and FFN "
          "narrowed, larger initializer_range",
          hidden_size=512, num_hidden_layers=32, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
          intermediate_size=1024, rope=_llama3_rope(8.0), tie_word_embeddings=False, initializer_range=0.1,
          real_values={"hidden_size": 4096, "num_attention_heads": 32, "intermediate_size": 14336,
                       "initializer_range": 0.02}),
)
"""The shapes, by name (names unique)."""
DEFAULT_SHAPES = ("llama-3.2-1b",)
"""What the command builds when no shape is named."""


class ShapedGGUFError(RuntimeError):
    """A shaped model cannot be built: no ``llama-quantize``, or it failed (its last output lines)."""


def shape(name: str) -> Shape:
    """The shape called ``name``.

    Raises:
        KeyError: no such shape.
    """
    for s in SHAPES:
        if s.name == name:
            return s
    raise KeyError(f"no shape {name!r} (shapes: {', '.join(s.name for s in SHAPES)})")


def cache_dir() -> Path:
    """Where the shaped models live: ``EDGESYNC_SHAPED_GGUF_DIR`` or ``~/.cache/edgesync/shaped-gguf``."""
    env = os.environ.get("EDGESYNC_SHAPED_GGUF_DIR")
    return Path(env) if env else Path.home() / ".cache" / "edgesync" / "shaped-gguf"


def quantize_path() -> Path:
    """``llama-quantize``: ``EDGESYNC_LLAMA_QUANTIZE`` or ``build/llama-quantize``.

    Raises:
        ShapedGGUFError: it is not there (``make llama-quantize`` builds it).
    """
    env = os.environ.get("EDGESYNC_LLAMA_QUANTIZE")
    path = Path(env) if env else ROOT / "build" / "llama-quantize"
    if not path.is_file():
        raise ShapedGGUFError(f"{path}: no llama-quantize (run `make llama-quantize`, or set EDGESYNC_LLAMA_QUANTIZE)")
    return path


def model_key(s: Shape) -> str:
    """16 hex digits of SHA-256 over what determines the GGUF's bytes."""
    spec = {"builder": BUILDER_VERSION, "tiny_builder": tiny_gguf.BUILDER_VERSION,
            "llama-cpp-python": tiny_gguf.llama_version(), "outtype": tiny_gguf.OUTTYPE,
            "shape": {k: v for k, v in asdict(s).items() if k not in ("name", "source", "real_values")}}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def gguf_path(s: Shape) -> Path:
    """Where shape ``s``'s GGUF is cached (it may not exist yet)."""
    return cache_dir() / f"{s.name}-{s.quant.lower()}-{model_key(s)}.gguf"


def quantize(src: Path, dst: Path, quant: str) -> None:
    """``llama-quantize src dst quant`` on every core.

    Raises:
        ShapedGGUFError: as :func:`quantize_path`, or it failed.
    """
    cmd = [str(quantize_path()), str(src), str(dst), quant, str(os.cpu_count() or 1)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not dst.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise ShapedGGUFError(f"llama-quantize failed on {src.name} (exit {proc.returncode}):\n{tail}")


def build(s: Shape) -> Path:
    """Shape ``s``'s GGUF: the cached file, or built now (random model, converter, quantizer),
    with ``<stem>.json`` beside it (the build's seconds per step).

    Raises:
        ShapedGGUFError: as :func:`quantize`.
        tiny_gguf.TinyGGUFError: as ``tiny_gguf.converter_dir``, ``tokenizer_dir`` and ``convert``.
    """
    path = gguf_path(s)
    if path.is_file():
        return path
    quantize_path()  # first: fail before minutes of model work
    converter = tiny_gguf.converter_dir()
    path.parent.mkdir(parents=True, exist_ok=True)
    steps: dict[str, float] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f".{s.name}-", dir=path.parent) as tmp:
        hf_dir, f16 = Path(tmp) / "hf", Path(tmp) / "model-f16.gguf"
        log.info("%s: random weights (%d parameters, %s)", s.name, s.n_params(), s.dtype)
        tiny_gguf.save_random_weights("LlamaConfig", s.config_kwargs(), hf_dir, seed=s.seed,
                                      embedding_scale=s.embedding_scale, dtype=s.dtype)
        steps["weights"] = time.perf_counter() - t0
        log.info("%s: convert_hf_to_gguf.py --outtype %s", s.name, tiny_gguf.OUTTYPE)
        tiny_gguf.convert(converter, hf_dir, f16, None)
        shutil.rmtree(hf_dir)
        steps["convert"] = time.perf_counter() - t0 - sum(steps.values())
        log.info("%s: llama-quantize %s", s.name, s.quant)
        partial = Path(tmp) / path.name
        quantize(f16, partial, s.quant)
        steps["quantize"] = time.perf_counter() - t0 - sum(steps.values())
        os.replace(partial, path)
    seconds = time.perf_counter() - t0
    meta = {"shape": s.name, "quant": s.quant, "bytes": path.stat().st_size, "n_params": s.n_params(),
            "build_seconds": round(seconds, 1), "steps": {k: round(v, 1) for k, v in steps.items()}}
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    log.info("built %s in %.1f s", path.name, seconds)
    return path


def build_seconds(path: Path) -> float | None:
    """How long the build of the GGUF at ``path`` took (its ``<stem>.json``), or None if unrecorded."""
    try:
        return json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))["build_seconds"]
    except (OSError, ValueError, KeyError):
        return None


CHECK_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
"""The short chat prompt (SmolLM2's template) :func:`check` decodes from."""


def check(path: Path, n_ctx: int = 2048, n_threads: int = 2, decode_tokens: int = 32,
          prefill_tokens: int = 256) -> dict:
    """Load the GGUF at ``path`` with llama-cpp-python and measure it: the last logits of
    :data:`CHECK_PROMPT` (all finite? their std), ``decode_tokens`` greedy tokens from it (decode
    speed: the tokens after the first over the time after the first) and the evaluation of a
    ``prefill_tokens``-token prompt (the chat prompt repeated) into an empty context (prefill
    speed, after one untimed pass that pages the weights in)."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                          verbose=False)
    prompt = llm.tokenize(CHECK_PROMPT.encode(), special=True)
    long_prompt = (prompt * (prefill_tokens // len(prompt) + 1))[:prefill_tokens]
    llm.eval(long_prompt)  # warm-up
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(long_prompt)
    prefill_s = time.perf_counter() - t0
    llm.reset()
    llm.eval(prompt)
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
    finite, logits_std = bool(np.isfinite(logits).all()), float(logits.std())
    llm.reset()
    tokens, stamps = [], []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
        tokens.append(tok)
        stamps.append(time.perf_counter())
        if len(tokens) == decode_tokens:
            break
    return {"n_vocab": llm.n_vocab(), "n_ctx": llm.n_ctx(), "n_threads": n_threads,
            "prompt_tokens": len(prompt), "logits_finite": finite, "logits_std": round(logits_std, 3),
            "greedy_tokens": tokens, "distinct_tokens": len(set(tokens)),
            "text": llm.detokenize(tokens).decode("utf-8", errors="replace"),
            "decode_tok_s": round((len(tokens) - 1) / (stamps[-1] - stamps[0]), 2),
            "prefill_tokens": prefill_tokens, "prefill_tok_s": round(prefill_tokens / prefill_s, 1)}


def main(argv: list[str] | None = None) -> int:
    """Build (or find) the named shapes' GGUFs; print path, bytes and seconds (and checks)."""
    parser = argparse.ArgumentParser(description="Build random-weight GGUFs of real model shapes.")
    names = ", ".join(s.name for s in SHAPES)
    parser.add_argument("shapes", nargs="*", help=f"shape names (default: {', '.join(DEFAULT_SHAPES)}; all: {names})")
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    parser.add_argument("--check", action="store_true",
                        help="load each model with llama-cpp-python: n_vocab, greedy tokens, prefill/decode speeds")
    args = parser.parse_args(argv)
    try:
        shapes = [shape(n) for n in args.shapes or DEFAULT_SHAPES]
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    sys.path.insert(0, str(ROOT))
    try:
        for s in shapes:
            t0 = time.perf_counter()
            path = build(s)
            out = {"shape": s.name, "path": str(path), "bytes": path.stat().st_size,
                   "seconds": round(time.perf_counter() - t0, 2), "build_seconds": build_seconds(path)}
            if args.check:
                out["check"] = check(path)
            print(json.dumps(out) if args.json else
                  f"{s.name:16s} {out['bytes']:>13,d} B  built in {out['build_seconds']} s  {path}"
                  + (f"\n  {json.dumps(out['check'])}" if args.check else ""))
    except (ShapedGGUFError, tiny_gguf.TinyGGUFError) as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
