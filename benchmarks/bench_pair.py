"""A target/draft pair on held-out code prompts: acceptance, speedup, and sample completions.

    python benchmarks/bench_pair.py [--target DIR --draft DIR] [-k 3 4 5] [--prompts-per-module 2]
                                    [--max-tokens 64] [--show 3]

Prompts are held-out standard-library modules cut just after a `def` line (see
specdec.benchmark.prompts). For each prompt, greedy speculative decoding and the target
alone run back to back (interleaved, so drift hits all alike); the table reports the
totals: α, τ, tokens/s of each, the measured speedup and the one predicted from α, k and
the measured cost ratio c; and it checks the outputs are identical.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from specdec import LLM, SamplingParams, SpecStats  # noqa: E402
from specdec.benchmark.machine import step_seconds  # noqa: E402
from specdec.demo import SHIPPED_DRAFT, SHIPPED_TARGET  # noqa: E402
from specdec.benchmark.prompts import held_out_code_prompts  # noqa: E402
from specdec.benchmark.run import with_drafter  # noqa: E402
from specdec.metrics import predicted_speedup  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(SHIPPED_TARGET))
    parser.add_argument("--draft", default=str(SHIPPED_DRAFT))
    parser.add_argument("-k", type=int, nargs="+", default=[5], help="one or more k (default 5)")
    parser.add_argument("--prompts-per-module", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-chars", type=int, default=800, help="prompt length in characters (at most)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--draft-dtype", default="auto")
    parser.add_argument("--draft-confidence", type=float, default=0.0,
                        help="adaptive k: LLM(draft_confidence_threshold=...) (default 0: always k)")
    parser.add_argument("--show", type=int, default=3, help="print this many completions")
    args = parser.parse_args()

    first = LLM(args.target, speculative_model=args.draft, num_speculative_tokens=args.k[0], dtype=args.dtype,
                draft_dtype=args.draft_dtype, draft_confidence_threshold=args.draft_confidence)
    plain = first.target_only()
    speculative = {k: with_drafter(first, first.engine.drafter, k) for k in args.k}  # one draft, loaded once
    prompts = held_out_code_prompts(args.prompts_per_module, max_chars=args.max_chars)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for llm in (plain, *speculative.values()):  # warm-up
        llm.generate(prompts[0].text, params)

    plain_stats, spec_stats = [], {k: [] for k in args.k}
    mismatches, shown = {k: [] for k in args.k}, []
    for prompt in prompts:  # interleaved: the target alone, then each k, prompt by prompt
        alone = plain.generate(prompt.text, params)[0]
        plain_stats.append(alone.metrics)
        for k, llm in speculative.items():
            ours = llm.generate(prompt.text, params)[0]
            spec_stats[k].append(ours.metrics)
            if ours.outputs[0].token_ids != alone.outputs[0].token_ids:
                mismatches[k].append(prompt.name)
        if len(shown) < args.show:
            shown.append((prompt, alone.outputs[0].text))

    base = _totals(plain_stats)
    cost_ratio = step_seconds(first.engine.drafter.model) / step_seconds(first.target.model)
    print(f"## {Path(args.target).name} + {Path(args.draft).name} (draft in "
          f"{str(first.engine.drafter.model.dtype).removeprefix('torch.')}"
          + (f", adaptive k: confidence >= {args.draft_confidence}" if args.draft_confidence else "")
          + f"), greedy, {len(prompts)} held-out code "
          f"prompts, {args.max_tokens} new tokens each\n")
    print("| decoder | tokens/s | α (accepted ÷ judged) | accepted ÷ proposed | τ | speedup | predicted "
          "| acceptance by position | identical outputs |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    print(f"| target alone | {base.tokens_per_second:.1f} | | | 1.00 | 1.00x | | | |")
    for k in args.k:
        spec = _totals(spec_stats[k])
        alpha = spec.acceptance_rate
        by_position = " ".join(f"{a:.2f}" for a in spec.acceptance_by_position)
        print(f"| draft model k={k} | {spec.tokens_per_second:.1f} | {alpha:.3f} | "
              f"{spec.proposed_acceptance_rate:.3f} | {spec.tokens_per_forward:.2f} | "
              f"{spec.tokens_per_second / base.tokens_per_second:.2f}x | "
              f"{predicted_speedup(alpha, k, cost_ratio):.2f}x | {by_position} | "
              f"{len(prompts) - len(mismatches[k])}/{len(prompts)} |")
    print(f"\ncost ratio c (one draft step ÷ one target step) = {cost_ratio:.3f}")
    for k in args.k:
        if mismatches[k]:
            print(f"k={k}: outputs differ from the target alone on {', '.join(mismatches[k])}")
    for prompt, completion in shown:
        print(f"\n### {prompt.name}\n```python\n{prompt.text[-300:]}{completion}\n```")


def _totals(stats: list[SpecStats]) -> SpecStats:
    """Sums over prompts run one after another (merge keeps the longest time: add them here)."""
    total = SpecStats.merge(stats)
    total.seconds = sum(s.seconds for s in stats)
    return total


if __name__ == "__main__":
    main()
