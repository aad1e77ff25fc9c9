"""n completions of one request (SamplingParams.n, engine/parallel_sampling.py): greedy ones are
the target alone's, under every drafter; a seeded one's completion i is the request alone with
seed + i (vLLM's rule); the completions after the first take the prompt's whole blocks from the
prefix cache instead of prefilling them; a streamed request's deltas join into what
LLM.generate returns; aborting the request frees every completion's blocks."""

from __future__ import annotations

import pytest
import torch

from helpers import random_prompts, save_random_head
from specdec import LLM, SamplingParams
from specdec.kv_cache import BLOCK_SIZE

PROMPT_LENGTH = 3 * BLOCK_SIZE + 5  # three whole blocks to share, and a partial one each computes


@pytest.fixture(scope="module")
def head(tiny_pair, tmp_path_factory):
    return save_random_head(tiny_pair["target"], tmp_path_factory.mktemp("head") / "head", seed=3)


def make_llm(tiny_pair, head, drafter: str, **kwargs) -> LLM:
    speculation = {
        "none": dict(speculative_method="none"),
        "draft_model": dict(speculative_model=str(tiny_pair["draft"])),
        "eagle": dict(speculative_model=str(head)),
        "ngram": dict(speculative_method="ngram"),
    }[drafter]
    if drafter != "none":  # k every round
        speculation.update(num_speculative_tokens=3, speculative_k_policy="fixed")
    return LLM(str(tiny_pair["target"]), dtype="float32", **speculation, **kwargs)


@pytest.fixture(scope="module")
def plain(tiny_pair, head):
    return make_llm(tiny_pair, head, "none")


@pytest.mark.parametrize("drafter", ["none", "draft_model", "eagle", "ngram"])
def test_greedy_completions_are_the_target_alones_and_share_the_prompt(tiny_pair, head, plain, drafter):
    prompts = random_prompts(2, seed=71, lengths=(PROMPT_LENGTH, PROMPT_LENGTH + 1))
    alone = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    llm = make_llm(tiny_pair, head, drafter)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3))
    for output, expected in zip(outputs, alone):
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert all(c.token_ids == expected.outputs[0].token_ids for c in output.outputs)
        assert all(c.finish_reason == "length" for c in output.outputs)
        assert output.metrics.num_emitted_tokens == 3 * 12
    queried, found = llm.engine.capacity.prefix_cache_counts
    shared_blocks = (PROMPT_LENGTH - 1) // BLOCK_SIZE
    # each prompt's completions 1 and 2 found its whole blocks (its first found none)
    assert found == len(prompts) * 2 * shared_blocks * BLOCK_SIZE, (queried, found)


@pytest.mark.parametrize("drafter", ["none", "draft_model"])
def test_a_seeded_requests_completion_i_is_the_request_alone_with_seed_plus_i(tiny_pair, head, drafter):
    llm = make_llm(tiny_pair, head, drafter)
    prompt = random_prompts(1, seed=72, lengths=(PROMPT_LENGTH, PROMPT_LENGTH + 1))[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, seed=2**40)
    (together,) = llm.generate([prompt], SamplingParams(**{**_fields(params), "n": 4}))
    alone = llm.generate(
        [prompt] * 4, [SamplingParams(**{**_fields(params), "seed": params.seed + i}) for i in range(4)]
    )
    assert [c.token_ids for c in together.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in together.outputs}) > 1  # sampled apart


def _fields(params: SamplingParams) -> dict:
    import dataclasses

    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def test_a_streamed_requests_deltas_join_into_its_whole_output(tiny_pair, head, plain):
    llm = make_llm(tiny_pair, head, "draft_model", seed=5)
    prompt = random_prompts(1, seed=73, lengths=(PROMPT_LENGTH, PROMPT_LENGTH + 1))[0]
    lengths = SamplingParams(temperature=0.8, max_tokens=10, seed=9, n=3, stop_token_ids=(7, 8, 9, 10, 11))
    (whole,) = llm.generate([prompt], lengths)
    engine, joined, finished_flags = llm.engine, {}, []
    with torch.inference_mode():
        engine.add_request("r", prompt, lengths)
        assert engine.request_ids() == ["r"]
        while engine.has_unfinished_requests():
            for output in engine.step():
                assert output.request_id == "r"
                for completion in output.outputs:
                    ids, reason = joined.setdefault(completion.index, ([], [None]))
                    ids += completion.token_ids
                    reason[0] = completion.finish_reason
                finished_flags.append(output.finished)
    assert finished_flags[-1] and not any(finished_flags[:-1])
    assert {i: (ids, reason[0]) for i, (ids, reason) in joined.items()} == {
        c.index: (c.token_ids, c.finish_reason) for c in whole.outputs
    }


def test_aborting_the_request_aborts_every_completion_and_frees_their_blocks(tiny_pair, head):
    llm = make_llm(tiny_pair, head, "draft_model", max_num_seqs=2)  # two run, the third waits
    engine = llm.engine
    prompt = random_prompts(1, seed=74, lengths=(PROMPT_LENGTH, PROMPT_LENGTH + 1))[0]
    with torch.inference_mode():
        engine.add_request("r", prompt, SamplingParams(max_tokens=50, ignore_eos=True, n=3))
        for _ in range(3):
            engine.step()
        assert engine.num_running == 2 and engine.num_waiting == 1
        assert engine.request_ids(waiting=False) == ["r"] and engine.request_ids(running=False) == ["r"]
        assert engine.abort("r") and not engine.abort("r")
    assert not engine.has_unfinished_requests() and engine.capacity.blocks.num_held == 0


def test_a_request_is_queued_whole_or_not_at_all(tiny_pair, head):
    llm = make_llm(tiny_pair, head, "none")
    engine = llm.engine
    with torch.inference_mode():
        engine.add_request("1_r", [5, 6, 7], SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="'1_r' is already running"):
            engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, n=3))  # its completion 1 clashes
        assert engine.request_ids() == ["1_r"] and engine.num_waiting == 1
        engine.add_request("p", [5], SamplingParams(max_tokens=4, n=2))
        for again in (1, 2):
            with pytest.raises(ValueError, match="'p' is already running"):
                engine.add_request("p", [5], SamplingParams(max_tokens=4, n=again))
        assert engine.request_ids() == ["1_r", "p"] and engine.num_waiting == 3
        while engine.has_unfinished_requests():
            engine.step()


@pytest.mark.parametrize(
    "fields, named",
    [(dict(n=0), "n"), (dict(n=129), "n"), (dict(n=1.5), "n"), (dict(n=3, seed=2**64 - 2), "seed")],
)
def test_bad_n_is_refused_by_name(fields, named):
    with pytest.raises(ValueError, match=rf"^{named}\b|\b{named} must|{named} \+"):
        SamplingParams(**fields)
