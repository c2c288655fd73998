"""Prefix-aware routing of ``edgesync serve``'s worker pool (``server/routing.py``) and the pool's
bookkeeping of live contexts and idle-time counters, without worker processes: a job goes to the
worker whose live conversation begins its prompt, unless that worker is busy and another is
idle; with no such worker, to the least loaded one."""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import random

import pytest

from edgesync_engines.server.pool import ROOM_MARGIN_TOKENS, WorkerPool
from edgesync_engines.server.routing import (
    MIN_PREFIX_CHARS,
    choose_worker,
    common_prefix_chars,
    context_text,
    prefix_score,
    prompt_text,
)
from edgesync_engines.server.worker import IDLE_FIELDS, CancelBoard, idle_counters

SYSTEM = {"role": "system", "content": "You are a helpful assistant who answers about the shop's opening hours. " * 3}


def _turn(question: str, history: list[dict] | None = None) -> list[dict]:
    return [SYSTEM, *(history or []), {"role": "user", "content": question}]


def test_without_a_prefix_the_least_loaded_worker_gets_the_job():
    assert choose_worker([0, 0, 0], [0, 0, 0]) == (0, False)
    assert choose_worker([2, 1, 1], [0, 0, 0]) == (1, False)
    assert choose_worker([3], [500]) == (0, False)  # one worker: nothing to choose
    # equally loaded: the one given a job longest ago, so that a new conversation does not
    # take the live sequence of the one before it
    assert choose_worker([0, 0, 0], [0, 0, 0], last_used=[5, 2, 7]) == (1, False)
    assert choose_worker([1, 0, 0], [0, 0, 0], last_used=[0, 9, 8]) == (2, False)


def test_the_longest_prefix_wins_and_ties_go_to_the_less_loaded_then_the_lower_index():
    assert choose_worker([0, 0, 0], [0, 300, 200]) == (1, True)
    assert choose_worker([0, 0, 0], [300, 300, 0]) == (0, True)
    assert choose_worker([2, 1, 3], [300, 300, 100]) == (1, True)  # all busy: the best score
    assert choose_worker([1, 2], [0, 200]) == (1, True)  # busy, no worker idle, one job more at most
    assert choose_worker([1, 4], [0, 200]) == (0, False)  # not onto a worker 3 jobs deeper


def test_a_busy_best_worker_gives_way_to_an_idle_one():
    assert choose_worker([1, 0, 0], [400, 0, 150]) == (2, True)  # the idle one with the best score
    assert choose_worker([1, 0, 0], [400, 0, 0]) == (1, False)  # no idle one matches: the lowest index
    assert choose_worker([1, 0, 0], [400, 150, 150]) == (1, True)


def test_choose_worker_refuses_mismatched_inputs():
    with pytest.raises(ValueError):
        choose_worker([0, 0], [0])
    with pytest.raises(ValueError):
        choose_worker([], [])


def test_common_prefix_chars_agrees_with_a_character_walk():
    rng = random.Random(7)
    for _ in range(300):
        a = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 40)))
        b = a[:rng.randrange(0, len(a) + 1)] + "".join(rng.choice("ab") for _ in range(rng.randrange(0, 10)))
        walk = 0
        while walk < min(len(a), len(b)) and a[walk] == b[walk]:
            walk += 1
        assert common_prefix_chars(a, b) == common_prefix_chars(b, a) == walk, (a, b)


def test_the_next_turn_begins_with_the_last_turn_and_its_answer():
    first = _turn("When do you open on Sunday?")
    context = context_text(first, "At ten.")
    second = _turn("And on Monday?", [first[-1], {"role": "assistant", "content": "At ten."}])
    assert prefix_score(prompt_text(second), context) == len(context) - len("chat\x02")  # all of it
    # another conversation shares the system prompt only: it scores that, not the whole context
    other = prompt_text(_turn("Do you sell bread?"))
    assert MIN_PREFIX_CHARS <= prefix_score(other, context) < len(context) - 5
    # a different answer departs at the answer
    assert prefix_score(prompt_text(second), context_text(first, "At nine.")) < len(context) - 5


