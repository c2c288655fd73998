"""The request seam's proof: ``EdgeSync`` serves the default mode from ``tests/dict_backend.py``, a
``FragmentBackend`` of plain dicts (no LMDB, no ``MaintenanceBackend``), with the real SmolLM2
through llama.cpp: a miss, an exact hit and a partial hit, each answer token-identical to an
uncached run, and the prompt tokens llama.cpp evaluated counted by its own perf counters.
"""

from __future__ import annotations

import pytest

from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.router import EdgeSync
from edgesync_store.core.backend import MaintenanceBackend
from tests.dict_backend import DictBackend
from tests.llama_counts import chat, llama_prefilled

pytestmark = [pytest.mark.model]

MAX_TOKENS = 16


def test_the_default_mode_serves_miss_exact_and_partial_hits_from_a_dict_backend(adapter, system_prompts):
    backend = DictBackend()
    assert not isinstance(backend, MaintenanceBackend)
    config = EdgeSyncConfig.load({}, environ={})
    first = chat(system_prompts[1], "How do I get from the airport to the city centre cheaply?")
    second = chat(system_prompts[1], "What should I pack for a week of hiking in the rain?")
    reference = [EdgeSync(adapter, store=False, config=config).generate(m, max_tokens=MAX_TOKENS).tokens
                 for m in (first, second)]
    cached = EdgeSync(adapter, store=backend, config=config)
    assert cached.store is backend and cached.jobs is None and cached.semantic is None  # maintenance: none

    def run(messages):
        """One request served from the backend: not from the engine's live sequence nor RAM."""
        adapter.clear_kv_cache()
        cached.fragment_cache.clear()
        adapter.reset_perf()
        result = cached.generate(messages, max_tokens=MAX_TOKENS)
        return result, llama_prefilled(adapter.perf_counts(), result.tokens, MAX_TOKENS)

    try:
        miss, evaluated = run(first)
        assert miss.hit == "miss" and miss.fragments_written >= 2 and miss.tokens_reused == 0
        assert evaluated == miss.prompt_tokens and miss.tokens == reference[0]
        assert len(backend.donors) == 1  # the prompt's donor record, written with its fragments

        exact, evaluated = run(first)
        assert exact.hit == "exact" and exact.tokens_reused > 0 and exact.bytes_read > 0
        assert exact.tokens_prefilled <= 1 and evaluated <= 1 and exact.tokens == reference[0]

        partial, evaluated = run(second)
        assert partial.hit == "partial" and partial.tokens_reused >= 128
        assert evaluated == partial.tokens_prefilled == partial.prompt_tokens - partial.tokens_reused
        assert partial.tokens == reference[1]
        assert backend.stats().fragments == miss.fragments_written + partial.fragments_written
    finally:
        cached.close()
