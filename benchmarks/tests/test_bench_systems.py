"""edgesync_bench.systems on the real model: one interface, hit detection, nothing printed.

Two short prompts (a ~100-token cut of a real system prompt plus two questions), all cores,
so that the module stays well under a minute on 2 cores.
"""

from __future__ import annotations

import pytest

from edgesync_bench.systems import SYSTEM_NAMES, Answer, hit_kind_of, identity, make_system


@pytest.fixture(scope="module")
def prompts(system_prompts):
    system = system_prompts[0][:450]
    return [
        [{"role": "system", "content": system}, {"role": "user", "content": "How do I improve my English?"}],
        [{"role": "system", "content": system}, {"role": "user", "content": "What is a good first book to read?"}],
    ]


def _run(name, tmp_path, stream, **kw):
    with make_system(name, workdir=tmp_path, **kw) as system:
        return [system.answer(m, max_tokens=8) for m in stream]


def test_hit_kind_and_identity_helpers():
    assert hit_kind_of(99, 100) == "exact" and hit_kind_of(64, 100) == "partial" and hit_kind_of(63, 100) is None
    a = Answer(1.0, [1, 2], "", 5, 0, None, 0)
    assert identity([a, a], [a, Answer(1.0, [1], "", 5, 0, None, 0)]) == 0.5
    with pytest.raises(ValueError):
        make_system("nope")
    with pytest.raises(ValueError):
        make_system("llama-disk")  # needs a workdir
    assert len(SYSTEM_NAMES) == 6


@pytest.mark.model
def test_no_cache_never_reuses(prompts, tmp_path, capfd):
    a, b, a2 = _run("no-cache", tmp_path, [prompts[0], prompts[1], prompts[0]])
    assert all(x.tokens_reused == 0 and x.hit is None and x.source is None for x in (a, b, a2))
    assert a.prompt_tokens > 64 and 0 < len(a.tokens) <= 8 and a.ttft_ms > 0
    assert a.tokens == a2.tokens and a.text == a2.text
    out, err = capfd.readouterr()
    assert out == "" and err == ""


@pytest.mark.model
def test_llama_ram_cache_hit_detected(prompts, tmp_path, capfd):
    a, b, a2 = _run("llama-ram", tmp_path, [prompts[0], prompts[1], prompts[0]])
    assert a.hit is None and a.tokens_reused == 0 and a.bytes_read == 0
    # B shares the system prompt with A still in the live context: llama-cpp-python keeps it
    assert b.source == "context" and b.tokens_reused > 0 and b.bytes_read == 0
    # A again: the cache holds A (+ its answer), longer than what the context shares: loaded
    assert a2.source == "cache" and a2.detail["cache_loaded"]
    assert a2.hit == "exact" and a2.tokens_reused == a2.prompt_tokens - 1 and a2.bytes_read > 0
    assert a2.detail["cache_entries"] == 2
    out, err = capfd.readouterr()
    assert out == "" and err == ""


@pytest.mark.model
def test_llama_disk_cache_keeps_one_entry(prompts, tmp_path, capfd):
    """LlamaDiskCache.__getitem__ pops the entry it finds, whether or not _create_completion
    then loads it, so in one process the cache holds only the last request and never loads;
    a new process on the same directory does load it."""
    a, b, a2 = _run("llama-disk", tmp_path, [prompts[0], prompts[1], prompts[0]])
    assert a.hit is None and b.source == "context"
    assert a2.source == "context" and not a2.detail["cache_loaded"] and a2.detail["cache_entries"] == 1
    (warm,) = _run("llama-disk", tmp_path, [prompts[0]])
    assert warm.source == "cache" and warm.hit == "exact" and warm.bytes_read > 0
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # LlamaDiskCache's prints are captured and logged


@pytest.mark.model
def test_naive_string_cache(prompts, tmp_path):
    a, a2 = _run("naive-string", tmp_path, [prompts[0], prompts[0]])
    assert a.hit is None and a2.hit == "exact" and a2.source == "answer"
    assert a2.tokens == a.tokens and a2.tokens_reused == a2.prompt_tokens and a2.ttft_ms < a.ttft_ms


@pytest.mark.model
def test_edgesync_exact_hit(prompts, tmp_path, capfd):
    a, a2 = _run("edgesync", tmp_path, [prompts[0], prompts[0]], config={"semantic": False})
    assert a.hit is None and a2.hit == "exact" and a2.source == "store" and a2.tokens == a.tokens
    # the repeat in the same process reads the store in place (uncompressed blobs: no RAM copy)
    assert a2.bytes_read > 0 and a2.detail["ram_tier_hits"] == 0 and a.detail["fragments_written"] >= 1
    (b,) = _run("edgesync", tmp_path, [prompts[0]], config={"semantic": False})  # a new process: the store
    assert b.hit == "exact" and b.bytes_read > 0 and b.detail["ram_tier_hits"] == 0 and b.tokens == a.tokens
    out, err = capfd.readouterr()
    assert out == "" and err == ""
