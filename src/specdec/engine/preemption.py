"""Preemption: room in the pool of cache blocks for every running sequence's next round.

Before each round every running sequence grows its blocks for the positions the round writes
(scheduler.py), oldest first. While the pool is short, the youngest running sequence is
preempted, to wait first in line, in one of two ways:
  swapped     its blocks' entries copied into the swap space (swap.py) where they fit: it keeps
              its slot and its drafter's state, and resumes from the very state it left
  recomputed  its slot and its drafter's state freed, to be prefilled anew later
So no request ever fails for lack of cache, and preemption changes no output.
"""

from __future__ import annotations

from specdec.drafters.base import Drafter
from specdec.engine.capacity import Capacity
from specdec.engine.scheduler import Scheduler
from specdec.engine.swap import SwapSpace
from specdec.kv_cache import BLOCK_SIZE, swap_in, swap_out
from specdec.sequence import Sequence


class Preemption:
    """The scheduler's running sequences, given their blocks in the capacity's pool; preempted
    ones' entries wait in swap (bytes bounded); drafter: forgets a recomputed one's state."""

    def __init__(self, scheduler: Scheduler, capacity: Capacity, drafter: Drafter | None, swap: SwapSpace):
        self.scheduler, self.capacity, self.drafter, self.swap = scheduler, capacity, drafter, swap

    def make_room(self) -> None:
        """Every running sequence's blocks for its next round, oldest first; while the pool is
        short, the youngest running sequence is preempted."""
        preempted: set[int] = set()  # ids of the sequences preempted here (a swapped one keeps its slot)
        for seq in list(self.scheduler.running):
            while id(seq) not in preempted and not seq.finished and not self.scheduler.grow(seq):
                victim = self.scheduler.youngest()
                preempted.add(id(victim))
                self._preempt(victim)

    def _preempt(self, victim: Sequence) -> None:
        """Take victim out to wait, first in line: swapped out where the swap space holds its
        entries, else to be recomputed."""
        blocks, pool = self.capacity.blocks, self.capacity.pool
        assert blocks is not None and pool is not None  # only a pool of blocks runs short
        held = blocks.blocks_of(victim.slot)
        if self.swap.fits(len(held) * BLOCK_SIZE * self.capacity.position_bytes):
            self.swap.put(victim.request_id, swap_out(pool, held))
            self.scheduler.preempt(victim, keep_slot=True)
            return
        if self.drafter is not None:
            self.drafter.release(victim)
        self.scheduler.preempt(victim, keep_slot=False)

    def swap_in(self, seq: Sequence) -> bool:
        """If seq was swapped out, its entries into the blocks it holds again; whether it was."""
        swapped = self.swap.pop(seq.request_id)
        if swapped is None:
            return False
        blocks, pool = self.capacity.blocks, self.capacity.pool
        assert blocks is not None and pool is not None  # it was swapped out of them
        swap_in(pool, blocks.blocks_of(seq.slot), swapped)
        return True
