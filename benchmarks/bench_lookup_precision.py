"""Prompt lookup's precision on the target's own greedy answers, by the length of the n-gram it
matched: what prompt lookup would propose at each position of each answer (k tokens, the longest
match of 4 down to 1 tokens, as drafters/ngram.py looks it up), against what the target wrote.

    python benchmarks/bench_lookup_precision.py [--data CHAT_DATA] [--model qwen2.5-coder-1.5b-instruct] [-k 5]

CHAT_DATA: a `specdec chat-data` directory (its held-out answers, `held_out/*-greedy.txt`: the
chat rendered with the target's template, the answer after the last assistant header). No model
runs: the answers are the target's greedy text, so a proposal is accepted exactly as far as it
agrees with the text that follows. Printed per kind of prompt (write, edit, explain)
and per matched length n: the share of positions, how often the first proposed token is right, and
the mean accepted run (of k). It says which matches are worth taking over a drafter that costs
something (lookup_then_draft takes matches of n >= 2: docs/runner.md, "What gets drafted").
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import numpy as np

from specdec.drafters.ngram import lookup
from specdec.paths import CACHE
from specdec.prompts import PromptEncoder
from specdec.tools.training.chat_prompts import kind_of

ASSISTANT = "<|im_start|>assistant\n"  # Qwen2.5's template: the answer follows the last one
USER = "<|im_start|>user\n"  # and the user's message the last of these
NGRAM_MAX = 4


def accepted_run(proposal: np.ndarray, truth: np.ndarray) -> int:
    """How many of proposal's tokens, from the first, agree with truth."""
    agree = proposal[: len(truth)] == truth[: len(proposal)]
    return int(agree.argmin()) if not agree.all() else len(agree)


def longest_match(context: np.ndarray, k: int) -> tuple[int, np.ndarray]:
    """(n, proposal): the longest n (NGRAM_MAX down to 1) whose match proposes something; (0, empty)."""
    for n in range(NGRAM_MAX, 0, -1):
        proposal = lookup(context, k, n, n)
        if len(proposal):
            return n, proposal
    return 0, context[:0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=CACHE / "data" / "qwen2.5-coder-1.5b-chat")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="whose tokenizer")
    parser.add_argument("-k", type=int, default=5)
    args = parser.parse_args()
    answers = sorted((args.data / "held_out").glob("*-greedy.txt"))
    if not answers:
        raise SystemExit(f"no held-out greedy answers in {args.data / 'held_out'}: run specdec chat-data first")
    tokenizer = PromptEncoder.load(args.model).tokenizer
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in answers:
        text = path.read_text(encoding="utf-8")
        cut = text.rindex(ASSISTANT) + len(ASSISTANT)
        kind = kind_of(text[:cut].rpartition(USER)[2])
        ids = np.asarray(tokenizer.encode(text))
        for t in range(len(tokenizer.encode(text[:cut])), len(ids) - 1):
            n, proposal = longest_match(ids[:t], args.k)
            counts[kind][n] += 1
            if n:
                run = accepted_run(proposal, ids[t : t + args.k])
                counts[kind][f"first{n}"] += run > 0
                counts[kind][f"run{n}"] += run
    print(f"{len(answers)} held-out greedy answers, k = {args.k}")
    print("| prompts | matched n | positions | first token right | mean accepted run |")
    print("|---|---:|---:|---:|---:|")
    for kind, c in sorted(counts.items()):
        total = sum(c[n] for n in range(NGRAM_MAX + 1))
        print(f"| {kind} | none | {c[0]} ({c[0] / total:.0%}) | | |")
        for n in range(1, NGRAM_MAX + 1):
            if c[n]:
                first, run = c[f"first{n}"] / c[n], c[f"run{n}"] / c[n]
                print(f"| {kind} | {n} | {c[n]} ({c[n] / total:.0%}) | {first:.2f} | {run:.2f} |")


if __name__ == "__main__":
    main()
