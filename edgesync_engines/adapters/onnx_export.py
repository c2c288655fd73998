"""Build the ONNX Runtime decoder of the same GGUF that llama.cpp runs (``edgesync export-onnx``).

transformers loads the GGUF (dequantized to float32), and ``torch.onnx.export(dynamo=True)``
traces ``forward(input_ids, attention_mask, position_ids, *past)`` in fp32 (quantized exports
change the greedy output). The export directory (:func:`export_dir`) holds:

* ``model.onnx`` (+ ``model.onnx.data``): inputs ``input_ids`` int64 [1, n], ``attention_mask``
  int64 [1, past + n], ``position_ids`` int64 [1, n], ``past_key_values.{i}.key`` / ``.value``
  float32 [1, n_head_kv, past, head_dim]; outputs ``logits`` float32 [1, n, vocab] and
  ``present.{i}.key`` / ``.value`` float32 [1, n_head_kv, past + n, head_dim];
* ``tokenizer.json``: the GGUF's tokenizer as transformers converts it;
* ``edgesync.json``: :data:`META_KEYS` (also in the ONNX ``metadata_props``), among them
  ``source_fingerprint``, the GGUF's SHA-256 (``compat.compatible_with``).

The heavy packages are the ``onnx`` extra, imported only here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import tempfile
import time
import warnings
from pathlib import Path

import platformdirs

from edgesync_engines.adapters.model_files import file_fingerprint
from edgesync_engines.adapters.onnx_support import onnx_refusal
from edgesync_engines.adapters.threads import usable_cpus
from edgesync_store.errors import install_hint, require_extra

log = logging.getLogger(__name__)

FORMAT = "edgesync-onnx-decoder/v1"
"""Version of the export's I/O contract and metadata (bump when either changes)."""
META_FILE = "edgesync.json"
MODEL_FILE = "model.onnx"
TOKENIZER_FILE = "tokenizer.json"
META_KEYS = ("format", "source_fingerprint", "source_name", "n_layer", "n_head_kv", "head_dim", "vocab_size",
             "rope_layout", "eos_token_ids", "bos_token_id", "chat_template", "exporter")
"""Keys of ``edgesync.json`` and of the ONNX ``metadata_props`` (values there as strings)."""


class ExportError(RuntimeError):
    """The export could not be made or is unusable: a missing optional package, a GGUF that
    transformers cannot load, or an export directory that lacks a file or its metadata."""


def onnx_root() -> Path:
    """Where exports live: ``EDGESYNC_ONNX_DIR``, else ``<user cache>/edgesync/onnx``
    (``~/.cache/edgesync/onnx`` on Linux, outside any checkout)."""
    override = os.environ.get("EDGESYNC_ONNX_DIR")
    if override:
        return Path(override)
    return Path(platformdirs.user_cache_dir("edgesync")) / "onnx"


def export_dir(gguf_path: str | os.PathLike, root: str | os.PathLike | None = None) -> Path:
    """The export directory of one GGUF: ``<root>/<first 16 hex of its SHA-256>``."""
    return Path(root if root is not None else onnx_root()) / file_fingerprint(Path(gguf_path))[:16]


def read_meta(directory: str | os.PathLike) -> dict:
    """The export's ``edgesync.json``; ExportError when the export is incomplete or another format."""
    directory = Path(directory)
    for name in (MODEL_FILE, TOKENIZER_FILE, META_FILE):
        if not (directory / name).is_file():
            raise ExportError(f"{directory}: no ONNX export ({name} missing); run `edgesync export-onnx`")
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{directory / META_FILE}: unreadable ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ExportError(
            f"{directory / META_FILE}: format {meta.get('format') if isinstance(meta, dict) else None!r}, "
            f"this EdgeSync reads {FORMAT!r}; export again with --force"
        )
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ExportError(f"{directory / META_FILE}: missing {', '.join(missing)}")
    for key in ("n_layer", "n_head_kv", "head_dim", "vocab_size"):
        if isinstance(meta[key], bool) or not isinstance(meta[key], int) or meta[key] < 1:
            raise ExportError(f"{directory / META_FILE}: {key} must be a positive integer, got {meta[key]!r}")
    return meta


