"""What running a GGUF file quantized (specdec's kernel) costs in quality, against the file's
values dequantized to float32 (quantization=None), the reference.

1. Per tensor type: whether the packed form holds exactly the values llama.cpp's `gguf`
   package dequantizes to, and the largest difference over every tensor of that type.
2. Whole model: the greedy agreement (teacher-forced: at each position of the reference's own
   greedy continuation, whether the quantized model's argmax is the reference's) and the
   perplexity of both on held-out text. The remaining difference is the kernel's int8
   activations (per block of 32, as llama.cpp computes these types).

    .venv/bin/python benchmarks/bench_gguf_quality.py [MODEL] [--prompts 8] [--tokens 64]

MODEL: a registered name or a .gguf path (default qwen2.5-coder-1.5b-instruct).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from specdec import LLM, SamplingParams
from specdec.models.gguf_linear import dequantize
from specdec.models.gguf_quants import LAYOUTS, pack
from specdec.models.registry import resolve_model
from specdec.tools.benchmark.prompts import HELD_OUT_MODULES, held_out_chat_prompts, stdlib_path

HELD_OUT_TEXT = stdlib_path() / HELD_OUT_MODULES[0]  # code the project's own pairs never train on


def tensor_errors(path: Path) -> dict[str, dict]:
    """Per GGUF type: tensors, weights, largest |packed - gguf's dequantization|."""
    reader = gguf.GGUFReader(str(path))
    result: dict[str, dict] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in LAYOUTS or len(tensor.shape) != 2:
            continue
        cols, rows = (int(n) for n in tensor.shape)
        raw = np.asarray(tensor.data)
        packed = pack(kind, raw, rows, cols)
        stats = result.setdefault(kind, {"tensors": 0, "weights": 0, "max_error": 0.0})
        for start in range(0, rows, 8192):  # a slab at a time: no whole float copy
            ids = torch.arange(start, min(start + 8192, rows))
            ours = dequantize(packed, ids)
            reference = torch.from_numpy(gguf.quants.dequantize(raw[start : start + len(ids)], tensor.tensor_type))
            stats["max_error"] = max(stats["max_error"], float((ours - reference).abs().max()))
        stats["tensors"] += 1
        stats["weights"] += rows * cols
    return result


def teacher_forced(llm: LLM, ids: list[int]) -> torch.Tensor:
    """log-probabilities [len(ids) - 1, V] of each next token, one forward over ids."""
    model = llm.target.model
    cache = model.new_cache(1, len(ids) + 1)
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--text-tokens", type=int, default=1024)
    args = parser.parse_args()
    path = Path(resolve_model(args.model))
    start = time.perf_counter()
    errors = tensor_errors(path)
    print(f"per tensor type ({path.name}, {time.perf_counter() - start:.0f} s):")
    print(f"{'type':<6} {'tensors':>8} {'weights':>14} {'exact':>6} {'max |error|':>12}")
    for kind, stats in sorted(errors.items()):
        print(
            f"{kind:<6} {stats['tensors']:>8} {stats['weights']:>14,} {str(stats['max_error'] == 0):>6} "
            f"{stats['max_error']:>12.3g}"
        )
    reference = LLM(model=str(path), dtype="float32", quantization=None, speculative_method="none")
    quantized = LLM(model=str(path), dtype="float32", speculative_method="none")
    prompts = [[{"role": "user", "content": p.text}] for p in held_out_chat_prompts()[: args.prompts]]
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    agree = total = 0
    for messages in prompts:
        output = reference.chat(messages, params)[0]
        ids = list(output.prompt_token_ids) + list(output.outputs[0].token_ids)
        n = len(output.outputs[0].token_ids)
        ref_next = teacher_forced(reference, ids)[-n:].argmax(-1)
        q_next = teacher_forced(quantized, ids)[-n:].argmax(-1)
        agree += int((ref_next == q_next).sum())
        total += n
    ids = reference.tokenizer.encode(HELD_OUT_TEXT.read_text())[: args.text_tokens]
    targets = torch.tensor(ids[1:])
    perplexity = {
        name: math.exp(-float(teacher_forced(llm, ids).gather(1, targets[:, None]).mean()))
        for name, llm in (("float32 reference", reference), ("quantized (specdec)", quantized))
    }
    print(
        f"\ngreedy agreement (teacher-forced, {len(prompts)} chat prompts x {args.tokens} tokens): "
        f"{agree}/{total} = {agree / total:.3f}"
    )
    for name, value in perplexity.items():
        print(f"perplexity of {HELD_OUT_TEXT.name} ({len(ids)} tokens), {name}: {value:.4f}")


if __name__ == "__main__":
    main()
