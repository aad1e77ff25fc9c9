"""What weight-only quantization costs in quality, and what it buys in speed.

Speculation is exact with respect to the model it verifies with, so a quantized target's
output is the quantized model's, not the original's. The bench measures the difference
against the same checkpoint loaded unquantized (same dtype, eager), on the bench's own prompts:
  greedy agreement  of each prompt's greedy output, the tokens before the first difference
                    (÷ the output's length), and how many outputs are identical
  perplexity        of held-out standard-library modules (never trained on), in windows of
                    the context length: exp(mean next-token negative log-likelihood)
  speed             the quantized target alone's greedy tokens/s over the unquantized one's,
                    on the same prompts
"""

from __future__ import annotations

import math
import time

import torch

from specdec.config import SamplingParams
from specdec.llm import LLM
from specdec.tools.benchmark.exactness import first_divergence
from specdec.tools.benchmark.prompts import held_out_sources

PERPLEXITY_TOKENS = 8192  # held-out tokens scored per model


def quantization_quality(
    quantized: LLM, reference: LLM, greedy_runs: list[tuple[list[int], list[int], float]], max_tokens: int
) -> dict:
    """greedy_runs: (prompt ids, the quantized target alone's greedy output, its seconds) per
    prompt. reference: the same checkpoint, unquantized."""
    agreements, identical, tokens, seconds, ref_tokens, ref_seconds = [], 0, 0, 0.0, 0, 0.0
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    reference.warm_up(greedy_runs[0][0], params)
    for prompt_ids, output, run_seconds in greedy_runs:
        start = time.perf_counter()
        expected = reference.generate({"prompt_token_ids": prompt_ids}, params)[0].outputs[0].token_ids
        ref_seconds += time.perf_counter() - start
        ref_tokens += len(expected)
        tokens, seconds = tokens + len(output), seconds + run_seconds
        divergence = first_divergence(output, expected)
        agreements.append((len(expected) if divergence is None else divergence) / max(len(expected), 1))
        identical += expected == output
    quantized_ppl = perplexity(quantized.runner.model, quantized)
    reference_ppl = perplexity(reference.runner.model, reference)
    return {
        "quantization": quantized.runner.quantization,
        "prompts": len(greedy_runs),
        "greedy_identical": identical,
        "greedy_agreement": sum(agreements) / len(agreements),
        "perplexity": quantized_ppl,
        "reference_perplexity": reference_ppl,
        "perplexity_difference": quantized_ppl - reference_ppl,
        "tokens_per_s": tokens / seconds,
        "reference_tokens_per_s": ref_tokens / ref_seconds,
        "speedup_over_reference": (tokens / seconds) / (ref_tokens / ref_seconds),
    }


def perplexity(model, llm: LLM, num_tokens: int = PERPLEXITY_TOKENS) -> float:
    """exp(mean negative log-likelihood of each next token) over the first num_tokens tokens
    of the held-out modules, in windows of the model's context length."""
    ids = []
    tokenizer = llm.tokenizer
    assert tokenizer is not None  # loaded with the model
    for _, source in held_out_sources():
        ids += tokenizer.encode(source)
        if len(ids) >= num_tokens + 1:
            break
    ids = torch.tensor(ids[: num_tokens + 1], device=llm.device)
    window = llm.max_model_len
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start : start + window + 1]  # [n + 1]: n inputs, each with its next token
            inputs = chunk[:-1][None]  # [1, n]
            positions = torch.arange(inputs.shape[1], device=llm.device)[None]  # [1, n]
            logits = model(inputs, positions, None)[0]  # [n, V]
            total += float(torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum"))
            count += inputs.shape[1]
    return math.exp(total / count)
