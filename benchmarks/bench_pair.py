"""A target/draft pair on held-out code prompts: acceptance, speedup, and sample completions.

    python benchmarks/bench_pair.py [--target DIR --draft DIR] [-k 5] [--prompts-per-module 2]
                                    [--max-tokens 64] [--show 3]

Prompts are held-out standard-library modules cut just after a `def` line (see
specdec.benchmark.prompts). For each prompt, greedy speculative decoding and the target
alone run back to back (interleaved, so drift hits both alike); the table reports the
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
from specdec.benchmark.prompts import held_out_code_prompts  # noqa: E402
from specdec.metrics import predicted_speedup  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(ROOT / "models" / "code-target"))
    parser.add_argument("--draft", default=str(ROOT / "models" / "code-draft"))
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--prompts-per-module", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-chars", type=int, default=800, help="prompt length in characters (at most)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--show", type=int, default=3, help="print this many completions")
    args = parser.parse_args()

    speculative = LLM(args.target, speculative_model=args.draft, num_speculative_tokens=args.k, dtype=args.dtype)
    plain = speculative.target_only()
    prompts = held_out_code_prompts(args.prompts_per_module, max_chars=args.max_chars)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    speculative.generate(prompts[0].text, params)  # warm-up
    plain.generate(prompts[0].text, params)

    spec_stats, plain_stats, mismatches, shown = [], [], [], []
    for prompt in prompts:
        ours = speculative.generate(prompt.text, params)[0]
        alone = plain.generate(prompt.text, params)[0]
        spec_stats.append(ours.metrics)
        plain_stats.append(alone.metrics)
        if ours.outputs[0].token_ids != alone.outputs[0].token_ids:
            mismatches.append(prompt.name)
        if len(shown) < args.show:
            shown.append((prompt, alone.outputs[0].text))

    spec, base = _totals(spec_stats), _totals(plain_stats)
    draft_model = speculative.engine.drafter.model
    cost_ratio = step_seconds(draft_model) / step_seconds(speculative.target.model)
    alpha = spec.acceptance_rate
    print(f"## {Path(args.target).name} + {Path(args.draft).name}, greedy, k={args.k}, "
          f"{len(prompts)} held-out code prompts, {args.max_tokens} new tokens each\n")
    print("| decoder | tokens/s | α | τ | speedup | predicted |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| target alone | {base.tokens_per_second:.1f} | | 1.00 | 1.00x | |")
    print(f"| draft model k={args.k} | {spec.tokens_per_second:.1f} | {alpha:.3f} | {spec.tokens_per_forward:.2f} | "
          f"{spec.tokens_per_second / base.tokens_per_second:.2f}x | "
          f"{predicted_speedup(alpha, args.k, cost_ratio):.2f}x |")
    by_position = " ".join(f"{a:.2f}" for a in spec.acceptance_by_position)
    print(f"\nacceptance by position: {by_position}; cost ratio c = {cost_ratio:.3f}")
    print(f"greedy outputs identical to the target alone: {len(prompts) - len(mismatches)}/{len(prompts)}"
          + (f" (differ: {', '.join(mismatches)})" if mismatches else ""))
    for prompt, completion in shown:
        print(f"\n### {prompt.name}\n```python\n{prompt.text[-300:]}{completion}\n```")


def _totals(stats: list[SpecStats]) -> SpecStats:
    """Sums over prompts run one after another (merge keeps the longest time: add them here)."""
    total = SpecStats.merge(stats)
    total.seconds = sum(s.seconds for s in stats)
    return total


if __name__ == "__main__":
    main()
