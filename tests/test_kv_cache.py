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
from specdec.block_manager import BlockManager
from specdec.kv_cache import (
    COMPILED_MAX_QUERIES,
    SCRATCH_ROW_BLOCKS,
    BlockPool,
    BlockTable,
    KVCache,
    blocks_for,
    compiled_batch,
    compiled_length,
    entries,
    pool_for,
)
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


@pytest.mark.parametrize("max_seqs,max_len,num_blocks", [(1, 40, 4), (3, 300, 60), (8, 700, 400)])
def test_a_compiled_pool_is_shaped_for_its_graphs(max_seqs, max_len, num_blocks):
    """pool_for(compiled=True): slots for the batch padded to a power of two, then the scratch
    slot; a power of two of positions per slot (at least 256); blocks for every slot at full
    length (exact: the budget's) and the scratch slot's own, which hold each of its first
    COMPILED_MAX_QUERIES positions in an entry of its own, and which no block manager hands out."""
    for exact in (False, True):
        pool = pool_for(None, max_seqs, max_len, num_blocks, "cpu", exact=exact, compiled=True)
        rows, length = compiled_batch(max_seqs), compiled_length(max_len)
        assert rows >= max_seqs and rows & (rows - 1) == 0 and rows < 2 * max_seqs + 1
        assert length >= max(max_len, 256) and length & (length - 1) == 0 and length < 2 * max(max_len, 256)
        assert (pool.table.max_seqs, pool.table.max_blocks) == (rows + 1, blocks_for(length))
        sequence_blocks = num_blocks if exact else 1 + rows * blocks_for(length)
        assert pool.num_blocks == sequence_blocks + SCRATCH_ROW_BLOCKS == pool.sequence_blocks + SCRATCH_ROW_BLOCKS
        scratch = pool.table.table[pool.scratch_slot]
        written = entries(scratch[None], torch.arange(COMPILED_MAX_QUERIES)[None])[0]  # [64]
        assert written.unique().numel() == COMPILED_MAX_QUERIES
        assert bool((written >= sequence_blocks * 16).all()) and bool((written < pool.num_blocks * 16).all())
        manager = BlockManager(pool.sequence_blocks, pool.table)
        each = min(manager.num_free // max_seqs, pool.table.max_blocks)
        for slot in range(max_seqs):
            manager.grow(slot, each * 16)
        handed = [block for slot in range(max_seqs) for block in manager.blocks_of(slot)]
        assert len(handed) == max_seqs * each and max(handed) < sequence_blocks
        assert pool.table.table[:max_seqs].max() < sequence_blocks  # no sequence's slot reads the scratch blocks


def test_a_held_pool_is_kept_only_where_it_suits_the_work():
    """A compiled pool serves eager work of its size too (its scratch slot unused), and is kept
    with its scratch slot's blocks assigned again; an eager pool is not kept for compiled work."""
    compiled = pool_for(None, 3, 300, 60, "cpu", compiled=True)
    assert pool_for(compiled, 2, 200, 30, "cpu") is compiled
    again = pool_for(compiled, 4, 256, 10, "cpu", compiled=True)
    assert again is compiled and int(again.table.table[again.scratch_slot, 0]) == again.sequence_blocks
    eager = pool_for(None, 3, 300, 60, "cpu")
    assert not eager.compiled and pool_for(eager, 3, 300, 60, "cpu", compiled=True).compiled
