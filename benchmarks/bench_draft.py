"""How fast one draft step runs in each draft dtype, and the cost ratio c it gives.

    python benchmarks/bench_draft.py [--target DIR --draft DIR] [--dtype bfloat16] [--repeats 5]

A draft step is one token through the draft with a warm cache (specdec.tools.benchmark.machine.
step_seconds, the fastest of --repeats measurements). "auto" is what LLM(draft_dtype="auto")
picks: on the CPU, for a small draft, float32 with its matrices of 2 MB or more (in the
shipped draft, only the output layer) prepacked in bfloat16.
The table prints the step time and c = draft step ÷ target step for each choice.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specdec.config import DRAFT_DTYPES, SpeculativeConfig
from specdec.drafters import DRAFTERS
from specdec.models.loader import load_pretrained
from specdec.paths import SHIPPED_DRAFT, SHIPPED_TARGET
from specdec.tools.benchmark.machine import step_seconds
from specdec.worker import ModelRunner

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(SHIPPED_TARGET))
    parser.add_argument("--draft", default=str(SHIPPED_DRAFT))
    parser.add_argument("--dtype", default="bfloat16", help="the target's dtype")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    target = load_pretrained(args.target, args.dtype, args.device)
    target_runner = ModelRunner(target.model, compile="off")
    target_step = min(step_seconds(target_runner) for _ in range(args.repeats))
    print(
        f"target {Path(args.target).name} in {args.dtype}: one step {target_step * 1e3:.3f} ms "
        f"({torch.get_num_threads()} threads, {args.device})\n"
    )
    print("| draft dtype | runs as | one draft step | c |")
    print("|---|---|---:|---:|")
    for draft_dtype in DRAFT_DTYPES:
        spec = SpeculativeConfig(method="draft_model", model=args.draft, draft_dtype=draft_dtype)
        runner = DRAFTERS["draft_model"](spec, target, target_runner).runner
        draft_step = min(step_seconds(runner) for _ in range(args.repeats))
        model = runner.eager_model()
        print(f"| {draft_dtype} | {_runs_as(model)} | {draft_step * 1e3:.3f} ms | {draft_step / target_step:.3f} |")


def _runs_as(model) -> str:
    """The model's dtype, and which of its matrices run prepacked in bfloat16."""
    from specdec.models.cpu_linear import Bf16PackedLinear

    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    packed = [name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, Bf16PackedLinear)]
    if not packed:
        return dtype
    kinds = ", ".join(sorted(set(packed)))
    return f"{dtype}; {len(packed)} matri{'x' if len(packed) == 1 else 'ces'} ({kinds}) prepacked in bfloat16"


if __name__ == "__main__":
    main()
