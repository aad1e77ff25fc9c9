"""Preemption is a scheduling decision only: a request preempted for lack of cache blocks (its
blocks swapped out, or freed and recomputed) gives bit for bit the tokens it gives when nothing
preempts it, greedy or sampled with its own seed, under every drafter, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from helpers import random_prompts, save_random_head
from specdec import LLM, SamplingParams

NUM_REQUESTS = 6
MAX_TOKENS = 48
SWAP_SPACES = {"swap": 4.0, "recompute": 0, "both": 2**-14}  # GiB; both: 64 KiB, 5 blocks of the tiny pair


def drafter_kwargs(drafter: str, tiny_pair, tmp_path) -> dict:
    """LLM's keywords for each drafter, k = 3 (k fixed: goodput's k follows timings)."""
    models = {
        "none": {},
        "draft_model": dict(speculative_model=str(tiny_pair["draft"])),
        "ngram": dict(speculative_method="ngram"),
        "lookup_then_draft": dict(speculative_model=str(tiny_pair["draft"]), speculative_method="lookup_then_draft"),
        "staged": dict(speculative_model=["[ngram]", str(tiny_pair["draft"])]),
        "early_exit": dict(speculative_method="early_exit", early_exit_layer=1),
        "suffix": dict(speculative_method="suffix"),  # the run before leaves every answer in its shared tree
        "suffix_then_draft": dict(speculative_model=str(tiny_pair["draft"]), speculative_method="suffix_then_draft"),
    }
    if drafter == "eagle":
        head = save_random_head(tiny_pair["target"], tmp_path / "head", seed=3)
        models["eagle"] = dict(speculative_model=str(head), speculative_method="eagle")
    if drafter == "none":
        return dict(speculative_method="none")
    return dict(**models[drafter], num_speculative_tokens=3, speculative_k_policy="fixed")


def request_params(seed: int) -> list[SamplingParams]:
    """Half greedy, half sampled (temperature 0.8, top-p 0.95) with seeds of their own."""
    return [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(temperature=0.8, top_p=0.95, max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed + i)
        for i in range(NUM_REQUESTS)
    ]


def serve_all(
    llm: LLM,
    prompts,
    params,
    num_blocks: int | None,
    max_model_len: int = 128,
    max_prefill_tokens: int | None = None,
    max_prefill_seconds: float | None = None,
) -> tuple[dict[str, list[int]], int]:
    """Every request added at once and stepped to the end in a pool of num_blocks blocks (None:
    room for all), prefilling at most max_prefill_tokens (and max_prefill_seconds) a step: each
    request's tokens, and the preemptions counted."""
    engine = llm.engine
    kv_cache_bytes = None if num_blocks is None else num_blocks * engine.capacity.position_bytes * 16
    engine.prepare_to_serve(max_model_len, kv_cache_bytes, max_prefill_tokens, max_prefill_seconds=max_prefill_seconds)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    tokens: dict[str, list[int]] = {}
    with torch.inference_mode():
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
    blocks = engine.capacity.blocks
    assert blocks is not None and blocks.num_held == 0  # nothing leaked
    return tokens, engine.scheduler.num_preemptions


DRAFTERS = [
    "none",
    "draft_model",
    "eagle",
    "ngram",
    "lookup_then_draft",
    "staged",
    "early_exit",
    "suffix",
    "suffix_then_draft",
]
CASES = [
    *[("swap", "float32", d) for d in DRAFTERS],
    *[pytest.param("swap", "bfloat16", d, marks=pytest.mark.slow) for d in DRAFTERS],
    *[pytest.param("recompute", "float32", d, marks=pytest.mark.slow) for d in DRAFTERS],
    ("both", "float32", "draft_model"),
]


