"""The reuse plan and its execution, without a model: requests through the real ``EdgeSync``
driving the fake adapter of tests/fake_adapter.py (one token per character), on a real
FragmentStore (LMDB in a tmp dir), with the real store-back.

What the plan decides (exact, partial, miss; the last-token rule; convertible KV only when
allowed; the approximate mode's thresholds) and how the executor falls back are checked here
in milliseconds; that the injected KV gives an uncached run's answer is what the real-model
tests check.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
from fake_adapter import FakeAdapter, fake_namespace

from edgesync_engines.adapters.protocol import EngineAdapter, missing_members
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request import reuse, storeback
from edgesync_engines.request.execute import Injector
from edgesync_engines.request.plan import HitKind, ReuseMode, SourceKind, hit_kind, plan_reuse
from edgesync_engines.request.router import EdgeSync
from edgesync_engines.request.semantic_lookup import Donor, Lookup
from edgesync_store.core.store import FragmentStore
from edgesync_store.schema import MIN_SPAN


def text(n: int, seed: int = 0) -> str:
    """``n`` deterministic lowercase characters (``n`` fake tokens); seeds give other texts."""
    return "".join(chr(97 + (i * 7 + seed * 13 + i // 26 * seed) % 26) for i in range(n))


def other(n: int) -> str:
    """``n`` characters that share no first character with :func:`text`'s (upper case)."""
    return text(n, 3).upper()


def cfg(**overrides) -> EdgeSyncConfig:
    """Settings without the store jobs and the RAM tier (every injection reads the store)."""
    return EdgeSyncConfig.load({"jobs": False, "ram_tier_bytes": 0, **overrides}, environ={})


@pytest.fixture
def store(tmp_path):
    with FragmentStore(tmp_path / "store") as s:
        yield s


@pytest.fixture
def adapter():
    return FakeAdapter()


def serve(store, adapter, config, prompt, *, semantic=None, max_tokens=4):
    """One request through the real ``EdgeSync`` on ``adapter`` and ``store`` in ``config``,
    with ``semantic`` (a :class:`FakeLookup`, or None) as its semantic lookup. Returns (the
    plan, the injection, fragments written); the plan and the injection are recorded on their
    way through ``plan_reuse`` and ``Injector.carry_out``."""
    seen = {}

    def plan_spy(*args, **kwargs):
        seen["plan"] = plan_reuse(*args, **kwargs)
        return seen["plan"]

    carry_out = Injector.carry_out

    def carry_out_spy(injector, plan):
        seen["injection"] = carry_out(injector, plan)
        return seen["injection"]

    # built in the exact mode (the semantic one would load MiniLM at start); its semantic lookup,
    # which has loaded nothing, gives way to the given one, and the request runs in config.reuse
    es = EdgeSync(adapter, store, dataclasses.replace(config, reuse=ReuseMode.EXACT))
    if es.semantic is not None:
        es.semantic.close()
    es.semantic = semantic
    try:
        with mock.patch.object(reuse, "plan_reuse", plan_spy), mock.patch.object(Injector, "carry_out",
                                                                                  carry_out_spy):
            result = es.generate(prompt, max_tokens=max_tokens, reuse=config.reuse)
    finally:
        es.semantic = None
        es.close()
    injected = seen["injection"]
    assert result.tokens_reused == injected.reused and result.approximate == injected.approximate
    assert result.tokens == adapter.answer[:max_tokens] and not adapter.closed
    return seen["plan"], injected, result.fragments_written


# -- hit kinds --------------------------------------------------------------------------


def test_hit_kind_names_what_was_injected():
    assert hit_kind(0, 300) == HitKind.MISS == "miss"
    assert hit_kind(MIN_SPAN - 1, 300) == HitKind.MISS
    assert hit_kind(MIN_SPAN, 300) == HitKind.PARTIAL == "partial"
    assert hit_kind(298, 300) == HitKind.PARTIAL
    assert hit_kind(299, 300) == HitKind.EXACT == "exact"
    assert hit_kind(0, 300, approximate=True) == HitKind.EXACT
    assert ReuseMode.EXACT == "exact" and ReuseMode.SEMANTIC == "semantic"


