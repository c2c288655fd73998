"""The request path end to end on the real model: hit kinds, prefill counted by llama.cpp itself,
token-identical output, corrupt and foreign fragments refused, two processes on one store.

Prompts are built from ../shared/workloads: system_prompts.json (the 8 app prompts, 315-339
tokens each) and qqp_clusters.jsonl questions via the seed workload (Random(0), README recipe).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
from edgesync_engines.adapters.protocol import ContextOverflowError
from edgesync_engines.request.result import READ_AHEAD
from edgesync_engines.request.router import EdgeSync
from edgesync_store.core import codec
from edgesync_store.core.store import FragmentStore
from edgesync_store.schema import MIN_SPAN, common_prefix_len

pytestmark = [pytest.mark.model]

TESTS = Path(__file__).parent
ESSAY = "Write a long, detailed essay about how to study well for exams, with many examples."


def chat(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def run_proc(script: str, *args: str, timeout: float = 300) -> list[dict]:
    """Run a helper script in a new interpreter; return its JSON lines."""
    proc = subprocess.run(
        [sys.executable, str(TESTS / script), *args], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def llama_prefilled(row: dict) -> int:
    """Prompt tokens llama.cpp evaluated, from its own perf counters (src/llama-context.cpp):
    n_p_eval counts multi-token batches (never exactly 1, and reports 0 as 1), n_eval counts
    single-token evaluations; decoding evaluates every generated token but the last one when
    max_tokens stopped the request."""
    n_p_eval = row["perf"]["n_p_eval"] if row["perf"]["n_p_eval"] > 1 else 0
    decode_evals = len(row["tokens"]) - 1
    return n_p_eval + row["perf"]["n_eval"] - decode_evals


@pytest.fixture
def store(tmp_path):
    s = FragmentStore(tmp_path / "store")
    yield s
    s.close()


@pytest.fixture
def uncached(adapter):
    return EdgeSync(adapter, store=False)


@pytest.fixture
def cached(adapter, store):
    es = EdgeSync(adapter, store=store)
    yield es
    es.close()  # stops its store jobs; the adapter and store it was given stay open


def test_exact_hit_in_a_new_process_skips_prefill(tmp_path, system_prompts):
    """Process A misses; process B (new interpreter, same store) is exact, with at
    most one prompt token evaluated by llama.cpp, and 32 identical greedy tokens."""
    store_dir = tmp_path / "store"
    requests = tmp_path / "requests.json"
    requests.write_text(json.dumps([chat(system_prompts[0], ESSAY)]))
    (a,) = run_proc("proc_request.py", str(store_dir), str(requests), "32")
    (b,) = run_proc("proc_request.py", str(store_dir), str(requests), "32")
    assert a["prompt_tokens"] >= 300
    assert a["hit"] == "miss" and a["tokens_reused"] == 0
    assert llama_prefilled(a) == a["prompt_tokens"]
    assert a["fragments_written"] >= 2
    assert b["hit"] == "exact"
    assert b["tokens_reused"] == b["prompt_tokens"] - 1
    assert llama_prefilled(b) <= 1
    assert len(a["tokens"]) == 32
    assert b["tokens"] == a["tokens"]
    assert b["bytes_read"] > 0


def test_shared_prefix_is_partial_and_identical(cached, uncached, system_prompts):
    """A prompt sharing its first K >= 200 tokens with a stored one."""
    first = chat(system_prompts[1], "How do I get from the airport to the city centre cheaply?")
    second = chat(system_prompts[1], "What should I pack for a week of hiking in the rain?")
    stored = cached.generate(first, max_tokens=16)
    assert stored.hit == "miss" and stored.fragments_written >= 2
    k = common_prefix_len(cached.prompt_tokens(first), cached.prompt_tokens(second))
    assert k >= 200
    result = cached.generate(second, max_tokens=24)
    reference = uncached.generate(second, max_tokens=24)
    assert result.hit == "partial"
    # the adapter's injection point: a prefill after it computes every token as an uncached one
    assert result.tokens_reused == cached.adapter.usable_prefix(k, result.prompt_tokens) > k - 24
    assert result.tokens_prefilled == result.prompt_tokens - result.tokens_reused
    assert result.tokens == reference.tokens
    assert len(result.tokens) > 0


def test_unrelated_prompt_misses_and_matches_uncached(cached, uncached, system_prompts):
    """A prompt that shares nothing with the stored ones misses and answers as an uncached run."""
    cached.generate(chat(system_prompts[2], "How do I save money on groceries?"), max_tokens=8)
    other = chat(system_prompts[5], "How do I prepare for a job interview at a bank?")
    result = cached.generate(other, max_tokens=24)
    assert result.hit == "miss" and result.tokens_reused == 0 and result.bytes_read == 0
    assert result.tokens == uncached.generate(other, max_tokens=24).tokens


def _raw_fragments_db(store_dir: Path):
    env = lmdb.open(str(store_dir), max_dbs=16, subdir=True, map_size=1 << 30)
    return env, env.open_db(b"fragments")


def _chunk_key(store: FragmentStore, token_start: int) -> bytes:
    for key, head, _life, _n in store.iterate():
        if head.token_start == token_start:
            return key
    raise AssertionError(f"no fragment starts at {token_start}")


def _rewrite(store: FragmentStore, key: bytes, mutate) -> None:
    """Fault injection (a fake for a corrupt page or a tampered file): rewrite one stored blob
    in place through a second LMDB handle."""
    env, db = _raw_fragments_db(store.path)
    with env.begin(write=True) as txn:
        blob = bytearray(txn.get(key, db=db))
        txn.put(key, bytes(mutate(blob)), db=db)
    env.close()


def _flip_payload_byte(blob: bytearray) -> bytearray:
    blob[len(blob) - 100] ^= 0x40
    return blob


def _wrong_content_hash(blob: bytearray) -> bytearray:
    """Change the header's content_hash and recompute the head's xxh3, so that only the hash is
    wrong (layout: codec.py docstring, format 2)."""
    import struct

    import xxhash

    _magic, _version, header_len = struct.unpack_from("<4sHI", blob, 0)
    header = json.loads(bytes(blob[10 : 10 + header_len]))
    header["content_hash"] = "0" * 64
    new_header = json.dumps(header, separators=(",", ":")).encode()
    assert len(new_header) == header_len
    blob[10 : 10 + header_len] = new_header
    span = header["token_end"] - header["token_start"]
    sum_at = 10 + header_len + 4 * span + 4 * header["embedding_dim"]
    struct.pack_into("<Q", blob, sum_at, xxhash.xxh3_64_intdigest(bytes(blob[:sum_at])))
    return blob


PUSH_UPS = "How many push-ups should a beginner do each day?"


@pytest.fixture(scope="module")
def push_ups_reference(adapter, system_prompts) -> list[int]:
    """The uncached answer (16 tokens) of the corrupt-fragment tests' prompt, computed once."""
    tokens = EdgeSync(adapter, store=False).generate(chat(system_prompts[3], PUSH_UPS), max_tokens=16).tokens
    adapter.clear_kv_cache()  # the tests' first request must not find this prompt live in the engine
    return tokens


