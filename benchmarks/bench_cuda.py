"""specdec on a CUDA GPU, checked and timed in one run: what CI (CPU only) cannot show.

    python benchmarks/bench_cuda.py [--device cuda] [--prompts 4] [--max-tokens 64] [--seeds 1]
        [--draws 200000] [--parts made,exactness,sampler,speed] [--compile off,on] [--batches 1,8]
        [--drafters LABEL,...] [--train-steps 200] [--out FILE.json]

0. Made on the device (--parts made; before exactness, which then checks them too): an EAGLE-3
   head for the shipped target, its features computed and the head trained on the device
   (training/eagle3.py, over a chat corpus of held-in standard-library code), and a draft with
   another tokenizer (its own byte-level BPE, a tiny llama trained on the same text), which
   drafts through text (drafters/cross_tokenizer.py), alone and as the first stage before the
   shipped draft. Each reports its training's held-out
   numbers; neither is meant to be good, only to run every path on the device.

1. Exactness. Greedy, float32, the shipped pair (models/code-target, models/code-draft,
   models/code-target-eagle), a ragged batch of held-out code prompts: every drafter's token ids
   against the target alone's, row by row (identical rows, and the first divergence where not),
   and the same in bfloat16, where a verify forward of k+1 rows may round a near-tie otherwise
   than a one-row decode step (cuBLAS picks its kernel by shape).
2. The rejection sampler on the device. rejection_sample draws from random draft and target
   distributions; a chi-square test of the first output token against the target's own
   distribution, of the recovered token (first draft rejected) against the residual, and of the
   second (given the first accepted) against its own; --draws sets the rows; with --seeds N,
   N such draws (each seed its own distributions), whose p-values, if the sampler is exact, are
   uniform: a Kolmogorov-Smirnov test of that, and Fisher's combination, per position.
3. Speed. Tokens/s of the target alone and of the draft model (k by goodput), eager and
   compiled (torch.compile's "reduce-overhead": CUDA graphs), at batch 1 and 8, bfloat16, with
   the compiled greedy output checked against the eager.

Prints a table per part; --out writes every number as JSON. On a machine without CUDA,
--device cpu runs the same checks (the suite already covers them there).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams
from specdec.spec.verify import rejection_sample
from specdec.tools.benchmark.chi_square import chi_square_counts
from specdec.tools.benchmark.exactness import first_divergence
from specdec.tools.benchmark.prompts import held_out_code_prompts

CHUNK = 500_000  # the sampler check's rows per rejection_sample call

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


CHAT_TEMPLATE = (  # a plain chat template for the shipped target (which has none), so chat-data reads it
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def chat_corpus(root: Path, train: int, held_out: int) -> Path:
    """A chat-data-like corpus (train/, held_out/ of rendered conversations) whose answers are
    pieces of the standard library's held-in (train) and held-out modules."""
    from specdec.tools.training.corpus import load_corpus

    corpus = load_corpus(None)
    for split, documents, count in (("train", corpus.train, train), ("held_out", corpus.held_out, held_out)):
        (root / split).mkdir(parents=True)
        for i, document in enumerate(documents[:count]):
            answer = document.text[:1500]
            (root / split / f"{i:05d}-greedy.txt").write_text(f"user: Write some Python.\nassistant: {answer}\n")
    return root