def test_exact_repeat_injects_all_but_the_last_token(store, adapter):
    config = cfg()
    plan, first, written = serve(store, adapter, config, text(300))
    assert first.reused == 0 and first.source.kind == SourceKind.PREFIX and written == 2  # [0,128) [128,299)

    plan, again, written = serve(store, adapter, config, text(300))
    assert [s.kind for s in plan.sources] == [SourceKind.PREFIX]
    assert plan.sources[0].match.matched_tokens == 299 and plan.sources[0].donor is None
    assert again.reused == 299 and hit_kind(again.reused, 300) == HitKind.EXACT
    assert len(again.keys) == 2 and again.bytes_read == sum(s.compressed_nbytes for s in plan.sources[0].match.spans)
    assert again.source_engine == "llama.cpp" and not again.approximate and not again.convertible
    assert adapter.prefilled[-1] == 1 and written == 0
    assert plan.similarity is None and plan.lookup_ms is None and plan.embedded is None


def test_partial_prefix_injects_the_common_tokens(store, adapter):
    config = cfg()
    serve(store, adapter, config, text(300))
    plan, injected, written = serve(store, adapter, config, text(300)[:200] + other(100))
    assert plan.sources[-1].match.matched_tokens == 200
    assert injected.reused == 200 and hit_kind(injected.reused, 300) == HitKind.PARTIAL
    assert adapter.prefilled[-1] == 100
    assert written == 1  # [128, 299) of the new prompt; [0, 128) was stored


def test_unrelated_prompt_misses(store, adapter):
    config = cfg()
    serve(store, adapter, config, text(300))
    plan, injected, _ = serve(store, adapter, config, other(300))
    assert injected.reused == 0 and injected.keys == () and injected.bytes_read == 0
    assert hit_kind(injected.reused, 300) == HitKind.MISS and injected.source_engine is None
    assert adapter.prefilled[-1] == 300


def test_prompts_under_64_tokens_are_never_cached(store, adapter):
    config = cfg()
    for n in (10, MIN_SPAN - 1, MIN_SPAN):
        assert serve(store, adapter, config, text(n))[2] == 0  # its chunks cover all but the last token
    assert store.stats().fragments == 0
    serve(store, adapter, config, text(300))
    plan, injected, _ = serve(store, adapter, config, text(MIN_SPAN - 1))
    assert plan.sources == () and injected.reused == 0  # its prefix is stored, but it is not looked up
    plan, injected, _ = serve(store, adapter, config, text(MIN_SPAN))
    assert injected.reused == 0  # 63 usable tokens are less than one fragment
    plan, injected, written = serve(store, adapter, config, text(MIN_SPAN + 1))
    assert injected.reused == MIN_SPAN and hit_kind(injected.reused, MIN_SPAN + 1) == HitKind.EXACT
    assert written == 1  # its own 64-token chunk


def test_last_token_rule_n_minus_2_stored_injects_n_minus_3(store, adapter):
    """The KV of a prompt's last token is never stored; with n - 2 tokens stored llama.cpp
    would evaluate one token alone, so one fewer is injected (README, How it works)."""
    config = cfg()
    serve(store, adapter, config, text(300))
    base = text(300)
    _, n2, _ = serve(store, adapter, config, base[:298] + "QR")
    assert n2.reused == 297 and adapter.prefilled[-1] == 3
    _, n1, _ = serve(store, adapter, config, base[:299] + "Q")
    assert n1.reused == 299 and hit_kind(n1.reused, 300) == HitKind.EXACT

    onnx_like = FakeAdapter(one_token_rule=False)
    _, ort, _ = serve(store, onnx_like, config, base[:298] + "WX")
    assert ort.reused == 298


# -- convertible KV ---------------------------------------------------------------------


@pytest.fixture
def onnx_adapter():
    return FakeAdapter(fake_namespace("onnxruntime"))


def test_convertible_kv_is_used_only_when_allowed(store, adapter, onnx_adapter):
    serve(store, onnx_adapter, cfg(), text(300))  # the other engine wrote the chain

    plan, injected, _ = serve(store, adapter, cfg(), text(300))
    assert [s.kind for s in plan.sources] == [SourceKind.PREFIX] and injected.reused == 0

    store2_prompt = text(300)
    allowed = cfg(allow_convertible=True)
    adapter2 = FakeAdapter()
    plan = plan_reuse(store2_prompt, adapter2.tokenize(store2_prompt), 4, store=store, adapter=adapter2,
                      config=allowed)
    # the own namespace now holds the chain too (the request above stored it): nothing to convert
    assert [s.kind for s in plan.sources] == [SourceKind.PREFIX]


