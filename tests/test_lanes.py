"""Which lane (slot) a request takes: pure logic on the fake adapter (a fake: the choice needs
no model), then ``EdgeSync(slots=2)`` on the real SmolLM2 and a real store: requests from
threads share the engine's steps, a conversation goes back to its slot, and every answer equals
the uncached one."""

from __future__ import annotations

import threading
import time

import pytest
from fake_adapter import FakeAdapter

from edgesync_engines.request.lanes import Lane, Lanes


def lanes_of(*held: list[int]) -> Lanes:
    lanes = []
    for i, tokens in enumerate(held):
        adapter = FakeAdapter()
        adapter.live = list(tokens)
        lane = Lane(i, adapter, None)
        lane.set_live(max(0, len(tokens) - 1))
        lanes.append(lane)
    return Lanes(lanes)


def test_a_request_takes_the_lane_holding_most_of_its_prompt():
    lanes = lanes_of([1, 2, 3, 4, 5], [1, 2, 9, 9], [7, 7, 7, 7, 7, 7])
    with lanes.taken([1, 2, 3, 4, 5, 6]) as lane:
        assert lane.index == 0
    assert lanes.by_prefix == 1


def test_without_a_prefix_an_empty_lane_then_the_one_used_longest_ago():
    lanes = lanes_of([5, 5, 5], [], [6, 6, 6])
    with lanes.taken([1, 2]) as lane:
        assert lane.index == 1  # empty
    lanes[1].adapter.live = [8, 8]
    lanes[1].set_live(1)
    with lanes.taken([9]) as first:
        assert first.index == 0  # no lane is empty: lowest index among the never used
    with lanes.taken([9]) as second:
        assert second.index == 2  # then the one not used since
    assert lanes.by_prefix == 0


def test_exact_kv_counts_only_while_the_sequence_is_unchanged():
    lanes = lanes_of([1, 2, 3, 4], [])
    assert lanes[0].exact_prefix([1, 2, 3, 4, 5]) == 3
    lanes[0].adapter.clear_kv_cache()  # kv_epoch moves on
    assert lanes[0].exact_prefix([1, 2, 3, 4, 5]) == 0
    assert lanes[0].take_live() == 0


def test_a_request_waits_while_every_lane_answers_another():
    lanes = lanes_of([], [])
    order: list[str] = []
    both = threading.Barrier(3)

    def hold(name: str) -> None:
        with lanes.taken([1]):
            both.wait()
            order.append(name)
            released.wait()

    released = threading.Event()
    holders = [threading.Thread(target=hold, args=(n,)) for n in ("a", "b")]
    for t in holders:
        t.start()
    both.wait()  # both lanes held
    waiter_done = threading.Event()

    def wait_for_one() -> None:
        with lanes.taken([1]):
            order.append("c")
        waiter_done.set()

    third = threading.Thread(target=wait_for_one)
    third.start()
    assert not waiter_done.wait(0.3)  # no lane is free
    assert lanes.driven_by(holders[0].ident) and not lanes.driven_by(threading.get_ident())
    released.set()
    assert waiter_done.wait(10)
    for t in (*holders, third):
        t.join()
    assert order[-1] == "c"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """An uncached reference and an ``EdgeSync`` of two slots on a real store (its config, store)."""
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_engines.request.router import EdgeSync

    cfg = dict(n_ctx=1024, n_threads=2, max_tokens=32)
    reference = EdgeSync(store=False, config=EdgeSyncConfig(**cfg))
    store = tmp_path_factory.mktemp("slots-store")
    slots = EdgeSync(config=EdgeSyncConfig(**cfg, slots=2, store_path=store, idle_store=True, jobs=False))
    yield reference, slots, store, cfg
    slots.close()
    reference.close()


