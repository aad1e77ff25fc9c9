"""What flat rows buy: a ragged batch's real tokens run as one flat run, against the same batch
padded to its longest row (kv_cache.FlatRows, ModelRunner.flat_rows).

    python benchmarks/bench_flat_rows.py [MODEL] [--head HEAD] [--batch 4] [--tokens 64] [--repeats 2]

MODEL: a name the registry knows or a path (default: Qwen2.5-Coder-1.5B-Instruct's GGUF,
`specdec fetch qwen2.5-coder-1.5b-instruct`). Two measurements, flat and padded interleaved run
by run on the same loaded model:

1. Prefill: --batch prompts of different lengths (40 to 300 tokens) fed in one call
   (`ModelRunner.feed`): padded, the runner splits them into forwards of similar lengths
   (ragged_groups.py); flat, one forward of their tokens.
2. Generation: --batch of the bench's held-out chat prompts (write, edit, explain a function)
   served together, greedy, --tokens new tokens each, by the target alone (its steps are one
   token a row: only the prefill is ragged), with prompt lookup (long drafts where a reply
   copies its prompt, none elsewhere) and with an EAGLE head
   drafting (--head, default the shipped one) chains and trees (k by goodput and trees cut by the
   verify's cost, each row its own, so the verify forwards are ragged; a head, not "auto", whose
   suffix trees would learn from the earlier runs' answers). Tokens/s end to end and whether the
   outputs are equal (they must be: flat rows change no bit).
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams
from specdec.tools.benchmark.prompts import held_out_chat_prompts

ROOT = Path(__file__).resolve().parent.parent
PROMPT_LENGTHS = (40, 300, 120, 200, 70, 260, 150, 90)


def prompts(batch: int, vocab_low: int = 200, vocab_high: int = 20000) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(batch)]
    return [torch.randint(vocab_low, vocab_high, (n,), generator=gen).tolist() for n in lengths]


def chat_requests(llm: LLM, batch: int) -> list[dict]:
    """The bench's held-out chat prompts (write, edit and explain a function), as token ids with
    the chat template: some copy their code (prompt lookup drafts long there), some do not."""
    prompts = held_out_chat_prompts(per_module=1, max_chars=700)[:batch]
    return [{"prompt_token_ids": llm.chat_token_ids([{"role": "user", "content": p.text}])} for p in prompts]


def time_prefill(runner, chunks: list[list[int]], flat: bool) -> float:
    runner.flat_rows = flat
    with torch.inference_mode():
        t0 = time.perf_counter()
        runner.feed(chunks, [0] * len(chunks), list(range(len(chunks))))
        return time.perf_counter() - t0


def time_generation(llm: LLM, requests: list[dict], params: SamplingParams, flat: bool) -> tuple[float, list]:
    llm.engine.target.flat_rows = flat
    t0 = time.perf_counter()
    outputs = llm.generate(requests, params)
    seconds = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds, [o.outputs[0].token_ids for o in outputs]


def print_prefill(runner, chunks: list[list[int]], repeats: int) -> None:
    """The prefill table: the runner's cache made anew for the chunks (after the generation runs)."""
    runner.prepare(len(chunks), 512, (1,), 1, pool=None)
    seconds = {True: [], False: []}
    for _ in range(repeats):
        for flat in (False, True):
            seconds[flat].append(time_prefill(runner, chunks, flat))
    padded_s, flat_s = min(seconds[False]), min(seconds[True])
    tokens = sum(len(c) for c in chunks)
    print("| prefill: prompt lengths | tokens | padded s | flat s | flat x padded |")
    print("|---|---:|---:|---:|---:|")
    print(f"| {[len(c) for c in chunks]} | {tokens} | {padded_s:.2f} | {flat_s:.2f} | {padded_s / flat_s:.2f}x |\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--head", default=str(ROOT / "models" / "qwen2.5-coder-1.5b-eagle3"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    print(f"model {args.model}, batch {args.batch}, {args.tokens} new tokens, {torch.get_num_threads()} threads\n")

    rows = []
    systems = {
        "the target alone": {"speculative_method": "none"},
        "prompt lookup (ngram)": {"speculative_method": "ngram"},
        "the head, chains": {"speculative_model": args.head},
        "the head, trees (EAGLE-2's)": {"speculative_model": args.head, "speculative_tree": "auto"},
    }
    for method, drafter in systems.items():
        llm = LLM(args.model, **drafter, max_num_seqs=args.batch, enable_prefix_caching=False)
        requests = chat_requests(llm, args.batch)
        time_generation(llm, requests, params, flat=True)  # warm up: the batch's round costs are timed here
        speed, outs = {True: [], False: []}, {}
        for _ in range(args.repeats):
            for flat in (False, True):
                tok_s, outs[flat] = time_generation(llm, requests, params, flat)
                speed[flat].append(tok_s)
        rows.append(
            (method, statistics.median(speed[False]), statistics.median(speed[True]), outs[False] == outs[True])
        )
        if method == "the target alone":
            print_prefill(llm.engine.target, prompts(args.batch), args.repeats)
        del llm
    print("| generation | padded tok/s | flat tok/s | flat x padded | outputs equal |")
    print("|---|---:|---:|---:|---|")
    for method, padded, flat, equal in rows:
        print(f"| {method} | {padded:.1f} | {flat:.1f} | {flat / padded:.2f}x | {equal} |")


if __name__ == "__main__":
    main()