def eagle3_head(device: str, work: Path, steps: int) -> tuple[Path, dict]:
    """An EAGLE-3 head for the shipped target, its features and its training on device."""
    from specdec.tools.training.eagle3 import Eagle3Config, train_eagle3
    from specdec.tools.training.loop import TrainConfig

    target = work / "chat-target"
    shutil.copytree(TARGET, target)
    tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"chat_template": CHAT_TEMPLATE}))
    data = chat_corpus(work / "chat-data", train=200, held_out=16)
    config = TrainConfig(
        steps=steps, batch_size=16, lr=3e-3, warmup=steps // 10, eval_every=0, checkpoint_every=0,
        log_every=max(1, steps // 5), eval_tokens=4096, device=device,
    )  # fmt: skip
    eagle3 = Eagle3Config(ttt_steps=3, context=256, output_vocab=4096)
    start = time.perf_counter()
    result = train_eagle3(target, data, work / "eagle3-head", config, eagle3)
    seconds = time.perf_counter() - start
    first, last = result.first_evaluation, result.last_evaluation
    row = {
        "seconds": seconds,
        "steps": steps,
        "held_out_loss_0": [first["held_out_loss_0"], last["held_out_loss_0"]],
        "held_out_tau_estimate": [first["held_out_tau_estimate"], last["held_out_tau_estimate"]],
    }
    print(
        f"  EAGLE-3 head: features and {steps} steps on {device} in {seconds:.0f} s;"
        f" held-out loss {row['held_out_loss_0'][0]:.2f} -> {row['held_out_loss_0'][1]:.2f},"
        f" tau estimate {row['held_out_tau_estimate'][0]:.2f} -> {row['held_out_tau_estimate'][1]:.2f}",
        flush=True,
    )
    return work / "eagle3-head", row


def other_tokenizer_draft(device: str, work: Path, steps: int, vocab_size: int = 2048) -> tuple[Path, dict]:
    """A tiny llama with its own byte-level BPE (vocab_size tokens), trained on device on the
    held-in standard library (as the target was), saved as a model directory."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from specdec.models.tokenizer import train_byte_level_bpe
    from specdec.tools.training.corpus import load_corpus

    text = "\n".join(document.text for document in load_corpus(None).train[:200])
    tokenizer = train_byte_level_bpe([text], vocab_size, special_tokens=("<s>", "</s>"))
    ids = torch.tensor(tokenizer.encode(text).ids, device=device)  # [N]
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=0,
        eos_token_id=1, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    start, window = time.perf_counter(), 256
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - window - 1, (32,)).tolist()
        batch = torch.stack([ids[s : s + window] for s in starts])  # [32, window]
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    seconds = time.perf_counter() - start
    path = work / "other-tokenizer-draft"
    model.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    row = {"seconds": seconds, "steps": steps, "vocab_size": config.vocab_size, "train_loss": loss.item()}
    print(
        f"  other-tokenizer draft: {config.vocab_size} tokens, {steps} steps on {device} in {seconds:.0f} s,"
        f" last loss {loss.item():.2f}",
        flush=True,
    )
    return path, row


def exactness(device: str, dtype: str, prompts: list[str], max_tokens: int, drafters: dict) -> list[dict]:
    """Each drafter's greedy token ids against the target alone's, in dtype."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reference = [
        out.outputs[0].token_ids
        for out in LLM(TARGET, device=device, dtype=dtype, speculative_method="none").generate(prompts, params)
    ]
    rows = []
    for label, keywords in drafters.items():
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
    own draws of the drafts, in chunks of CHUNK rows): the first output token against
    target_probs[0]; among rows that rejected the first draft token, the recovered token against
    the residual max(0, p - q); the second token (among rows that accepted the first) against
    target_probs[1]."""
    gen = torch.Generator().manual_seed(seed)
    target_probs = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, -1)  # [k+1, V]
    draft_probs = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, -1)  # [k, V]
    generator = torch.Generator(device=device).manual_seed(seed)
    first, recovered, second = (torch.zeros(vocab, dtype=torch.long) for _ in range(3))
    for start in range(0, draws, CHUNK):
        rows = min(CHUNK, draws - start)
        draft_tokens = torch.stack(
            [torch.multinomial(draft_probs[j], rows, replacement=True, generator=gen) for j in range(k)], dim=1
        )  # [N, k]
        output, num_accepted = rejection_sample(
            draft_tokens.to(device),
            torch.full((rows,), k, device=device),
            draft_probs.expand(rows, k, vocab).to(device),
            target_probs.expand(rows, k + 1, vocab).to(device),
            [generator] * rows,
        )  # output [N, k+1]
        output, num_accepted = output.cpu(), num_accepted.cpu()
        first += torch.bincount(output[:, 0], minlength=vocab)
        recovered += torch.bincount(output[num_accepted == 0, 0], minlength=vocab)
        second += torch.bincount(output[num_accepted >= 1, 1], minlength=vocab)
    residual = (target_probs[0] - draft_probs[0]).clamp(min=0)  # [V]
    checks = (
        ("first token", first, target_probs[0]),
        ("recovered", recovered, residual),
        ("second token", second, target_probs[1]),
    )
    results = []
    for label, counts, probs in checks:
        statistic, p_value = chi_square_counts(counts, probs, label)
        results.append({"position": label, "draws": int(counts.sum()), "chi2": statistic, "p_value": p_value})
        print(f"  {label:12} draws {int(counts.sum()):9}  chi2 {statistic:7.2f}  p {p_value:.3f}", flush=True)
    return results


def sampler_seeds(device: str, seeds: int, draws: int) -> dict:
    """rejection_sampler over seeds 0..seeds-1; per position, the p-values' Kolmogorov-Smirnov
    test against uniform and Fisher's combination (both near 1 or spread if exact, near 0 if not)."""
    from scipy.stats import combine_pvalues, kstest

    rows = [row | {"seed": seed} for seed in range(seeds) for row in rejection_sampler(device, draws, seed=seed)]
    summary = {}
    for position in ("first token", "recovered", "second token"):
        p_values = [row["p_value"] for row in rows if row["position"] == position]
        summary[position] = {
            "seeds": len(p_values),
            "ks_p_value": float(kstest(p_values, "uniform").pvalue),
            "fisher_p_value": float(combine_pvalues(p_values, method="fisher").pvalue),
            "below_0.05": sum(p < 0.05 for p in p_values),
        }
        print(
            f"  {position:12} {len(p_values)} seeds: p-values uniform? KS p {summary[position]['ks_p_value']:.3f},"
            f"  Fisher p {summary[position]['fisher_p_value']:.3f},  {summary[position]['below_0.05']} below 0.05",
            flush=True,
        )
    return {"rows": rows, "summary": summary}


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


