"""What a request reuses and stores, one strategy per reuse mode (``EdgeSyncConfig.reuse``).

:class:`ExactReuse` touches no semantic, blend or documents code.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from edgesync_engines.request import storeback
from edgesync_engines.request.execute import Injection
from edgesync_engines.request.plan import ReuseMode, ReusePlan, plan_reuse
from edgesync_store.schema import MIN_SPAN, common_prefix_len

if TYPE_CHECKING:
    from edgesync_engines.adapters.protocol import EngineAdapter
    from edgesync_engines.request.lanes import Lane


def live_prefix(adapter: "EngineAdapter", tokens: list[int], live_exact: int) -> int:
    """Tokens of ``tokens`` that the engine's live sequence holds with exact KV (its first
    ``live_exact`` tokens), cut to an injection point (``usable_prefix``); no lower bound."""
    if live_exact < 1:
        return 0
    common = common_prefix_len(adapter.live_tokens()[:live_exact], tokens)
    return max(0, adapter.usable_prefix(common, len(tokens)))


class ExactReuse:
    """``exact`` (and ``blend`` without documents): only token-identical KV is injected, so
    answers equal an uncached run's; a request that extends the engine's live sequence by at
    least what the store holds continues it and injects nothing.

    Args:
        engine: the ``EdgeSync`` served (its store, config, RAM tier, prefetcher); the adapter and
            injector are those of the lane a request runs in.
        mode: the reuse mode it serves (``exact`` or ``blend``).
    """

    first_lane = False
    """It may run in any of the engine's lanes."""

    def __init__(self, engine, mode: str = ReuseMode.EXACT) -> None:
        self.engine, self.mode = engine, mode
        self.config = engine.config if engine.config.reuse == mode else replace(engine.config, reuse=mode)

    def reuse(self, lane: "Lane", prompt, tokens: list[int], max_tokens: int,
              live_exact: int = 0) -> tuple[ReusePlan, Injection]:
        """Plan what the request reuses and inject it into ``lane`` (the caller holds it);
        ``live_exact``: leading live tokens with exact KV. The plan needs no prompt text."""
        es, adapter = self.engine, lane.adapter
        plan = plan_reuse(None, tokens, max_tokens, store=es.store, adapter=adapter, config=self.config)
        if lane.injector is None:
            return plan, Injection(None, plan.prompt)
        live = live_prefix(adapter, tokens, live_exact)
        n = len(tokens)
        stored = max((adapter.usable_prefix(min(source.match.matched_tokens, source.limit), n)
                      for source in plan.sources if source.tokens == plan.prompt), default=0)
        if stored < MIN_SPAN:  # the injector injects nothing shorter
            stored = 0
        if live and live >= stored:
            return plan, Injection(None, tuple(tokens), live, live=True)
        return plan, lane.injector.carry_out(plan)

    def after_answer(self, lane: "Lane", prompt, tokens: list[int], out: list[int], plan: ReusePlan,
                     injected: Injection) -> int:
        """Store the prompt's missing chunks from ``lane`` (with its donor record when
        ``config.semantic``) and feed the prefetcher; returns the fragments written. A context
        holding KV that is not the prompt's own (a donor's, another engine's) stores nothing."""
        es = self.engine
        written = 0
        if es.store is not None and exact_context(injected):
            donor = prompt if es.config.semantic else None
            written = storeback.store_new(es.store, lane.adapter, tokens, es.config, donor, es.fragment_cache)
        if es.prefetcher is not None:
            es.prefetcher.after_answer(tokens, out)
        return written

    def exact_context(self, injected: Injection) -> bool:
        """The engine's sequence holds the prompt's own exact KV once answered."""
        return exact_context(injected)

    def annotate(self, result) -> None:
        """Fill a strategy's own fields of the request's ``GenerationResult`` (none here)."""


def exact_context(injected: Injection) -> bool:
    """``injected`` is the prompt's own exact KV (not a donor's, not converted)."""
    return not (injected.approximate or injected.convertible)


class SemanticReuse:
    """``semantic`` (opt-in, approximate): the lookup may nominate a donor prompt by meaning,
    served whole at ``similarity_exact`` or for its verified prefix (``request/plan.py``); the
    live sequence is not continued. Stores as :class:`ExactReuse` does, and indexes the prompt.
    """

    mode = ReuseMode.SEMANTIC
    first_lane = False

    def __init__(self, engine) -> None:
        self.engine = engine
        self.exact = ExactReuse(engine, self.mode)

    def reuse(self, lane: "Lane", prompt, tokens: list[int], max_tokens: int,
              live_exact: int = 0) -> tuple[ReusePlan, Injection]:
        """Plan with the semantic lookup and inject into ``lane`` (the caller holds it)."""
        es = self.engine
        plan = plan_reuse(prompt, tokens, max_tokens, store=es.store, adapter=lane.adapter, config=self.exact.config,
                          semantic=es.semantic)
        for key in plan.stale_donors:
            es.semantic.forget(key)
        if lane.injector is None:
            return plan, Injection(None, plan.prompt)
        return plan, lane.injector.carry_out(plan)

    def after_answer(self, lane: "Lane", prompt, tokens: list[int], out: list[int], plan: ReusePlan,
                     injected: Injection) -> int:
        """:meth:`ExactReuse.after_answer`, then the prompt's vector (``storeback.index_prompt``)."""
        written = self.exact.after_answer(lane, prompt, tokens, out, plan, injected)
        es = self.engine
        if es.store is not None and es.semantic is not None and exact_context(injected):
            storeback.index_prompt(es.semantic, es.store, es.namespace, prompt, tokens, plan.embedded, es.config)
        return written

    def exact_context(self, injected: Injection) -> bool:
        """As :meth:`ExactReuse.exact_context`."""
        return exact_context(injected)

    def annotate(self, result) -> None:
        """No fields of its own."""


def strategy_for(mode: str, engine) -> "ExactReuse | SemanticReuse":
    """The strategy of ``mode`` for ``engine`` (an ``EdgeSync``); ValueError for an unknown mode."""
    if mode == ReuseMode.SEMANTIC:
        return SemanticReuse(engine)
    if mode in (ReuseMode.EXACT, ReuseMode.BLEND):
        return ExactReuse(engine, mode)
    raise ValueError(f"reuse: {mode!r} is not one of exact, semantic, blend")
