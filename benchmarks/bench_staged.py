"""Staged drafts against their stages alone: the target alone, the first stage (prompt lookup by
default), the draft model, and the first stage drafting for the draft model (staged:
speculative_model=[FIRST, DRAFT]), interleaved prompt by prompt.

    python benchmarks/bench_staged.py [--target qwen2.5-coder-1.5b-instruct]
        [--draft qwen2.5-coder-0.5b-instruct] [--first '[ngram]' | smollm2] [--prompts 2]
        [--max-tokens 128] [-k 5] [--policies goodput,fixed] [--repeats 2]

--first names the first stage: "[ngram]" (prompt lookup) or a smaller draft model, which may have
another tokenizer than the target's (SmolLM2-135M-Instruct for the Qwen pair: it drafts through
text, drafters/cross_tokenizer.py); alone, it drafts for the target directly.

Greedy, on held-out chat prompts (write, edit or explain a function: the bench's "chat" set),
each rendered with the target's chat template (LLM.chat_token_ids). One LLM is made as a user
makes it (speculative_model=["[ngram]", DRAFT]); the other rows run over the same loaded target
and draft (LLM.with_drafter): prompt lookup, the draft model alone, the staged drafter, each with
k at most -k by goodput (LLM's default) and, with --policies, k fixed. Every LLM is warmed up on
the longest prompt first; each prompt runs --repeats times by every method in turn, the fastest
of each counting (others share these machines). Printed per method, over the prompts: tokens/s
(prefill included), its ratio to the target alone, τ (tokens per target forward), α, whether the
greedy output is the target's, for the staged rows the draft model's inner rounds: their τ
(tokens per draft-model forward) and α (prompt lookup's tokens, judged by the draft model), and
where the time went per generated token (the engine's timings: drafting, the target's verify
forwards and sampling, the prefill).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch

from specdec import LLM, SamplingParams, SpecStats
from specdec.drafters import DraftModelDrafter
from specdec.spec.staged import StagedDrafter
from specdec.tools.benchmark.prompts import held_out_chat_prompts
from specdec.tools.benchmark.run import spread


@dataclass
class Totals:
    """One method's tokens, seconds and rounds over the prompts (the fastest run of each)."""

    tokens: int = 0
    seconds: float = 0.0
    stats: list[SpecStats] = field(default_factory=list)
    inner: list[SpecStats] = field(default_factory=list)  # a staged drafter's inner rounds
    outputs: list[list[int]] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=dict)  # seconds by part (engine.timings)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")


def methods(llm: LLM, k: int, policies: tuple[str, ...], first: str) -> dict[str, LLM]:
    """label -> LLM over llm's target and draft: the target alone, then per policy the first stage
    alone (named first), the draft model and the staged drafter (llm's own for goodput)."""
    staged = llm.engine.drafter
    assert isinstance(staged, StagedDrafter)
    draft_model = DraftModelDrafter(staged.runner, staged.vocab_size)  # the same weights and runner
    out = {"target alone": llm.target_only()}
    for policy in policies:
        staged_here = (
            staged if policy == "goodput" else StagedDrafter(draft_model, staged.inner, k, policy, staged.stages)
        )
        out[f"{first} ({policy})"] = llm.with_drafter(staged.inner, k, policy)
        out[f"draft model ({policy})"] = llm.with_drafter(draft_model, k, policy)
        out[f"staged ({policy})"] = llm if policy == "goodput" else llm.with_drafter(staged_here, k, policy)
    return out


def run(args) -> None:
    torch.manual_seed(0)
    llm = LLM(args.target, speculative_model=[args.first, args.draft], num_speculative_tokens=args.k)
    prompts = [
        llm.chat_token_ids([{"role": "user", "content": p.text}]) for p in spread(held_out_chat_prompts(), args.prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    first = "prompt lookup" if args.first == "[ngram]" else args.first
    table = methods(llm, args.k, args.policies, first)
    longest = max(prompts, key=len)
    for label, each in table.items():
        print(f"warming up {label}", flush=True)
        each.warm_up(longest, params)
    totals = {label: Totals() for label in table}
    for number, prompt in enumerate(prompts):
        print(f"prompt {number + 1}/{len(prompts)}: {len(prompt)} tokens", flush=True)
        labels = list(table)[number % len(table) :] + list(table)[: number % len(table)]  # rotated
        best: dict[str, tuple] = {}
        for _ in range(args.repeats):
            for label in labels:
                start = time.perf_counter()
                output = table[label].generate({"prompt_token_ids": prompt}, params)[0]
                seconds = time.perf_counter() - start
                drafter = table[label].engine.drafter
                inner = drafter.stats if isinstance(drafter, StagedDrafter) else None
                if label not in best or seconds < best[label][1]:
                    best[label] = (
                        output,
                        seconds,
                        inner and SpecStats.merge([inner]),
                        dict(table[label].engine.timings),
                    )
        for label, (output, seconds, inner, parts) in best.items():
            total = totals[label]
            for part, part_seconds in parts.items():
                total.parts[part] = total.parts.get(part, 0.0) + part_seconds
            total.tokens += len(output.outputs[0].token_ids)
            total.seconds += seconds
            total.stats.append(output.metrics)
            total.outputs.append(output.outputs[0].token_ids)
            if inner is not None:
                total.inner.append(inner)
    report(totals)


def report(totals: dict[str, Totals]) -> None:
    plain = totals["target alone"]
    print(
        "\n| method | tok/s | × target alone | τ | α | greedy = target's | inner τ (draft forwards) | inner α "
        "| ms/token: draft | target | prefill |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, total in totals.items():
        stats = SpecStats.merge(total.stats)
        inner = SpecStats.merge(total.inner) if total.inner else None
        inner_cells = f"{inner.tokens_per_forward:.2f} | {inner.acceptance_rate:.3f}" if inner else "| "
        per_token = " | ".join(
            f"{1000 * total.parts.get(part, 0.0) / total.tokens:.0f}" for part in ("draft", "target", "prefill")
        )
        print(
            f"| {label} | {total.rate:.2f} | {total.rate / plain.rate:.2f} | {stats.tokens_per_forward:.2f} | "
            f"{stats.acceptance_rate:.3f} | {total.outputs == plain.outputs} | {inner_cells} | {per_token} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--first", default="[ngram]", help="the first stage: '[ngram]' or a smaller draft model")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--policies", type=lambda text: tuple(text.split(",")), default=("goodput",))
    parser.add_argument("--repeats", type=int, default=2)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
