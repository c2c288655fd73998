"""Gemma 3 270M (the real registry model, a two-part sliding-window cache: 3 global + 15
window layers, window 512) through EdgeSync with a real store: a miss, an exact hit in a new
process with at most one prompt token evaluated, a partial hit on a new question after a
~1,500-token shared context (longer than the window), each token-identical to an uncached run,
the tokens evaluated read from llama.cpp's own perf counters. Also the seq-state codec on a real
two-part state, and the built-in chat template (the GGUF carries none).

The shared context is real text: the app system prompts of ../shared/workloads
(system_prompts.json), joined until the rendered chat is over 1,500 Gemma tokens.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from seqstate_writer import serialize_parts

from edgesync_engines.adapters import seqstate
from edgesync_engines.adapters.kv_layout import GROUPED_ROWS
from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
from edgesync_engines.adapters.model_files import gemma3_model_path
from edgesync_engines.request.router import EdgeSync
from edgesync_store.schema import common_prefix_len
from tests.llama_counts import chat, llama_prefilled

pytestmark = [pytest.mark.model]

ROOT = Path(__file__).resolve().parents[1]
N_CTX = 2048
MAX_TOKENS = 12
CONTEXT_TOKENS = 1500
QUESTIONS = ("Which of these apps would help me most before an exam? Answer briefly.",
             "Summarise what the travel app does in two sentences.")


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    """The Gemma 3 270M GGUF, assembled once from its part packages into the user cache dir."""
    return gemma3_model_path()


@pytest.fixture(scope="module")
def gemma(gemma_path):
    """One f16-KV Gemma 3 context (flash attention off) for the module."""
    a = LlamaCppAdapter(gemma_path, n_ctx=N_CTX)
    yield a
    a.close()


@pytest.fixture(scope="module")
def shared_context(gemma, system_prompts) -> str:
    """App system prompts joined until the chat of the first question is over 1,500 tokens."""
    text = ""
    for prompt in system_prompts:
        text = f"{text}\n\n{prompt}" if text else prompt
        if len(gemma.tokenize(gemma.apply_chat_template(chat(text, QUESTIONS[0])))) >= CONTEXT_TOKENS:
            return text
    raise AssertionError("the system prompts add up to fewer than 1,500 Gemma tokens")


def test_gemma_is_cached_with_two_parts(gemma):
    assert gemma.cache_refusal is None
    ns = gemma.namespace
    assert ns.layout == "llama.cpp-seq-state/tokens-major-v1;v_trans=1;parts=3+15;swa=512;swa_full=1"
    assert (ns.n_layer, ns.kv_dtype, ns.flash_attn) == (18, "f16", False)
    assert ns.n_head_kv * ns.head_dim == 256


def test_gemmas_repacked_kernels_keep_the_grouped_injection_rule(gemma):
    """Gemma's Q4_K weights are repacked on this CPU (rows computed by groups): the load-time
    probe keeps the default rule, which the exact hits and partial hits below rely on."""
    assert gemma.injection_rule == GROUPED_ROWS
    assert gemma.usable_prefix(100, 400) == 96


def test_builtin_chat_template_renders_gemma_turns(gemma):
    assert not gemma.llm.metadata.get("tokenizer.chat_template")
    text = gemma.apply_chat_template(chat("You are terse.", "Hi there"))
    # llama.cpp's "gemma" template folds the system message into the first user turn
    assert text == "<start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
    tokens = gemma.tokenize(text)
    bos = gemma.tokenize("")
    start, end = gemma.tokenize("<start_of_turn>"), gemma.tokenize("<end_of_turn>")
    assert len(start) == len(end) == len(bos) + 1  # one special token each, not their letters
    turn_start, turn_end = start[-1], end[-1]
    assert tokens.count(turn_start) == 2 and tokens.count(turn_end) == 1
    assert gemma.is_eog(turn_end)


def _seq_state(llm) -> bytes:
    import llama_cpp

    size = llama_cpp.llama_state_seq_get_size(llm.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    assert llama_cpp.llama_state_seq_get_data(llm.ctx, buf, size, 0) == size
    return bytes(buf)


def test_two_part_seq_state_round_trip(gemma, shared_context):
    """A real 700-token Gemma state: the global part holds every position, the window part the
    last 512; serializing the parsed parts gives back the bytes llama.cpp wrote."""
    tokens = gemma.tokenize(gemma.apply_chat_template(chat(shared_context, QUESTIONS[0])))[:700]
    gemma.clear_kv_cache()
    try:
        gemma.llm.eval(tokens)
        raw = _seq_state(gemma.llm)
    finally:
        gemma.clear_kv_cache()
    parts = seqstate.parse_parts(raw)
    assert [p.n_layer for p in parts] == [3, 15]
    np.testing.assert_array_equal(parts[0].pos, np.arange(700))
    np.testing.assert_array_equal(parts[1].pos, np.arange(700 - 512, 700))
    for p in parts:
        assert p.type_k == p.type_v == 1 and p.v_trans == 1 and p.ext is None
        assert all(a.shape == (len(p.pos), 256) and a.dtype == np.dtype("<f2") for a in (*p.k, *p.v))
    assert bytes(serialize_parts(parts)) == raw


def test_miss_exact_in_new_process_partial(gemma, gemma_path, shared_context, tmp_path):
    store_dir = tmp_path / "store"
    first, second = chat(shared_context, QUESTIONS[0]), chat(shared_context, QUESTIONS[1])
    uncached = EdgeSync(gemma, store=False)
    reference = [uncached.generate(m, max_tokens=MAX_TOKENS) for m in (first, second)]
    assert all(len(r.tokens) >= 4 for r in reference)

    with EdgeSync(gemma, store=store_dir) as es:
        gemma.reset_perf()
        miss = es.generate(first, max_tokens=MAX_TOKENS)
        miss_perf = gemma.perf_counts()
        k = common_prefix_len(es.prompt_tokens(first), es.prompt_tokens(second))
    assert miss.prompt_tokens >= CONTEXT_TOKENS and k >= CONTEXT_TOKENS - 100
    assert miss.hit == "miss" and miss.tokens_reused == 0 and miss.fragments_written >= 2
    assert llama_prefilled(miss_perf, miss.tokens, MAX_TOKENS) == miss.prompt_tokens
    assert miss.tokens == reference[0].tokens

    requests = tmp_path / "requests.json"
    requests.write_text(json.dumps([first, second]))
    env = dict(os.environ, PYTHONPATH=str(ROOT), EDGESYNC_MODEL=str(gemma_path), EDGESYNC_N_CTX=str(N_CTX),
               EDGESYNC_KV_TYPE="f16", EDGESYNC_FLASH_ATTN="0")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "proc_request.py"), str(store_dir), str(requests),
                           str(MAX_TOKENS)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exact, partial = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]

    assert exact["hit"] == "exact" and exact["tokens_reused"] == exact["prompt_tokens"] - 1
    assert llama_prefilled(exact["perf"], exact["tokens"], MAX_TOKENS) <= 1
    assert exact["bytes_read"] > 0
    assert exact["tokens"] == reference[0].tokens

    # the new question reuses the shared ~1,500 tokens: positions far beyond the 512 window,
    # whose sliding-layer KV was captured block by block during the miss's prefill
    assert partial["hit"] == "partial"
    assert k >= partial["tokens_reused"] >= k - 128
    assert partial["tokens_reused"] > 1024
    prefilled = llama_prefilled(partial["perf"], partial["tokens"], MAX_TOKENS)
    assert prefilled == partial["prompt_tokens"] - partial["tokens_reused"]
    assert partial["tokens"] == reference[1].tokens


def test_user_llama_with_swa_full_is_cached(gemma, gemma_path, system_prompts, tmp_path):
    """A ``llama_cpp.Llama`` the user built with ``swa_full=True`` is cut like the adapter's own:
    the same namespace, so its fragments serve the adapter (and back), identical tokens."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gemma_path), n_ctx=N_CTX, swa_full=True,
                          verbose=False)
    prompt = chat(system_prompts[2], QUESTIONS[0])
    try:
        with EdgeSync(llm, store=tmp_path / "store") as es:
            assert es.adapter.cache_refusal is None
            assert es.adapter.namespace == gemma.namespace
            miss = es.generate(prompt, max_tokens=MAX_TOKENS)
            reference = EdgeSync(es.adapter, store=False).generate(prompt, max_tokens=MAX_TOKENS)
    finally:
        llm.close()
    with EdgeSync(gemma, store=tmp_path / "store") as es:
        gemma.reset_perf()
        exact = es.generate(prompt, max_tokens=MAX_TOKENS)
        perf = gemma.perf_counts()
    assert miss.hit == "miss" and miss.fragments_written >= 2 and exact.hit == "exact"
    assert llama_prefilled(perf, exact.tokens, MAX_TOKENS) <= 1
    assert miss.tokens == exact.tokens == reference.tokens


