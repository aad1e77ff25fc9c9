"""A target/draft pair on held-out prompts: acceptance, speedup, and sample completions.

    python benchmarks/bench_pair.py [--target DIR --draft DIR] [-k 3 4 5] [--prompts-per-module 2]
                                    [--prompt-set code|chat|edit] [--prompts N]
                                    [--max-tokens 64] [--lookup] [--k-policy fixed goodput] [--show 3]

Prompts (--prompt-set, as specdec bench's sets; specdec.tools.benchmark.prompts): "code", held-out
standard-library modules cut just after a `def` line (the default); "chat", user messages about
held-out functions (write / edit / explain), rendered with the target's chat template; "edit",
only the "edit this function" ones. --prompts N takes N of them spread through the set.
--head DIR adds rows for an EAGLE head (speculative_method="eagle"), --early-exit L for the
target's own first L layers drafting (speculative_method="early_exit"), at the same k and
policies; --tree SHAPE... rows for each of those and the draft model growing trees of k nodes
(speculative_tree). For each prompt, greedy speculative decoding and the target
alone run back to back (interleaved, so drift hits all alike); the table reports the
totals: α, τ, tokens/s of each, the measured speedup and the one predicted from α, k and
the measured cost ratio c; it checks the outputs are identical; and it counts how many of the
target's completion lines are valid Python after their prompt (Prompt.lines_that_parse).
--lookup adds rows for speculative_method="lookup_then_draft": prompt lookup where the context
repeats, the same draft model elsewhere (no prediction: the cost per draft token varies by round;
nor with --draft-confidence, where k varies). The prediction models decoding alone; the measured
speedup includes both models' prefill, so it reads lower on short outputs. --k-policy runs each
row at a fixed k, or by goodput with k as the most (LLM's speculative_k_policy; its rows also say
how many rounds ran at each k).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdec import LLM, SamplingParams, SpecStats
from specdec.config import COMPILE_HELP, COMPILE_MODES, K_POLICIES, SpeculativeConfig
from specdec.drafters import DRAFTERS, LookupThenDraftDrafter
from specdec.metrics import predicted_speedup
from specdec.paths import SHIPPED_DRAFT, SHIPPED_TARGET
from specdec.spec.tree_width import TreeWidth
from specdec.tools.benchmark.machine import step_seconds
from specdec.tools.benchmark.run import PROMPT_SETS, spread

ROOT = Path(__file__).resolve().parent.parent

DRAFT_MODEL, LOOKUP, EAGLE, EARLY_EXIT = "draft model", "prompt lookup, else draft model", "eagle head", "early exit"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(SHIPPED_TARGET))
    parser.add_argument("--draft", default=str(SHIPPED_DRAFT))
    parser.add_argument("-k", type=int, nargs="+", default=[5], help="one or more k (default 5)")
    parser.add_argument("--prompts-per-module", type=int, default=2)
    parser.add_argument("--prompt-set", choices=("code", "chat", "edit"), default="code")
    parser.add_argument("--prompts", type=int, default=None, help="at most this many prompts, spread through the set")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-chars", type=int, default=800, help="prompt length in characters (at most)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--draft-dtype", default="auto")
    parser.add_argument("--compile", choices=COMPILE_MODES, default="auto", help=COMPILE_HELP)
    parser.add_argument(
        "--draft-confidence",
        type=float,
        default=0.0,
        help="adaptive k: LLM(draft_confidence_threshold=...) (default 0: always k)",
    )
    parser.add_argument(
        "--lookup",
        action="store_true",
        help="also run speculative_method='lookup_then_draft' (prompt lookup, else the draft) at each k",
    )
    parser.add_argument(
        "--k-policy",
        nargs="+",
        choices=K_POLICIES,
        default=["fixed"],
        help="fixed k, or k by goodput (at most k), or both (default fixed)",
    )
    parser.add_argument("--show", type=int, default=3, help="print this many completions")
    parser.add_argument("--head", help="also run this EAGLE head (speculative_method='eagle')")
    parser.add_argument(
        "--no-draft-rows",
        action="store_true",
        help="leave out the draft model's own rows (it is still loaded: c is measured against it)",
    )
    parser.add_argument(
        "--early-exit",
        type=int,
        metavar="L",
        help="also run the target's first L layers as the draft (speculative_method='early_exit')",
    )
    parser.add_argument(
        "--tree",
        nargs="+",
        default=[],
        metavar="SHAPE",
        help="also run each drafter that grows trees with these tree shapes (speculative_tree: "
        "'auto' or children per depth like '3,2,1'), k nodes a tree, under each --k-policy (goodput: "
        "the depth chosen as a chain's k, the nodes verified by their cost)",
    )
    args = parser.parse_args()

    first = LLM(
        args.target,
        speculative_model=args.draft,
        num_speculative_tokens=args.k[0],
        dtype=args.dtype,
        draft_dtype=args.draft_dtype,
        draft_confidence_threshold=args.draft_confidence,
        compile=args.compile,
    )
    plain = first.target_only()
    drafters = {} if args.no_draft_rows else {DRAFT_MODEL: first.engine.drafter}  # one draft, loaded once
    if args.lookup:
        drafters[LOOKUP] = LookupThenDraftDrafter.sharing_weights(first.engine.drafter)
    if args.head:  # over the same loaded target
        drafters[EAGLE] = DRAFTERS["eagle"](SpeculativeConfig("eagle", args.head), first.target, first.runner)
    if args.early_exit:
        spec = SpeculativeConfig("early_exit", early_exit_layer=args.early_exit)
        drafters[f"{EARLY_EXIT} (layer {args.early_exit})"] = DRAFTERS["early_exit"](spec, first.target, first.runner)
    speculative = {
        (name, policy, k, "chain"): first.with_drafter(drafter, k, policy)
        for name, drafter in drafters.items()
        for policy in args.k_policy
        for k in args.k
    }
    speculative.update(
        {
            (name, policy, k, shape): first.with_drafter(drafter, k, policy, tree=shape)
            for name, drafter in drafters.items()
            if drafter.grows_trees
            for shape in args.tree
            for policy in args.k_policy
            for k in args.k
        }
    )
    title, make_prompts = PROMPT_SETS[args.prompt_set]
    prompts = make_prompts(args.prompts_per_module, max_chars=args.max_chars)
    prompts = spread(prompts, args.prompts) if args.prompts else prompts
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    inputs = {
        prompt.name: first.chat_token_ids([{"role": "user", "content": prompt.text}]) if prompt.chat else prompt.text
        for prompt in prompts
    }  # what each run is given: text, or a rendered chat
    longest = max(prompts, key=lambda prompt: len(first.prompt_token_ids(inputs[prompt.name], params)))
    for llm in (plain, *speculative.values()):  # warm-up (and compiling) for the longest prompt
        llm.warm_up(inputs[longest.name], params)
    for llm in speculative.values():  # count the measured rounds' tree widths only
        if llm.engine.k_choice.tree_width is not None:
            llm.engine.k_choice.tree_width.kept_nodes.clear()

    plain_stats, spec_stats = [], {key: [] for key in speculative}
    mismatches, shown, parsing = {key: [] for key in speculative}, [], []
    for prompt in prompts:  # interleaved: the target alone, then each k, prompt by prompt
        alone = plain.generate(inputs[prompt.name], params)[0]
        plain_stats.append(alone.metrics)
        parsing.append(prompt.lines_that_parse(alone.outputs[0].text))
        for key, llm in speculative.items():
            ours = llm.generate(inputs[prompt.name], params)[0]
            spec_stats[key].append(ours.metrics)
            if ours.outputs[0].token_ids != alone.outputs[0].token_ids:
                mismatches[key].append(prompt.name)
        if len(shown) < args.show:
            shown.append((prompt, alone.outputs[0].text))

    base = SpecStats.merge(plain_stats, one_after_another=True)
    cost_ratio = step_seconds(first.engine.drafter.runner) / step_seconds(first.runner)
    print(
        f"## {Path(args.target).name} + {Path(args.draft).name} (target in "
        f"{str(first.runner.dtype).removeprefix('torch.')}, compile={args.compile}, draft in "
        f"{str(first.engine.drafter.model.dtype).removeprefix('torch.')}"
        + (f", adaptive k: confidence >= {args.draft_confidence}" if args.draft_confidence else "")
        + f"), greedy, {len(prompts)} prompts of the set {title}, {args.max_tokens} new tokens each\n"
    )
    print(
        "| decoder | tokens/s | α (accepted ÷ judged) | accepted ÷ proposed | τ | speedup | predicted "
        "| acceptance by position | identical outputs |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    print(f"| target alone | {base.tokens_per_second:.1f} | | | 1.00 | 1.00x | | | |")
    for (name, policy, k, shape), stats in spec_stats.items():
        spec = SpecStats.merge(stats, one_after_another=True)
        alpha = spec.acceptance_rate
        by_position = " ".join(f"{a:.2f}" for a in spec.acceptance_by_position)
        fixed_k = name == DRAFT_MODEL and not args.draft_confidence and policy == "fixed" and shape == "chain"
        predicted = f"{predicted_speedup(alpha, k, cost_ratio):.2f}x" if fixed_k else "–"  # what the formula models
        label = _label(name, policy, k, shape, spec, speculative[name, policy, k, shape].engine.k_choice.tree_width)
        print(
            f"| {label} | {spec.tokens_per_second:.1f} | {alpha:.3f} | "
            f"{spec.proposed_acceptance_rate:.3f} | {spec.tokens_per_forward:.2f} | "
            f"{spec.tokens_per_second / base.tokens_per_second:.2f}x | {predicted} | {by_position} | "
            f"{len(prompts) - len(mismatches[name, policy, k, shape])}/{len(prompts)} |"
        )
    print(f"\ncost ratio c (one draft step ÷ one target step) = {cost_ratio:.3f}")
    if args.tree:
        print("tree rows: accepted ÷ proposed counts every node; acceptance by position is by depth")
    for (name, policy, k, shape), names in mismatches.items():
        if names:
            print(f"{_label(name, policy, k, shape, None)}: outputs differ from the target alone on {', '.join(names)}")
    if args.prompt_set == "code":
        valid_lines, whole_lines = (sum(counts) for counts in zip(*parsing))
        valid_throughout = sum(valid == whole for valid, whole in parsing)
        print(
            f"\nthe target's completions: {valid_lines} of their {whole_lines} whole non-blank lines are valid "
            f"Python after their prompt; {valid_throughout} of {len(prompts)} completions are valid throughout"
        )
    for prompt, completion in shown:
        print(f"\n### {prompt.name}\n```python\n{prompt.text[-300:]}{completion}\n```")


def _label(name: str, policy: str, k: int, shape: str, spec: SpecStats | None, width: TreeWidth | None = None) -> str:
    if shape != "chain" and policy == "fixed":
        return f"{name} tree {shape}, {k} nodes"
    if shape != "chain":  # the depth by goodput, the nodes verified by their cost (tree_width.py)
        verified = (
            sum(n * count for n, count in width.kept_nodes.items()) / max(1, width.kept_nodes.total()) if width else 0
        )
        depths = f"depth chosen {spec.k_summary().strip()}; " if spec is not None else ""
        return f"{name} tree {shape}, goodput, <={k} nodes ({depths}{verified:.1f} nodes verified a round)"
    if policy == "fixed":
        return f"{name} k={k}"
    return f"{name} goodput k<={k}" + (f" ({spec.k_summary().strip()})" if spec is not None else "")


if __name__ == "__main__":
    main()
