"""Sizing the caches for the work ahead, before any request runs.

The caches are pools of blocks read through one block table (kv_cache.py), handed out by a block
manager (block_manager.py). Two ways to size: for a known list of requests (LLM.generate: as many
slots as run at once, and blocks for each to be as long as the longest needs: nothing waits for
blocks) or for serving (max_num_seqs slots of up to max_model_len positions, and as many blocks
as a memory budget allows: by default KV_CACHE_MEMORY_FRACTION of the memory free after the
weights, as vLLM's gpu_memory_utilization; sequences hold blocks for what they use). Either way
the runners make their caches (and compile for the work, where they are to), and the goodput
policy measures its round costs here, never inside a timed request.
"""

from __future__ import annotations

import torch

from specdec.block_manager import BlockManager
from specdec.drafters.base import Drafter
from specdec.kv_cache import (
    BLOCK_SIZE,
    BlockPool,
    CacheTooLarge,
    blocks_for,
    free_memory_bytes,
    pool_for,
)
from specdec.progress import stage
from specdec.sequence import Sequence
from specdec.spec.k_choice import KChoice
from specdec.worker import ForwardBatch, ModelRunner

CALIBRATION_CONTEXT = 128  # the positions the goodput policy's cost calibration runs at
KV_CACHE_MEMORY_FRACTION = 0.5  # of the free memory, the target's cache by default when serving
MAX_TIMED_ROWS = 256  # serving times its round costs at batch sizes up to this many rows; a larger
# batch starts from the largest's costs and its own rounds correct them (goodput.py)


