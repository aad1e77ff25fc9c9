"""What the runner buys: one model's decode step and verify forward, eager against compiled,
unquantized against int8 / int4 weights, and the step against the memory-bandwidth roofline.

    python benchmarks/bench_runner.py [--model DIR | --shape smollm2-135m] [--dtype auto] [-k 5] [--pack on,off]
        [--compile off,on] [--quantization none,int8,int4]
    tools/both-cpus .venv/bin/python benchmarks/bench_runner.py   # both CPU kinds

--shape smollm2-135m builds a random model of SmolLM2-135M's shape (30 layers, hidden 576,
9 heads, 3 KV heads, vocabulary 49152, tied embeddings; no download), in the dtype "auto"
picks for a bfloat16 checkpoint on this CPU. For each way to run, the median time of a
one-token step and of a (k+1)-token verify forward after a context of 64 tokens (batch 1),
v = verify ÷ step (the number speculation lives on: it must stay near 1), and the step's
fraction of the roofline: (weight bytes a step reads ÷ streaming read bandwidth) ÷ step time.
The compile time is printed by the runner's log line.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from specdec.models.llama import LlamaModel, ModelConfig
from specdec.models.loader import load_pretrained
from specdec.paths import SHIPPED_TARGET
from specdec.platform import auto_dtype, detect_platform
from specdec.tools.benchmark.machine import decode_weight_bytes, read_bandwidth, step_seconds
from specdec.worker import ModelRunner

ROOT = Path(__file__).resolve().parent.parent

SHAPES = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
}


def load(args) -> LlamaModel:
    """A fresh copy of the model (the runner quantizes and packs it in place)."""
    if args.shape is None:
        return load_pretrained(args.model, args.dtype, "cpu", load_tokenizer=False).model
    dtype = (
        auto_dtype(torch.bfloat16, detect_platform("cpu"))[0] if args.dtype == "auto" else getattr(torch, args.dtype)
    )
    torch.manual_seed(0)
    model = LlamaModel(SHAPES[args.shape])
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.02)
    return model.to(dtype).eval().requires_grad_(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SHIPPED_TARGET))
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a random model of this shape instead of --model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--compile", default="off,on", help="comma-separated compile modes to run")
    parser.add_argument("--quantization", default="none", help="comma-separated: none, int8, int4")
    parser.add_argument(
        "--pack", default="on", help="comma-separated: on (eager weights prepacked for oneDNN, the default), off"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="specdec: %(message)s")
    bandwidth = read_bandwidth(1 << 30)
    name = args.shape or Path(args.model).name
    print(
        f"{name} on {detect_platform('cpu').describe()}, {torch.get_num_threads()} threads, "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s\n"
    )
    print(
        f"| run | dtype | weights | step (1 token) | verify ({args.k + 1} tokens) | v = verify ÷ step "
        "| weight MB | of roofline |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    runs = [
        (q, mode, pack)
        for q in args.quantization.split(",")
        for mode in args.compile.split(",")
        for pack in args.pack.split(",")
    ]
    for quantization, mode, pack in runs:
        runner = ModelRunner(
            load(args),
            compile=mode,
            quantization=None if quantization == "none" else quantization,
            pack_weights=pack == "on",
        )
        step = step_seconds(runner, args.repeats)
        verify = step_seconds(runner, args.repeats, num_tokens=args.k + 1)
        weight_bytes = decode_weight_bytes(runner.eager_model())
        print(
            f"| {'compiled' if mode == 'on' else 'eager'} | {str(runner.dtype).removeprefix('torch.')} | "
            f"{quantization}{'' if pack == 'on' else ' (not prepacked)'} | {step * 1e3:.2f} ms | "
            f"{verify * 1e3:.2f} ms | {verify / step:.2f} | "
            f"{weight_bytes / 1e6:.0f} | {weight_bytes / bandwidth / step:.2f} |",
            flush=True,
        )
        del runner


if __name__ == "__main__":
    main()