def test_convertible_source_converts_and_stores_nothing(store, adapter, onnx_adapter):
    serve(store, onnx_adapter, cfg(), text(300))
    plan, injected, written = serve(store, adapter, cfg(allow_convertible=True), text(300))
    assert [s.kind for s in plan.sources] == [SourceKind.CONVERTIBLE, SourceKind.PREFIX]
    conv = plan.sources[0]
    assert conv.namespace == onnx_adapter.namespace and conv.required == 1
    assert injected.convertible and injected.reused == 299 and injected.source_engine == "onnxruntime"
    assert injected.donor is None and written == 0  # the fake refuses another namespace: it was converted


def test_another_model_is_never_a_source(store, adapter):
    stranger = FakeAdapter(fake_namespace("onnxruntime", fingerprint="0b" * 32))
    serve(store, stranger, cfg(), text(300))
    plan, injected, _ = serve(store, adapter, cfg(allow_convertible=True), text(300))
    assert [s.kind for s in plan.sources] == [SourceKind.PREFIX] and injected.reused == 0


# -- semantic donors --------------------------------------------------------------------


class FakeLookup:
    """Stands in for SemanticLookup: nominates the given donors (most similar first), records
    the calls, and indexes nothing."""

    def __init__(self, donors=(), similarity=None):
        self.donors = list(donors)
        self.similarity = similarity if similarity is not None else (self.donors[0].similarity if self.donors else None)
        self.nominated = 0
        self.forgotten = []

    def nominate(self, prompt, namespace):
        self.nominated += 1
        return Lookup(self.similarity, self.donors, ("embedded text", np.zeros(384, dtype=np.float32)))

    def forget(self, key):
        self.forgotten.append(key)

    def ready_now(self):
        return False  # no index: the router does not index the prompt after its answer


SYSTEM = "You are a helpful assistant who answers briefly and precisely. " * 3