@pytest.mark.model
class TestSlotsOfOneEngine:
    """``EdgeSync`` with two slots on the real model and a real store."""

    def conversations(self, system_prompts):
        return [[{"role": "system", "content": system_prompts[i]}, {"role": "user", "content": q}]
                for i, q in enumerate(("What is a prime number?", "How do I boil an egg?"))]

    def test_threads_share_steps_and_answer_as_uncached(self, engines, system_prompts):
        reference, slots, _, _ = engines
        convs = self.conversations(system_prompts)
        expected = [reference.generate(c).tokens for c in convs]
        loop = slots.adapter.engine.loop
        before = loop.steps
        results = [None, None]
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, slots.generate(convs[i])))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.tokens for r in results] == expected
        assert sorted(r.slot for r in results) == [0, 1]
        assert loop.steps - before < sum(len(e) for e in expected)  # decode steps were shared

    def test_a_next_turn_goes_back_to_its_slot_and_continues_it(self, engines, system_prompts):
        reference, slots, _, _ = engines
        convs = self.conversations(system_prompts)
        first = [slots.generate(c) for c in convs]
        slots.idle.wait_idle(60)  # idle-time storing of both conversations
        turns = [c + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "Tell me more."}]
                 for c, r in zip(convs, first)]
        for turn, answered in zip(reversed(turns), reversed(first)):  # the other order than they were answered
            result = slots.generate(turn)
            assert result.slot == answered.slot
            assert result.live_tokens > 0 and result.tokens_prefilled < result.prompt_tokens // 2
            assert result.tokens == reference.generate(turn).tokens
        self.__class__.turns = turns

    def test_after_a_restart_a_turn_is_an_exact_hit(self, engines, system_prompts):
        from edgesync_engines.config import EdgeSyncConfig
        from edgesync_engines.request.router import EdgeSync

        reference, slots, store, cfg = engines
        turns = getattr(self.__class__, "turns", None) or self.conversations(system_prompts)
        slots.idle.wait_idle(60)
        slots.close()
        again = EdgeSync(config=EdgeSyncConfig(**cfg, slots=2, store_path=store, jobs=False))
        try:
            result = again.generate(turns[0])
            assert result.hit == "exact" and result.tokens_reused == result.prompt_tokens - 1
            assert result.tokens == reference.generate(turns[0]).tokens
        finally:
            again.close()

    def test_closing_one_stream_midway_leaves_the_other_answer_identical(self, engines, system_prompts):
        from edgesync_engines.config import EdgeSyncConfig
        from edgesync_engines.request.router import EdgeSync

        reference, _, _, cfg = engines
        convs = self.conversations(system_prompts)
        expected = reference.generate(convs[1], max_tokens=48).tokens
        with EdgeSync(store=False, config=EdgeSyncConfig(**cfg, slots=2)) as es:
            other: list = []
            stream = es.generate(convs[0], max_tokens=48, stream=True)
            pieces = iter(stream)
            next(pieces)
            t = threading.Thread(target=lambda: other.append(es.generate(convs[1], max_tokens=48)))
            t.start()
            for _ in range(3):
                next(pieces)
            stream.close()
            t.join()
            assert stream.result.finish_reason == "cancelled"
            assert other[0].tokens == expected

    def test_close_waits_for_another_threads_stream(self, engines, system_prompts):
        from edgesync_engines.config import EdgeSyncConfig
        from edgesync_engines.request.router import EdgeSync

        reference, _, _, cfg = engines
        conv = self.conversations(system_prompts)[0]
        es = EdgeSync(store=False, config=EdgeSyncConfig(**cfg, slots=2))
        started, ended, results = threading.Event(), threading.Event(), []

        def reader() -> None:
            stream = es.generate(conv, stream=True)
            pieces = iter(stream)
            next(pieces)
            started.set()
            time.sleep(0.5)  # the main thread calls close() meanwhile
            for _ in pieces:
                pass
            results.append(stream.result)
            ended.set()

        t = threading.Thread(target=reader)
        t.start()
        assert started.wait(60)
        es.close()
        assert ended.is_set()  # close() returned only once the stream had ended
        t.join()
        assert results[0].tokens == reference.generate(conv).tokens