def test_layer_groups_and_chat_continuation(gemma, system_prompts, tmp_path):
    """Fragments of 4 layers, so groups straddle the 3 + 15 split of the two cache parts; then a
    chat continuation (the first answer and a new user turn after it) is a partial hit on the
    first prompt and, asked again, an exact hit; every answer identical to the uncached one."""
    from edgesync_engines.config import EdgeSyncConfig

    config = EdgeSyncConfig.load({"layers_per_fragment": 4, "semantic": False, "jobs": False})
    context = "\n\n".join(system_prompts[:2])
    first, other = chat(context, "Hello, what can you do?"), chat(context, "Tell me a joke.")
    uncached = EdgeSync(gemma, store=False)
    with EdgeSync(gemma, store=tmp_path / "store", config=config) as es:
        miss, exact, partial = (es.generate(p, max_tokens=MAX_TOKENS) for p in (first, first, other))
        follow = first + [{"role": "assistant", "content": miss.text}, {"role": "user", "content": "And what else?"}]
        continued, again = (es.generate(follow, max_tokens=MAX_TOKENS) for _ in range(2))
    assert miss.fragments_written >= 10 and miss.fragments_written % 5 == 0  # 18 layers: groups 4,4,4,4,2
    assert (miss.hit, exact.hit, partial.hit, continued.hit, again.hit) == (
        "miss", "exact", "partial", "partial", "exact")
    assert continued.tokens_reused >= miss.prompt_tokens - 128
    assert miss.tokens == exact.tokens == uncached.generate(first, max_tokens=MAX_TOKENS).tokens
    assert partial.tokens == uncached.generate(other, max_tokens=MAX_TOKENS).tokens
    assert continued.tokens == again.tokens == uncached.generate(follow, max_tokens=MAX_TOKENS).tokens
