"""specdec on a CUDA GPU, checked and timed in one run: what CI (CPU only) cannot show.

    python benchmarks/bench_cuda.py [--device cuda] [--prompts 4] [--max-tokens 64] [--out FILE.json]

1. Exactness. Greedy, float32, the shipped pair (models/code-target, models/code-draft,
   models/code-target-eagle), a ragged batch of held-out code prompts: every drafter's token ids
   against the target alone's, row by row (identical rows, and the first divergence where not),
   and the same in bfloat16, where a verify forward of k+1 rows may round a near-tie otherwise
   than a one-row decode step (cuBLAS picks its kernel by shape).
2. The rejection sampler on the device. rejection_sample draws from random draft and target
   distributions; a chi-square test of the first output token against the target's own
   distribution, and of the second (given the first accepted) against its own.
3. Speed. Tokens/s of the target alone and of the draft model (k by goodput), eager and
   compiled (torch.compile's "reduce-overhead": CUDA graphs), at batch 1 and 8, bfloat16, with
   the compiled greedy output checked against the eager.

Prints a table per part; --out writes every number as JSON. On a machine without CUDA,
--device cpu runs the same checks (the suite already covers them there).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams
from specdec.spec.verify import rejection_sample
from specdec.tools.benchmark.chi_square import chi_square_counts
from specdec.tools.benchmark.exactness import first_divergence
from specdec.tools.benchmark.prompts import held_out_code_prompts

ROOT = Path(__file__).resolve().parent.parent
TARGET, DRAFT, HEAD = (str(ROOT / "models" / name) for name in ("code-target", "code-draft", "code-target-eagle"))

# label -> LLM keywords of the drafter (the target and dtype are added)
DRAFTERS = {
    "draft model": {"speculative_model": DRAFT},
    "EAGLE head": {"speculative_model": HEAD},
    "prompt lookup": {"speculative_model": "[ngram]"},
    "lookup, else draft": {"speculative_model": DRAFT, "speculative_method": "lookup_then_draft"},
    "staged lookup -> draft": {"speculative_model": ["[ngram]", DRAFT]},
    "early exit": {"speculative_method": "early_exit"},
    "draft model, tree": {"speculative_model": DRAFT, "speculative_tree": "auto", "num_speculative_tokens": 8},
    "EAGLE head, tree": {"speculative_model": HEAD, "speculative_tree": "auto", "num_speculative_tokens": 8},
}


def exactness(device: str, dtype: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """Each drafter's greedy token ids against the target alone's, in dtype."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reference = [out.outputs[0].token_ids for out in LLM(TARGET, device=device, dtype=dtype).generate(prompts, params)]
    rows = []
    for label, keywords in DRAFTERS.items():
        keywords = {"num_speculative_tokens": 5, "speculative_k_policy": "fixed", **keywords}
        llm = LLM(TARGET, device=device, dtype=dtype, **keywords)
        outputs = llm.generate(prompts, params)
        divergences = [first_divergence(out.outputs[0].token_ids, ref) for ref, out in zip(reference, outputs)]
        tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
        forwards = sum(out.metrics.num_target_forwards for out in outputs)
        rows.append(
            {
                "dtype": dtype,
                "drafter": label,
                "identical": sum(d is None for d in divergences),
                "rows": len(prompts),
                "first_divergence": [d for d in divergences if d is not None],
                "tau": tokens / forwards if forwards else float("nan"),
            }
        )
        print(
            f"  {dtype:8} {label:24} identical {rows[-1]['identical']}/{len(prompts)}"
            f"  tau {rows[-1]['tau']:.2f}  divergences at {rows[-1]['first_divergence']}",
            flush=True,
        )
    return rows


