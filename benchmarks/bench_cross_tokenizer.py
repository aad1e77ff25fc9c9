"""A draft with another tokenizer than its target's (drafters/cross_tokenizer.py) on coding chats.

    python benchmarks/bench_cross_tokenizer.py [--target qwen2.5-coder-1.5b-instruct]
        [--draft ~/.cache/specdec/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf] [-k 3 5] [--max-tokens 128]

For each chat (LLM.chat, greedy) the target alone and the target with the draft at each fixed k
run back to back; one row each: whether the output is the target's, α (accepted ÷ judged),
accepted ÷ proposed, τ (tokens per target forward), target tokens proposed per round, rounds
that proposed nothing (the junction refused), tokens/s of both and their ratio, and where the
drafter's time went: its tokenizer work (re-encoding the target's text, carrying the draft's text
over) and its model (catch-up and draft forwards).
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

from specdec import LLM, SamplingParams
from specdec.drafters import CrossTokenizerDrafter

CHATS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring and type hints.",
    "Write a Python class Stack with push, pop, peek and is_empty methods, and a short example of its use.",
)
SMOLLM2_GGUF = Path.home() / ".cache/specdec/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class Timings:
    """Since reset(): seconds in the drafter's tokenizer work (re-encoding the target's text,
    carrying the draft over) and in its model (the drafting loop less the carrying over), and
    its rounds and the rounds that proposed nothing (batch 1: one _draft call a round)."""

    def __init__(self, drafter: CrossTokenizerDrafter):
        self.reset()
        drafter._read = self._timed("read", drafter._read)
        drafter._carry_over = self._timed("carry", drafter._carry_over)
        drafter._draft = self._timed("drafting", drafter._draft, count_rounds=True)

    def reset(self) -> None:
        self.seconds = {"read": 0.0, "carry": 0.0, "drafting": 0.0}
        self.rounds = self.empty = 0

    @property
    def tokenizer_seconds(self) -> float:
        return self.seconds["read"] + self.seconds["carry"]

    @property
    def model_seconds(self) -> float:
        return self.seconds["drafting"] - self.seconds["carry"]

    def _timed(self, name: str, method, count_rounds: bool = False):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = method(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - start
            if count_rounds:
                self.rounds += 1
                self.empty += sum(not proposal for proposal in result)
            return result

        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default=str(SMOLLM2_GGUF))
    parser.add_argument("-k", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    llm = LLM(args.target, speculative_model=args.draft, num_speculative_tokens=max(args.k))
    drafter = llm.engine.drafter
    if not isinstance(drafter, CrossTokenizerDrafter):
        raise SystemExit(f"{args.draft} shares {args.target}'s tokenizer: it drafts as a plain draft model")
    timings = Timings(drafter)
    plain = llm.target_only()
    speculative = {k: llm.with_drafter(drafter, k, "fixed") for k in args.k}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    warm_up = SamplingParams(temperature=0, max_tokens=8)
    for decoder in (plain, *speculative.values()):
        decoder.chat([{"role": "user", "content": CHATS[0]}], warm_up)

    print(f"## {Path(args.draft).name} drafting for {args.target}, greedy, {args.max_tokens} new tokens\n")
    print(
        "| chat | k | identical | α | accepted ÷ proposed | τ | proposed per round | empty rounds "
        "| tokens/s plain | tokens/s draft | ratio | tokenizers s | draft model s |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for chat_index, chat in enumerate(CHATS):
        messages = [{"role": "user", "content": chat}]
        for k, decoder in speculative.items():  # interleaved: the target alone, then with the draft
            alone = plain.chat(messages, params)[0]
            timings.reset()
            ours = decoder.chat(messages, params)[0]
            stats, base = ours.metrics, alone.metrics
            print(
                f"| {chat_index} | {k} | {ours.outputs[0].token_ids == alone.outputs[0].token_ids} | "
                f"{stats.acceptance_rate:.3f} | {stats.proposed_acceptance_rate:.3f} | "
                f"{stats.tokens_per_forward:.2f} | "
                f"{stats.num_draft_tokens / max(1, timings.rounds):.2f} | {timings.empty}/{timings.rounds} | "
                f"{base.tokens_per_second:.2f} | {stats.tokens_per_second:.2f} | "
                f"{stats.tokens_per_second / base.tokens_per_second:.2f}x | {timings.tokenizer_seconds:.2f} | "
                f"{timings.model_seconds:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
