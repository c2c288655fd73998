"""``edgesync serve --slots``: one worker answering several conversations at once in one llama.cpp
context (the real server, the real SmolLM2, idle-time storing on). Answers equal the uncached
ones, each conversation's next turn continues its own slot, ``/metrics`` counts per slot and the
usage stays exact; several workers of one slot each still serve. Figures come from the server's
answers and ``/metrics``, never from timing."""

from __future__ import annotations

import json
import threading
import urllib.request

import openai
import pytest

from tests.serve_process import ServeProcess

pytestmark = [pytest.mark.model, pytest.mark.server]

QUESTIONS = ("Explain how a rainbow forms.", "Give me three tips for learning a language.")
TOKENS = 40


def _metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
        rows = [line.rsplit(" ", 1) for line in r.read().decode().splitlines() if line and line[0] != "#"]
    return {name: float(value) for name, value in rows}


def _ask_together(client, conversations: list[list[dict]]) -> list:
    """Each conversation streamed from its own thread, all at once; the (text, usage, extra) of each."""
    out: list = [None] * len(conversations)

    def ask(i: int) -> None:
        stream = client.chat.completions.create(model="any", messages=conversations[i], max_tokens=TOKENS,
                                                temperature=0, stream=True, stream_options={"include_usage": True})
        text, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        out[i] = ("".join(text), usage)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(conversations))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServeProcess(tmp_path_factory.mktemp("slots-store"), "--workers", "1", "--slots", "2",
                      env={"EDGESYNC_IDLE_STORE": ""}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_two_conversations_at_once_answer_as_uncached_and_count_per_slot(server, client, reference,
                                                                           system_prompts):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10) as r:
        assert json.loads(r.read())["slots"] == 2
    assert "1 worker x" in server.stderr() and "2 slots each" in server.stderr()
    convs = [[{"role": "system", "content": system_prompts[i]}, {"role": "user", "content": q}]
             for i, q in enumerate(QUESTIONS)]
    answers = _ask_together(client, convs)
    for conv, (text, _) in zip(convs, answers):
        assert text == reference.generate(conv, max_tokens=TOKENS).text
    m = _metrics(server)
    assert m["edgesync_slots"] == 2
    assert m['edgesync_slot_requests_total{slot="0",worker="0"}'] == 1
    assert m['edgesync_slot_requests_total{slot="1",worker="0"}'] == 1
    prompt = sum(usage.prompt_tokens for _, usage in answers)
    assert m["edgesync_prompt_tokens_total"] == prompt == sum(
        m[f'edgesync_slot_tokens_total{{kind="prompt",slot="{s}",worker="0"}}'] for s in (0, 1))

    # the next turn of each continues its own slot: only the new message is prefilled
    turns = [conv + [{"role": "assistant", "content": text}, {"role": "user", "content": "Say more."}]
             for conv, (text, _) in zip(convs, answers)]
    live = m["edgesync_live_prefix_requests_total"]
    second = _ask_together(client, turns)
    for turn, (text, usage), (_, first_usage) in zip(turns, second, answers):
        assert text == reference.generate(turn, max_tokens=TOKENS).text
        assert usage.prompt_tokens_details.cached_tokens >= first_usage.prompt_tokens - 1
    m = _metrics(server)
    assert m["edgesync_live_prefix_requests_total"] == live + 2
    assert m["edgesync_cached_prompt_tokens_total"] == sum(
        usage.prompt_tokens_details.cached_tokens for _, usage in answers + second)


def test_two_workers_of_one_slot_each_still_serve(tmp_path, reference, system_prompts):
    with ServeProcess(tmp_path / "store", "--workers", "2", "--slots", "1") as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        convs = [[{"role": "system", "content": system_prompts[i + 2]}, {"role": "user", "content": q}]
                 for i, q in enumerate(QUESTIONS)]
        answers = _ask_together(c, convs)
        with urllib.request.urlopen(f"http://127.0.0.1:{s.port}/health", timeout=10) as r:
            health = json.loads(r.read())
    assert health["workers"] == 2 and health["slots"] == 2
    assert "2 workers sharing" in s.stderr()
    for conv, (text, _) in zip(convs, answers):
        assert text == reference.generate(conv, max_tokens=TOKENS).text