@pytest.mark.parametrize(
    "mutate", [_flip_payload_byte, _wrong_content_hash], ids=["flipped-byte", "wrong-content-hash"]
)
def test_corrupt_fragment_is_refused_removed_and_prefilled(cached, push_ups_reference, store, system_prompts, mutate):
    """A bad stored value is refused on read, the request falls
    back to prefill with the right answer, and the bad entry is removed."""
    messages = chat(system_prompts[3], PUSH_UPS)
    first = cached.generate(messages, max_tokens=16)
    assert first.hit == "miss"
    bad = _chunk_key(store, 128)
    with pytest.raises(codec.CodecError):
        codec.decode(_raw_blob_after(store, bad, mutate))
    _rewrite(store, bad, mutate)
    cached.fragment_cache.clear()  # as in a process that has no RAM copy: the store is read
    cached.adapter.clear_kv_cache()  # nor the prompt live in its engine
    again = cached.generate(messages, max_tokens=16)
    assert again.tokens == push_ups_reference
    assert again.tokens_reused == 128  # the intact first chunk still serves
    assert again.hit == "partial"
    assert store.stats().dropped_corrupt == 1
    # the bad entry was removed, then the request stored its chunk anew from live KV
    fresh = cached.generate(messages, max_tokens=16)
    assert fresh.hit == "exact" and fresh.tokens == first.tokens


