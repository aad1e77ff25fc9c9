"""A key/value cache of fixed-size blocks, read and written through a block table.

Terms:
  block        BLOCK_SIZE (16) consecutive positions of one sequence: [16, Hkv, D] keys and as
               many values in every layer. A cache is a pool of num_blocks blocks.
  block table  [max_seqs, max_blocks] (BlockTable): table[s, i] is the block that holds positions
               16i..16i+15 of the sequence in row s of the table (its slot). Entry SCRATCH_BLOCK
               (block 0, never any sequence's) where none is assigned: what a forward writes there
               is lost, and no query reads it (positions past a sequence's length are masked).

A table whose slots each own consecutive blocks for all max_len positions (BlockTable.contiguous)
is the cache of one slot per sequence; the engine's block manager hands out blocks as sequences
grow instead (vLLM's PagedAttention), and every cache of a sequence (the target's, a draft
model's, an EAGLE head's: the same positions) reads the same table, each from its own pool.

A forward names the slots of its rows: it runs on `cache.rows(slots)`, the cache as those rows
see it (a model given the cache itself runs rows 0..B-1), and writes each token's K/V at the
token's position. Nothing is ever copied or rolled back: when draft tokens are rejected, their
entries stay at positions past the row's length, the causal mask (key position <= query
position) hides them, and the next round writes over them.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

BLOCK_SIZE = 16  # positions per block
SCRATCH_BLOCK = 0  # the block of every unassigned table entry


class CacheTooLarge(ValueError):
    """A cache that would not fit in the memory this machine has free."""


def blocks_for(num_positions: int) -> int:
    """Blocks that hold positions 0..num_positions-1."""
    return -(-num_positions // BLOCK_SIZE)


class BlockTable:
    """table [max_seqs, max_blocks] int64 on device: table[s, i] the block of positions 16i..16i+15
    of slot s (SCRATCH_BLOCK where unassigned). Caches read it; only its owner (the engine's block
    manager, or a cache of its own) writes it."""

    def __init__(self, max_seqs: int, max_blocks: int, device: torch.device | str):
        self.table = torch.full((max_seqs, max_blocks), SCRATCH_BLOCK, dtype=torch.long, device=device)
        self.max_seqs, self.max_blocks = max_seqs, max_blocks
        # on the CPU, written through numpy: a few blocks at a time, each new tensor would cost more
        self._numpy = self.table.numpy() if self.table.device.type == "cpu" else None
        self.num_blocks_needed = 1  # the pool a cache reading this table needs: the scratch block at least
        self.readers: weakref.WeakSet[KVCache] = weakref.WeakSet()  # caches made to read it (swapping copies theirs)
        # how many caches have ever been made to read it: while it is unchanged, every entry a
        # block was given is still in the caches that read the table (block_manager.py keeps its
        # cached prefixes across an engine's prepare calls on that)
        self.readers_made = 0

    @classmethod
    def contiguous(cls, max_seqs: int, max_len: int, device: torch.device | str) -> BlockTable:
        """Every slot its own consecutive blocks for positions 0..max_len-1: slot s holds blocks
        1 + s * M .. (s + 1) * M (M = blocks_for(max_len))."""
        M = blocks_for(max_len)
        table = cls(max_seqs, M, device)
        table.table.copy_(1 + torch.arange(max_seqs * M, device=device).view(max_seqs, M))
        table.num_blocks_needed = 1 + max_seqs * M
        return table

    def assign(self, slot: int, first: int, blocks: Sequence[int]) -> None:
        """Positions from 16 x first on of slot go to blocks (in order)."""
        if first + len(blocks) > self.max_blocks:
            last = first + len(blocks) - 1
            raise ValueError(f"slot {slot}: blocks {first}..{last} are past the table's {self.max_blocks}")
        if self._numpy is not None:
            self._numpy[slot, first : first + len(blocks)] = blocks
        else:
            self.table[slot, first : first + len(blocks)] = torch.tensor(blocks, dtype=torch.long)

    def clear(self, slot: int) -> None:
        """Slot holds no block (its sequence left)."""
        self.table[slot] = SCRATCH_BLOCK


@dataclass(frozen=True)
class BlockPool:
    """What the caches of one engine's sequences share: the block table (the engine's block
    manager writes it) and the number of blocks each cache's pool holds.

    compiled: the pool is shaped for compiled forwards (pool_for): its table's last row is the
    scratch slot, where the padding rows of a compiled batch go, and it owns the pool's last
    SCRATCH_ROW_BLOCKS blocks (positions 0..COMPILED_MAX_QUERIES-1, so that a probe of a
    compiled graph against eager writes each position to an entry of its own)."""

    table: BlockTable
    num_blocks: int
    compiled: bool = False

    @property
    def scratch_slot(self) -> int:
        """A compiled pool's scratch slot: its table's last row, never a sequence's."""
        assert self.compiled, "only a compiled pool has a scratch slot"
        return self.table.max_seqs - 1

    @property
    def sequence_blocks(self) -> int:
        """The blocks a block manager hands out from (0..sequence_blocks-1, block 0 the scratch
        block): all but the scratch slot's."""
        return self.num_blocks - (SCRATCH_ROW_BLOCKS if self.compiled else 0)