def test_short_or_cross_kind_prefixes_do_not_count():
    short = [{"role": "user", "content": "hi"}]
    assert prefix_score(prompt_text(short), context_text(short, "hello")) == 0  # under MIN_PREFIX_CHARS
    text = "x" * 400
    assert prefix_score(prompt_text(text + " more"), context_text(text, "!")) == 400
    # a prompt string never continues a chat context, nor the other way round
    chat = [{"role": "user", "content": text}]
    assert prefix_score(prompt_text(text), context_text(chat, "a")) == 0
    assert prefix_score(prompt_text(chat), context_text(text, "a")) == 0
    assert prefix_score(prompt_text(chat), None) == 0


class _Pool:
    """A :class:`WorkerPool` of ``n`` workers whose request queues are plain queues: jobs are
    routed and answered by hand."""

    def __init__(self, n: int) -> None:
        self.pool = WorkerPool({}, n)
        for worker in self.pool._workers:
            worker.requests = queue.Queue()
        self.open: dict[int, tuple] = {}  # job id -> (worker, generator, first-message task)
        self.rooms: list[tuple[int, int]] = []  # (worker index, tokens) of each room hint, in order
        self.prepares: list[tuple[int, list]] = []  # (worker index, messages) of each prepare, in order

    async def submit(self, prompt) -> int:
        """Submit a job; returns the index of the worker it went to."""
        gen = self.pool.submit({"prompt": prompt})
        task = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0)
        self.take_rooms()
        for worker in self.pool._workers:
            try:
                job = worker.requests.get_nowait()
            except queue.Empty:
                continue
            self.open[job["id"]] = (worker, gen, task)
            return worker.index
        raise AssertionError("the job went nowhere")

    def take_rooms(self) -> list[tuple[int, int]]:
        """Move the room hints (and prepare messages, to :attr:`prepares`) waiting in the workers'
        queues to :attr:`rooms`; returns the new room hints."""
        new = []
        for worker in self.pool._workers:
            while not worker.requests.empty() and worker.requests.queue[0].get("type") in ("room", "prepare"):
                msg = worker.requests.get_nowait()
                if msg["type"] == "room":
                    new.append((worker.index, msg["tokens"]))
                else:
                    self.prepares.append((worker.index, msg["prompt"]))
        self.rooms += new
        return new

    async def finish(self, index: int, msg: dict) -> dict:
        """Answer the oldest open job of worker ``index`` with ``msg`` (its type and fields)."""
        job_id = min(j for j, (worker, _, _) in self.open.items() if worker.index == index)
        worker, gen, task = self.open.pop(job_id)
        self.pool._deliver(worker, {"id": job_id, **msg})
        got = await task
        await gen.aclose()
        return got


def _done(answer: str, idle: dict | None = None, pending: bool = False) -> dict:
    return {"type": "done", "text": answer, "finish_reason": "stop",
            "result": {"idle": {**dict.fromkeys(IDLE_FIELDS, 0), **(idle or {})}, "idle_pending": pending}}


def test_the_pool_sends_each_conversation_back_to_its_worker():
    async def scenario():
        p = _Pool(2)
        a1, b1 = _turn("When do you open on Sunday?"), _turn("Do you deliver to the old town on weekdays?")
        assert await p.submit(a1) == 0
        assert await p.submit(b1) == 1  # worker 0 is busy
        assert (await p.finish(0, _done("At ten.")))["type"] == "done"
        await p.finish(1, _done("Yes, every weekday."))
        a2 = _turn("And on Monday?", [a1[-1], {"role": "assistant", "content": "At ten."}])
        b2 = _turn("How much is it?", [b1[-1], {"role": "assistant", "content": "Yes, every weekday."}])
        assert await p.submit(b2) == 1  # by prefix, though worker 0 is as free and comes first
        assert await p.submit(a2) == 0
        assert p.pool.routed_by_prefix() == 2
        await p.finish(1, _done("Five euros."))
        # worker 0 is busy with a2; its conversation's next turn goes to the idle worker 1
        a3 = _turn("Thanks!", [*a2[1:], {"role": "assistant", "content": "At nine."}])
        assert await p.submit(a3) == 1
        assert p.pool.routed_by_prefix() == 3  # worker 1 shares the system prompt
        await p.finish(0, {"type": "cancelled"})
        assert p.pool._workers[0].context is None  # a cancelled job leaves nothing known live
        await p.finish(1, {"type": "error", "status": 500, "message": "engine failed"})
        assert p.pool._workers[1].context is None
        assert p.pool.queued() == 0 and p.pool._prompts == {}
        assert p.pool.cancelled() == 1

    asyncio.run(scenario())