def _raw_blob_after(store: FragmentStore, key: bytes, mutate) -> bytes:
    return bytes(mutate(bytearray(store.get_blob(key))))


def test_prompt_over_the_context_raises(cached, data_dir):
    """A chat session's pasted turn longer than the context (chat_sessions.jsonl
    holds turns over 20,000 characters) raises ContextOverflowError naming both numbers."""
    longest = max(
        (
            turn
            for line in (data_dir / "chat_sessions.jsonl").read_text().splitlines()
            for turn in json.loads(line)["turns"]
        ),
        key=len,
    )
    assert len(longest) > 20_000
    with pytest.raises(ContextOverflowError) as info:
        cached.generate([{"role": "user", "content": longest}], max_tokens=64)
    err = info.value
    assert err.prompt_tokens > cached.adapter.n_ctx
    assert str(err.prompt_tokens) in str(err) and "64" in str(err) and str(cached.adapter.n_ctx) in str(err)
    assert cached.store.stats().fragments == 0


def test_fragment_of_another_flash_attention_setting_is_never_injected(tmp_path, cached, uncached, system_prompts):
    """Fragments written with flash attention on are not used with it off."""
    messages = chat(system_prompts[4], "My laptop will not connect to the office printer, what now?")
    flash = LlamaCppAdapter(flash_attn=True)
    try:
        assert flash.namespace != cached.namespace
        writer = EdgeSync(flash, store=cached.store)
        written = writer.generate(messages, max_tokens=8)
        assert written.fragments_written >= 2
        assert writer.generate(messages, max_tokens=8).hit == "exact"
    finally:
        flash.close()
    result = cached.generate(messages, max_tokens=16)
    assert result.hit == "miss" and result.tokens_reused == 0
    assert result.tokens == uncached.generate(messages, max_tokens=16).tokens


def store_relabelled(cached, uncached, messages, **change) -> tuple[list[int], list]:
    """Store the prompt's real KV (two fragments, split at 128) under the adapter's namespace
    with ``change`` applied: the prompt's tokens and the fragments stored."""
    adapter = uncached.adapter
    tokens = cached.prompt_tokens(messages)
    uncached.generate(messages, max_tokens=4)  # leaves the prompt's KV in the live sequence
    other_ns = dataclasses.replace(adapter.namespace, **change)
    foreign = [dataclasses.replace(f, namespace=other_ns, content_hash="")
               for f in adapter.extract_fragments(tokens, [(0, 128), (128, len(tokens))])]
    assert cached.store.put_many(foreign) == 2
    return tokens, foreign


def test_fragment_of_another_model_file_is_never_injected(cached, uncached, adapter, system_prompts):
    """The same tokens' KV relabelled as another model file's (a namespace that
    differs only in the model fingerprint) is not found by the walk and is refused by the
    adapter if handed over directly."""
    messages = chat(system_prompts[6], "What is the difference between affect and effect?")
    tokens, foreign = store_relabelled(cached, uncached, messages, model_fingerprint="f" * 64)
    assert cached.store.prefix_walk(adapter.namespace, tokens).matched_tokens == 0
    with pytest.raises(ValueError, match="namespace"):
        adapter.inject_fragment(foreign, len(tokens) - 1, tokens)
    result = cached.generate(messages, max_tokens=16)
    assert result.hit == "miss"
    assert result.tokens == uncached.generate(messages, max_tokens=16).tokens


