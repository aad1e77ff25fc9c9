"""Preemption changes no output: many requests at once in a cache pool far too small for them,
against the same requests in a pool that holds them all.

    python benchmarks/bench_preemption.py [--target models/code-target] [--draft models/code-draft]
        [--requests 30] [--max-tokens 128] [--pool-share 0.25]

Each case serves --requests held-out code prompts at once through one engine (the shipped pair
by default, k = 4 fixed): first with a pool large enough for all, then with a pool of
--pool-share of the blocks they need at their longest, so that the youngest running requests
are preempted again and again. Cases: sampled in float32 (temperature 0.8, top-p 0.95, each
request its own seed) and greedy in bfloat16, each with preemption by swapping (the default,
swap_space 4 GiB) and by recomputing (swap_space 0). Prints, per case, the preemptions, how many
were swapped out, and how many of the requests' token sequences differ from the large pool's
(the goal: 0), with the seconds of each run. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdec import LLM, SamplingParams
from specdec.kv_cache import BLOCK_SIZE, blocks_for
from specdec.paths import ROOT
from specdec.tools.benchmark.machine import describe_machine
from specdec.tools.benchmark.prompts import held_out_code_prompts

CASES = [  # (dtype, sampled, swap_space GiB)
    ("float32", True, 4.0),
    ("float32", True, 0.0),
    ("bfloat16", False, 4.0),
    ("bfloat16", False, 0.0),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(ROOT / "models" / "code-target"))
    p.add_argument("--draft", default=str(ROOT / "models" / "code-draft"))
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--pool-share", type=float, default=0.25, help="the small pool's blocks / what all need")
    args = p.parse_args()
    machine = describe_machine()
    print(f"CPU: {machine.get('cpu', '?')}; {args.requests} requests, {args.max_tokens} tokens each\n")
    columns = ["dtype", "sampling", "preemption", "preemptions", "swapped out", "outputs changed", "s (large pool)"]
    print("| " + " | ".join([*columns, "s (small)"]) + " |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for dtype, sampled, swap_space in CASES:
        row = run_case(args, dtype, sampled, swap_space)
        sampling = "T 0.8, top-p 0.95, seeded" if sampled else "greedy"
        mode = "swap" if swap_space else "recompute"
        print(f"| {dtype} | {sampling} | {mode} | " + " | ".join(str(value) for value in row) + " |", flush=True)


def run_case(args, dtype: str, sampled: bool, swap_space: float) -> tuple:
    llm = LLM(
        args.target,
        speculative_model=args.draft,
        num_speculative_tokens=4,
        speculative_k_policy="fixed",
        dtype=dtype,
        max_num_seqs=args.requests,
        swap_space=swap_space,
    )
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, seed=1000 + i)
        if sampled
        else SamplingParams(temperature=0, max_tokens=args.max_tokens)
        for i in range(args.requests)
    ]
    code = held_out_code_prompts(max_chars=700)[: args.requests]  # the shipped target's context is 512 tokens
    prompts = [llm.prompt_token_ids(prompt.text, p) for prompt, p in zip(code, params)]
    needed = sum(blocks_for(len(prompt) + args.max_tokens + 8) for prompt in prompts)
    block_bytes = llm.engine.capacity.position_bytes * BLOCK_SIZE
    longest = max(len(prompt) for prompt in prompts) + args.max_tokens + 8
    expected, large_seconds, _ = serve(llm, prompts, params, longest, None)
    small = max(int(needed * args.pool_share), blocks_for(longest) + 1) * block_bytes
    got, small_seconds, preemptions = serve(llm, prompts, params, longest, small)
    changed = sum(got[request_id] != tokens for request_id, tokens in expected.items())
    swapped = llm.engine.preemption.swap.num_swapped_out
    return preemptions, swapped, f"{changed} of {len(prompts)}", f"{large_seconds:.1f}", f"{small_seconds:.1f}"


def serve(llm: LLM, prompts, params, max_model_len: int, kv_cache_bytes: int | None):
    """Every request added at once, stepped to the end: their tokens, the seconds, the preemptions."""
    engine = llm.engine
    with torch.inference_mode():
        engine.prepare_to_serve(max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes)
        start = time.perf_counter()
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", prompt, p)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
    return tokens, time.perf_counter() - start, engine.scheduler.num_preemptions


if __name__ == "__main__":
    main()
