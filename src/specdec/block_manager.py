"""The block manager: which cache blocks each running sequence holds, and which full blocks of
earlier sequences are kept for their prefixes. Plain Python, no tensors.

Terms (kv_cache.py): a block holds BLOCK_SIZE (16) consecutive positions of one sequence; the
block table maps a sequence's slot and block index to a block of the pool. Block 0 is the
scratch block, never handed out.

A sequence holds blocks for what it uses: its positions so far and the few a round writes past
them (its drafts and the verify's bonus position). Before each round the engine asks `grow` for
every running sequence; when the pool runs short, the scheduler preempts (frees a sequence's
blocks, their entries swapped out or to be recomputed: scheduler.py), never fails a request.

Prefix caching (vLLM's automatic prefix caching): once a block's 16 positions all hold the
cache entries of accepted tokens, it is registered under its key, a digest of its tokens and
its prefix's key (so equal keys mean equal tokens from position 0). A new sequence whose first
blocks' keys are registered takes those blocks as they are (shared, reference-counted) and its
prefill starts after them. A block no sequence holds stays registered until its space is
needed: free blocks are handed out first, then registered ones, least recently freed first
(LRU eviction).

A drafter's cache in the same pool (a draft model's, an EAGLE head's) writes a block's entries
on its own schedule, often a round or more behind the target (not at all in rounds it does not
draft). A registered block is also marked drafted once the drafter's entries of all its
positions are written (`register`'s num_drafter_entries). A new sequence's drafter starts after
its leading drafted blocks, the target after its registered ones; with drafter_needs_target
(a drafter fed the target's features of every position, as an EAGLE head is), the target too
starts after the drafted ones, since their features come from its prefill.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from specdec.kv_cache import BLOCK_SIZE, SCRATCH_BLOCK, BlockTable, blocks_for

ROOT_KEY = b""  # the key before a sequence's first block


def block_key(prefix_key: bytes, tokens: list[int]) -> bytes:
    """The key of a block of tokens after a prefix whose last block's key is prefix_key."""
    digest = hashlib.blake2b(prefix_key, digest_size=16)
    digest.update(b"".join(token.to_bytes(8, "little", signed=True) for token in tokens))
    return digest.digest()


