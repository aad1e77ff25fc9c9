"""Core speed on this machine: specdec vs transformers, verify cost, bandwidth roofline.

    python benchmarks/bench_core.py [--tokens 128] [--repeats 5] [--out docs/core_speed.md]

1. Target-only greedy decoding of --tokens tokens on a random-init ~100M-parameter Llama in
   bfloat16: specdec's tokens/s vs transformers' `generate` on the same saved weights,
   interleaved run by run so machine drift hits both alike (median of --repeats).
2. One verify forward of 6 tokens (k = 5 drafts + the last token) vs one single-token decode
   step, at the same context length.
3. The roofline: weight bytes / streaming read bandwidth, measured here by summing a buffer
   larger than the last-level cache, and by summing a weight-sized buffer (which a large
   cache may hold); target-only decoding as a fraction of each.
Prints Markdown tables; --out also writes them to a file.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams
from specdec.engine import Engine
from specdec.models.loader import load_pretrained
from specdec.paths import BUILD
from specdec.tools.benchmark.machine import read_bandwidth
from specdec.worker import ModelRunner

ROOT = Path(__file__).resolve().parent.parent

MODEL_DIR = BUILD / "llama-100m-random"


def make_model(path: Path) -> Path:
    """A ~100M-parameter Llama (hidden 768, 12 layers, GQA 12/4, vocab 32000, tied) in bf16."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from specdec.output_dir import open_output_dir

    if (path / "config.json").is_file():
        return path
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    with open_output_dir(
        path, "bench_core", resumable=False
    ) as output:  # an interrupted build leaves nothing that loads
        output.clear_staging()
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(output.staging)
        return output.commit()


def time_call(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_speed(path: Path, num_tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    llm = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, speculative_method="none")
    # the same engine over an unpacked load: what prepacking the weights is worth
    unpacked = load_pretrained(path, "bfloat16", "cpu", load_tokenizer=False)
    llm_unpacked = llm.target_only()
    llm_unpacked.target = unpacked
    llm_unpacked.engine = Engine(
        ModelRunner(unpacked.model, compile="off", pack_weights=False), None, 0, unpacked.eos_token_ids, None
    )

    prompt = torch.randint(2, 32000, (1, 32), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)

    def run_hf():
        with torch.inference_mode():
            hf.generate(prompt, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False)

    runs = {
        "specdec": lambda: llm.generate(prompt[0].tolist(), params),
        "specdec (weights not prepacked)": lambda: llm_unpacked.generate(prompt[0].tolist(), params),
        "transformers generate": run_hf,
    }
    for fn in runs.values():  # warm-up
        fn()
    seconds = {name: [] for name in runs}
    for _ in range(repeats):  # interleaved
        for name, fn in runs.items():
            seconds[name].append(time_call(fn))
    ours = llm.generate(prompt[0].tolist(), params)[0].outputs[0].token_ids
    with torch.inference_mode():
        theirs = hf.generate(prompt, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False)[
            0, 32:
        ].tolist()
    tokens_per_second = {name: num_tokens / statistics.median(s) for name, s in seconds.items()}
    agree = sum(a == b for a, b in zip(ours, theirs))
    return {"tokens_per_second": tokens_per_second, "greedy_agreement": (agree, num_tokens), "model": llm.target.model}


def verify_cost(model, context: int = 128, repeats: int = 30) -> dict:
    """Median seconds of one forward of T tokens after `context` cached tokens, T = 1 and 6."""
    cache = model.new_cache(1, context + 16)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        model(torch.randint(2, 32000, (1, context), generator=g), torch.arange(context)[None], cache)
        result = {}
        for num_tokens in (1, 6):
            ids = torch.randint(2, 32000, (1, num_tokens), generator=g)
            positions = torch.arange(context, context + num_tokens)[None]
            for _ in range(3):
                model(ids, positions, cache)
            result[num_tokens] = statistics.median(
                time_call(functools.partial(model, ids, positions, cache)) for _ in range(repeats)
            )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="also write the tables to this Markdown file")
    args = parser.parse_args()

    path = make_model(MODEL_DIR)
    speed = decode_speed(path, args.tokens, args.repeats)
    model = speed["model"]
    costs = verify_cost(model)
    n_bytes = model.config.num_parameters * 2  # bf16 weights as a decode step reads them
    big_bandwidth = read_bandwidth(4 << 30)
    warm_bandwidth = read_bandwidth(n_bytes)
    tps = speed["tokens_per_second"]
    lines = [
        f"## Core speed ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__})",
        "",
        f"Random-init Llama, {model.config.num_parameters / 1e6:.0f}M parameters, bfloat16, "
        f"greedy, {args.tokens} new tokens after a 32-token prompt, median of {args.repeats} interleaved runs.",
        "",
        "| decoder | tokens/s | vs transformers |",
        "|---|---:|---:|",
    ]
    base = tps["transformers generate"]
    for name, value in tps.items():
        lines.append(f"| {name} | {value:.1f} | {value / base:.2f}x |")
    agree, total = speed["greedy_agreement"]
    lines += [
        "",
        f"Greedy tokens identical to transformers: {agree}/{total} (bf16 rounding may flip near-ties).",
        "",
        "| forward | ms | ratio |",
        "|---|---:|---:|",
        f"| 1 token (decode step) | {costs[1] * 1e3:.2f} | 1.00 |",
        f"| 6 tokens (verify, k=5) | {costs[6] * 1e3:.2f} | {costs[6] / costs[1]:.2f} |",
        "",
        "| roofline | read GB/s | ceiling tok/s | specdec tok/s as fraction |",
        "|---|---:|---:|---:|",
    ]
    for label, bandwidth in (
        ("4 GiB buffer (DRAM)", big_bandwidth),
        (f"{n_bytes / 1e6:.0f} MB buffer (weight-sized, cache-warm)", warm_bandwidth),
    ):
        ceiling = bandwidth / n_bytes
        lines.append(f"| {label} | {bandwidth / 1e9:.1f} | {ceiling:.1f} | {tps['specdec'] / ceiling:.2f} |")
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
