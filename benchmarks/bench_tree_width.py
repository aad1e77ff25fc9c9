"""What cutting trees to the width their verify buys (spec/tree_width.py) gives, against verifying
every node, on a real model: the same drafter twice over one loaded target, one with the cut and
one without, interleaved prompt by prompt, greedy.

    python benchmarks/bench_tree_width.py [--model qwen2.5-coder-1.5b-instruct] [--prompt-set batch]
        [--prompts 16] [--max-tokens 128] [-k 5 16]

The drafter is the model's default (LLM(model)'s: for Qwen2.5-Coder-1.5B-Instruct suffix decoding,
else the shipped EAGLE-3 head) at each k, k chosen by goodput; a row per k and cut. Prints tok/s,
τ, the nodes verified a round and whether every output equals plain decoding's.
"""

from __future__ import annotations

import argparse
import dataclasses

from specdec import LLM, SamplingParams, SpecStats
from specdec.drafters import DRAFTERS
from specdec.tools.benchmark.run import PROMPT_SETS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--prompt-set", default="batch", choices=sorted(PROMPT_SETS))
    parser.add_argument("--prompts", type=int, default=16, help="the first N of the set, in its order")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, nargs="+", default=[5, 16])
    args = parser.parse_args()

    llm = LLM(args.model)
    spec = llm.speculative_config
    assert spec is not None, f"{args.model} has no default drafter"
    plain = llm.target_only()
    systems = {}
    for k in args.k:
        for cut in (True, False):
            drafter = DRAFTERS[spec.method](dataclasses.replace(spec, num_speculative_tokens=k), llm.target, llm.runner)
            system = llm.with_drafter(drafter, k)
            if not cut:
                system.engine.round.tree_width = None
            systems[k, cut] = system
    title, make_prompts = PROMPT_SETS[args.prompt_set]
    prompts = make_prompts()[: args.prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    inputs = [llm.chat_token_ids([{"role": "user", "content": p.text}]) if p.chat else p.text for p in prompts]
    for system in (plain, *systems.values()):
        system.warm_up(inputs[0], params)
        if hasattr(system.engine.drafter, "forget"):
            system.engine.drafter.forget()  # the warm-up's answer would draft its prompt
        if system.engine.k_choice.tree_width is not None:
            system.engine.k_choice.tree_width.kept_nodes.clear()
    stats: dict = {key: [] for key in [None, *systems]}
    same = dict.fromkeys(systems, 0)
    for i, text in enumerate(inputs):
        alone = plain.generate(text, params)[0]
        stats[None].append(alone.metrics)
        for key, system in systems.items():
            ours = system.generate(text, params)[0]
            stats[key].append(ours.metrics)
            same[key] += ours.outputs[0].token_ids == alone.outputs[0].token_ids
        print(f"prompt {i + 1}/{len(inputs)} done", flush=True)
    base = SpecStats.merge(stats[None], one_after_another=True)
    print(f"\n## {args.model}, {spec.method}, {len(inputs)} prompts of {title}, {args.max_tokens} tokens, greedy\n")
    print("| system | tok/s | x plain | τ | nodes verified a round | same as plain |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| plain | {base.tokens_per_second:.1f} | 1.00x | 1.00 | – | – |")
    for (k, cut), system in systems.items():
        total = SpecStats.merge(stats[k, cut], one_after_another=True)
        width = system.engine.k_choice.tree_width
        kept = width.kept_nodes if cut and width is not None else None
        verified = f"{sum(n * c for n, c in kept.items()) / kept.total():.2f} ({kept.total()} trees)" if kept else "–"
        print(
            f"| k <= {k}, {'trees cut by cost' if cut else 'every node verified'} | {total.tokens_per_second:.1f} | "
            f"{total.tokens_per_second / base.tokens_per_second:.2f}x | {total.tokens_per_forward:.2f} | {verified} | "
            f"{same[k, cut]}/{len(inputs)} |"
        )


if __name__ == "__main__":
    main()