def chat(question: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def donor_of(adapter, config, messages, similarity) -> Donor:
    tokens = adapter.tokenize(adapter.apply_chat_template(messages))
    return Donor(storeback.donor_key(adapter.namespace, tokens, config), similarity, np.asarray(tokens, dtype=np.int32))


def test_lookup_runs_only_in_the_approximate_mode_and_not_on_an_exact_hit(store, adapter):
    serve(store, adapter, cfg(), text(300))
    lookup = FakeLookup()
    for prompt in (text(200) + other(100), other(300), text(298) + "QR"):  # partial, miss, 2 uncovered
        plan, _, _ = serve(store, adapter, cfg(), prompt, semantic=lookup)
        assert plan.lookup_ms is None and plan.similarity is None and plan.embedded is None
    assert lookup.nominated == 0  # the default mode never asks

    semantic_mode = cfg(reuse="semantic")
    serve(store, adapter, semantic_mode, text(300), semantic=lookup)
    assert lookup.nominated == 0  # an exact hit never looks
    plan, _, _ = serve(store, adapter, semantic_mode, text(298) + "XY", semantic=lookup)
    assert lookup.nominated == 1  # 2 uncovered are enough in the approximate mode
    assert plan.lookup_ms is not None and plan.embedded[0] == "embedded text"


@pytest.mark.parametrize("similarity, served", [(0.99, True), (0.92, True), (0.9199, False)])
def test_approximate_mode_serves_a_donor_at_similarity_exact(store, adapter, similarity, served):
    config = cfg(reuse="semantic")
    donor_msgs = chat("What is the capital of France, and why is it famous?")
    serve(store, adapter, config, donor_msgs)
    donor = donor_of(adapter, config, donor_msgs, similarity)
    plan, injected, written = serve(store, adapter, config, chat("Which city is the capital of France?"),
                                    semantic=FakeLookup([donor]))
    assert plan.similarity == similarity
    if served:
        assert plan.sources[0].kind == SourceKind.DONOR and plan.sources[0].required == len(donor.tokens) - 1
        assert injected.approximate and injected.reused == len(donor.tokens) - 1
        assert list(injected.tokens) == donor.tokens.tolist() and adapter.prefilled[-1] == 1
        assert injected.donor == donor.key.hex() and injected.source_engine is None and written == 0
    else:
        assert [s.kind for s in plan.sources] == [SourceKind.PREFIX] and not injected.approximate
        assert injected.reused > 0 and injected.donor == donor.key.hex()  # it verified the shared prefix


def test_default_mode_never_serves_a_donor_whole(store, adapter):
    config = cfg()
    donor_msgs = chat("What is the capital of France, and why is it famous?")
    serve(store, adapter, config, donor_msgs)
    donor = donor_of(adapter, config, donor_msgs, 0.999)
    lookup = FakeLookup([donor])
    plan, injected, _ = serve(store, adapter, config, chat("Which city is the capital of France?"), semantic=lookup)
    assert [s.kind for s in plan.sources] == [SourceKind.PREFIX] and not injected.approximate
    assert lookup.nominated == 0 and plan.sources[0].donor is None


def test_donor_of_another_context_or_too_long_is_not_served(store, adapter):
    config = cfg(reuse="semantic")
    elsewhere = chat("What is the capital of France, and why is it famous?", system="Another app. " * 12)
    serve(store, adapter, config, elsewhere)
    lookup = FakeLookup([donor_of(adapter, config, elsewhere, 1.0)])
    plan, _, _ = serve(store, adapter, config, chat("Which city is the capital of France?"), semantic=lookup)
    assert SourceKind.DONOR not in [s.kind for s in plan.sources]  # the embedding saw the question alone

    donor_msgs = chat("What is the capital of France, and why is it famous?")
    serve(store, adapter, config, donor_msgs)
    donor = donor_of(adapter, config, donor_msgs, 1.0)
    small = FakeAdapter(n_ctx=len(donor.tokens) + 3)
    prompt = chat("Which city?")
    tokens = small.tokenize(small.apply_chat_template(prompt))
    plan = plan_reuse(prompt, tokens, 4, store=store, adapter=small, config=config, semantic=FakeLookup([donor]))
    assert SourceKind.DONOR not in [s.kind for s in plan.sources]  # donor + max_tokens > n_ctx


def test_donor_whose_chain_is_gone_is_dropped(store, adapter):
    config = cfg(reuse="semantic")
    never_stored = donor_of(adapter, config, chat("A question nobody stored, about the weather in May?"), 0.99)
    lookup = FakeLookup([never_stored])
    plan, injected, _ = serve(store, adapter, config, chat("Which city is the capital of France?"), semantic=lookup)
    assert plan.stale_donors == (never_stored.key,) and not injected.approximate


def test_donor_spoiled_after_the_plan_falls_back_to_the_prefix(store, adapter):
    config = cfg(reuse="semantic")
    donor_msgs = chat("What is the capital of France, and why is it famous?")
    serve(store, adapter, config, donor_msgs)
    donor = donor_of(adapter, config, donor_msgs, 0.99)
    prompt = chat("Which city is the capital of France?")
    tokens = adapter.tokenize(adapter.apply_chat_template(prompt))
    plan = plan_reuse(prompt, tokens, 4, store=store, adapter=adapter, config=config, semantic=FakeLookup([donor]))
    assert plan.sources[0].kind == SourceKind.DONOR
    last = plan.sources[0].match.spans[-1]
    store.delete(last.keys[0])  # another process evicts the donor's last chunk
    injected = Injector(store, adapter).carry_out(plan)
    assert not injected.approximate and injected.source.kind == SourceKind.PREFIX
    assert 0 < injected.reused < len(tokens) - 1 and list(injected.tokens) == tokens


def test_refused_injection_prefills(store, adapter):
    config = cfg()
    serve(store, adapter, config, text(300))
    adapter.refuse_injection = True
    _, injected, _ = serve(store, adapter, config, text(300))
    assert injected.reused == 0 and adapter.prefilled[-1] == 300


def test_plan_is_immutable(store, adapter):
    plan, _, _ = serve(store, adapter, cfg(), text(300))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.sources = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.sources[0].limit = 0


def test_fake_adapter_has_the_protocol_members(adapter):
    assert isinstance(adapter, EngineAdapter) and missing_members(adapter) == []


def test_edgesync_refuses_a_model_that_is_no_adapter_naming_what_it_lacks(store):
    half = SimpleNamespace(tokenize=lambda text: [ord(c) for c in text], n_ctx=4096)
    with pytest.raises(TypeError, match=r"SimpleNamespace lacks .*generate.*namespace") as err:
        EdgeSync(half, store, cfg())
    assert "tokenize" not in str(err.value) and "n_ctx" not in str(err.value)
    with pytest.raises(TypeError, match="store: expected a FragmentBackend"):
        EdgeSync(FakeAdapter(), 42, cfg())