COMPILED_MAX_QUERIES = 64  # tokens a row of a compiled forward feeds at most (longer: eager)
SCRATCH_ROW_BLOCKS = -(-COMPILED_MAX_QUERIES // BLOCK_SIZE)  # a compiled pool's scratch slot's blocks
MIN_COMPILED_LEN = 256  # a compiled pool's positions per slot: a power of two from here (few shapes)


def compiled_batch(max_seqs: int) -> int:
    """The rows of a compiled graph for max_seqs sequences: the next power of two."""
    return 1 << (max_seqs - 1).bit_length()


def compiled_length(max_len: int) -> int:
    """The positions per slot of a compiled cache: the next power of two, at least MIN_COMPILED_LEN."""
    return max(MIN_COMPILED_LEN, 1 << (max_len - 1).bit_length())


def pool_for(
    held: BlockPool | None,
    max_seqs: int,
    max_len: int,
    num_blocks: int,
    device,
    exact: bool = False,
    compiled: bool = False,
) -> BlockPool:
    """A pool of num_blocks for max_seqs slots of max_len positions: held where it is large
    enough (exact: of num_blocks exactly, a memory budget's), else a new one; its table cleared.

    compiled: shaped for compiled forwards, whose shapes it fixes (a compiled graph reads every
    slot's blocks for all its positions): compiled_batch(max_seqs) slots and the scratch slot,
    compiled_length(max_len) positions each, and blocks for all of them (exact: num_blocks and
    the scratch slot's), so that work of similar sizes finds the same shapes."""
    if compiled:
        max_seqs, max_len = compiled_batch(max_seqs) + 1, compiled_length(max_len)
        whole = 1 + (max_seqs - 1) * blocks_for(max_len)
        num_blocks = (num_blocks if exact else whole) + SCRATCH_ROW_BLOCKS
    if (
        held is None
        or held.table.max_seqs < max_seqs
        or held.table.max_blocks < blocks_for(max_len)
        or held.num_blocks < num_blocks
        or (exact and held.num_blocks > num_blocks)
        or (compiled and not held.compiled)
    ):
        held = BlockPool(BlockTable(max_seqs, blocks_for(max_len), device), num_blocks, compiled)
    held.table.table.fill_(SCRATCH_BLOCK)
    if held.compiled:
        first = held.num_blocks - SCRATCH_ROW_BLOCKS
        held.table.assign(held.scratch_slot, 0, list(range(first, held.num_blocks)))
    return held


class KVCache:
    def __init__(
        self,
        num_layers: int,
        max_batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        static: bool = False,
        table: BlockTable | None = None,
        num_blocks: int | None = None,
    ):
        """Up to max_batch sequences (slots) of max_len positions each. table: the block table it
        reads (None: one of its own, each slot owning consecutive blocks for all max_len
        positions); num_blocks: the pool's blocks (None: what the table needs).

        static: every forward reads all max_len positions (masked past each query), and the
        slots are always gathered, so a forward's shapes depend on its batch and query length
        only, never on how long the sequences are: what a compiled graph needs. Otherwise a
        forward reads positions 0..max(positions) (fewer keys, but a new shape each step)."""
        self.table = table if table is not None else BlockTable.contiguous(max_batch, max_len, device)
        if self.table.max_seqs < max_batch or self.table.max_blocks < blocks_for(max_len):
            raise ValueError(
                f"a block table of {self.table.max_seqs} slots x {self.table.max_blocks} blocks is smaller "
                f"than the cache's {max_batch} x {blocks_for(max_len)}"
            )
        num_blocks = num_blocks if num_blocks is not None else self.table.num_blocks_needed
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)  # [blocks, positions in a block, Hkv, D]
        check_fits(
            2 * num_layers * num_blocks * BLOCK_SIZE * num_kv_heads * head_dim * dtype.itemsize,
            torch.device(device),
            f"a key/value cache of {max_batch} slots x {max_len:,} positions"
            if table is None
            else f"a key/value cache of {num_blocks:,} blocks of {BLOCK_SIZE} positions",  # the pool's
        )
        # Zeros, not empty: masked entries still meet the value matmul with weight 0, and
        # uninitialised memory could hold NaN (0 * NaN = NaN).
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_batch, self.max_len, self.static, self.num_blocks = max_batch, max_len, static, num_blocks
        self.shared_table = table  # None: a table of its own
        if table is not None:
            table.readers.add(self)
            table.readers_made += 1
        self._arange = torch.arange(max_batch, device=device)  # [max_batch]: rows 0..B-1 without an op per layer

    def reads(self, pool: BlockPool | None) -> bool:
        """Whether this cache is the one pool's sequences use (None: a table of its own)."""
        if pool is None:
            return self.shared_table is None
        return self.shared_table is pool.table and self.num_blocks == pool.num_blocks

    def rows(self, slots: torch.Tensor | Sequence[int], flat: FlatRows | None = None) -> CacheRows:
        """The cache as a forward whose row i reads and writes slot slots[i] sees it (flat: the
        rows' tokens run as one [1, N], see FlatRows)."""
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.keys[0].device)  # [B]
        if bool((slots < 0).any()) or bool((slots >= self.max_batch).any()):
            raise ValueError(f"cache slots must be in [0, {self.max_batch}), got {slots.tolist()}")
        if flat is not None:
            return CacheRows(self, slots, flat)
        if not self.static and torch.equal(slots, self._arange[: len(slots)]):
            return CacheRows(self, None)  # rows 0..B-1
        return CacheRows(self, slots)

    def num_keys(self, positions: torch.Tensor) -> int:
        """How many cache positions (0..num_keys-1) a forward at positions [B, T] reads."""
        return self.max_len if self.static else int(positions.max()) + 1

    def layer(self, layer: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return CacheRows(self, None).layer(layer, batch_size)

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        CacheRows(self, None).write(layer, positions, k, v)

    def write_and_read(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_keys: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return CacheRows(self, None).write_and_read(layer, positions, k, v, num_keys)

    def move(self, slots: torch.Tensor | list[int], sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """In every layer, copy each row's entries at positions sources [B, M] to destinations
        [B, M] (row i being slot slots[i]): what a tree's accepted branch needs to become the
        sequence's next positions. All are read before any is written; destinations must be
        distinct within a row (a no-op pair, source = destination, pads a short row)."""
        rows = torch.as_tensor(slots, dtype=torch.long, device=self.keys[0].device)  # [B]
        blocks = self.table.table[rows]  # [B, max_blocks]
        source_entries, destination_entries = entries(blocks, sources), entries(blocks, destinations)  # [B, M] each
        for keys, values in zip(self.keys, self.values):
            flat_keys, flat_values = keys.flatten(0, 1), values.flatten(0, 1)  # [blocks x 16, Hkv, D]
            flat_keys[destination_entries] = flat_keys[source_entries]
            flat_values[destination_entries] = flat_values[source_entries]


@dataclass
class SwappedEntries:
    """A sequence's cache entries copied out of a pool's blocks (swap-out preemption), for every
    cache that reads the pool: caches[i]'s keys and values, per layer [n, 16, Hkv, D] for the n
    blocks copied, in position order. nbytes: what they hold."""

    caches: list[KVCache]
    keys: list[list[torch.Tensor]]
    values: list[list[torch.Tensor]]
    nbytes: int


def swap_out(pool: BlockPool, blocks: Sequence[int]) -> SwappedEntries:
    """Copies (on the CPU) of blocks' entries in every cache reading pool: a draft model's and a
    head's as well as the target's, so that a sequence preempted for its blocks resumes with
    exactly the entries it had."""
    caches = [cache for cache in pool.table.readers if cache.reads(pool)]
    index = torch.tensor(list(blocks), dtype=torch.long)  # [n]
    keys = [[layer.index_select(0, index.to(layer.device)).cpu() for layer in cache.keys] for cache in caches]
    values = [[layer.index_select(0, index.to(layer.device)).cpu() for layer in cache.values] for cache in caches]
    nbytes = sum(t.nbytes for per_cache in keys + values for t in per_cache)
    return SwappedEntries(caches, keys, values, nbytes)


def swap_in(pool: BlockPool, blocks: Sequence[int], swapped: SwappedEntries) -> None:
    """Write swapped's entries into blocks (in position order; as many as were copied out) of
    the same caches, which must still read pool."""
    n = len(swapped.keys[0][0]) if swapped.caches else 0
    if len(blocks) < n:
        raise ValueError(f"{n} blocks were swapped out and only {len(blocks)} are given to swap them into")
    index = torch.tensor(list(blocks[:n]), dtype=torch.long)  # [n]
    for cache, keys, values in zip(swapped.caches, swapped.keys, swapped.values):
        if not cache.reads(pool):
            raise RuntimeError("a cache was remade while a sequence's entries were swapped out of it")
        for layer, saved in zip(cache.keys + cache.values, keys + values):
            layer.index_copy_(0, index.to(layer.device), saved.to(layer.device))


def entries(blocks: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The flat entry (block x BLOCK_SIZE + offset) of each position [B, T] of rows whose blocks
    are blocks [B, max_blocks]: [B, T]."""
    return blocks.gather(1, positions // BLOCK_SIZE) * BLOCK_SIZE + positions % BLOCK_SIZE


@dataclass(frozen=True)
class FlatRows:
    """Rows of different lengths as one run of tokens [1, N] with no padding (vLLM's flattened
    batch): row b's tokens are starts[b]..starts[b+1]-1 of the run, consecutive positions of its
    slot, and its queries read the slot's positions 0..num_keys[b]-1. A forward's linear layers
    then multiply the N real tokens only, where a padded batch [B, W] multiplies B x W.

    starts [B + 1], num_keys [B], token_rows [N] (each token's row): int64."""

    starts: torch.Tensor
    num_keys: torch.Tensor
    token_rows: torch.Tensor

    @classmethod
    def of(cls, positions: torch.Tensor, lengths: torch.Tensor) -> tuple[FlatRows, torch.Tensor]:
        """Rows whose first lengths[b] [B] of positions [B, W] are real -> the FlatRows and which
        entries of [B, W] are real, a bool mask [B, W] (row-major: the run's order)."""
        B, W = positions.shape
        real = torch.arange(W, device=positions.device) < lengths[:, None]  # [B, W]
        starts = torch.zeros(B + 1, dtype=torch.long, device=positions.device)
        starts[1:] = lengths.cumsum(0)
        num_keys = positions.masked_fill(~real, -1).amax(1) + 1  # [B]: past each row's last real position
        token_rows = torch.arange(B, device=positions.device).repeat_interleave(lengths)  # [N]
        return cls(starts, num_keys, token_rows), real


class CacheRows:
    """A KVCache as one forward sees it: its row i reads and writes slot slots[i] (slots None:
    rows 0..B-1, as a KVCache given to a model directly). A model takes either where it takes a
    cache. flat: the forward's tokens are the rows' runs one after another, [1, N] (FlatRows;
    slots given); attention that reads the pool through each row's blocks takes them so."""

    def __init__(self, cache: KVCache, slots: torch.Tensor | None, flat: FlatRows | None = None):
        if flat is not None and slots is None:
            raise ValueError("flat rows name their slots")
        self.cache, self.slots, self.flat = cache, slots, flat
        self.static, self.max_len = cache.static, cache.max_len
        # read once per forward, not once per layer (the table does not change within a forward)
        self._blocks: torch.Tensor | None = None  # the rows' blocks
        self._written: tuple[torch.Tensor, torch.Tensor] | None = None  # (positions, their entries)

    def num_keys(self, positions: torch.Tensor) -> int:
        return self.cache.num_keys(positions)

    def blocks(self, batch_size: int) -> torch.Tensor:
        """Each of the forward's batch_size rows' blocks [B, max_blocks] (its slot's table row);
        flat, every row's, whatever batch_size (the run's 1)."""
        blocks = self._blocks
        if self.flat is not None:
            batch_size = len(self.flat.num_keys)
        if blocks is None or blocks.shape[0] != batch_size:
            table = self.cache.table.table
            blocks = self._blocks = table[:batch_size] if self.slots is None else table[self.slots]
        return blocks

    def _entries(self, blocks: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """entries(blocks, positions), computed once for the forward's positions [B, T] (every
        layer writes the same ones)."""
        written = self._written
        if written is None or written[0] is not positions:
            if self.flat is None:
                written = self._written = (positions, entries(blocks, positions))
            else:  # each token through its own row's blocks: [N, max_blocks], [N, 1] -> [1, N]
                tokens = entries(blocks[self.flat.token_rows], positions.reshape(-1, 1))
                written = self._written = (positions, tokens.reshape(positions.shape))
        return written[1]

    def layer(self, layer: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This layer's keys and values [blocks, 16, Hkv, D] and the blocks of each of the
        forward's batch_size rows [B, max_blocks]."""
        return self.cache.keys[layer], self.cache.values[layer], self.blocks(batch_size)

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B, T, Hkv, D] at positions [B, T] of the rows' slots."""
        keys, values, blocks = self.layer(layer, positions.shape[0])  # [N, 16, Hkv, D] x 2, [B, max_blocks]
        written = self._entries(blocks, positions)  # [B, T]
        keys.flatten(0, 1)[written] = k  # [N x 16, Hkv, D] entries
        values.flatten(0, 1)[written] = v

    def write_and_read(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_keys: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, T, Hkv, D] at positions [B, T]; return this layer's keys and values for
        the rows' slots at positions 0..num_keys-1: [B, num_keys, Hkv, D] each."""
        B = positions.shape[0]
        if self.flat is not None:
            raise ValueError("flat rows are read through the pool's blocks (an attention backend that reads them so)")
        if num_keys > self.max_len:
            raise ValueError(f"position {num_keys - 1} is past the cache length {self.max_len}")
        self.write(layer, positions, k, v)
        keys, values, blocks = self.layer(layer, B)  # [N, 16, Hkv, D] x 2, [B, max_blocks]
        flat_keys, flat_values = keys.flatten(0, 1), values.flatten(0, 1)  # [N x 16, Hkv, D]
        if self.slots is None and self.cache.shared_table is None:  # rows 0..B-1 of its own table: one run from block 1
            per_slot = self.cache.table.max_blocks * BLOCK_SIZE
            start, stop = BLOCK_SIZE, BLOCK_SIZE + B * per_slot
            return (
                flat_keys[start:stop].view(B, per_slot, *k.shape[2:])[:, :num_keys],
                flat_values[start:stop].view(B, per_slot, *v.shape[2:])[:, :num_keys],
            )  # [B, num_keys, Hkv, D] views
        read = blocks[:, : blocks_for(num_keys)]  # [B, nb]
        return (
            keys[read].flatten(1, 2)[:, :num_keys],
            values[read].flatten(1, 2)[:, :num_keys],
        )  # [B, nb, 16, Hkv, D] -> [B, num_keys, Hkv, D]


@dataclass(frozen=True)
class TreeAttention:
    """How a forward's tokens are stored and what they read when they are not one run of
    consecutive positions, each after the one before (a tree of candidate tokens, whose
    branches share their ancestors).

    write_positions [B, T]  the cache position each token's K/V is stored at (its RoPE
                            position, the model's `positions`, is its place in its own branch)
    tree_start [B]          every query reads the row's cache positions before tree_start...
    visible [B, T, R]       ...and position tree_start + r where visible[b, t, r] (its
                            branch: its ancestors, and itself, wherever they were written)
    """

    write_positions: torch.Tensor
    tree_start: torch.Tensor
    visible: torch.Tensor

    def mask(self, num_keys: int, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """[B, 1, T, num_keys] (True = attend); a sliding window (of more positions than any
        branch is deep) cuts the keys before tree_start by the query's RoPE position."""
        B, T, R = self.visible.shape
        keys = torch.arange(num_keys, device=positions.device)  # [S]
        before = keys[None, None, :] < self.tree_start[:, None, None]  # [B, 1, S]
        if window is not None:
            before = before & (keys[None, None, :] > positions[:, :, None] - window)  # [B, T, S]
        offset = keys[None, :] - self.tree_start[:, None]  # [B, S]: key position - tree_start
        in_tree = (offset >= 0) & (offset < R)  # [B, S]
        region = self.visible.gather(2, offset.clamp(0, R - 1)[:, None, :].expand(B, T, num_keys))  # [B, T, S]
        return (before | (region & in_tree[:, None, :]))[:, None]  # [B, 1, T, S]


@dataclass(frozen=True)
class FlatTree:
    """A tree's forward run as flat rows (FlatRows): tree's layout over the batch [B, T] for its
    real tokens only (real [B, T], row-major: the run's order), as a model reads a TreeAttention.
    positions [B, T]: the tokens' RoPE positions in the batch's shape."""

    tree: TreeAttention
    positions: torch.Tensor
    real: torch.Tensor

    @property
    def write_positions(self) -> torch.Tensor:
        return self.tree.write_positions[self.real][None]  # [1, N]

    def mask(self, num_keys: int, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """The tree's mask of the real tokens, [1, 1, N, num_keys] (positions: the run's [1, N],
        the same tokens')."""
        return self.tree.mask(num_keys, self.positions, window)[:, 0][self.real][None, None]  # [B, T, S] -> [N, S]


def ragged_batch(
    chunks: list[list[int]], starts: list[int], max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack rows of different lengths for one forward: row i feeds chunks[i] at positions
    starts[i], starts[i]+1, ... Returns input_ids [B, W], positions [B, W] and the index of
    each row's last real token [B].

    Padding slots (token 0) take the positions after the row's own, clamped to the cache's
    last position (max_len - 1): past every row's length, so real queries never read what they write,
    and the row's next real tokens overwrite it (the engine keeps the last position free).
    """
    width = max(len(chunk) for chunk in chunks)
    input_ids = torch.zeros(len(chunks), width, dtype=torch.long)
    positions = torch.zeros(len(chunks), width, dtype=torch.long)
    for row, (chunk, start) in enumerate(zip(chunks, starts)):
        input_ids[row, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
        positions[row] = torch.arange(start, start + width).clamp(max=max_len - 1)
    last_index = torch.tensor([len(chunk) - 1 for chunk in chunks])
    return input_ids, positions, last_index


def check_fits(num_bytes: int, device: torch.device, what: str) -> None:
    """Raise CacheTooLarge before allocating num_bytes that the device does not have free
    (an allocation that size would fail deep in torch, or push the machine into swap until the
    kernel kills the process)."""
    free = free_memory_bytes(device)
    if free is not None and num_bytes > free:
        raise CacheTooLarge(f"{what} needs {_size(num_bytes)}, more than the {_size(free)} free on {device}")


def free_memory_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation can take: CUDA's free memory, or the CPU's MemAvailable (Linux);
    None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if device.type == "cpu" and meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _size(num_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.1f} {unit}"
    return f"{num_bytes:,} bytes"
