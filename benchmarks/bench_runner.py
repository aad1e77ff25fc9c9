"""What compiling buys: one model's decode step and verify forward, eager against compiled.

    python benchmarks/bench_runner.py [--model DIR] [--dtype auto] [-k 5]
    ../shared/tools/both-cpus .venv/bin/python benchmarks/bench_runner.py   # both CPU kinds

For each way to run (ModelRunner compile="off", then "on"), the median time of a one-token
step and of a (k+1)-token verify forward after a context of 64 and of 400 tokens (batch 1),
and v = verify ÷ step, the number speculation lives on (it must stay near 1). The compile
time is printed by the runner's log line.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from specdec.benchmark.machine import step_seconds  # noqa: E402
from specdec.models.loader import load_pretrained  # noqa: E402
from specdec.paths import SHIPPED_TARGET  # noqa: E402
from specdec.platform import detect_platform  # noqa: E402
from specdec.runner import ModelRunner  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SHIPPED_TARGET))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="specdec: %(message)s")
    print(f"{Path(args.model).name} on {detect_platform('cpu').describe()}, {torch.get_num_threads()} threads\n")
    print(f"| run | dtype | context | step (1 token) | verify ({args.k + 1} tokens) | v = verify ÷ step |")
    print("|---|---|---:|---:|---:|---:|")
    for mode in ("off", "on"):
        runner = ModelRunner(load_pretrained(args.model, args.dtype, "cpu", load_tokenizer=False).model,
                             compile=mode)
        for context in (64, 400):
            step = step_seconds(runner, args.repeats, context=context)
            verify = step_seconds(runner, args.repeats, context=context, num_tokens=args.k + 1)
            print(f"| {'compiled' if mode == 'on' else 'eager'} | {str(runner.dtype).removeprefix('torch.')} | "
                  f"{context} | {step * 1e3:.2f} ms | {verify * 1e3:.2f} ms | {verify / step:.2f} |", flush=True)


if __name__ == "__main__":
    main()
