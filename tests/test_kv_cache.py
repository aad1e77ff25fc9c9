"""The key/value cache's blocks (kv_cache.py): a sequence's positions may sit in any blocks of the
pool, in any order, as a block table says; a model reads and writes through the table exactly
what it would in a cache of one run of positions per slot, on every path (PyTorch's attention
for prefills, the attention kernel for decode steps and verify forwards, a GGUF layer's one C++
call), and a tree's accepted branch moves within the blocks."""

from __future__ import annotations

import pytest
import torch

from gguf_files import tiny_hf_model, write_gguf
from helpers import save_tiny_model
from specdec.kv_cache import BlockPool, BlockTable, KVCache, blocks_for
from specdec.models.loader import load_pretrained

MAX_LEN = 70  # 5 blocks, the last in part


def scattered_table(max_seqs: int, max_len: int, seed: int) -> tuple[BlockTable, int]:
    """A table whose slots hold blocks of a pool twice as large as they need, shuffled (block 0,
    the scratch block, never). Returns the table and the pool's size."""
    M = blocks_for(max_len)
    num_blocks = 1 + 2 * max_seqs * M
    order = (1 + torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed))).tolist()
    table = BlockTable(max_seqs, M, "cpu")
    for slot in range(max_seqs):
        table.assign(slot, 0, order[slot * M : slot * M + M])
    return table, num_blocks


def run_steps(model, cache) -> torch.Tensor:
    """A ragged prefill of two rows, decode steps, a verify-sized forward and one row alone: the
    logits of every forward after the prefill, [2, 6, V] and [1, 3, V]."""
    g = torch.Generator().manual_seed(7)
    a, b = torch.randint(2, 300, (40,), generator=g), torch.randint(2, 300, (40,), generator=g)
    steps = torch.randint(2, 300, (2, 6), generator=g)
    with torch.inference_mode():
        model(torch.stack([a, b]), torch.arange(40).expand(2, 40), cache)  # row 1's last 15 are padding
        decoded = [model(steps[:, i : i + 1], torch.tensor([[40 + i], [25 + i]]), cache) for i in range(2)]
        verify = model(steps[:, 2:], torch.stack([torch.arange(42, 46), torch.arange(27, 31)]), cache)
        alone = model(steps[:1, :3], torch.arange(46, 49)[None], cache.rows([1]))  # slot 1 by itself
    return torch.cat([*decoded, verify], dim=1), alone


def assert_scattered_blocks_read_as_one_run(model, seed: int) -> None:
    """model's forwards (run_steps) over a cache of scattered blocks give, bit for bit, what they
    give over a cache of one run of positions per slot."""
    table, num_blocks = scattered_table(2, MAX_LEN, seed=seed)
    expected = run_steps(model, model.new_cache(2, MAX_LEN))
    got = run_steps(model, model.new_cache(2, MAX_LEN, pool=BlockPool(table, num_blocks)))
    for e, g in zip(expected, got):
        assert torch.equal(g, e)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_float_model_reads_scattered_blocks_as_one_run_of_positions(tmp_path, dtype):
    model = load_pretrained(save_tiny_model(tmp_path / "m", "llama", seed=1), dtype, load_tokenizer=False).model
    assert_scattered_blocks_read_as_one_run(model, seed=2)


def test_a_gguf_layers_one_call_reads_scattered_blocks_as_one_run_of_positions(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tiny_hf_model(), "Q8_0")
    model = load_pretrained(path, "float32", load_tokenizer=False, keep_quantized=True).model
    assert_scattered_blocks_read_as_one_run(model, seed=3)


def test_a_move_copies_within_scattered_blocks(tmp_path):
    model = load_pretrained(save_tiny_model(tmp_path / "m", "llama", seed=4), "float32", load_tokenizer=False).model
    table, num_blocks = scattered_table(2, MAX_LEN, seed=5)
    paged, plain = model.new_cache(2, 48, pool=BlockPool(table, num_blocks)), model.new_cache(2, 48)
    ids = torch.randint(2, 300, (2, 40), generator=torch.Generator().manual_seed(6))
    sources, destinations = torch.tensor([[33, 35, 39], [20, 20, 20]]), torch.tensor([[14, 15, 16], [20, 20, 20]])
    with torch.inference_mode():
        for cache in (paged, plain):
            model(ids, torch.arange(40).expand(2, 40), cache)
            cache.move([1, 0], sources, destinations)
    for layer in range(len(plain.keys)):
        for rows in ([0], [1]):
            k_paged, v_paged = paged.rows(rows).write_and_read(
                layer, torch.tensor([[47]]), *[torch.zeros(1, 1, 2, 16)] * 2, 40
            )
            k_plain, v_plain = plain.rows(rows).write_and_read(
                layer, torch.tensor([[47]]), *[torch.zeros(1, 1, 2, 16)] * 2, 40
            )
            assert torch.equal(k_paged, k_plain) and torch.equal(v_paged, v_plain)


def test_a_table_refuses_blocks_past_its_end():
    table = BlockTable(2, 3, "cpu")
    with pytest.raises(ValueError, match="blocks 2..3 are past the table's 3"):
        table.assign(0, 2, [5, 6])
    with pytest.raises(ValueError, match="smaller than the cache's"):
        KVCache(1, 2, 64, 1, 16, torch.float32, "cpu", table=table, num_blocks=10)
