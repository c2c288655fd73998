"""A model of 2 MiB of KV a token through the real ``EdgeSync`` and an LMDB store.

The model: ``tools/tiny_gguf.py``'s ``wide-kv`` row (random weights, 64 layers x 16 KV heads of
256 on a hidden size of 16, 39 MB, built once into the cache directory), run with f32 KV:
K and V are 2 x 64 x 4,096 f32 values, 2 MiB, a token (16 x Llama-3.1-8B's 128 KiB in f16).

A prompt of about a hundred tokens is a miss and is stored; a NEW ``EdgeSync`` on the same
store directory (the store opened again) answers it as an exact hit on which llama.cpp evaluates
one token (its own counters, ``tests/llama_counts.py``); every answer is token-identical to an
uncached run, and the store's files hold at most 2% more than the prompt's KV bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.router import EdgeSync
from tests.llama_counts import chat, llama_prefilled

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import tiny_gguf  # noqa: E402

pytestmark = [pytest.mark.model]

MAX_TOKENS = 8
N_CTX = 256
"""Context window, tokens: 512 MiB of f32 KV at 2 MiB a token."""
KV_TYPE = "f32"
F32_BYTES = 4
SYSTEM = ("You are Atlas, the travel planner of a small rail company. Answer in two sentences at most, "
          "name the train and the platform when you know them, and never invent a timetable. Trains to "
          "the coast leave every hour from platform 4; night trains to the mountains leave at 22:10 from "
          "platform 9, and bicycles travel free on weekdays.")
QUESTIONS = ("When does the night train to the mountains leave?", "Can I take my bicycle to the coast?")


def kv_bytes_per_token() -> int:
    """K and V of one token over every layer, from the row's config: 2 x layers x KV heads x head size x 4."""
    c = tiny_gguf.WIDE_KV.config
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * F32_BYTES


@pytest.fixture(scope="module")
def gguf() -> Path:
    """The ``wide-kv`` GGUF, built once into the cache directory (seconds)."""
    return tiny_gguf.build(tiny_gguf.WIDE_KV)


@pytest.fixture(scope="module")
def config() -> EdgeSyncConfig:
    """f32 KV in a 256-token context, one thread; exact reuse only, no background jobs.

    One thread: llama.cpp's threads meet at every node of the graph (about 30 a layer, 64
    layers), and where other processes hold the cores two threads wait for each other at each
    meeting; one thread keeps the test's time that of its work."""
    return EdgeSyncConfig.load({"n_ctx": N_CTX, "kv_type": KV_TYPE, "n_threads": 1, "semantic": False,
                                "jobs": False})


def answer(es: EdgeSync, prompt) -> tuple:
    """The result of one request and the prompt tokens llama.cpp evaluated for it."""
    es.adapter.reset_perf()
    result = es.generate(prompt, max_tokens=MAX_TOKENS)
    return result, llama_prefilled(es.adapter.perf_counts(), result.tokens, MAX_TOKENS)


def test_the_row_has_two_mib_of_kv_a_token_in_a_small_file(gguf):
    assert kv_bytes_per_token() == 2 * 1024 * 1024
    assert gguf.stat().st_size < 40_000_000


def test_a_stored_prompt_is_an_exact_hit_in_a_new_instance(gguf, config, tmp_path):
    prompt, control = chat(SYSTEM, QUESTIONS[0]), chat(SYSTEM, QUESTIONS[1])
    with EdgeSync(gguf, store=False, config=config) as es:
        ns = es.namespace
        reference = es.generate(prompt, max_tokens=MAX_TOKENS)
        other = es.generate(control, max_tokens=MAX_TOKENS)
    assert (ns.n_layer, ns.n_head_kv, ns.head_dim, ns.kv_dtype) == (64, 16, 256, KV_TYPE)
    assert reference.tokens != other.tokens  # the answer follows the prompt, so identity below means something

    store_dir = tmp_path / "store"
    with EdgeSync(gguf, store=store_dir, config=config) as es:
        miss, miss_evaluated = answer(es, prompt)
    with EdgeSync(gguf, store=store_dir, config=config) as es:  # a new instance: the store opened again
        hit, hit_evaluated = answer(es, prompt)
        stats = es.store.stats()

    n = miss.prompt_tokens
    assert 64 < n < 128  # stored (over 64 tokens), one fragment
    assert miss.tokens == hit.tokens == reference.tokens
    assert miss.hit == "miss" and miss.fragments_written == 1 and miss_evaluated == n
    assert hit.hit == "exact" and hit.tokens_reused == n - 1 and hit.tokens_prefilled == 1
    assert hit_evaluated == 1
    assert hit.bytes_read >= (n - 1) * kv_bytes_per_token()
    assert stats.fragments == 1 and stats.raw_bytes == (n - 1) * kv_bytes_per_token()
    assert stats.disk_bytes <= 1.02 * n * kv_bytes_per_token()
