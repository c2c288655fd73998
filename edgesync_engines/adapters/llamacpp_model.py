"""What the adapter asks a loaded ``llama_cpp.Llama`` before the probe: whether its KV memory can
be cut (:func:`memory_refusal`), llama.cpp's built-in chat templates for a GGUF without one,
and what is wrong with a GGUF llama.cpp refused (:func:`gguf_problem`)."""

from __future__ import annotations

import ctypes
import logging
import re
from typing import Mapping, Sequence

from edgesync_engines.adapters import seqstate
from edgesync_engines.adapters.gguf_header import GGUFHeaderError, not_a_model, read_header
from edgesync_engines.adapters.protocol import check_messages

log = logging.getLogger(__name__)


def memory_refusal(llama_cpp, llm, kv_types: Sequence[str]) -> str | None:
    """Why the KV memory of ``llm`` cannot be cut into fragments (None: try the probe):
    recurrent or hybrid memory, a sliding window without ``swa_full``, or K/V types that differ
    or are not in ``kv_types``."""
    model = llm.model
    arch = llm.metadata.get("general.architecture", "?")
    if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
        return f"{arch}: recurrent or hybrid memory holds no per-token KV to cut"
    n_swa = int(llama_cpp.llama_model_n_swa(model))
    if n_swa > 0 and not llm.context_params.swa_full:
        return (f"{arch}: sliding-window attention (window {n_swa} tokens) without a full-size window "
                "cache: build the Llama with swa_full=True to cache it")
    types = (int(llm.context_params.type_k), int(llm.context_params.type_v))
    names = [seqstate.GGML_TYPES[t].name if t in seqstate.GGML_TYPES else f"ggml type {t}" for t in types]
    if types[0] != types[1] or names[0] not in kv_types:
        return f"KV types type_k {names[0]}, type_v {names[1]}: only equal {', '.join(kv_types)} are cut"
    return None


def builtin_templates(llama_cpp) -> list[str]:
    """Names of llama.cpp's built-in chat templates (``llama_chat_builtin_templates``,
    ``src/llama-chat.cpp``)."""
    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(names, n)
    return [name.decode() for name in names]


def builtin_template_for(llama_cpp, arch: str | None) -> str | None:
    """The built-in template named after the model's architecture (``gemma3`` -> ``gemma``,
    ``llama`` -> ``llama2``... only exact or digit-stripped names), None when there is none."""
    if not arch:
        return None
    names = builtin_templates(llama_cpp)
    for candidate in (arch, re.sub(r"\d+$", "", arch)):
        if candidate in names:
            return candidate
    return None


_LOGGED_BUILTIN: set[tuple[str, str]] = set()


def builtin_chat_prompt(llama_cpp, template: str, messages: Sequence[Mapping[str, str]], model_name: str,
                        add_generation_prompt: bool = True) -> str:
    """Render ``messages`` with llama.cpp's built-in ``template`` (``llama_chat_apply_template``),
    ending with the assistant prompt unless ``add_generation_prompt`` is False. ValueError: unknown
    template, or a message lacks role/content."""
    check_messages(messages)
    if (model_name, template) not in _LOGGED_BUILTIN:
        _LOGGED_BUILTIN.add((model_name, template))
        log.info("%s has no chat template: using llama.cpp's built-in %r", model_name, template)
    keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
    chat = (llama_cpp.llama_chat_message * len(keep))(*(llama_cpp.llama_chat_message(r, c) for r, c in keep))
    size = 2 * sum(len(r) + len(c) for r, c in keep) + 256
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(template.encode(), chat, len(keep), add_generation_prompt, buf,
                                                 size)
        if n < 0:
            raise ValueError(f"chat template {template!r}: llama.cpp does not know it")
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n + 1
    raise ValueError(f"chat template {template!r}: the prompt did not fit the buffer")


def gguf_problem(path) -> str | None:
    """What is wrong with a file llama.cpp refused to load, from its GGUF header alone, or None
    when the header looks like a model's."""
    try:
        return not_a_model(read_header(path))
    except GGUFHeaderError as exc:
        text = str(exc)
        return text[len(f"{path}: "):] if text.startswith(f"{path}: ") else text
    except OSError as exc:
        return f"cannot read it ({exc.strerror or exc})"