def rejection_sampler(device: str, draws: int = 200_000, vocab: int = 12, k: int = 3, seed: int = 0) -> list[dict]:
    """rejection_sample on device over `draws` rows of one random draft and target (each row its
    own draws of the drafts): the first output token against target_probs[0], the second (among
    rows that accepted the first draft token) against target_probs[1]."""
    gen = torch.Generator().manual_seed(seed)
    target_probs = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, -1)  # [k+1, V]
    draft_probs = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, -1)  # [k, V]
    draft_tokens = torch.stack(
        [torch.multinomial(draft_probs[j], draws, replacement=True, generator=gen) for j in range(k)], dim=1
    )  # [N, k]
    generator = torch.Generator(device=device).manual_seed(seed)
    output, num_accepted = rejection_sample(
        draft_tokens.to(device),
        torch.full((draws,), k, device=device),
        draft_probs.expand(draws, k, vocab).to(device),
        target_probs.expand(draws, k + 1, vocab).to(device),
        [generator] * draws,
    )  # output [N, k+1]
    output, num_accepted = output.cpu(), num_accepted.cpu()
    first = torch.bincount(output[:, 0], minlength=vocab)
    accepted_first = num_accepted >= 1
    second = torch.bincount(output[accepted_first, 1], minlength=vocab)
    rows = []
    for label, counts, probs in (("first token", first, target_probs[0]), ("second token", second, target_probs[1])):
        statistic, p_value = chi_square_counts(counts, probs, label)
        rows.append({"position": label, "draws": int(counts.sum()), "chi2": statistic, "p_value": p_value})
        print(f"  {label:12} draws {int(counts.sum()):7}  chi2 {statistic:7.2f}  p {p_value:.3f}", flush=True)
    return rows


def timed(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """(tokens/s, token ids) of one generate over prompts, after a warm-up on them."""
    llm.generate(prompts, params)  # warm-up: compiles, captures graphs, calibrates goodput
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ids = [out.outputs[0].token_ids for out in outputs]
    return sum(map(len, ids)) / seconds, ids


def speed(device: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """Tokens/s of the target alone and with the draft model, eager and compiled, batch 1 and 8."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for compile_mode in ("off", "on"):
        plain = LLM(TARGET, device=device, dtype="bfloat16", compile=compile_mode)
        draft = LLM(TARGET, speculative_model=DRAFT, device=device, dtype="bfloat16", compile=compile_mode)
        for batch in (1, 8):
            batch_prompts = (prompts * batch)[:batch]
            plain_rate, plain_ids = timed(plain, batch_prompts, params)
            draft_rate, draft_ids = timed(draft, batch_prompts, params)
            rows.append(
                {
                    "compile": compile_mode,
                    "batch": batch,
                    "plain_tok_s": plain_rate,
                    "draft_tok_s": draft_rate,
                    "speedup": draft_rate / plain_rate,
                    "plain_ids": plain_ids,
                    "draft_ids": draft_ids,
                }
            )
            print(
                f"  compile {compile_mode:3} batch {batch}  plain {plain_rate:8.1f} tok/s"
                f"  draft model {draft_rate:8.1f} tok/s  {draft_rate / plain_rate:.2f}x",
                flush=True,
            )
    for row in rows:  # the compiled greedy output against the eager, at the same batch
        eager = next(r for r in rows if r["compile"] == "off" and r["batch"] == row["batch"])
        row["same_as_eager"] = row["plain_ids"] == eager["plain_ids"] and row["draft_ids"] == eager["draft_ids"]
    for row in rows:
        del row["plain_ids"], row["draft_ids"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--parts", default="exactness,sampler,speed")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    prompts = [p.text for p in held_out_code_prompts(per_module=1, max_chars=500)][: args.prompts]
    parts = set(args.parts.split(","))
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(f"device {name}, torch {torch.__version__}, {len(prompts)} prompts, {args.max_tokens} tokens", flush=True)
    results: dict = {"device": name, "torch": torch.__version__}

    def save() -> None:  # after each part: a run cut short keeps what it measured
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))

    if "exactness" in parts:
        print("exactness (greedy, each drafter against the target alone):", flush=True)
        results["exactness"] = [
            row for dtype in ("float32", "bfloat16") for row in exactness(args.device, dtype, prompts, args.max_tokens)
        ]
        save()
    if "sampler" in parts:
        print("rejection sampler (chi-square against the target's distribution):", flush=True)
        results["sampler"] = rejection_sampler(args.device)
        save()
    if "speed" in parts:
        print("speed (bfloat16, greedy, tokens/s):", flush=True)
        results["speed"] = speed(args.device, prompts, 2 * args.max_tokens)
        save()


if __name__ == "__main__":
    main()
