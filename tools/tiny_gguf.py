"""Build the tiny GGUFs of the architecture matrix (``tools/arch_matrix.py``), and the rows of
:data:`EXTRA_ROWS` that tests use beside it, from random weights, with llama.cpp's own
converter, once, into a cache directory.

For each row: a transformers config (tiny sizes, SmolLM2's vocabulary), a model of random
weights (``torch.manual_seed``) saved with ``save_pretrained`` (safetensors), SmolLM2's
tokenizer beside it, then ``convert_hf_to_gguf.py --outtype f16`` from the llama-cpp-python
source distribution the set-up downloads (``make`` puts it at
``build/llama_cpp_python-<version>.tar.gz``; ``EDGESYNC_LLAMA_SDIST`` overrides), with that
distribution's own ``gguf-py``. No weights are downloaded.

SmolLM2's tokenizer comes out of the SmolLM2 GGUF the set-up installs
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, then ``save_pretrained``); the
converter recognises its pre-tokenizer (the ``smollm`` hash of ``get_vocab_base_pre``).
``tokenizer_config.json`` names it ``GPT2Tokenizer``, the class SmolLM2's own repository names,
which is what the Phi-3 converter asks for before it writes a BPE vocabulary.

Models are cached as ``<cache>/<row>-<key>.gguf`` (``~/.cache/edgesync/tiny-gguf``;
``EDGESYNC_TINY_GGUF_DIR`` overrides); the key hashes the row's config, seed, embedding scale
and vocabulary writer, :data:`BUILDER_VERSION` and the converter's version, so a changed row
rebuilds. Files of earlier keys stay until the directory is deleted (about 10 MB each; the
``wide-kv`` row 39 MB).

Command: ``python tools/tiny_gguf.py [ROW ...] [--json]`` builds (or finds) the models (every
row of the matrix by default; :data:`EXTRA_ROWS` by name) and prints each path with its build
time.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import arch_matrix  # noqa: E402  (a sibling module; tools/ is not a package)

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
BUILDER_VERSION = 1
"""Bump when the way models are built changes (weights, tokenizer, converter options)."""
OUTTYPE = "f16"
_CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
"""What the converter needs of the sdist's ``vendor/llama.cpp`` tree."""
_RUN_CONVERTER = """\
import runpy, sys
from transformers import AutoTokenizer, TokenizersBackend
AutoTokenizer.from_pretrained = TokenizersBackend.from_pretrained
src, writer = sys.argv[1], sys.argv[2]
sys.path[1:1] = [src, src + "/gguf-py"]
if writer:
    import importlib
    module, cls = writer.split(":")
    getattr(importlib.import_module(module), cls).set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
"""Runs the converter as its own script, with two adjustments and nothing else changed:

* the tokenizer is read exactly as ``tokenizer.json`` says (``TokenizersBackend``). The
  converter's requirements pin transformers 4.57.6, which loads the class named in
  ``tokenizer_config.json`` from ``tokenizer.json``; transformers 5 instead rebuilds the
  tokenizers of some model types from vocabulary and merges with their family's own
  pre-tokenizer (Qwen2's regex for ``qwen2``: ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`` in
  ``tokenization_auto.py``), which is no longer SmolLM2's and fails the pre-tokenizer hash check;