class BlockManager:
    """num_blocks: the pool's size (block 0, the scratch block, included); table: the block table
    it writes (every cache reading it sees a sequence's blocks as it does); prefix_caching:
    keep full blocks for later sequences' prefixes; drafter_needs_target: a new sequence's
    cached prefix is only what the drafter's cache holds too (see above)."""

    def __init__(
        self, num_blocks: int, table: BlockTable, prefix_caching: bool = False, drafter_needs_target: bool = False
    ):
        if num_blocks < 2:
            raise ValueError(f"a pool of {num_blocks} blocks holds no sequence's (block {SCRATCH_BLOCK} is scratch)")
        self.num_blocks, self.table, self.prefix_caching = num_blocks, table, prefix_caching
        self.drafter_needs_target = drafter_needs_target
        self._free = [b for b in range(num_blocks - 1, 0, -1)]  # a stack: block 1 is handed out first
        self._held: dict[int, list[int]] = {}  # slot -> its blocks, in position order
        self._refs: dict[int, int] = {}  # block -> how many slots hold it
        self._block_of_key: dict[bytes, int] = {}  # registered blocks, by key
        self._key_of_block: dict[int, bytes] = {}
        self._unused: OrderedDict[int, None] = OrderedDict()  # registered blocks no slot holds, least recent first
        self._registered: dict[int, tuple[int, bytes]] = {}  # slot -> (its leading blocks registered, the last's key)
        self._drafted: set[int] = set()  # registered blocks whose drafter entries are written too
        self._num_drafted: dict[int, int] = {}  # slot -> its leading blocks whose drafter entries are written
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, found

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take: free ones, and registered ones no sequence holds."""
        return len(self._free) + len(self._unused)

    @property
    def num_held(self) -> int:
        """Blocks held by sequences (each once, however many share it)."""
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Registered blocks (held or not)."""
        return len(self._block_of_key)

    def blocks_of(self, slot: int) -> list[int]:
        return list(self._held.get(slot, ()))

    # --- a sequence's blocks ------------------------------------------------------------------

    def blocks_needed(self, slot: int, num_positions: int) -> int:
        """The blocks slot must gain to hold positions 0..num_positions-1."""
        return max(0, blocks_for(num_positions) - len(self._held.get(slot, ())))

    def can_grow(self, slot: int, num_positions: int) -> bool:
        return self.blocks_needed(slot, num_positions) <= self.num_free

    def grow(self, slot: int, num_positions: int) -> None:
        """Give slot blocks for positions 0..num_positions-1 (those it lacks), in the table too.
        A ValueError if the pool or the table is short (the scheduler checks can_grow first)."""
        needed = self.blocks_needed(slot, num_positions)
        if needed == 0:
            return
        if needed > self.num_free:
            raise ValueError(f"slot {slot} needs {needed} more blocks and {self.num_free} are free")
        held = self._held.setdefault(slot, [])
        new = [self._take_free() for _ in range(needed)]
        self.table.assign(slot, len(held), new)
        held += new
        for block in new:
            self._refs[block] = 1

    def free(self, slot: int) -> None:
        """slot's blocks back to the pool (a shared one once no slot holds it; a registered one
        stays registered, last in the eviction order); its table row to the scratch block."""
        blocks = self._held.pop(slot, [])
        self._registered.pop(slot, None)
        self._num_drafted.pop(slot, None)
        for block in reversed(blocks):  # a prefix's later blocks are evicted before its first
            self._refs[block] -= 1
            if self._refs[block] == 0:
                del self._refs[block]
                if block in self._key_of_block:
                    self._unused[block] = None
                else:
                    self._free.append(block)
        self.table.clear(slot)

    def _take_free(self) -> int:
        """A block no sequence holds: a free one, else the least recently freed registered one
        (its key forgotten)."""
        if self._free:
            return self._free.pop()
        block, _ = self._unused.popitem(last=False)
        del self._block_of_key[self._key_of_block.pop(block)]
        self._drafted.discard(block)
        return block

    # --- prefixes -----------------------------------------------------------------------------

    def admit(
        self, slot: int, token_ids: list[int], num_positions: int, look_up: bool = True
    ) -> tuple[int, int] | None:
        """Blocks for a new sequence in slot, of tokens token_ids, to hold positions
        0..num_positions-1: its longest registered prefix of whole blocks (never its last token,
        which its prefill must compute; none where not look_up: a prefill that must compute
        every position), then new blocks. Returns the positions found cached for the target
        and, of those, for the drafter ((0, 0) without prefix caching), or None if the pool is
        short (nothing taken)."""
        cached = self._cached_prefix(token_ids) if look_up else []
        num_drafted = next((i for i, block in enumerate(cached) if block not in self._drafted), len(cached))
        if self.drafter_needs_target:
            cached = cached[:num_drafted]
        reused_unused = sum(1 for block in cached if block in self._unused)
        needed = blocks_for(num_positions) - len(cached)
        if needed > self.num_free - reused_unused:
            return None
        if self.prefix_caching:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += len(cached) * BLOCK_SIZE
        for block in cached:
            self._unused.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
        self._held[slot] = list(cached)
        if cached:
            self.table.assign(slot, 0, cached)
            self._registered[slot] = (len(cached), self._key_of_block[cached[-1]])
            self._num_drafted[slot] = num_drafted
        self.grow(slot, num_positions)
        return len(cached) * BLOCK_SIZE, num_drafted * BLOCK_SIZE

    def _cached_prefix(self, token_ids: list[int]) -> list[int]:
        """The registered blocks of token_ids' leading whole blocks, up to the first not found,
        short of the last token."""
        if not self.prefix_caching:
            return []
        blocks, key = [], ROOT_KEY
        for i in range((len(token_ids) - 1) // BLOCK_SIZE):
            key = block_key(key, token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            block = self._block_of_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def register(self, slot: int, token_ids: list[int], num_drafter_entries: int | None = None) -> None:
        """Register slot's blocks whose positions all hold entries of token_ids (every position
        before the last token's, whose entry the next forward writes). A block whose key is
        registered already (another sequence computed the same prefix) stays unregistered.
        num_drafter_entries: the leading positions whose entries the drafter's cache holds too
        (their whole registered blocks are marked drafted); None: no drafter cache in the pool
        (every registered block counts as drafted)."""
        if not self.prefix_caching or slot not in self._held:
            return
        done, key = self._registered.get(slot, (0, ROOT_KEY))
        held = self._held[slot]
        complete = min((len(token_ids) - 1) // BLOCK_SIZE, len(held))
        for i in range(done, complete):
            key = block_key(key, token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            block = held[i]
            if key not in self._block_of_key and block not in self._key_of_block:
                self._block_of_key[key], self._key_of_block[block] = block, key
        if complete > done:
            self._registered[slot] = (complete, key)
        drafted = complete if num_drafter_entries is None else min(complete, num_drafter_entries // BLOCK_SIZE)
        for block in held[self._num_drafted.get(slot, 0) : drafted]:
            if block in self._key_of_block:
                self._drafted.add(block)
        self._num_drafted[slot] = max(drafted, self._num_drafted.get(slot, 0))