def test_fragment_of_other_kernels_is_never_injected(cached, uncached, adapter, system_prompts):
    """KV that the same model and build computed with other kernels (another architecture,
    NEON against AVX2, or an AVX-512 build; ``make arm64-check`` runs the real thing) is a
    miss, and the answer is the uncached one. This machine has one kernel set in the normal
    suite, so the other machine's fragments are this one's relabelled with another kernel
    digest: a stand-in for a fault the suite cannot provoke."""
    messages = chat(system_prompts[7], "How do I keep basil alive on a windowsill?")
    tokens, foreign = store_relabelled(cached, uncached, messages, kernels="0" * 64)
    assert cached.store.prefix_walk(foreign[0].namespace, tokens).matched_tokens == len(tokens)
    assert cached.store.prefix_walk(adapter.namespace, tokens).matched_tokens == 0
    with pytest.raises(ValueError, match="namespace"):
        adapter.inject_fragment(foreign, len(tokens) - 1, tokens)
    result = cached.generate(messages, max_tokens=16)
    assert result.hit == "miss" and result.tokens_reused == 0
    assert result.tokens == uncached.generate(messages, max_tokens=16).tokens


def test_two_processes_share_one_store_concurrently(tmp_path):
    """Two processes answer seed requests on one store for 30 s (override with
    EDGESYNC_CONCURRENCY_SECONDS); no errors, no output differing from uncached runs, every
    fragment readable afterwards."""
    seconds = os.environ.get("EDGESYNC_CONCURRENCY_SECONDS", "30")
    store_dir = tmp_path / "shared-store"
    procs = [
        subprocess.Popen(
            [sys.executable, str(TESTS / "proc_concurrent.py"), str(store_dir), str(w), seconds],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            # one llama.cpp thread each: two spinning 2-thread pools on 2 cores crawl
            env={**os.environ, "EDGESYNC_THREADS": "1"},
        )
        for w in (0, 1)
    ]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=float(seconds) + 240)
        assert p.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for r in reports:
        assert r["requests"] >= 4
        assert r["mismatches"] == []
        assert r["dropped_corrupt"] == 0
    assert sum(r["hits"].get("partial", 0) + r["hits"].get("exact", 0) for r in reports) > 0
    with FragmentStore(store_dir) as store:
        keys = [key for key, head, _l, _n in store.iterate()]
        assert len(keys) > 0
        for key in keys:
            frag = store.get(key)
            assert frag is not None and frag.key() == key
        assert store.stats().dropped_corrupt == 0


def test_two_threads_never_drive_the_engine_at_once(cached, uncached, system_prompts):
    """One lock per Llama: concurrent requests from two threads give the answers each would
    get alone."""
    import threading

    prompts = [chat(system_prompts[7], q) for q in ("Who painted the Mona Lisa?", "What is the largest planet?")]
    expected = [uncached.generate(p, max_tokens=12).tokens for p in prompts]
    got: dict[int, list] = {}
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            got[i] = [cached.generate(prompts[i], max_tokens=12).tokens for _ in range(2)]
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    for i in (0, 1):
        assert got[i] == [expected[i], expected[i]]


def test_abandoned_stream_releases_the_engine_on_close(cached, system_prompts):
    import threading

    messages = chat(system_prompts[0], "Explain photosynthesis step by step in detail.")
    stream = cached.generate(messages, max_tokens=64, stream=True)
    next(stream)
    stream.close()
    done = threading.Event()
    threading.Thread(target=lambda: (cached.generate(messages, max_tokens=2), done.set()), daemon=True).start()
    assert done.wait(timeout=120), "another thread still waits for the engine"


@pytest.mark.parametrize("prompt", ["", "   ", [], [{"role": "user", "content": "  "}]])
def test_blank_prompts_are_refused(cached, prompt):
    with pytest.raises(ValueError, match="prompt"):
        cached.generate(prompt, max_tokens=4)


