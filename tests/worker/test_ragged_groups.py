"""Ragged forwards in groups of similar lengths: the grouping is the cheapest partition (checked
against every partition of the rows), and a prefill run in groups gives each row what it gets
alone (the reference: the row's own forward, which has no padding at all)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from helpers import save_tiny_model
from specdec import LLM, SamplingParams
from specdec.models.loader import load_pretrained
from specdec.worker import ModelRunner
from specdec.worker.ragged_groups import ragged_groups


def set_partitions(items: list[int]):
    """Every partition of items into non-empty groups (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield [*partition[:i], [first, *partition[i]], *partition[i + 1 :]]


def padded_tokens(lengths: list[int], groups: list[list[int]]) -> int:
    """What the groups' forwards multiply: the sum of rows x longest row per group."""
    return sum(len(group) * max(lengths[row] for row in group) for group in groups)


def cost(lengths: list[int], groups: list[list[int]], split_cost: int) -> int:
    return padded_tokens(lengths, groups) + split_cost * len(groups)


@pytest.mark.parametrize("seed", range(12))
def test_the_grouping_is_the_cheapest_partition(seed):
    """Random lengths and split costs: no partition of the rows, consecutive by length or not,
    costs less than ragged_groups' choice, which covers every row once."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, 400) for _ in range(rng.randint(1, 7))]
    split_cost = rng.choice([0, 5, 64, 128, 1000])
    groups = ragged_groups(lengths, split_cost)
    assert sorted(itertools.chain(*groups)) == list(range(len(lengths)))
    best = min(cost(lengths, partition, split_cost) for partition in set_partitions(list(range(len(lengths)))))
    assert cost(lengths, groups, split_cost) == best


def test_rows_stay_together_when_splitting_does_not_pay():
    """Lengths close together, or a split cost above what any split saves: one group, in order."""
    assert ragged_groups([120, 126, 118, 131]) == [[0, 1, 2, 3]]
    assert ragged_groups([10, 300, 40], split_cost=10_000) == [[0, 1, 2]]
    assert ragged_groups([7]) == [[0]]


def test_a_burst_of_prompts_multiplies_far_less_padding():
    """The prompt lengths of bench_replicas' 16 clients (Qwen2.5-Coder's tokenizer): one padded
    forward multiplies 5,264 tokens for 2,694 real ones; three groups, 3,142."""
    lengths = [26, 159, 154, 172, 157, 140, 183, 122, 183, 234, 329, 267, 126, 150, 165, 127]
    groups = ragged_groups(lengths)
    assert padded_tokens(lengths, [list(range(16))]) == 5264
    assert len(groups) == 3 and padded_tokens(lengths, groups) == 3142
    assert ragged_groups(lengths, split_cost=0) != groups  # free splits take every distinct length apart
    assert padded_tokens(lengths, ragged_groups(lengths, split_cost=0)) == sum(lengths)


def test_a_negative_split_cost_is_refused():
    with pytest.raises(ValueError, match="split_cost"):
        ragged_groups([1, 2], split_cost=-1)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("long"), "llama", seed=3, init_std=0.3, max_position_embeddings=512)


def test_a_grouped_prefill_gives_each_row_its_own_forward(long_model):
    """float32: four prompts of 12 to 300 tokens fed at once (run as groups) give every row the
    logits after its last token and the hidden states of its own one-row forward; padding
    columns past a row's group hold zeros."""
    model = load_pretrained(long_model, "float32", load_tokenizer=False).model
    runner = ModelRunner(model, compile="off")
    runner.prepare(max_batch=8, max_len=512, query_lengths=(1,), num_forwards=1, return_hidden=True)
    gen = torch.Generator().manual_seed(7)
    lengths = [12, 300, 40, 260]
    chunks = [torch.randint(2, 320, (n,), generator=gen).tolist() for n in lengths]
    assert len(ragged_groups(lengths)) > 1
    logits, hidden = runner.feed(chunks, [0] * 4, [0, 1, 2, 3], return_hidden=True)  # [4, V], [4, 300, F]
    for row, chunk in enumerate(chunks):
        alone_logits, alone_hidden = runner.feed([chunk], [0], [4 + row], return_hidden=True)
        torch.testing.assert_close(logits[row], alone_logits[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hidden[row, : len(chunk)], alone_hidden[0], rtol=1e-5, atol=1e-5)
    assert hidden[0, 40:].abs().sum() == 0  # row 0 ran with row 2, 40 wide


def test_generate_of_ragged_long_prompts_is_each_prompt_alone(long_model):
    """Greedy float32 through the engine: a batch of prompts of 9 to 280 tokens (prefilled in
    groups) gives each prompt the tokens it gets alone."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 320, (n,), generator=gen).tolist() for n in (280, 9, 150, 30, 270)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(long_model), dtype="float32", compile="off", enable_prefix_caching=False, speculative_method="none")
    together = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    alone = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts]
    assert together == alone