* a row's ``vocab_writer`` class gets the converter's GPT-2 BPE vocabulary writer instead of
  its SentencePiece-only one (Gemma 2; the converter's Gemma 3 class does the same when no
  ``tokenizer.model`` is there)."""


WIDE_KV = arch_matrix.ArchRow(
    "wide-kv", "LlamaConfig",
    {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 64, "num_attention_heads": 16,
     "num_key_value_heads": 16, "head_dim": 256, "max_position_embeddings": 4096},
    "Llama: 64 layers, 16 heads = 16 KV heads of 256 on a hidden size of 16, FFN 32: K and V 2 x 64 x 4,096 "
    "values a token, 1 MiB in f16 and 2 MiB in f32 (Llama-3.1-8B: 128 KiB in f16)",
    arch_matrix.EXACT,
    "one KV cache, a large one: per layer K and V are projected from 16 to 4,096 values and Q and O are as large "
    "(as many query heads as KV heads, the fewest llama.cpp allows; transformers wants the hidden size a multiple "
    "of the heads, hence 16 heads and 64 layers), so the attention weights hold as many parameters as the f16 KV "
    "of 16 tokens has bytes (16.8 M); 18.5 M parameters in all, 39 MB of f16")
"""A model of large KV per token and small weights, for tests of fragments of hundreds of MB
(not a row of the matrix: its architecture is the ``llama3`` row's)."""
EXTRA_ROWS: tuple[arch_matrix.ArchRow, ...] = (WIDE_KV,)
"""Rows this module builds beside ``arch_matrix.ROWS`` (names distinct from theirs)."""


def row(name: str) -> arch_matrix.ArchRow:
    """The row called ``name``: of the matrix or of :data:`EXTRA_ROWS`.

    Raises:
        KeyError: no such row.
    """
    for r in EXTRA_ROWS:
        if r.name == name:
            return r
    try:
        return arch_matrix.row(name)
    except KeyError:
        names = ", ".join(r.name for r in (*arch_matrix.ROWS, *EXTRA_ROWS))
        raise KeyError(f"no row {name!r} (rows: {names})") from None


class TinyGGUFError(RuntimeError):
    """A tiny model cannot be built: the source distribution is missing, or the converter
    failed (the message carries its last output lines)."""


def llama_version() -> str:
    """The installed llama-cpp-python version (the converter must be the same release)."""
    return importlib.metadata.version("llama-cpp-python")


def cache_dir() -> Path:
    """Where the tiny models live: ``EDGESYNC_TINY_GGUF_DIR`` or ``~/.cache/edgesync/tiny-gguf``."""
    env = os.environ.get("EDGESYNC_TINY_GGUF_DIR")
    return Path(env) if env else Path.home() / ".cache" / "edgesync" / "tiny-gguf"


def sdist_path() -> Path:
    """The llama-cpp-python source distribution of the installed version.

    Raises:
        TinyGGUFError: it is not there (``make`` downloads it into ``build/``).
    """
    version = llama_version()
    env = os.environ.get("EDGESYNC_LLAMA_SDIST")
    path = Path(env) if env else ROOT / "build" / f"llama_cpp_python-{version}.tar.gz"
    if not path.is_file():
        raise TinyGGUFError(f"{path}: no llama-cpp-python {version} source distribution "
                            f"(run `make build/llama_cpp_python-{version}.tar.gz`, or set EDGESYNC_LLAMA_SDIST)")
    return path


def converter_dir() -> Path:
    """The converter (``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``) unpacked from
    the source distribution, once, into the cache directory."""
    out = cache_dir() / f"converter-{llama_version()}"
    if (out / "convert_hf_to_gguf.py").is_file():
        return out
    sdist = sdist_path()
    out.parent.mkdir(parents=True, exist_ok=True)  # also the models' directory
    tmp = Path(tempfile.mkdtemp(prefix=".converter-", dir=out.parent))
    with tarfile.open(sdist) as tar:
        top = tar.next().name.split("/")[0]
        prefix = f"{top}/vendor/llama.cpp/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                   and m.name[len(prefix):].startswith(_CONVERTER_FILES) and (m.isfile() or m.isdir())]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(tmp, members=members, filter="data")
    if not (tmp / "convert_hf_to_gguf.py").is_file():
        shutil.rmtree(tmp)
        raise TinyGGUFError(f"{sdist}: no vendor/llama.cpp/convert_hf_to_gguf.py inside")
    tmp.chmod(0o755)
    try:
        tmp.rename(out)
    except OSError:  # another process unpacked it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def tokenizer_dir() -> Path:
    """SmolLM2's tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, chat template),
    saved once from the SmolLM2 GGUF into the cache directory.

    Raises:
        TinyGGUFError: the SmolLM2 GGUF is not installed."""
    out = cache_dir() / f"tokenizer-smollm2-v{BUILDER_VERSION}"
    if (out / "tokenizer_config.json").is_file():
        return out
    from transformers import AutoTokenizer

    from edgesync_engines.adapters.model_files import ModelNotFoundError, default_model_path

    try:
        gguf = default_model_path()
    except ModelNotFoundError as exc:
        raise TinyGGUFError(f"SmolLM2's tokenizer: {exc}") from None
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=out.parent))
    tokenizer.save_pretrained(str(tmp))
    cfg_path = tmp / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "GPT2Tokenizer"  # SmolLM2's own repository names this class
    cfg_path.write_text(json.dumps(cfg, indent=1), encoding="utf-8")
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def model_key(r: arch_matrix.ArchRow) -> str:
    """16 hex digits of SHA-256 over what determines the GGUF's bytes."""
    spec = {"builder": BUILDER_VERSION, "llama-cpp-python": llama_version(), "outtype": OUTTYPE,
            "hf_config": r.hf_config, "config": r.config_kwargs(), "seed": r.seed, "vocab_writer": r.vocab_writer,
            "embedding_scale": r.embedding_scale}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def gguf_path(r: arch_matrix.ArchRow) -> Path:
    """Where row ``r``'s GGUF is cached (it may not exist yet)."""
    return cache_dir() / f"{r.name}-{model_key(r)}.gguf"