@pytest.mark.parametrize(("name", "value"), [
    ("max_tokens", "8"), ("max_tokens", 2.5), ("max_tokens", True), ("max_tokens", 0),
    ("temperature", "hot"), ("temperature", True), ("temperature", float("nan")), ("temperature", -0.5),
    ("top_p", "x"), ("top_p", True), ("top_p", 0), ("top_p", 1.5),
    ("seed", "x"), ("seed", True), ("seed", 1.5), ("seed", -1), ("seed", 2**32),
    ("stop", 5), ("stop", ["a", 5]), ("stop", {"a"}), ("stop", "\ud800"), ("stop", ["ok", "\udfff"]),
])
def test_bad_sampling_arguments_are_refused_by_name_before_any_engine_work(cached, system_prompts, name, value):
    """A badly typed or out-of-range argument (a bool is not a number here): generate() itself
    raises, streamed or not, a ValueError naming the argument and the value given; llama.cpp
    evaluates nothing and nothing is stored."""
    messages = chat(system_prompts[0], ESSAY)
    cached.adapter.reset_perf()
    before = cached.adapter.perf_counts()
    for stream in (False, True):
        with pytest.raises(ValueError, match=rf"^{name}(\[1\])?: must be .*, got ") as info:
            cached.generate(messages, stream=stream, **{"max_tokens": 4, name: value})
        assert repr(value[1] if isinstance(value, list) else value) in str(info.value)  # the bad value shown
    assert cached.adapter.perf_counts() == before
    assert cached.store.stats().fragments == 0


@pytest.mark.parametrize(("prompt", "named"), [
    ("abc\ud800", "prompt: must be valid Unicode text"),
    ([{"role": "user", "content": "abc\ud800"}], r"prompt: messages\[0\] content"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "\udfff why?"}],
     r"prompt: messages\[1\] content"),
])
def test_a_lone_surrogate_in_a_prompt_is_refused_by_name(cached, prompt, named):
    """Text UTF-8 cannot encode is a ValueError naming where it is, from every call that takes a
    prompt (with documents too), not a UnicodeEncodeError from the tokenizer."""
    for call in (lambda: cached.generate(prompt, max_tokens=4), lambda: cached.prompt_tokens(prompt),
                 lambda: cached.prepare(prompt),
                 lambda: cached.generate(prompt, documents=["A short document."], max_tokens=4)):
        with pytest.raises(ValueError, match=named):
            call()
    assert cached.store.stats().fragments == 0


def test_edge_values_of_the_sampling_arguments_are_accepted(uncached):
    """An int is a number (temperature 0, top_p 1), numpy integers are ints, seed 0, any number
    of stop strings (the HTTP server's limit of 4 is not the Python API's), any role."""
    import numpy as np

    prompt = "Name three colours."
    first = uncached.generate(prompt, max_tokens=1)
    assert len(first.tokens) == 1
    again = uncached.generate(prompt, max_tokens=np.int64(1), temperature=0, top_p=1, seed=0,
                              stop=("@@1", "@@2", "@@3", "@@4", "@@5"))
    assert again.tokens == first.tokens and again.finish_reason == "length"
    assert uncached.prompt_tokens([{"role": "tool", "content": "42"}, {"role": "user", "content": "Sum?"}])


@pytest.mark.parametrize(("documents", "named"), [
    (5, r"^documents: expected a list"),
    (["\ud800"], r"^documents\[0\]: the text must be valid Unicode text"),
    (["fine", {"text": "fine too", "title": "x\udfff"}], r"^documents\[1\]: the title must be valid Unicode"),
])
def test_bad_documents_are_refused_by_name(cached, documents, named):
    """Documents that are not a list, or hold text UTF-8 cannot encode: a ValueError naming
    the document, from generate() and add_documents(), nothing stored."""
    for call in (lambda: cached.generate("What do they say?", documents=documents, max_tokens=4),
                 lambda: cached.add_documents(documents)):
        with pytest.raises(ValueError, match=named):
            call()
    assert cached.store.stats().fragments == 0 and cached.list_documents() == []


def test_stream_must_be_a_bool(cached):
    with pytest.raises(ValueError, match=r"^stream: must be True or False, got 'yes'"):
        cached.generate("Hi there", stream="yes", max_tokens=2)


