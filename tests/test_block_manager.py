"""The block manager (block_manager.py) against a plain model of the pool: random grow and
free calls keep every block in exactly one place (free, or one slot's), the table says what each
slot holds, and a slot holds exactly the blocks its positions need; with prefix caching, a
sequence takes exactly the registered blocks of its longest whole-block prefix (shared, counted),
and unused registered blocks are evicted least recently freed first."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.block_manager import ROOT_KEY, BlockManager, block_key
from specdec.kv_cache import BLOCK_SIZE, SCRATCH_BLOCK, BlockTable


def test_random_grows_and_frees_keep_every_block_in_one_place():
    rng = random.Random(3)
    num_blocks, max_seqs, max_blocks = 40, 6, 12
    manager = BlockManager(num_blocks, BlockTable(max_seqs, max_blocks, "cpu"))
    lengths = dict.fromkeys(range(max_seqs), 0)  # the positions each slot was grown to
    for _ in range(2000):
        slot = rng.randrange(max_seqs)
        if rng.random() < 0.2:
            manager.free(slot)
            lengths[slot] = 0
            continue
        length = min(lengths[slot] + rng.randint(0, 40), max_blocks * BLOCK_SIZE)
        if manager.can_grow(slot, length):
            manager.grow(slot, length)
            lengths[slot] = max(lengths[slot], length)
        else:
            with pytest.raises(ValueError, match="more blocks and"):
                manager.grow(slot, length)
        held = {s: manager.blocks_of(s) for s in range(max_seqs)}
        every = [b for blocks in held.values() for b in blocks] + manager._free + list(manager._unused)
        assert sorted(every) == list(range(1, num_blocks))  # each block once; the scratch block never
        assert manager.num_free + manager.num_held == num_blocks - 1
        for s, blocks in held.items():
            assert len(blocks) == -(-lengths[s] // BLOCK_SIZE)
            row = manager.table.table[s].tolist()
            assert row[: len(blocks)] == blocks and set(row[len(blocks) :]) <= {SCRATCH_BLOCK}


def test_freed_blocks_are_handed_out_again():
    manager = BlockManager(5, BlockTable(2, 4, "cpu"))
    manager.grow(0, 4 * BLOCK_SIZE)  # the whole pool
    assert manager.num_free == 0 and not manager.can_grow(1, 1)
    manager.free(0)
    assert torch.equal(manager.table.table[0], torch.zeros(4, dtype=torch.long))
    manager.grow(1, 1)
    assert manager.blocks_of(1) == [1] and manager.num_free == 3


def test_a_pool_of_only_the_scratch_block_is_refused():
    with pytest.raises(ValueError, match="holds no sequence's"):
        BlockManager(1, BlockTable(1, 1, "cpu"))


def tokens(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(1000), k=n)


def test_a_prefix_of_whole_blocks_is_shared_short_of_the_last_token():
    manager = BlockManager(64, BlockTable(4, 10, "cpu"), prefix_caching=True)
    system = tokens(1, 40)  # 2 whole blocks and 8 tokens
    first = system + tokens(2, 9)
    assert manager.admit(0, first, len(first) + 4) == (0, 0)  # nothing registered yet
    manager.register(0, first)  # 49 tokens: positions 0..47 hold entries, blocks 0..2 complete
    second = system + tokens(3, 30)
    assert manager.admit(1, second, len(second) + 4) == (32, 32)  # the system prompt's 2 whole blocks
    assert manager.blocks_of(1)[:2] == manager.blocks_of(0)[:2]
    assert manager.blocks_of(1)[2] not in manager.blocks_of(0)
    assert manager.prefix_queries == len(first) + len(second) and manager.prefix_hits == 32
    same = first[:48]  # exactly 3 whole blocks: the last token's block is computed, not shared
    assert manager.admit(2, same, 52) == (32, 32)
    table = manager.table.table
    assert table[1, :2].tolist() == table[0, :2].tolist() == table[2, :2].tolist()


@pytest.mark.parametrize("drafter_needs_target", [False, True])
def test_a_drafter_shares_only_the_blocks_its_entries_fill(drafter_needs_target):
    """The drafter's cache wrote the entries of the first 20 positions (its first block) when the
    target's filled 3 blocks: a later sequence's target starts after 2 shared blocks, its
    drafter after 1; a drafter fed the target's features makes the target start there too, in a
    block of its own. Once the drafter catches up, both blocks are whole for it."""
    manager = BlockManager(64, BlockTable(4, 10, "cpu"), True, drafter_needs_target)
    system = tokens(1, 40)
    first = system + tokens(2, 9)
    manager.admit(0, first, len(first) + 4)
    manager.register(0, first, num_drafter_entries=20)
    second = system + tokens(3, 30)
    if drafter_needs_target:
        assert manager.admit(1, second, len(second) + 4) == (16, 16)
        assert manager.blocks_of(1)[1] != manager.blocks_of(0)[1]
    else:
        assert manager.admit(1, second, len(second) + 4) == (32, 16)
        assert manager.blocks_of(1)[:2] == manager.blocks_of(0)[:2]
    manager.register(0, first, num_drafter_entries=48)
    assert manager.admit(2, system + tokens(4, 5), 50) == (32, 32)


def test_keys_chain_their_prefix():
    a, b = tokens(4, 16), tokens(5, 16)
    assert block_key(block_key(ROOT_KEY, a), b) != block_key(block_key(ROOT_KEY, b), b)
    assert block_key(block_key(ROOT_KEY, a), b) == block_key(block_key(ROOT_KEY, list(a)), list(b))
    assert block_key(ROOT_KEY, [1]) != block_key(ROOT_KEY, [256])  # tokens are not bytes


def test_a_finished_sequences_blocks_serve_a_later_one_until_evicted():
    manager = BlockManager(9, BlockTable(2, 8, "cpu"), prefix_caching=True)  # 8 usable blocks
    prompt = tokens(6, 64)
    manager.admit(0, prompt, 70)  # 5 blocks
    manager.register(0, prompt)  # 3 complete (positions 0..47 of the 63 before the last token)
    kept = manager.blocks_of(0)[:3]
    manager.free(0)
    assert manager.num_free == 8 and manager.num_cached == 3
    assert manager.admit(1, prompt, 70) == (48, 48) and manager.blocks_of(1)[:3] == kept
    manager.free(1)
    other = tokens(7, 100)
    assert manager.admit(0, other, 7 * 16) == (0, 0)  # 7 blocks: 5 free, then 2 registered evicted
    assert manager.num_cached == 1
    assert manager.blocks_of(0)[-2:] == [kept[2], kept[1]]  # the prefix's last blocks went first
    manager.free(0)
    assert manager.admit(1, prompt, 70) == (16, 16)  # only the first block was still registered


def test_random_admissions_keep_shared_blocks_counted():
    rng = random.Random(8)
    manager = BlockManager(30, BlockTable(5, 8, "cpu"), prefix_caching=True)
    prefixes = [tokens(10 + i, 48) for i in range(3)]
    live: dict[int, list[int]] = {}
    for _ in range(1500):
        slot = rng.randrange(5)
        if slot in live:
            if rng.random() < 0.5:
                drafted = rng.choice([None, rng.randrange(len(live[slot]) + 1)])
                manager.register(slot, live[slot], drafted)
            else:
                manager.free(slot)
                del live[slot]
        else:
            prompt = rng.choice(prefixes)[: rng.randint(1, 48)] + tokens(rng.randrange(10**6), rng.randint(1, 60))
            room = len(prompt) + 4
            got = manager.admit(slot, prompt, room)
            if got is not None:
                cached, drafted = got
                assert cached % 16 == 0 and drafted % 16 == 0 and drafted <= cached < len(prompt)
                live[slot] = prompt
        counts: dict[int, int] = {}
        for s in live:
            for block in manager.blocks_of(s):
                counts[block] = counts.get(block, 0) + 1
            assert manager.table.table[s, : len(manager.blocks_of(s))].tolist() == manager.blocks_of(s)
        assert counts == manager._refs
        assert sorted(list(counts) + manager._free + list(manager._unused)) == list(range(1, 30))