def test_idle_counters_are_summed_over_workers_and_restarts():
    async def scenario():
        p = _Pool(2)
        await p.submit("first prompt")
        await p.submit("second prompt")
        await p.finish(0, _done("x", {"jobs": 1, "tokens_prefilled": 100}))
        await p.finish(1, _done("y", {"jobs": 2, "tokens_prefilled": 50, "tokens_wasted": 5}))
        # a report between jobs (the idle-time job went on after the answer)
        with p.pool._lock:
            p.pool._count_idle(p.pool._workers[0],
                               {**dict.fromkeys(IDLE_FIELDS, 0), "jobs": 1, "tokens_prefilled": 164})
        totals = p.pool.idle_totals()
        assert totals["jobs"] == 3 and totals["tokens_prefilled"] == 214 and totals["tokens_wasted"] == 5
        # a restarted worker counts from 0 again: nothing is lost or subtracted
        p.pool._workers[1].idle = {}
        await p.submit("third prompt")
        await p.finish(0, _done("z", {"jobs": 1, "tokens_prefilled": 164}))  # the least loaded: worker 0
        await p.submit("fourth prompt")
        await p.submit("fifth prompt")
        await p.finish(1, _done("w", {"jobs": 1, "tokens_prefilled": 10}))
        totals = p.pool.idle_totals()
        assert totals["jobs"] == 4 and totals["tokens_prefilled"] == 224

    asyncio.run(scenario())


def test_idle_counters_of_an_engine():
    class Engine:
        class idle:  # noqa: N801 - stands for EdgeSync.idle
            from edgesync_engines.request.idle import IdleStats

            stats = IdleStats(jobs=2, tokens_prefilled=128)

    assert idle_counters(Engine()) == {**dict.fromkeys(IDLE_FIELDS, 0), "jobs": 2, "tokens_prefilled": 128}
    assert idle_counters(object()) == dict.fromkeys(IDLE_FIELDS, 0)


def test_among_busy_workers_one_whose_job_is_decoding_gets_the_job():
    """Equally loaded, no prefix: not the worker whose job has its prefill ahead."""
    assert choose_worker([1, 1], [0, 0], last_used=[1, 2], unstarted=[4000, 0]) == (1, False)
    assert choose_worker([1, 1], [0, 0], last_used=[2, 1], unstarted=[0, 0]) == (1, False)  # then longest ago
    assert choose_worker([1, 2], [0, 0], unstarted=[4000, 0]) == (0, False)  # loads come first


def test_the_pool_routes_by_the_jobs_that_have_not_started():
    """A worker's job counts as not started until its first message (a stream's piece, or the
    ``started`` a whole answer's worker sends, which the pool keeps to itself)."""
    async def scenario():
        p = _Pool(2)
        long_prompt, short = _turn("Summarise this: " + "words " * 600), _turn("Hi")
        assert await p.submit(long_prompt) == 0
        assert await p.submit(_turn("Tell me a story.")) == 1
        worker0, worker1 = p.pool._workers
        job1 = next(j for j, (worker, _, _) in p.open.items() if worker is worker1)
        p.pool._deliver(worker1, {"id": job1, "type": "started"})  # worker 1 decodes; worker 0 prefills
        assert job1 in worker1.started and not worker0.started
        assert await p.submit(short) == 1
        await p.finish(0, _done("A summary."))
        assert (await p.finish(1, _done("Once upon a time.")))["type"] == "done"  # "started" was not passed on
        await p.finish(1, _done("Hello!"))
        assert not worker0.started and not worker1.started and p.pool.queued() == 0

    asyncio.run(scenario())