def test_a_call_from_the_thread_of_an_open_stream_is_refused_and_the_stream_stays_exact(cached, uncached,
                                                                                      system_prompts):
    """The engine's lock is re-entrant: a generate() between a stream's pieces, from the
    stream's own thread, would change the sequence the stream decodes (found by a new-user
    trial: the stream went on with garbage). It raises instead; the stream's answer equals an
    uncached run's, and once the stream is closed the engine serves again."""
    messages = chat(system_prompts[0], ESSAY)
    stream = cached.generate(messages, max_tokens=24, stream=True)
    pieces = [next(stream), next(stream)]
    for call in (lambda: cached.generate("Tell me about mountains in one line.", max_tokens=4),
                 lambda: cached.prepare(chat(system_prompts[1], "Hello")), lambda: cached.add_documents(["A doc."]),
                 lambda: cached.make_room(64)):
        with pytest.raises(RuntimeError, match="a stream of this thread still holds the engine"):
            call()
    pieces += list(stream)
    assert stream.result.tokens == uncached.generate(messages, max_tokens=24).tokens
    assert "".join(pieces) == stream.result.text
    other = cached.generate("Tell me about mountains in one line.", max_tokens=4)
    assert other.tokens == uncached.generate("Tell me about mountains in one line.", max_tokens=4).tokens


def test_a_stream_is_read_and_closed_on_one_thread_and_the_engine_is_not_closed_under_it(cached, uncached,
                                                                                         system_prompts):
    """Another thread reading or closing a running stream, or the stream's own thread closing
    the engine, raise RuntimeError (found by a new-user trial: the lock the stream holds could
    not be released by another thread and stayed held for good; closing the engine under the
    stream aborted the process). The stream goes on to the uncached answer, and afterwards
    another thread is served."""
    import threading

    messages = chat(system_prompts[0], ESSAY)
    stream = cached.generate(messages, max_tokens=24, stream=True)
    pieces = [next(stream)]
    with pytest.raises(RuntimeError, match="before closing the engine"):
        cached.close()
    errors, answers = [], []

    def other_thread():
        for call in (lambda: next(stream), stream.close):
            try:
                call()
            except RuntimeError as e:
                errors.append(str(e))

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert len(errors) == 2 and all("read by another thread" in e for e in errors)
    pieces += list(stream)
    assert stream.result.tokens == uncached.generate(messages, max_tokens=24).tokens
    assert "".join(pieces) == stream.result.text
    t = threading.Thread(target=lambda: answers.append(cached.generate("Hello there", max_tokens=4)))
    t.start()
    t.join(timeout=300)  # not a timing: a lock left held would block it for good
    assert len(answers) == 1 and answers[0].tokens == uncached.generate("Hello there", max_tokens=4).tokens


def test_async_for_reads_a_stream_on_a_thread_of_its_own(cached, uncached, system_prompts):
    """``async for`` (and Starlette's ``StreamingResponse``, which iterates an async iterable on
    the event loop rather than reading each piece on whichever thread-pool thread is free, where
    a piece read by another thread raises): the pieces make the uncached answer; leaving early
    stops decoding and gives the engine back to another thread."""
    import asyncio

    from starlette.responses import StreamingResponse

    messages = chat(system_prompts[0], ESSAY)
    expected = uncached.generate(messages, max_tokens=24)

    async def read_all():
        stream = cached.generate(messages, max_tokens=24, stream=True)
        return stream, [piece async for piece in stream]

    stream, pieces = asyncio.run(read_all())
    assert stream.result.tokens == expected.tokens and "".join(pieces) == stream.result.text == expected.text

    async def respond():
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        response = StreamingResponse(cached.generate(messages, max_tokens=24, stream=True), media_type="text/plain")
        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

    assert asyncio.run(respond()).decode() == expected.text

    async def leave_early():
        seen = []
        with cached.generate(messages, max_tokens=200, stream=True) as stream:
            async for piece in stream:
                seen.append(piece)
                break
        # close() (the with) waited for the reading thread: the result is there, no await needed
        left = stream.result
        again_stream = cached.generate(messages, max_tokens=200, stream=True)
        async for _ in again_stream:
            break
        # no close: the break itself stops decoding; a plain call then gets the engine
        again = cached.generate("Hello there", max_tokens=4)
        return left, seen, again_stream.result, again

    left, seen, second, again = asyncio.run(leave_early())
    full = uncached.generate(messages, max_tokens=200).tokens
    for result in (left, second):
        assert result.finish_reason == "cancelled" and 1 <= len(result.tokens) < 200
        assert result.tokens == full[:len(result.tokens)]
    assert len(seen) == 1 and again.tokens == uncached.generate("Hello there", max_tokens=4).tokens

    async def slow_then_leave():
        stream = cached.generate(messages, max_tokens=200, stream=True)
        async for _ in stream:
            await asyncio.sleep(0.5)  # a slow consumer: the reading thread waits, it does not decode on
            break
        done = [piece async for piece in cached.generate("Hello there", max_tokens=4, stream=True)]
        return stream.result, done, [piece async for piece in stream]  # a finished stream: nothing more

    slow, done, again_pieces = asyncio.run(slow_then_leave())
    assert slow.finish_reason == "cancelled" and len(slow.tokens) <= 3 * READ_AHEAD, len(slow.tokens)
    assert "".join(done) == uncached.generate("Hello there", max_tokens=4).text and again_pieces == []

    stream = cached.generate(messages, max_tokens=24, stream=True)
    pieces = [next(stream)]
    with pytest.raises(RuntimeError, match="read with next"):
        asyncio.run(read_rest(stream))
    pieces += list(stream)  # the stream goes on, on its thread
    assert stream.result.tokens == expected.tokens and "".join(pieces) == expected.text


