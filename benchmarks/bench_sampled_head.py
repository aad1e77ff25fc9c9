"""A sampled EAGLE head's drafts at the request's temperature against sharper ones: the head
alone and prompt lookup before it, each at EagleDrafter's temperature_scale 1.0 (the plain
warped distribution) and at the default (drafters/eagle.py's SAMPLED_TEMPERATURE_SCALE); with
--trees, the head growing trees of k nodes too (a tree's sampled candidates are point masses on
its likeliest tokens, verify.py: the scale does not apply).

    python benchmarks/bench_sampled_head.py [--target qwen2.5-coder-1.5b-instruct]
        [--head models/qwen2.5-coder-1.5b-eagle3] [--prompts 4] [--seeds 3] [--max-tokens 128]
        [--temperature 0.8] [--top-p 0.95] [--scales 1.0,0.5] [--trees auto]

Held-out chat prompts (write, edit or explain a function), each rendered with the target's chat
template, sampled with seeds 0..seeds-1; k at most 5 by goodput (LLM's default). One target and
one head are loaded; every prompt and seed runs by every row in turn (the order rotating), so the
machine's drift falls on all rows alike. Printed per row, over all runs: tokens/s (prefill
included), its ratio to the target alone, τ (tokens per target forward), α (accepted ÷ judged
drafts), and acceptance by draft position. The output follows the target's distribution in every
row (tests/spec/test_distribution.py); only how often drafts are accepted, and so the speed, moves.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch

from specdec import LLM, SamplingParams, SpecStats
from specdec.config import DEFAULT_NGRAM_MIN
from specdec.drafters import EagleDrafter
from specdec.drafters.lookup_then_draft import LookupThenDraftDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.tools.benchmark.prompts import held_out_chat_prompts
from specdec.tools.benchmark.run import spread


@dataclass
class Row:
    """One row's LLM, the head's temperature_scale it runs at (None: no head) and its runs."""

    llm: LLM
    scale: float | None
    tokens: int = 0
    seconds: float = 0.0
    stats: list[SpecStats] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=dict)  # seconds by part (engine.timings)


def rows(llm: LLM, head: EagleDrafter, scales: list[float], trees: list[str], k: int, ngram_max: int) -> dict[str, Row]:
    """label -> Row: the target alone, then per scale the head alone and lookup before it (k at most
    k, by goodput), then the head growing each tree shape of k nodes, all over llm's loaded target
    and head."""
    lookup = NgramDrafter(DEFAULT_NGRAM_MIN["lookup_then_draft"], ngram_max, head.head.device)
    out = {"target alone": Row(llm.target_only(), None)}
    for scale in scales:
        out[f"head, scale {scale:g}"] = Row(llm.with_drafter(head, k), scale)
        out[f"lookup, else head, scale {scale:g}"] = Row(
            llm.with_drafter(LookupThenDraftDrafter(lookup, head), k), scale
        )
    for shape in trees:
        out[f"head, {shape} tree of {k}"] = Row(llm.with_drafter(head, k, tree=shape), 1.0)
    return out


def run(args) -> None:
    torch.manual_seed(0)
    llm = LLM(args.target, speculative_model=args.head)
    head = llm.engine.drafter
    assert isinstance(head, EagleDrafter), f"{args.head} is not an EAGLE head"
    prompts = [
        llm.chat_token_ids([{"role": "user", "content": p.text}]) for p in spread(held_out_chat_prompts(), args.prompts)
    ]
    scales = [float(s) for s in args.scales.split(",")]
    spec = llm.speculative_config
    assert spec is not None
    trees = [t for t in args.trees.split(";") if t]
    table = rows(llm, head, scales, trees, spec.num_speculative_tokens, spec.ngram_max)
    warm = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=16, seed=0)
    for label, row in table.items():
        print(f"warming up {label}", flush=True)
        row.llm.warm_up(max(prompts, key=len), warm)
    runs = [(prompt, seed) for prompt in prompts for seed in range(args.seeds)]
    for number, (prompt, seed) in enumerate(runs):
        print(f"run {number + 1}/{len(runs)}: {len(prompt)} prompt tokens, seed {seed}", flush=True)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=seed)
        labels = list(table)[number % len(table) :] + list(table)[: number % len(table)]  # rotated
        for label in labels:
            row = table[label]
            if row.scale is not None:
                head.temperature_scale = row.scale
            start = time.perf_counter()
            output = row.llm.generate({"prompt_token_ids": prompt}, params)[0]
            row.seconds += time.perf_counter() - start
            row.tokens += len(output.outputs[0].token_ids)
            row.stats.append(output.metrics)
            for part, seconds in row.llm.engine.timings.items():
                row.parts[part] = row.parts.get(part, 0.0) + seconds
    report(table)


def report(table: dict[str, Row]) -> None:
    plain = table["target alone"]
    base = plain.tokens / plain.seconds
    print(f"\n{'row':<30} {'tok/s':>6} {'x alone':>8} {'τ':>5} {'α':>5}  acceptance by position 1, 2, ...")
    for label, row in table.items():
        stats = SpecStats.merge(row.stats)
        rate = row.tokens / row.seconds
        tau = stats.num_emitted_tokens / max(1, stats.num_target_forwards)
        by_position = " ".join(
            f"{a / p:.2f}" for a, p in zip(stats.accepted_by_position, stats.proposed_by_position) if p
        )
        alpha = stats.acceptance_rate if stats.num_draft_tokens else float("nan")
        print(f"{label:<30} {rate:>6.1f} {rate / base:>7.2f}x {tau:>5.2f} {alpha:>5.2f}  {by_position}")
    print("\nk chosen by goodput (k:rounds), and ms per generated token by part (engine.timings):")
    for label, row in table.items():
        rounds = SpecStats.merge(row.stats).rounds_by_k
        ks = " ".join(f"{k}:{n}" for k, n in enumerate(rounds) if n)
        parts = " ".join(f"{part} {1e3 * seconds / row.tokens:.1f}" for part, seconds in row.parts.items() if seconds)
        print(f"  {label}: {ks or '-'}; {parts}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--head", default="models/qwen2.5-coder-1.5b-eagle3")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--scales", default="1.0,0.5")
    parser.add_argument(
        "--trees", default="", help="tree shapes separated by ';': auto, or branching factors per depth such as 3,2,1"
    )
    run(parser.parse_args())


if __name__ == "__main__":
    main()
