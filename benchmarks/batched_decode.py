"""Does a sequence keep its exact answer when its llama_decode batches carry another sequence's tokens?

``python -m edgesync_bench.batched_decode [--steps N] [--threads N] [--chunk N] [--json FILE]``

Not a test: an experiment on the real model (EdgeSync's configured GGUF) through llama-cpp-python's
low-level API, for the question behind continuous batching (serving several conversations from
one llama.cpp context, as llama-server's slots do): are a sequence's logits bit-identical to the
same sequence answered alone?

Two prompts A and B (chat-rendered, about 90 tokens each). The reference answers each alone in a
one-sequence context: the prompt but its last token in one batch, the last token alone, then
``--steps`` greedy decode steps of one token. Then, in a two-sequence context, once with
``kv_unified`` on (one KV buffer for both sequences, what ``sequence_params`` opens for
blending) and once off (a KV stream per sequence):

* ``solo``: A answered alone in the two-sequence context;
* ``decode-batched``: A and B prefilled one after the other, then every decode step one batch
  holding A's token and B's token;
* ``prefill-after``: B prefilled in ``--chunk``-token pieces, each in one batch with A's decode
  token placed after B's rows, then both decoded together;
* ``prefill-before``: the same with A's token placed before B's rows (B's rows then start at
  batch row 1, off the 8-row grouping ``kv_layout.exact_batches`` keeps).

For each case and sequence it prints the steps whose logits (float32, n_vocab) are bit-identical
to the reference, the largest absolute difference, and whether the greedy tokens are the same.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np

PROMPTS = (
    [{"role": "system", "content": "You are a helpful assistant. Answer in plain words, with one worked example."},
     {"role": "user", "content": "My bicycle has three chainrings at the front and nine sprockets at the back. "
      "Explain how the gears change the effort I need on the pedals and my speed, why a small chainring with a "
      "large sprocket helps on a steep hill, and which combinations I should avoid and why."}],
    [{"role": "system", "content": "You are a helpful assistant. Answer in plain words, with one worked example."},
     {"role": "user", "content": "Write a short poem of two stanzas about the sea at night, the harbour lights and "
      "a fishing boat coming home late, then explain the metre you used, how the rhyme scheme works, and what "
      "you would change to make it sound more like a sea shanty."}],
)


class Context:
    """One llama.cpp context driven batch by batch (``llama_batch`` rows of token, position,
    sequence, logits wanted)."""

    def __init__(self, llama_cpp, model: Path, n_seq_max: int, kv_unified: bool, threads: int) -> None:
        from edgesync_engines.adapters.llamacpp_blend import sequence_params

        self.low = llama_cpp.llama_cpp
        params = sequence_params(llama_cpp, kv_unified) if n_seq_max > 1 else contextlib.nullcontext()
        with params:
            self.llm = llama_cpp.Llama(model_path=str(model), n_ctx=2048, n_threads=threads,
                                       n_threads_batch=threads, verbose=False, swa_full=True)
        self.n_vocab = self.llm.n_vocab()

    def clear(self) -> None:
        self.low.llama_memory_clear(self.low.llama_get_memory(self.llm.ctx), True)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> dict[int, np.ndarray]:
        """One ``llama_decode`` of ``rows``; the logits (float32, (n_vocab,)) by row index of the
        rows that want them. Raises RuntimeError on a non-zero return."""
        low = self.low
        batch = low.llama_batch_init(len(rows), 0, 2)
        try:
            for i, (token, pos, seq, want) in enumerate(rows):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, want
                batch.seq_id[i][0] = seq
            batch.n_tokens = len(rows)
            rc = low.llama_decode(self.llm.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            return {i: np.ctypeslib.as_array(low.llama_get_logits_ith(self.llm.ctx, i), shape=(self.n_vocab,)).copy()
                    for i, row in enumerate(rows) if row[3]}
        finally:
            low.llama_batch_free(batch)


class Answer:
    """One sequence's greedy answer as it goes: its next token, position and logits so far."""

    def __init__(self, seq: int, prompt: list[int]) -> None:
        self.seq, self.prompt, self.pos = seq, prompt, len(prompt)
        self.logits: list[np.ndarray] = []
        self.tokens: list[int] = []

    def take(self, logits: np.ndarray) -> None:
        self.logits.append(logits)
        self.tokens.append(int(np.argmax(logits)))

    def row(self) -> tuple[int, int, int, bool]:
        """The decode row of its last token (which then takes the next position)."""
        self.pos += 1
        return (self.tokens[-1], self.pos - 1, self.seq, True)


def prefill(ctx: Context, answer: Answer) -> None:
    """The prompt but its last token in one batch, the last token alone."""
    p = answer.prompt
    ctx.decode([(t, i, answer.seq, False) for i, t in enumerate(p[:-1])])
    answer.take(ctx.decode([(p[-1], len(p) - 1, answer.seq, True)])[0])


def decode_together(ctx: Context, answers: list[Answer], steps: int) -> None:
    """Decode steps, every unfinished answer's token in one batch, until each has ``steps + 1``
    logits."""
    while True:
        live = [a for a in answers if len(a.logits) <= steps]
        if not live:
            return
        out = ctx.decode([a.row() for a in live])
        for i, a in enumerate(live):
            a.take(out[i])