@pytest.mark.parametrize("preemption, dtype, drafter", CASES)
def test_preempted_requests_give_the_tokens_they_give_unpreempted(tiny_pair, tmp_path, preemption, dtype, drafter):
    """Six requests of 21-45 prompt tokens + 48 new ones, half greedy and half sampled with their
    own seeds, in a pool of 14 blocks: the youngest are preempted again and again; every
    request's tokens equal the same engine's with a pool large enough for all.

    swap: every victim swapped out (exact by construction, bfloat16 too). recompute (no swap
    space): every victim prefilled anew over its tokens but the last, its generator untouched;
    the same tokens here in float32, where the prefill's rows give what the steps gave to well
    within a sampling boundary (bfloat16's do not: that is what swapping is for). both: the swap
    space holds a few victims, the others are recomputed."""
    llm = LLM(
        str(tiny_pair["target"]),
        dtype=dtype,
        max_num_seqs=NUM_REQUESTS,
        swap_space=SWAP_SPACES[preemption],
        **drafter_kwargs(drafter, tiny_pair, tmp_path),
    )
    prompts = random_prompts(NUM_REQUESTS, seed=57, lengths=(7, 16), repeat=True)  # prompt lookup finds matches
    params = request_params(seed=100)
    expected, none = serve_all(llm, prompts, params, num_blocks=None)
    assert none == 0
    got, preemptions = serve_all(llm, prompts, params, num_blocks=14)
    swapped = llm.engine.preemption.swap.num_swapped_out
    assert preemptions >= 3
    assert {"swap": swapped == preemptions, "recompute": swapped == 0, "both": 0 < swapped < preemptions}[preemption]
    assert got == expected


def test_a_swapped_out_request_aborted_while_it_waits_frees_its_slot_and_space(tiny_pair):
    """A request swapped out and then aborted before it resumes: its swap space and its slot are
    free again (the next request runs in that slot), and the rest finish as before."""
    llm = LLM(
        str(tiny_pair["target"]), dtype="float32", max_num_seqs=3, **drafter_kwargs("draft_model", tiny_pair, None)
    )
    engine = llm.engine
    engine.prepare_to_serve(max_model_len=128, kv_cache_bytes=12 * engine.capacity.position_bytes * 16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(3, seed=58, lengths=(30, 40))):
        engine.add_request(f"r{i}", prompt, params)
    with torch.inference_mode():
        while not engine.scheduler.num_preemptions:
            engine.step()
        (waiting,) = [seq for seq in engine.scheduler.waiting]
        assert waiting.slot >= 0 and engine.preemption.swap.used_bytes > 0  # swapped out, its slot kept
        assert engine.abort(waiting.request_id)
        assert engine.preemption.swap.used_bytes == 0
        engine.add_request("late", random_prompts(1, seed=59, lengths=(5, 6))[0], params)
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.capacity.blocks is not None and engine.capacity.blocks.num_held == 0
    assert sorted(engine.scheduler._free_slots) == [0, 1, 2]


@pytest.mark.parametrize("swap_space", [-1, float("nan"), float("inf"), "4", True, 10**9])
def test_a_bad_swap_space_is_refused_naming_it(tiny_pair, swap_space):
    with pytest.raises(ValueError, match="swap_space"):
        LLM(str(tiny_pair["target"]), dtype="float32", swap_space=swap_space, speculative_method="none")


@pytest.mark.slow
def test_a_compiled_target_and_draft_preempted_give_the_tokens_they_give_unpreempted(tiny_pair, tmp_path):
    """Compiled, the target and the draft read the engine's pool as eager ones do: swapped out and
    back in with their blocks, requests give what the same engine gives them unpreempted, and
    what the target alone gives them greedy (float32)."""
    llm = LLM(
        str(tiny_pair["target"]),
        dtype="float32",
        max_num_seqs=NUM_REQUESTS,
        compile="on",
        **drafter_kwargs("draft_model", tiny_pair, tmp_path),
    )
    prompts = random_prompts(NUM_REQUESTS, seed=59, lengths=(7, 16), repeat=True)
    params = request_params(seed=101)
    expected, none = serve_all(llm, prompts, params, num_blocks=None)
    assert none == 0 and llm.runner.cache.static and llm.runner.reads_pool(llm.engine.capacity.pool)
    got, preemptions = serve_all(llm, prompts, params, num_blocks=14)
    assert preemptions >= 3 and llm.engine.preemption.swap.num_swapped_out == preemptions
    assert got == expected
    alone = LLM(str(tiny_pair["target"]), dtype="float32", compile="off", speculative_method="none")
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    outputs = alone.generate([prompts[i] for i in greedy], [params[i] for i in greedy])
    assert [got[f"r{i}"] for i in greedy] == [out.outputs[0].token_ids for out in outputs]
