"""logprobs: each generated token's log-probability under the target, and the top tokens',
against transformers' own logits for the same text, with and without speculation (chains and
trees), greedy and sampled; requests without logprobs beside them get none."""

from __future__ import annotations

import dataclasses

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


def assert_prompt_logprobs(output, sampling: SamplingParams, model) -> None:
    """output.prompt_logprobs against transformers' log_softmax over the prompt: None for the
    first token, then each token's and the top sampling.prompt_logprobs."""
    prompt = output.prompt_token_ids
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)  # [L - 1, V]
    got = output.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    assert [entry.token_id for entry in got[1:]] == prompt[1:]
    chosen = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([entry.logprob for entry in got[1:]]), chosen, atol=1e-4, rtol=1e-4)
    for entry, row in zip(got[1:], want):
        assert len(entry.top) == sampling.prompt_logprobs
        top_values = torch.tensor([value for _, value in entry.top])
        torch.testing.assert_close(top_values, row.topk(sampling.prompt_logprobs).values, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("drafting", ["target alone", "draft model"])
def test_prompt_logprobs_are_the_targets_own(tiny_pair, drafting):
    """prompt_logprobs, against transformers' logits over each prompt: requests asking beside
    ones that do not (which get none, and the same tokens as without them), prompts of 4-40
    tokens, a request of n = 2 (the prompt's once); asked again for a prompt already in the
    prefix cache, every position is computed all the same."""
    options = DRAFTING[drafting] | (
        {"speculative_model": str(tiny_pair["target"])} if drafting != "target alone" else {}
    )
    llm = LLM(
        str(tiny_pair["target"]),
        dtype="float32",
        num_speculative_tokens=3 if drafting != "target alone" else None,
        **options,
    )
    model = load_hf(tiny_pair["target"])
    prompts = shared_random_prompts(4, seed=17, lengths=(4, 40))
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=n, n=2 if i == 3 else 1)
        for i, n in enumerate((2, None, 0, 5))
    ]
    plain = llm.generate(prompts, [dataclasses.replace(p, prompt_logprobs=None) for p in params])
    before = llm.engine.capacity.prefix_cache_counts[1]
    outputs = llm.generate(prompts, params)  # the prompts are in the prefix cache now
    assert llm.engine.capacity.prefix_cache_counts[1] - before == 16 * 2  # found: the 22-token prompt, completion 1
    assert outputs[1].prompt_logprobs is None
    for output, sampling, alone in zip(outputs, params, plain):
        assert [c.token_ids for c in output.outputs] == [alone.outputs[0].token_ids] * sampling.n
        if sampling.prompt_logprobs is not None:
            assert_prompt_logprobs(output, sampling, model)


def test_prompt_logprobs_of_a_prompt_prefilled_in_chunks(tiny_pair):
    """A 70-token prompt prefilled 16 tokens a step, through Engine.step: its prompt logprobs
    come whole in its first output (none in the later ones), equal to transformers'."""
    llm = LLM(str(tiny_pair["target"]), dtype="float32", speculative_method="none")
    engine = llm.engine
    engine.prepare_to_serve(max_model_len=128, max_prefill_tokens=16)
    prompt = shared_random_prompts(1, seed=23, lengths=(70, 71))[0]
    sampling = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    engine.add_request("r", prompt, sampling)
    outputs = []
    with torch.inference_mode():
        while engine.has_unfinished_requests():
            outputs += engine.step()
    assert outputs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outputs[1:])
    assert_prompt_logprobs(outputs[0], sampling, load_hf(tiny_pair["target"]))


def test_prompt_logprobs_are_checked():
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer from 0 to 20"):
        SamplingParams(prompt_logprobs=21)