def test_cancel_all_marks_every_outstanding_job_on_its_workers_board():
    """At the end of the shutdown grace the app cancels every job at once (``pool.cancel_all``):
    each worker's board then holds its running and its queued jobs, and no other id."""
    async def scenario():
        p = _Pool(2)
        for worker in p.pool._workers:
            worker.cancel = CancelBoard(multiprocessing.get_context("spawn"))
        routed = [await p.submit(_turn(q)) for q in ("One?", "Two?", "Three?")]
        p.pool.cancel_all()
        for job_id, (worker, _, _) in p.open.items():
            assert worker.cancel.cancelled(job_id)
            assert not any(other.cancel.cancelled(job_id) for other in p.pool._workers if other is not worker)
        assert sorted(routed) == [0, 0, 1] and len(p.open) == 3
        for index in routed:
            await p.finish(index, _done("-"))

    asyncio.run(scenario())


def test_an_answer_tells_the_other_workers_to_make_room_for_its_conversation():
    """A worker's answered conversation may come back to another worker (its own busy), which
    then injects it: the others are told its length (prompt and answer tokens plus the
    margin) once, when it is the longest they have heard of, and a restarted worker again."""
    def done(prompt_tokens: int, completion_tokens: int) -> dict:
        msg = _done("-")
        msg["result"].update(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
        return msg

    async def scenario():
        p = _Pool(3)
        a = await p.submit(_turn("One?"))
        await p.finish(a, done(300, 120))
        assert p.take_rooms() == [(i, 420 + ROOM_MARGIN_TOKENS) for i in range(3) if i != a]
        b = await p.submit(_turn("Two?"))
        await p.finish(b, done(100, 20))  # shorter than what the others heard of: no hint
        c = await p.submit(_turn("Three?"))
        await p.finish(c, {"type": "cancelled"})  # nothing answered
        assert p.take_rooms() == []
        d = await p.submit(_turn("Four?"))
        await p.finish(d, done(900, 50))
        assert p.take_rooms() == [(i, 950 + ROOM_MARGIN_TOKENS) for i in range(3) if i != d]
        for worker in p.pool._workers:
            worker.room = 0  # what a restart sets: the new process has heard nothing
        e = await p.submit(_turn("Five?"))
        await p.finish(e, done(400, 10))
        assert p.take_rooms() == [(i, 410 + ROOM_MARGIN_TOKENS) for i in range(3) if i != e]

    asyncio.run(scenario())


def test_a_conversation_still_being_stored_moves_to_another_worker_when_a_new_one_takes_its_own():
    """Two conversations, one per worker. A new one takes the worker given a job longest ago
    (worker 0): it still says its idle-time work is pending, so its conversation is handed to
    worker 1 (a ``prepare`` with the messages and the answer), whose next turn then goes there
    by prefix. Once a worker says its work is done, a new conversation takes it and nothing is
    handed over (its history is in the store)."""
    async def scenario():
        p = _Pool(2)
        a1, b1 = _turn("When do you open on Sunday?"), _turn("Do you deliver to the old town on weekdays?")
        assert await p.submit(a1) == 0
        assert await p.submit(b1) == 1
        await p.finish(0, _done("At ten.", pending=True))
        await p.finish(1, _done("Yes.", pending=True))
        p.pool._deliver(p.pool._workers[1], {"type": "idle", "stats": {}, "pending": False})
        assert await p.submit(_turn("Can I pay by card?")) == 0
        history = [*a1, {"role": "assistant", "content": "At ten."}]
        assert p.prepares == [(1, history)] and p.pool.handed_over() == 1
        a2 = _turn("And on Monday?", [a1[-1], {"role": "assistant", "content": "At ten."}])
        assert await p.submit(a2) == 1
        await p.finish(0, _done("Yes, any card.", pending=False))
        await p.finish(1, _done("At nine.", pending=True))
        p.pool._deliver(p.pool._workers[1], {"type": "idle", "stats": {}, "pending": False})
        assert await p.submit(_turn("Is there parking?")) == 0  # worker 0 was given a job longest ago
        assert len(p.prepares) == 1 and p.pool.handed_over() == 1  # its work was done: nothing handed over
        await p.finish(0, _done("Yes."))

    asyncio.run(scenario())
