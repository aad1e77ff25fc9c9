"""Swap space: where preempted sequences' cache entries wait to be swapped back in.

When the pool of cache blocks runs short, the engine preempts the youngest running sequence
(scheduler.py). Swapped out, its blocks' entries (every cache in the pool's: the target's, a
draft model's, a head's) are copied here and its blocks freed; it keeps its slot, so its
drafter's state stays as it was; when blocks are free again its entries are copied into new
blocks and it goes on from the very state it left: the same tokens, the same generator, the
same drafts. So preemption changes no output (vLLM's swap preemption; vLLM's swap_space).

The space is bounded (swap_space, in bytes): a victim whose entries do not fit is recomputed
instead (its blocks and slot freed, prefilled anew later: Sequence.prefill_token_ids), which
gives the same tokens only where a prefill's rows compute what the steps that wrote them
computed, bit for bit.
"""

from __future__ import annotations

from specdec.kv_cache import SwappedEntries

DEFAULT_SWAP_SPACE_GIB = 4.0  # vLLM's default swap_space


class SwapSpace:
    """capacity_bytes: the most that swapped-out entries may hold at once (0: never swap)."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._swapped: dict[str, SwappedEntries] = {}  # by request id
        self.used_bytes = 0
        self.num_swapped_out = 0  # preemptions by swapping since the last clear

    def fits(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.capacity_bytes

    def put(self, request_id: str, swapped: SwappedEntries) -> None:
        if request_id in self._swapped:
            raise RuntimeError(f"request {request_id!r} is swapped out already")
        self._swapped[request_id] = swapped
        self.used_bytes += swapped.nbytes
        self.num_swapped_out += 1

    def pop(self, request_id: str) -> SwappedEntries | None:
        """The request's swapped-out entries, no longer held here (None: it has none)."""
        swapped = self._swapped.pop(request_id, None)
        if swapped is not None:
            self.used_bytes -= swapped.nbytes
        return swapped

    def clear(self) -> None:
        self._swapped.clear()
        self.used_bytes = self.num_swapped_out = 0