async def read_rest(stream):
    return [piece async for piece in stream]


def test_an_adapter_passed_in_stays_open(adapter, tmp_path, system_prompts):
    with EdgeSync(adapter, store=tmp_path / "s") as es:
        es.generate("Hello there", max_tokens=2)
    assert adapter.llm is not None
    assert EdgeSync(adapter, store=False).generate("Hello again", max_tokens=2).tokens


def test_a_closed_engine_refuses_every_call_by_name(tmp_path):
    """An engine that owns its model, once closed: each call that would use the model (and
    ``with``) raises the same RuntimeError instead of an AttributeError from inside or a
    success; closing again does nothing."""
    from edgesync_engines.config import EdgeSyncConfig

    es = EdgeSync(config=EdgeSyncConfig.load({"n_ctx": 512, "store_path": str(tmp_path / "s")}))
    begun = es.generate("Hi", max_tokens=2, stream=True)  # begun before close(), read after it
    es.close()
    es.close()
    with pytest.raises(RuntimeError, match="the engine is closed"):
        list(begun)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    for call in (lambda: es.generate("Hi", max_tokens=2), lambda: es.prompt_tokens("Hi"),
                 lambda: es.history_tokens(messages), lambda: es.prepare(messages), lambda: es.prepare_later(messages),
                 lambda: es.make_room(16), es.__enter__, lambda: es.generate("Hi", documents=["abc"], max_tokens=2),
                 lambda: es.add_documents(["abc"]), es.list_documents, lambda: es.remove_documents("0123abcd"),
                 lambda: es.forget("Hi")):
        with pytest.raises(RuntimeError, match="the engine is closed"):
            call()


def test_a_stored_match_too_short_to_inject_does_not_hide_the_live_one(adapter, store):
    """With idle-time storing, a prompt whose stored match (under 64 tokens: never injected)
    is longer than what the live sequence shares with it continues the live sequence instead
    of prefilling everything (found by a new-user trial)."""
    from edgesync_engines.config import EdgeSyncConfig

    base = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
            "developed movable metal type in Mainz. His innovations combined an oil-based ink, a hand mould "
            "for casting type, and a wooden screw press adapted from wine presses. Within decades, printing "
            "shops spread to more than two hundred cities across Europe, and the cost of books fell sharply. ")
    prompts = [base + "Continue:", base[:301] + " and then", base[:333] + " and then"]
    with EdgeSync(adapter, store=store, config=EdgeSyncConfig.load({"idle_store": True})) as es:
        for prompt in prompts:
            result = es.generate(prompt, max_tokens=8)
        tokens, live = es.prompt_tokens(prompts[2]), es.prompt_tokens(prompts[1])
        stored = common_prefix_len(tokens, es.prompt_tokens(prompts[0]))
        shared = es.adapter.usable_prefix(common_prefix_len(tokens, live), len(tokens))
        assert shared < stored < MIN_SPAN  # the case: a longer stored match that cannot be injected
        assert result.live_tokens == result.tokens_reused == shared > 0
    assert result.tokens == EdgeSync(adapter, store=False).generate(prompts[2], max_tokens=8).tokens