def open_export(directory: str | os.PathLike, n_threads: int | None = None):
    """Load an export and check that its parts agree (:func:`read_meta`, the model's inputs,
    the tokenizer's vocabulary): ``(meta, session, tokenizer)``, an ONNX Runtime CPU
    ``InferenceSession`` and a ``tokenizers.Tokenizer``. Raises ExportError when a check fails."""
    ort = require_extra("onnxruntime", "onnx", "the ONNX Runtime engine")
    Tokenizer = require_extra("tokenizers", "onnx", "the ONNX Runtime engine").Tokenizer

    directory = Path(directory)
    meta = read_meta(directory)
    again = "export again with `edgesync export-onnx --force`"
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = n_threads or usable_cpus()
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 4  # errors reach the caller as the exception below
    try:
        session = ort.InferenceSession(str(directory / MODEL_FILE), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own types (Fail, InvalidProtobuf, ...)
        raise ExportError(f"{directory / MODEL_FILE}: onnxruntime cannot load it "
                          f"({str(exc).splitlines()[0][:200]}); {again}") from None
    inputs = {i.name: i.shape for i in session.get_inputs()}
    n_layer, n_head_kv, head_dim = meta["n_layer"], meta["n_head_kv"], meta["head_dim"]
    want = {"input_ids", "attention_mask", "position_ids"} | {
        f"past_key_values.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")}
    if set(inputs) != want:
        odd = sorted(set(inputs) ^ want)
        raise ExportError(f"{directory}: the model's inputs do not match {META_FILE} (n_layer {n_layer}): "
                          f"{', '.join(odd[:4])}{'...' if len(odd) > 4 else ''} differ; {again}")
    shape = inputs["past_key_values.0.key"]
    if len(shape) != 4 or shape[1] != n_head_kv or shape[3] != head_dim:
        raise ExportError(f"{directory}: past_key_values are {shape}, {META_FILE} says "
                          f"[1, {n_head_kv}, past, {head_dim}]; {again}")
    try:
        tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise ExportError(f"{directory / TOKENIZER_FILE}: cannot load it ({exc}); {again}") from None
    if tokenizer.get_vocab_size(with_added_tokens=True) > meta["vocab_size"]:
        raise ExportError(f"{directory / TOKENIZER_FILE}: {tokenizer.get_vocab_size()} tokens for a model of "
                          f"{meta['vocab_size']}; {again}")
    return meta, session, tokenizer


def is_gguf(path: Path) -> bool:
    """True when ``path`` starts with the GGUF magic ``b"GGUF"`` (ggml's ``gguf.h``)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def check_exportable(gguf_path: str | os.PathLike) -> None:
    """Raise ExportError (FileNotFoundError: no file) for a GGUF whose header the export does not handle."""
    reason = onnx_refusal(gguf_path)
    if reason is not None:
        raise ExportError(f"cannot export to ONNX: {reason}")


def clean_leftovers(root: Path, max_age_s: float = 3600.0) -> int:
    """Remove unfinished export directories (``.<name>.<random>`` beside the exports) older than
    ``max_age_s`` seconds: what a killed export leaves. Returns how many were removed."""
    removed = 0
    if not root.is_dir():
        return 0
    for entry in root.iterdir():
        try:
            stale = entry.name.startswith(".") and entry.is_dir() and time.time() - entry.stat().st_mtime > max_age_s
        except OSError:
            continue
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            removed += 1
    return removed


def _missing_extra(exc: ImportError) -> ExportError:
    return ExportError(f"the ONNX export needs the `onnx` extra ({install_hint('onnx')}): {exc}")


def _import_heavy():
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise _missing_extra(exc) from None


def load_gguf_as_torch(gguf_path: Path):
    """The GGUF as a float32 ``LlamaForCausalLM`` and its tokenizer; ExportError when it cannot load."""
    _import_heavy()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    # struct.error, IndexError, EOFError: transformers' GGUF reader on a truncated or damaged file
    except (OSError, ValueError, KeyError, RuntimeError, struct.error, IndexError, EOFError) as exc:
        raise ExportError(f"{gguf_path}: transformers cannot load this GGUF ({exc})") from None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config  # the weights are dequantized already
    return model.eval(), tokenizer


class _Decoder:
    """``forward(input_ids, attention_mask, position_ids, *past)`` around a causal LM, with the
    past as a flat tuple (k0, v0, k1, v1, ...) so that the ONNX graph has one input per tensor."""

    def __new__(cls, model):
        import torch
        from transformers import DynamicCache

        class Decoder(torch.nn.Module):
            def __init__(self, lm):
                super().__init__()
                self.lm = lm

            def forward(self, input_ids, attention_mask, position_ids, *past):
                cache = DynamicCache(config=self.lm.config)
                for i in range(len(past) // 2):
                    cache.update(past[2 * i], past[2 * i + 1], i)
                out = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=cache, use_cache=True)
                presents = []
                for layer in out.past_key_values.layers:
                    presents += [layer.keys, layer.values]
                return (out.logits, *presents)

        return Decoder(model)


def export_meta(model, meta: dict) -> dict:
    """The export's full :data:`META_KEYS` record: ``meta`` (``source_fingerprint``,
    ``source_name``, ``chat_template``) with the geometry read from ``model.config``, the
    token IDs and the exporter's versions."""
    import onnx
    import torch
    import transformers

    cfg = model.config
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    return {
        "format": FORMAT,
        "n_layer": int(cfg.num_hidden_layers),
        "n_head_kv": int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
        "head_dim": int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
        "vocab_size": int(cfg.vocab_size),
        "rope_layout": "rotate-half",
        "eos_token_ids": [int(t) for t in eos if t is not None],
        "bos_token_id": None if cfg.bos_token_id is None else int(cfg.bos_token_id),
        "exporter": f"torch {torch.__version__}, transformers {transformers.__version__}, "
                    f"onnx {onnx.__version__}",
        **meta,
    }


