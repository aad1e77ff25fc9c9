"""Never slower than plain decoding: the cases where speculation does not pay, with k by goodput.

    python benchmarks/bench_never_slower.py [--target DIR --draft DIR] [-k 5] [--max-tokens 64]
    tools/both-cpus .venv/bin/python benchmarks/bench_never_slower.py

Each case runs the target alone, then speculation with k fixed, then with k by goodput (at most
k; LLM's default), on the same held-out code prompts, back to back, and prints tokens/s and the
ratio to the target alone (goal: goodput >= 0.95x in every case, and >= 1.5x at batch 4 greedy).
Each case runs --repeats times, the three interleaved, and keeps each one's best tokens/s (the
2-core machines are shared: the best is the least disturbed):
  random draft       a draft of the shipped draft's shape with random weights (α ~ 0), greedy
  temperature 1.5    the shipped draft, sampled at temperature 1.5 (α falls)
  batch 4 / 16 / 32  the shipped draft, prompts run together, greedy and sampled (0.8 / 0.95)
The goodput rows also say how many rounds ran at each k.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams, SpecStats
from specdec.config import COMPILE_HELP, COMPILE_MODES, SpeculativeConfig
from specdec.drafters import DRAFTERS
from specdec.metrics import rounds_by_k_text
from specdec.models.checkpoint import save_pretrained
from specdec.models.loader import load_pretrained
from specdec.paths import SHIPPED_DRAFT, SHIPPED_TARGET
from specdec.platform import detect_platform
from specdec.tools.benchmark.prompts import held_out_code_prompts

ROOT = Path(__file__).resolve().parent.parent

GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.8, top_p=0.95)
HOT = dict(temperature=1.5)


def random_draft_like(draft_dir: str, out: Path) -> Path:
    """The draft's architecture and tokenizer with random weights (normal, std 0.02)."""
    model = load_pretrained(draft_dir, "float32", "cpu").model
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    save_pretrained(model, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(draft_dir) / name).is_file():
            shutil.copyfile(Path(draft_dir) / name, out / name)
    return out


def run(llm: LLM, prompts: list[str], params: SamplingParams, batch: int) -> tuple[float, SpecStats]:
    """tokens/s of generating every prompt, batch prompts at a time."""
    tokens, seconds, stats = 0, 0.0, []
    for start in range(0, len(prompts), batch):
        begin = time.perf_counter()
        outputs = llm.generate(prompts[start : start + batch], params)
        seconds += time.perf_counter() - begin
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
        stats += [o.metrics for o in outputs]
    return tokens / seconds, SpecStats.merge(stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(SHIPPED_TARGET))
    parser.add_argument("--draft", default=str(SHIPPED_DRAFT))
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--compile", choices=COMPILE_MODES, default="auto", help=COMPILE_HELP)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    target = LLM(args.target, compile=args.compile, speculative_method="none")
    plain = target.target_only()
    shipped = DRAFTERS["draft_model"](
        SpeculativeConfig(method="draft_model", model=args.draft), target.target, target.runner
    )
    with tempfile.TemporaryDirectory() as tmp:
        random_dir = random_draft_like(args.draft, Path(tmp) / "random-draft")
        useless = DRAFTERS["draft_model"](
            SpeculativeConfig(method="draft_model", model=str(random_dir)), target.target, target.runner
        )
    prompts = [p.text for p in held_out_code_prompts(2, max_chars=800)]
    cases = [("random draft, greedy", useless, GREEDY, 1), ("temperature 1.5", shipped, HOT, 1)]
    cases += [
        (f"batch {b}, {name}", shipped, sampling, b)
        for b in (4, 16, 32)
        for name, sampling in (("greedy", GREEDY), ("sampled", SAMPLED))
    ]
    print(
        f"{Path(args.target).name} + {Path(args.draft).name}, {detect_platform('cpu').describe()}, "
        f"{torch.get_num_threads()} threads, target in {str(target.runner.dtype).removeprefix('torch.')}, "
        f"compile={args.compile}, {len(prompts)} held-out code prompts, {args.max_tokens} tokens each, k={args.k}\n"
    )
    print(
        "| case | target alone | fixed k | goodput k | goodput ÷ target alone | fixed ÷ target alone "
        "| goodput rounds by k |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, drafter, sampling, batch in cases:
        params = SamplingParams(max_tokens=args.max_tokens, **sampling)
        fixed, goodput = target.with_drafter(drafter, args.k, "fixed"), target.with_drafter(drafter, args.k, "goodput")
        for llm in (plain, fixed, goodput):
            llm.warm_up(prompts[0], params)
        rates = {"plain": 0.0, "fixed": 0.0, "goodput": 0.0}
        for _ in range(args.repeats):
            for label, llm in (("plain", plain), ("fixed", fixed), ("goodput", goodput)):
                rate, stats = run(llm, prompts, params, batch)
                rates[label] = max(rates[label], rate)
                if label == "goodput":
                    by_k = rounds_by_k_text(stats.rounds_by_k)
        print(
            f"| {name} | {rates['plain']:.1f} | {rates['fixed']:.1f} | {rates['goodput']:.1f} | "
            f"{rates['goodput'] / rates['plain']:.2f}x | {rates['fixed'] / rates['plain']:.2f}x | {by_k} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