def alone(ctx: Context, prompt: list[int], steps: int) -> Answer:
    ctx.clear()
    a = Answer(0, prompt)
    prefill(ctx, a)
    decode_together(ctx, [a], steps)
    return a


def paired(ctx: Context, pa: list[int], pb: list[int], steps: int, mixed: str | None,
           chunk: int) -> tuple[Answer, Answer]:
    """A in sequence 0 and B in sequence 1; ``mixed`` None (B prefilled alone), ``after`` or
    ``before`` (where A's decode row goes in B's prefill batches)."""
    ctx.clear()
    a, b = Answer(0, pa), Answer(1, pb)
    prefill(ctx, a)
    if mixed is None:
        prefill(ctx, b)
    else:
        i, last = 0, len(pb) - 1
        while i < last:
            rows_b = [(t, i + j, 1, False) for j, t in enumerate(pb[i:min(i + chunk, last)])]
            rows = rows_b + [a.row()] if mixed == "after" else [a.row()] + rows_b
            out = ctx.decode(rows)
            a.take(out[len(rows_b)] if mixed == "after" else out[0])
            i += len(rows_b)
        rows = [(pb[last], last, 1, True), a.row()] if mixed == "after" else [a.row(), (pb[last], last, 1, True)]
        out = ctx.decode(rows)
        b.take(out[0] if mixed == "after" else out[1])
        a.take(out[1] if mixed == "after" else out[0])
    decode_together(ctx, [a, b], steps)
    return a, b


def compare(ref: Answer, got: Answer) -> dict:
    """Steps with bit-identical logits, the largest |difference|, identical tokens."""
    n = min(len(ref.logits), len(got.logits))
    same = sum(np.array_equal(ref.logits[i], got.logits[i]) for i in range(n))
    worst = max(float(np.max(np.abs(ref.logits[i] - got.logits[i]))) for i in range(n))
    return {"steps": n, "identical_steps": int(same), "max_abs_diff": worst,
            "same_tokens": ref.tokens[:n] == got.tokens[:n]}


def run(args: argparse.Namespace) -> dict:
    import llama_cpp

    from edgesync_engines.adapters.model_files import model_file

    model = model_file(args.model)
    t0 = time.perf_counter()
    single = Context(llama_cpp, model, 1, True, args.threads)
    prompts = [single.llm.tokenize(_render(single.llm, m).encode(), special=True) for m in PROMPTS]
    refs = [alone(single, p, args.steps) for p in prompts]
    rows = []
    for unified in (True, False):
        ctx = Context(llama_cpp, model, 2, unified, args.threads)
        kv = "unified" if unified else "per-sequence"
        rows.append({"kv": kv, "case": "solo", "sequence": "A", **compare(refs[0], alone(ctx, prompts[0], args.steps))})
        for case, mixed in (("decode-batched", None), ("prefill-after", "after"), ("prefill-before", "before")):
            a, b = paired(ctx, prompts[0], prompts[1], args.steps, mixed, args.chunk)
            rows.append({"kv": kv, "case": case, "sequence": "A", **compare(refs[0], a)})
            rows.append({"kv": kv, "case": case, "sequence": "B", **compare(refs[1], b)})
        ctx.llm.close()
    single.llm.close()
    return {"model": str(model), "threads": args.threads, "steps": args.steps, "chunk": args.chunk,
            "prompt_tokens": [len(p) for p in prompts], "seconds": round(time.perf_counter() - t0, 1), "rows": rows}


def _render(llm, messages: list[dict]) -> str:
    """The GGUF's chat template over ``messages`` with the generation prompt (llama-cpp-python's
    Jinja2 formatter)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata["tokenizer.chat_template"]
    eos = llm.detokenize([llm.token_eos()]).decode(errors="replace")
    bos = llm.detokenize([llm.token_bos()]).decode(errors="replace")
    return Jinja2ChatFormatter(template, eos_token=eos, bos_token=bos)(messages=messages).prompt


def main(argv: list[str] | None = None) -> int:
    from edgesync_engines.app.cli_common import int_at_least

    positive = int_at_least(1)
    p = argparse.ArgumentParser(prog="python -m edgesync_bench.batched_decode", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: EdgeSync's configured model)")
    p.add_argument("--steps", type=positive, default=48,
                   help="greedy decode steps per answer (default 48); the table compares these and the "
                        "prompt's last-token logits, so it counts steps + 1")
    p.add_argument("--threads", type=positive, default=2, help="CPU threads (default 2)")
    p.add_argument("--chunk", type=positive, default=32, help="B's prefill rows per mixed batch (default 32)")
    p.add_argument("--json", dest="json_out", type=Path, default=None, help="write every figure here")
    args = p.parse_args(argv)
    result = run(args)
    print(f"{'KV cache':<13} {'case':<15} seq  identical steps  max |d logit|  same tokens")
    for r in result["rows"]:
        print(f"{r['kv']:<13} {r['case']:<15} {r['sequence']:<4} {r['identical_steps']:>6} / {r['steps']:<6} "
              f"{r['max_abs_diff']:>13.3g}  {'yes' if r['same_tokens'] else 'no'}")
    print(f"({result['prompt_tokens']} prompt tokens, {result['threads']} threads, {result['seconds']} s)")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