def speed(device: str, prompts: list[str], max_tokens: int, compile_modes: list[str], batches: list[int]) -> list[dict]:
    """Tokens/s of the target alone and with the draft model, per compile mode and batch."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for compile_mode in compile_modes:
        plain = LLM(TARGET, device=device, dtype="bfloat16", compile=compile_mode, speculative_method="none")
        draft = LLM(TARGET, speculative_model=DRAFT, device=device, dtype="bfloat16", compile=compile_mode)
        for batch in batches:
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
    for row in rows:  # the compiled greedy output against the eager, at the same batch, where both ran
        eager = next((r for r in rows if r["compile"] == "off" and r["batch"] == row["batch"]), None)
        if eager is not None:
            row["same_as_eager"] = row["plain_ids"] == eager["plain_ids"] and row["draft_ids"] == eager["draft_ids"]
    for row in rows:
        del row["plain_ids"], row["draft_ids"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--parts", default="made,exactness,sampler,speed")
    parser.add_argument("--drafters", help="the exactness part's drafters, by label, separated by ; (default: all)")
    parser.add_argument("--train-steps", type=int, default=200, help="the made part's training steps")
    parser.add_argument("--seeds", type=int, default=1, help="the sampler check's runs, each its own seed")
    parser.add_argument("--draws", type=int, default=200_000, help="the sampler check's rows per seed")
    parser.add_argument("--compile", default="off,on", help="the speed part's compile modes")
    parser.add_argument("--batches", default="1,8", help="the speed part's batch sizes")
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

    drafters = dict(DRAFTERS)
    work = Path(tempfile.mkdtemp(prefix="bench_cuda-"))
    if "made" in parts:
        print(f"made on the device ({args.train_steps} training steps each):", flush=True)
        head, results["eagle3_head"] = eagle3_head(args.device, work, args.train_steps)
        draft, results["other_tokenizer_draft"] = other_tokenizer_draft(args.device, work, args.train_steps)
        drafters["EAGLE-3 head (made here)"] = {"speculative_model": str(head)}
        drafters["EAGLE-3 head, tree"] = {
            "speculative_model": str(head),
            "speculative_tree": "auto",
            "num_speculative_tokens": 8,
        }
        drafters["other tokenizer (made here)"] = {"speculative_model": str(draft)}
        drafters["staged other tokenizer -> draft"] = {"speculative_model": [str(draft), DRAFT]}
        save()
    if args.drafters:
        drafters = {label: drafters[label] for label in args.drafters.split(";")}
    if "exactness" in parts:
        print("exactness (greedy, each drafter against the target alone):", flush=True)
        results["exactness"] = [
            row
            for dtype in ("float32", "bfloat16")
            for row in exactness(args.device, dtype, prompts, args.max_tokens, drafters)
        ]
        save()
    if "sampler" in parts:
        print("rejection sampler (chi-square against the target's distribution):", flush=True)
        if args.seeds == 1:
            results["sampler"] = rejection_sampler(args.device, args.draws)
        else:
            results["sampler"] = sampler_seeds(args.device, args.seeds, args.draws)
        save()
    if "speed" in parts:
        print("speed (bfloat16, greedy, tokens/s):", flush=True)
        compile_modes = args.compile.split(",")
        batches = [int(batch) for batch in args.batches.split(",")]
        results["speed"] = speed(args.device, prompts, 2 * args.max_tokens, compile_modes, batches)
        save()


if __name__ == "__main__":
    main()