def save_random_model(r: arch_matrix.ArchRow, out: Path) -> None:
    """Write row ``r``'s random-weight model (``config.json``, ``model.safetensors``) and
    SmolLM2's tokenizer files to ``out``."""
    save_random_weights(r.hf_config, r.config_kwargs(), out, seed=r.seed, embedding_scale=r.embedding_scale)


def save_random_weights(hf_config: str, config: dict, out: Path, *, seed: int, embedding_scale: float = 1.0,
                        dtype: str = "float32") -> None:
    """Write a random-weight model of ``transformers.<hf_config>(**config)`` (weights drawn after
    ``torch.manual_seed(seed)``, token embeddings times ``embedding_scale``, stored as ``dtype``:
    a ``torch`` dtype name) with ``save_pretrained``, and SmolLM2's tokenizer files, to ``out``."""
    import torch
    import transformers

    model_config = getattr(transformers, hf_config)(**config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(model_config, dtype=getattr(torch, dtype))
    if embedding_scale != 1.0:
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(embedding_scale)
    model.save_pretrained(str(out))
    for f in tokenizer_dir().iterdir():
        shutil.copy(f, out / f.name)


def convert(converter: Path, hf_dir: Path, outfile: Path, vocab_writer: str | None) -> None:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` (in ``converter``, see :func:`converter_dir`)
    on ``hf_dir`` with this interpreter.

    Raises:
        TinyGGUFError: the converter failed (its last output lines in the message).
    """
    cmd = [sys.executable, "-c", _RUN_CONVERTER, str(converter), vocab_writer or "",
           str(hf_dir), "--outfile", str(outfile), "--outtype", OUTTYPE]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not outfile.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise TinyGGUFError(f"convert_hf_to_gguf.py failed on {hf_dir.name} (exit {proc.returncode}):\n{tail}")


def build(r: arch_matrix.ArchRow) -> Path:
    """Row ``r``'s GGUF: the cached file, or built now (random model, then the converter).

    Raises:
        TinyGGUFError: as :func:`sdist_path`, :func:`tokenizer_dir` and :func:`convert`.
    """
    path = gguf_path(r)
    if path.is_file():
        return path
    t0 = time.perf_counter()
    converter = converter_dir()  # first: a missing sdist fails before any model work
    with tempfile.TemporaryDirectory(prefix=f".{r.name}-", dir=path.parent) as tmp:
        hf_dir = Path(tmp) / "hf"
        save_random_model(r, hf_dir)
        partial = Path(tmp) / path.name
        convert(converter, hf_dir, partial, r.vocab_writer)
        os.replace(partial, path)
    log.info("built %s in %.1f s", path.name, time.perf_counter() - t0)
    return path


def main(argv: list[str] | None = None) -> int:
    """Build (or find) the named rows' GGUFs, every row by default; print path and seconds."""
    parser = argparse.ArgumentParser(description="Build the tiny random-weight GGUFs of the architecture matrix.")
    names = ", ".join(r.name for r in arch_matrix.ROWS)
    extra = ", ".join(r.name for r in EXTRA_ROWS)
    parser.add_argument("rows", nargs="*", help=f"row names (default: the matrix: {names}; also: {extra})")
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    try:
        rows = [row(n) for n in args.rows] if args.rows else list(arch_matrix.ROWS)
        for r in rows:
            t0 = time.perf_counter()
            path = build(r)
            out = {"row": r.name, "path": str(path), "seconds": round(time.perf_counter() - t0, 2),
                   "bytes": path.stat().st_size}
            print(json.dumps(out) if args.json else f"{r.name:12s} {out['seconds']:6.1f} s  {path}")
    except (KeyError, TinyGGUFError) as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
