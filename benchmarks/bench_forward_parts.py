"""Where a GGUF model's forward of n tokens goes: the whole forward against its quantized products
alone (every GGUFLinear of the loaded model called once on n random rows, by kind), so that what
is left (attention, norms, RoPE, the calls between) shows as the difference.

    python benchmarks/bench_forward_parts.py [--model qwen2.5-coder-1.5b-instruct] [--rows 1,7,16]
        [--context 256] [--repeats 9]

The target is loaded as LLM loads it (the CPU's default kernel; hold one with SPECDEC_KERNEL and
ATEN_CPU_CAPABILITY as bench_verify_width.py does), a context of --context tokens prefilled, and
then, in turn for each width, a forward over the same positions and each kind of product; every
repetition times them all, and the table gives medians in ms and each width's ratio to one row.
A product here reads its weights as it does in the forward (from memory, one kind after
another), but not interleaved with the layer's other work.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import LLM
from specdec.models.gguf_linear import GGUFLinear
from specdec.worker import ForwardBatch


def products_by_kind(model: torch.nn.Module) -> dict[str, list[GGUFLinear]]:
    """The model's GGUF products in model order, by the name they have in each layer (qkv_proj,
    gate_up_proj, lm_head, ...)."""
    kinds: dict[str, list[GGUFLinear]] = {}
    for name, module in model.named_modules():
        if isinstance(module, GGUFLinear):
            kinds.setdefault(name.rsplit(".", 1)[-1], []).append(module)
    return kinds


def seconds(work, n: int) -> float:
    """Seconds of work(n)."""
    start = time.perf_counter()
    work(n)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--rows", default="1,7,16", help="forward widths in tokens, comma-separated (1 first)")
    parser.add_argument("--context", type=int, default=256, help="tokens before the timed forwards")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    rows = sorted({int(n) for n in args.rows.split(",")} | {1})

    llm = LLM(args.model, speculative_method="none")
    runner = llm.runner
    kinds = products_by_kind(runner.model)
    if not kinds:
        parser.error(f"{args.model} runs no GGUF product on this machine: nothing to split")
    runner.prepare(1, args.context + max(rows) + 16, tuple(rows), 0)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, runner.config.vocab_size, (1, args.context + max(rows)), generator=generator)

    def forward(n: int) -> None:
        positions = torch.arange(args.context, args.context + n)[None]  # [1, n]
        runner(ForwardBatch.of(ids[:, args.context : args.context + n], positions, [0]))

    inputs = {n: {id(m): torch.randn(n, m.input_size) for ms in kinds.values() for m in ms} for n in rows}

    def products(n: int, modules: list[GGUFLinear]) -> None:
        for module in modules:
            module.product(inputs[n][id(module)])

    every = [m for ms in kinds.values() for m in ms]
    parts = {"forward": forward, "all products": lambda n: products(n, every)}
    parts.update({kind: (lambda n, ms=ms: products(n, ms)) for kind, ms in kinds.items()})
    times: dict[tuple[str, int], list[float]] = {(part, n): [] for part in parts for n in rows}
    with torch.inference_mode():
        runner(ForwardBatch.of(ids[:, : args.context], torch.arange(args.context)[None], [0]))
        for n in rows:  # warm
            for work in parts.values():
                work(n)
        for _ in range(args.repeats):
            for n in rows:
                for part, work in parts.items():
                    times[part, n].append(seconds(work, n))

    threads = torch.get_num_threads()
    print(
        f"{args.model}, a forward of n tokens after {args.context}, {threads} threads, ms (median of {args.repeats})\n"
    )
    ratios = " | ".join(f"x 1 row at {n}" for n in rows[1:])
    print("| part | " + " | ".join(f"{n} rows" for n in rows) + " | " + ratios + " |")
    print("|---|" + "---:|" * (2 * len(rows) - 1))
    medians = {key: statistics.median(value) * 1e3 for key, value in times.items()}
    for part in [*parts, "the rest"]:
        ms = [
            medians["forward", n] - medians["all products", n] if part == "the rest" else medians[part, n] for n in rows
        ]
        cells = " | ".join(f"{v:.2f}" for v in ms) + " | "
        cells += " | ".join(f"{v / ms[0]:.2f}" if ms[0] > 0 else "-" for v in ms[1:])
        print(f"| {part} | {cells} |")


if __name__ == "__main__":
    main()