def _trace(model, full: dict, path: Path) -> None:
    """Export :class:`_Decoder` around ``model`` to ``path`` (weights external; lengths dynamic, batch 1)."""
    import torch

    n_layer, n_head_kv, head_dim = full["n_layer"], full["n_head_kv"], full["head_dim"]
    names_past = [f"past_key_values.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")]
    names_present = [f"present.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")]
    past_len, new_len = 5, 3
    example = (
        torch.ones((1, new_len), dtype=torch.int64),
        torch.ones((1, past_len + new_len), dtype=torch.int64),
        torch.arange(past_len, past_len + new_len, dtype=torch.int64)[None],
        *[torch.zeros((1, n_head_kv, past_len, head_dim), dtype=torch.float32) for _ in names_past],
    )
    # the mask spans the past and the new tokens
    seq, past = torch.export.Dim("seq", min=1, max=8192), torch.export.Dim("past", min=0, max=8192)
    # *past is one tuple
    shapes = ({1: seq}, {1: torch.export.Dim.AUTO}, {1: seq}, tuple({2: past} for _ in names_past))
    decoder = _Decoder(model).eval()
    t0 = time.perf_counter()
    # the exporter's notes (torchvision ops skipped, axis names merged, a deprecated pytree
    # check) say nothing about this model; keep them off the user's terminal
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        program = torch.onnx.export(
            decoder, example, dynamo=True, input_names=["input_ids", "attention_mask", "position_ids", *names_past],
            output_names=["logits", *names_present], dynamic_shapes=shapes, optimize=True, verbose=False,
        )
        program.save(str(path), external_data=True)
    log.info("exported the ONNX graph in %.0f s", time.perf_counter() - t0)


def _write_export(model, tokenizer, full: dict, directory: Path) -> None:
    """Write model (``full`` in ``metadata_props`` as ``edgesync.<key>``), tokenizer and edgesync.json."""
    import onnx

    _trace(model, full, directory / MODEL_FILE)
    proto = onnx.load(str(directory / MODEL_FILE), load_external_data=False)
    del proto.metadata_props[:]
    for key in META_KEYS:
        prop = proto.metadata_props.add()
        prop.key = f"edgesync.{key}"
        prop.value = full[key] if isinstance(full[key], str) else json.dumps(full[key])
    onnx.save(proto, str(directory / MODEL_FILE))
    tokenizer.backend_tokenizer.save(str(directory / TOKENIZER_FILE)) if hasattr(tokenizer, "backend_tokenizer") \
        else tokenizer.save(str(directory / TOKENIZER_FILE))
    (directory / META_FILE).write_text(json.dumps(full, indent=1))


def export_model(model, tokenizer, out_dir: Path, meta: dict) -> Path:
    """Export a float32 llama-architecture causal LM to ``out_dir`` (model, tokenizer.json,
    edgesync.json); the directory appears whole (written beside it, then renamed). ``meta``: as
    :func:`export_meta` takes it. Raises ExportError when the exporter fails."""
    _import_heavy()
    full = export_meta(model, meta)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        _write_export(model, tokenizer, full, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException as exc:  # Ctrl-C too: never leave a half-written copy behind
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, ExportError) or not isinstance(exc, Exception):
            raise
        raise ExportError(f"ONNX export failed: {type(exc).__name__}: {exc}") from exc
    return out_dir


def export_gguf(gguf_path: str | os.PathLike, root: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Export a GGUF to its :func:`export_dir` unless a sound export of it is there (it loads
    and records this GGUF's fingerprint) and not ``force``. The model and the destination are
    checked before the GGUF is loaded. Returns the directory. Raises FileNotFoundError (no GGUF) or
    ExportError (not a GGUF, unsupported model, unwritable destination, failed load or export)."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: no such GGUF file")
    if not is_gguf(gguf_path):
        raise ExportError(f"{gguf_path}: not a GGUF file (it does not start with the GGUF magic)")
    check_exportable(gguf_path)
    out = export_dir(gguf_path, root)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out.parent).close()
    except OSError as exc:
        raise ExportError(f"{out.parent}: cannot write the export there ({exc.strerror or exc})") from None
    clean_leftovers(out.parent)
    if not force and out.exists():
        try:
            meta, _, _ = open_export(out, n_threads=1)
            if meta["source_fingerprint"] == file_fingerprint(gguf_path):
                log.info("%s: export already there", out)
                return out
            log.warning("%s: exported from another file; exporting again", out)
        except ExportError as exc:
            log.warning("%s; exporting again", exc)
    model, tokenizer = load_gguf_as_torch(gguf_path)
    template = getattr(tokenizer, "chat_template", None) or ""
    return export_model(model, tokenizer, out, {
        "source_fingerprint": file_fingerprint(gguf_path),
        "source_name": gguf_path.name,
        "chat_template": template,
    })