class Capacity:
    """Sizes the target's and the drafter's caches for the rounds k_choice plans.
    return_hidden: the target's forwards return its hidden states too (for the drafter)."""

    def __init__(
        self,
        target: ModelRunner,
        drafter: Drafter | None,
        k_choice: KChoice,
        return_hidden: bool,
        prefix_caching: bool = True,
    ):
        self.target, self.drafter, self.k_choice, self.return_hidden = target, drafter, k_choice, return_hidden
        self.prefix_caching = prefix_caching
        self.pool: BlockPool | None = None  # the caches' blocks, once sized
        self.blocks: BlockManager | None = None  # who holds which of them

    def for_requests(self, seqs: list[Sequence], max_num_seqs: int) -> tuple[int, int]:
        """Caches for generating seqs, at most max_num_seqs at once; returns (slots, positions
        per slot)."""
        max_batch = min(max_num_seqs, len(seqs))
        # room for the forwards of every k these requests can use, which calibration and warm-up
        # run (a k far beyond what they can emit is neither allocated nor timed)
        k = self.k_choice.sizing_k(seqs)
        max_len = max(s.num_tokens + s.params.max_tokens for s in seqs) + self.k_choice.margin(k) + 1
        waves = -(-len(seqs) // max_batch)
        num_blocks = 1 + max_batch * blocks_for(max_len)  # every slot at full length: nothing waits for blocks
        self._reserve(max_batch, max_len, waves * max(s.params.max_tokens for s in seqs), k, num_blocks)
        return max_batch, self._max_len()

    def for_serving(
        self, max_model_len: int, max_num_seqs: int, kv_cache_bytes: int | None, engines_sharing: int = 1
    ) -> tuple[int, int]:
        """Caches for up to max_num_seqs requests at once of up to max_model_len tokens (prompt
        and output) each, in kv_cache_bytes of cache, the target's and the drafter's (None:
        KV_CACHE_MEMORY_FRACTION of the free memory, split among engines_sharing engines on one
        machine: Ray Serve replicas), or blocks for all max_num_seqs at full length where that is less;
        the goodput policy measures its costs at every batch size a power of two up to
        max_num_seqs (up to MAX_TIMED_ROWS). Slots whose memory is not free are refused
        (CacheTooLarge: _check_slots) before anything is allocated or timed. Returns (slots,
        positions per slot)."""
        k = self.k_choice.k
        max_len = max_model_len + self.k_choice.margin(k) + 1
        block_bytes = self.position_bytes * BLOCK_SIZE
        budget = kv_cache_bytes if kv_cache_bytes is not None else self._default_budget() // engines_sharing
        num_blocks = min(1 + max_num_seqs * blocks_for(max_len), budget // block_bytes)
        if num_blocks - 1 < blocks_for(max_len):
            raise CacheTooLarge(
                f"one sequence of {max_len:,} positions needs {blocks_for(max_len) * block_bytes / 1e6:,.1f} MB of "
                f"key/value cache, more than the budget of {budget / 1e6:,.1f} MB"
                + ("" if kv_cache_bytes is not None else f" ({_default_share(engines_sharing)})")
                + "; lower max_model_len, or raise the budget (--kv-cache-memory)"
            )
        self._check_slots(max_num_seqs, max_len, budget // block_bytes - 1, num_blocks * block_bytes)
        self._reserve(max_num_seqs, max_len, 0, k, num_blocks, within_budget=True, calibrate=False)
        if self.k_choice.policy is not None:
            for batch_size in timed_batch_sizes(max_num_seqs):
                self._calibrate(batch_size, max_len, k)
        return max_num_seqs, self._max_len()

    def _check_slots(self, max_num_seqs: int, max_len: int, budget_blocks: int, cache_bytes: int) -> None:
        """Refuse max_num_seqs slots whose memory beside the cache (cache_bytes) is more than is
        free: their block table (a row of blocks_for(max_len) block numbers each) and one round's
        forward over as many of them as can run at once (a running sequence holds one of the
        budget_blocks blocks at least), k + 1 positions a row (forward_bytes each)."""
        free = free_memory_bytes(self.target.device)
        if free is None:
            return
        available = max(0, free - cache_bytes)
        table_bytes, row_bytes = blocks_for(max_len) * 8, (self.k_choice.k + 1) * self.forward_bytes
        rows = min(max_num_seqs, budget_blocks)
        needed = max_num_seqs * table_bytes + rows * row_bytes
        if needed <= available:
            return
        most = available // (table_bytes + row_bytes)
        if most >= budget_blocks:  # past the blocks' rows, a slot costs only its row of the table
            most = max(budget_blocks, (available - budget_blocks * row_bytes) // table_bytes)
        raise CacheTooLarge(
            f"max_num_seqs {max_num_seqs:,}: that many sequences at once take about {needed / 1e9:,.1f} GB beside "
            f"the key/value cache (their block table, and a round's forward over {rows:,} of them, k + 1 = "
            f"{self.k_choice.k + 1} positions each: its logits and activations), more than the "
            f"{available / 1e9:,.1f} GB free; lower max_num_seqs (--max-num-seqs) to at most {most:,}"
        )

    @property
    def forward_bytes(self) -> int:
        """About the memory one position of a target forward takes while it runs (float32): its
        logits over the vocabulary three times over (the logits, their warped copy, the
        probabilities) and its MLP's two intermediate activations."""
        config = self.target.model.config
        return 4 * (3 * config.vocab_size + 2 * config.intermediate_size)

    @property
    def position_bytes(self) -> int:
        """The caches' bytes per position of a sequence: the target's and the drafter's."""
        drafter_bytes = 0 if self.drafter is None else self.drafter.position_bytes()
        return self.target.model.position_bytes + drafter_bytes

    @property
    def prefix_cache_counts(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, of those found) since it was sized."""
        blocks = self.blocks
        return (0, 0) if blocks is None else (blocks.prefix_queries, blocks.prefix_hits)

    @property
    def cache_usage(self) -> float:
        """The fraction of the caches' blocks that sequences hold (0 before sizing)."""
        blocks = self.blocks
        return 0.0 if blocks is None else blocks.num_held / (blocks.num_blocks - 1)

    @property
    def cache_tokens(self) -> int:
        """The positions the pool holds for sequences (after sizing)."""
        return 0 if self.blocks is None else (self.blocks.num_blocks - 1) * BLOCK_SIZE

    def _default_budget(self) -> int:
        free = free_memory_bytes(self.target.device)
        return int(KV_CACHE_MEMORY_FRACTION * free) if free is not None else 1 << 62

    def _max_len(self) -> int:
        """The positions a sequence may use: the target's cache's, within the block table."""
        assert self.pool is not None
        return min(self.target.max_len, self.pool.table.max_blocks * BLOCK_SIZE)

    def _reserve(
        self,
        max_batch: int,
        max_len: int,
        num_forwards: int,
        k: int,
        num_blocks: int,
        within_budget: bool = False,
        calibrate: bool = True,
    ) -> None:
        """Caches for the work ahead (at most num_forwards target forwards, k drafts a round at
        most) in a pool of num_blocks blocks (within_budget: exactly that many); the runners
        compile for it if they are to, and (calibrate) the policy measures its costs at max_batch."""
        held_pool, held_blocks = self.pool, self.blocks
        # shaped for compiled forwards where the target or the drafter compiles for this work
        compiled = self.target.compiles(max_batch, max_len, self.k_choice.query_lengths(), num_forwards) or (
            self.drafter is not None and self.drafter.compiles(max_batch, max_len, num_forwards)
        )
        # the pool held where it is large enough (within_budget: of num_blocks exactly, the budget's)
        pool = self.pool = pool_for(
            self.pool, max_batch, max_len, num_blocks, self.target.device, within_budget, compiled
        )
        readers_made = pool.table.readers_made
        self.blocks = None
        try:
            self.target.prepare(
                max_batch,
                max_len,
                self.k_choice.query_lengths(),
                num_forwards,
                return_hidden=self.return_hidden,
                pool=pool,
            )
            if self.drafter is not None:
                self.drafter.reserve(max_batch, max_len, num_forwards, pool)
        except CacheTooLarge as e:
            raise CacheTooLarge(
                f"{e}: {max_batch} sequences at once, each of up to {max_len:,} positions (prompt + "
                "max_tokens + k + 1); lower max_tokens, or max_num_seqs"
            ) from None
        entries_kept = pool is held_pool and pool.table.readers_made == readers_made
        self.blocks = self._block_manager(pool, held_blocks, entries_kept)
        if calibrate and self.k_choice.policy is not None:
            self._calibrate(max_batch, max_len, k)

    def _block_manager(self, pool: BlockPool, held: BlockManager | None, entries_kept: bool) -> BlockManager:
        """Who hands out pool's blocks. Prefix caching shares blocks where the target's cache
        reads the pool (compiled or not); a drafter fed
        the target's features needs its own entries of a shared prefix too. held: the block
        manager of the last reserve; entries_kept: the pool and every cache reading it are the
        ones it was for (the entries of its cached prefixes are still there). It is kept then, if
        it matches and no sequence holds a block, so that the requests of a generate call find
        the prefixes of the calls before (as a server's requests find those of earlier ones); a
        new one carries on its prefix cache counts."""
        prefix_caching = self.prefix_caching and self.target.reads_pool(pool)
        needs_target = self.drafter is not None and self.drafter.needs_target_hidden
        if (
            entries_kept
            and held is not None
            and held.num_held == 0
            and held.prefix_caching == prefix_caching
            and held.drafter_needs_target == needs_target
        ):
            return held
        blocks = BlockManager(pool.sequence_blocks, pool.table, prefix_caching, drafter_needs_target=needs_target)
        if held is not None:
            blocks.prefix_queries, blocks.prefix_hits = held.prefix_queries, held.prefix_hits
        return blocks

    def _calibrate(self, batch_size: int, max_len: int, k: int) -> None:
        """The goodput policy's costs at batch_size rows for every k up to k (once per batch
        bucket: goodput.py; a larger k later adds its lengths)."""
        policy, drafter = self.k_choice.policy, self.drafter
        assert policy is not None and drafter is not None  # goodput's k > 0: there is a drafter
        with stage(f"timing the round costs of {batch_size} row{'s' if batch_size > 1 else ''} for k by goodput"):
            policy.calibrate(
                batch_size,
                k,
                lambda num_tokens: self._time_target(batch_size, num_tokens, max_len),
                lambda: drafter.time_step(batch_size),
            )

    def warm_up(self, num_slots: int, repeats: int = 2) -> None:
        """Run, untimed, every target forward the rounds can take (1 to k + 1 tokens a row, all
        num_slots slots) and a draft step, `repeats` times each: the first calls of a shape
        allocate, pack weights and pick kernels, which a timed request should not pay. After
        sizing, before requests run (it writes where calibration does: _time_target)."""
        max_len = self.target.max_len
        with torch.inference_mode():
            for _ in range(repeats):
                for num_tokens in range(1, min(self.k_choice.k + 1, max_len - 1) + 1):  # the forwards the cache holds
                    self._time_target(num_slots, num_tokens, max_len)
                if self.drafter is not None:
                    self.drafter.time_step(num_slots)

    def _time_target(self, batch_size: int, num_tokens: int, max_len: int) -> None:
        """A target forward of num_tokens tokens per row for batch_size rows, in slots
        0..batch_size-1 before any sequence holds them, at positions from CALIBRATION_CONTEXT on
        (attention over as many keys as a typical prompt; what it writes there sits past every
        new sequence's length until that sequence overwrites it)."""
        device = self.target.device
        start = max(0, min(CALIBRATION_CONTEXT, max_len - num_tokens - 1))
        input_ids = torch.zeros(batch_size, num_tokens, dtype=torch.long, device=device)  # [B, T]
        positions = start + torch.arange(num_tokens, device=device).expand(batch_size, num_tokens)  # [B, T]
        self.target(ForwardBatch.of(input_ids, positions, range(batch_size)), return_hidden=self.return_hidden)


def timed_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes serving times its round costs at: every power of two below max_num_seqs,
    and max_num_seqs itself, none above MAX_TIMED_ROWS (then MAX_TIMED_ROWS is the last)."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs] + [max_num_seqs]
    return sorted({min(size, MAX_TIMED_ROWS) for size in sizes})


def _default_share(engines_sharing: int) -> str:
    """The default budget, in words."""
    split = "" if engines_sharing == 1 else f", split among {engines_sharing} engines"
    return f"half the free memory{split}"
