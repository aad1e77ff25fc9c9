"""What a verify of n tokens costs in decode steps, V(n), for every GGUF kernel this CPU has:
the number a round's cost, goodput and tree width live on (issue 52's goals).

    python benchmarks/bench_verify_width.py [--model qwen2.5-coder-1.5b-instruct]
        [--kinds default,amx,avx512_vnni,avx_vnni,avx2] [--rows 1,2,4,7,8,12,16,24,32] [--repeats 9]

Each kernel kind runs in a Python of its own, held by SPECDEC_KERNEL (avx_vnni and avx2 with
PyTorch held to AVX2 too, ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2: a CPU without AVX-512
runs every op that way), and "default" with nothing held (what a user gets: on an AMX CPU, VNNI
with the tiles for the Q4_K and Q5_K products of 32 rows or more); a kind the CPU lacks is left
out with the reason. Kinds in different processes compare only roughly: a wide forward is bound by
the core and a step by memory, and a shared host's drift moves the two apart (to compare the tiles
with VNNI on an AMX CPU, `set_kernel` switches them within one process: docs/runner.md). In each,
the target is loaded as LLM loads it, a context of --context tokens is prefilled, and then
forwards of each width in --rows (1 = a decode step) are timed in turn, the order rotated every
repetition, so that the host's drift hits every width alike; V(n) is the median over repetitions
of the n-token forward's time ÷ the 1-token forward's of the same repetition. Threads: PyTorch's default (the
cores). Prints a table (the step in ms, V(n) per width) and issue 52's goals for the kinds measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# a kind: whether PyTorch is held to AVX2 too; SPECDEC_KERNEL holds the kernel, except for
# "default", the kernel (and AMX policy) this CPU gets with nothing held
KINDS = {"default": False, "amx": False, "avx512_vnni": False, "avx_vnni": True, "avx2": True}
HELD_TO_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# issue 52's goals: kind -> {rows: the most steps a verify of that many rows may cost}
GOALS = {"amx": {7: 1.2, 16: 1.5}, "avx512_vnni": {7: 1.5, 16: 2.5}, "avx_vnni": {7: 2.0}, "avx2": {7: 2.0}}


def widths_of(rows: list[int]) -> list[int]:
    """The widths timed: 1 (the step every V(n) divides by) first, then the others, each once."""
    return [1, *sorted(set(rows) - {1})]


def measure(model: str, rows: list[int], repeats: int, context: int) -> dict:
    """In this process (its kernel as SPECDEC_KERNEL holds it): the step's median seconds and
    V(n) for each n in rows."""
    import torch

    from specdec import LLM
    from specdec.kernels import qmatmul
    from specdec.worker import ForwardBatch

    llm = LLM(model, speculative_method="none")
    runner = llm.runner
    widest = max(rows)
    widths = widths_of(rows)
    runner.prepare(1, context + widest + 16, tuple(widths), 0)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, runner.config.vocab_size, (1, context + widest), generator=generator)  # [1, positions]

    def forward(n: int) -> float:
        """Seconds of one forward of n tokens after the context (written over the same positions)."""
        batch = ForwardBatch.of(ids[:, context : context + n], torch.arange(context, context + n)[None], [0])
        start = time.perf_counter()
        runner(batch)
        return time.perf_counter() - start

    with torch.inference_mode():
        runner(ForwardBatch.of(ids[:, :context], torch.arange(context)[None], [0]))  # the context
        for n in widths:  # warm: pages, code, any lazily packed layout
            forward(n)
        seconds: dict[int, list[float]] = {n: [] for n in widths}
        ratios: dict[int, list[float]] = {n: [] for n in widths}
        for r in range(repeats):
            shift = r % len(widths)
            this = {n: forward(n) for n in widths[shift:] + widths[:shift]}
            for n in widths:
                seconds[n].append(this[n])
                ratios[n].append(this[n] / this[1])
    return {
        "kernel": qmatmul().isa(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "step_ms": statistics.median(seconds[1]) * 1e3,
        "steps": {n: statistics.median(ratios[n]) for n in widths},
    }


def run_kind(kind: str, args) -> dict:
    """measure() in a fresh Python held to kind (PyTorch reads ATEN_CPU_CAPABILITY at start)."""
    env = {**os.environ, "SPECDEC_KERNEL": kind, **(HELD_TO_AVX2 if KINDS[kind] else {})}
    if kind == "default":
        env.pop("SPECDEC_KERNEL")
    command = [sys.executable, __file__, "--model", args.model, "--rows", args.rows, "--repeats", str(args.repeats)]
    command += ["--context", str(args.context), "--child"]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": last}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["steps"] = {int(n): v for n, v in result["steps"].items()}  # JSON's keys are strings
    return result


def goal_lines(results: dict[str, dict]) -> list[str]:
    lines = []
    for kind, goals in GOALS.items():
        result = results.get(kind)
        for n, bar in goals.items():
            if result is None or "error" in result or n not in result["steps"]:
                continue
            measured = result["steps"][n]
            verdict = "met" if measured <= bar else "**missed**"
            lines.append(f"| {kind} | {n} rows <= {bar:.1f} steps | {measured:.2f} | {verdict} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--kinds", default=",".join(KINDS), help="kernel kinds, comma-separated")
    parser.add_argument("--rows", default="1,2,4,7,8,12,16,24,32", help="forward widths in tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--context", type=int, default=256, help="tokens before the timed forwards")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows = [int(n) for n in args.rows.split(",")]
    if any(n < 1 for n in rows):
        parser.error(f"--rows must be positive token counts, got {args.rows}")
    if args.child:
        print(json.dumps(measure(args.model, rows, args.repeats, args.context)))
        return
    kinds = args.kinds.split(",")
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown:
        parser.error(f"--kinds: {', '.join(unknown)} is not a kernel kind; choose from {', '.join(KINDS)}")

    from specdec.platform import cpu_model

    results = {}
    for kind in kinds:
        print(f"measuring {kind} ...", file=sys.stderr, flush=True)
        results[kind] = run_kind(kind, args)
    widths = widths_of(rows)
    print(f"{args.model}, {cpu_model()}, a forward of n tokens after {args.context}, in decode steps")
    print(f"(median of {args.repeats} rotated repetitions each)\n")
    print("| kernel | PyTorch | step, ms | " + " | ".join(f"V({n})" for n in widths[1:]) + " |")
    print("|---|---|---:|" + "---:|" * (len(widths) - 1))
    for kind, result in results.items():
        if "error" in result:
            print(f"| {kind} | left out: {result['error']} |")
            continue
        cells = " | ".join(f"{result['steps'][n]:.2f}" for n in widths[1:])
        print(f"| {result['kernel']} | {result['capability']} | {result['step_ms']:.1f} | {cells} |")
    lines = goal_lines(results)
    if lines:
        print("\nIssue 52's goals for a verify:\n")
        print("| kernel | goal | measured | verdict |\n|---|---|---:|---|")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
