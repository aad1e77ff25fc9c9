"""logprobs: each generated token's log-probability under the target, and the top tokens',
against transformers' own logits for the same text, with and without speculation (chains and
trees), greedy and sampled; requests without logprobs beside them get none."""

from __future__ import annotations

import pytest
import torch

from helpers import load_hf
from helpers import random_prompts as shared_random_prompts
from specdec import LLM, SamplingParams


def random_prompts(n: int, seed: int, **kwargs) -> list[list[int]]:
    return shared_random_prompts(n, seed, lengths=(4, 16), **kwargs)


@pytest.fixture(scope="module")
def reference(tiny_pair):
    model = load_hf(tiny_pair["target"])

    def logprobs_of(prompt: list[int], output: list[int]) -> torch.Tensor:
        """log_softmax of transformers' logits before each output token: [len(output), V]."""
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0].float()  # [T, V]
        return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)

    return logprobs_of


DRAFTING = {
    "target alone": {"speculative_method": "none"},
    "draft model": {"speculative_model": "target", "speculative_k_policy": "fixed"},
    "draft tree": {"speculative_model": "target", "speculative_tree": "auto", "speculative_k_policy": "fixed"},
}  # drafting for itself: accepted (k fixed: goodput would not draft with a draft as dear as the target)


@pytest.mark.parametrize("drafting", DRAFTING)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_are_the_targets_own(tiny_pair, reference, drafting, temperature):
    options = {
        key: str(tiny_pair[value]) if key == "speculative_model" else value for key, value in DRAFTING[drafting].items()
    }
    llm = LLM(
        str(tiny_pair["target"]),
        dtype="float32",
        num_speculative_tokens=4 if "speculative_model" in options else None,
        **options,
    )
    prompts = random_prompts(3, seed=int(temperature * 10) + len(drafting))
    params = [
        SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True, seed=5, logprobs=n)
        for n in (3, None, 0)
    ]
    outputs = llm.generate(prompts, params)
    assert outputs[1].outputs[0].logprobs is None
    for output, sampling in zip(outputs, params):
        completion = output.outputs[0]
        if sampling.logprobs is None:
            continue
        want = reference(output.prompt_token_ids, completion.token_ids)  # [T, V]
        assert [entry.token_id for entry in completion.logprobs] == completion.token_ids
        got = torch.tensor([entry.logprob for entry in completion.logprobs])
        chosen = want.gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(got, chosen, atol=1e-4, rtol=1e-4)
        for entry, row in zip(completion.logprobs, want):
            assert len(entry.top) == sampling.logprobs
            top_values = torch.tensor([value for _, value in entry.top])
            torch.testing.assert_close(top_values, row.topk(sampling.logprobs).values, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(top_values, row[[token for token, _ in entry.top]], atol=1e-4, rtol=1e-4)
        if drafting != "target alone":
            assert output.metrics.num_accepted_tokens > 0  # accepted drafts have logprobs too


def test_logprobs_are_checked(tiny_pair):
    with pytest.raises(ValueError, match="logprobs must be an integer from 0 to 20"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
