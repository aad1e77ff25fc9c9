"""The scheduler: which requests wait, which run, in which cache slot, holding which blocks.
Plain Python, no tensors.

A request waits (first come, first served) until a slot is free and the block manager
(block_manager.py) has the blocks its prompt and a round's writes need; then it runs, holding
its slot (a row of the block table) and its blocks until it finishes or is aborted, when both go
to the next waiting request: continuous batching. Before each round every running sequence grows
its blocks for the positions the round writes; when the pool runs short, the youngest running
sequences are preempted, so that no request ever fails for lack of cache. A preempted sequence
waits again, first in line, in one of two ways (the engine chooses, engine.py):
  swapped    its blocks' entries copied out and the blocks freed; it keeps its slot (and so its
             drafter's state), and resumes with fresh blocks holding those entries: exactly
             where it was
  recomputed its blocks and its slot freed; it is prefilled anew over its tokens so far but the
             last (prefill_token_ids), which the next round feeds as for any running sequence
The number of slots is the most sequences run at once (max_num_seqs); the number of blocks, the
cache memory (capacity.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from specdec.block_manager import BlockManager
from specdec.kv_cache import BLOCK_SIZE
from specdec.sequence import Sequence


class Scheduler:
    """max_prefill_tokens: the most tokens one step's prefill may run, counted as the forward
    runs them (rows x the longest prompt among them); more waiting requests start at the next
    steps, so that a burst of prompts does not stall the running requests' decoding for one long
    prefill. At least one request starts whenever a slot and blocks are free (the engine feeds a
    prompt longer than the budget in chunks over several steps). None: no limit.
    room(seq): the positions seq must hold blocks for before its next forward (its tokens and
    what a round writes past them)."""

    def __init__(self, num_slots: int = 0, max_prefill_tokens: int | None = None):
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_slots = 0
        self.blocks: BlockManager | None = None
        self.room: Callable[[Sequence], int] = lambda seq: seq.num_tokens
        self.num_preemptions = 0
        self._free_slots: list[int] = []
        self.resize(num_slots)

    def resize(
        self, num_slots: int, blocks: BlockManager | None = None, room: Callable[[Sequence], int] | None = None
    ) -> None:
        """Run up to num_slots sequences at once from now on (only while none is running), in
        the blocks that manager hands out (None: every slot holds all its positions)."""
        if self.running:
            raise RuntimeError("the scheduler's slots cannot change while sequences run")
        self.num_slots = num_slots
        self._free_slots = list(range(num_slots))[::-1]  # slot 0 first
        self.blocks = blocks
        if room is not None:
            self.room = room

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Waiting sequences, in order, while there are blocks for them: a swapped-out one into
        its own slot, the others into free slots. Returns the ones that run now (their blocks
        held for their next forward; a new one's cached prefix shared: seq.num_cached_tokens)."""
        admitted, longest = [], 0
        while self.waiting:
            seq = self.waiting[0]
            if seq.slot >= 0:  # swapped out: its slot is still its own
                if not self.grow(seq):
                    break
                self.waiting.popleft()
                admitted.append(seq)
                continue
            if not self._free_slots or self._waits_for_sibling(seq):
                break
            longest = max(longest, seq.num_tokens)
            if (
                admitted
                and self.max_prefill_tokens is not None
                and (len(admitted) + 1) * longest > self.max_prefill_tokens
            ):
                break
            slot = self._free_slots[-1]
            tokens = seq.prefill_token_ids
            # a new sequence asking for its prompt's logprobs: its prefill computes every position
            every_position = seq.params.prompt_logprobs is not None and not seq.output_token_ids
            cached = (
                (0, 0) if self.blocks is None else self.blocks.admit(slot, tokens, self.room(seq), not every_position)
            )
            if cached is None:
                break  # first come, first served: the next waits for blocks too
            self.waiting.popleft()
            seq.slot, (seq.num_cached_tokens, seq.num_drafter_cached_tokens) = self._free_slots.pop(), cached
            admitted.append(seq)
        self.running += admitted
        return admitted

    def _waits_for_sibling(self, seq: Sequence) -> bool:
        """Whether seq, one of a request's n completions, waits for the sibling whose prompt blocks
        it will share (engine/parallel_sampling.py): until that one's prefill is done (its first
        token sampled, its blocks then registered). Never where no block could be shared, unless
        the first computes the request's prompt logprobs (they then come in the request's first
        output, before any other completion's)."""
        first = seq.fork_of
        return (
            first is not None
            and (first.params.prompt_logprobs is not None or self._shares_prompt_blocks(seq))
            and not first.output_token_ids
            and not first.finished
        )

    def _shares_prompt_blocks(self, seq: Sequence) -> bool:
        return self.blocks is not None and self.blocks.prefix_caching and len(seq.prompt_token_ids) > BLOCK_SIZE

    def grow(self, seq: Sequence) -> bool:
        """Give running seq the blocks its next forward writes; False (nothing taken) if the
        pool is short."""
        if self.blocks is None:
            return True
        room = self.room(seq)
        if not self.blocks.can_grow(seq.slot, room):
            return False
        self.blocks.grow(seq.slot, room)
        return True

    def register_full_blocks(self, drafter_entries: Callable[[Sequence], int | None] | None = None) -> None:
        """Every running sequence's blocks whose entries are all written, registered for later
        prefixes (block_manager.py; nothing without prefix caching). drafter_entries(seq): the
        leading positions whose entries a drafter's cache in the pool holds for seq (None: it
        keeps none there)."""
        if self.blocks is not None and self.blocks.prefix_caching:
            for seq in self.running:
                drafted = None if drafter_entries is None else drafter_entries(seq)
                self.blocks.register(seq.slot, seq.token_ids[: seq.num_written + 1], drafted)

    def youngest(self) -> Sequence:
        """The running sequence admitted last: the one preempted first."""
        return self.running[-1]

    def preempt(self, seq: Sequence, keep_slot: bool) -> None:
        """Take running seq out, its blocks free, to wait first in line. keep_slot: swapped out
        (its slot stays its own, to resume in); else its slot is free too, to be recomputed."""
        self._release(seq, keep_slot=keep_slot)
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def retire_finished(self) -> list[Sequence]:
        """The running sequences that finished, out of the batch, their slots and blocks free."""
        finished = [seq for seq in self.running if seq.finished]
        if finished:
            self.running = [seq for seq in self.running if not seq.finished]
            for seq in finished:
                self._release(seq, keep_slot_number=True)
        return finished

    def remove(self, request_id: str) -> Sequence | None:
        """Take a request out, waiting or running (freeing its slot and blocks); None if it is
        not here."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                if seq.slot >= 0:  # swapped out: its blocks are free, its slot not yet
                    self._free_slots.append(seq.slot)
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                self._release(seq, keep_slot_number=True)
                return seq
        return None

    def _release(self, seq: Sequence, keep_slot_number: bool = False, keep_slot: bool = False) -> None:
        """seq's blocks free, and its slot unless keep_slot (seq.slot kept where the caller still
        reads it: a finished or aborted sequence's drafter state is released by slot after this)."""
        if self.blocks is not None:
            self.blocks.free(seq.slot)
        if keep_slot:
            return
        self._free_slots.append(seq.slot)
        if not keep_slot_number:
            seq.slot = -1

    def check_idle(self) -> None:
        """A RuntimeError while any sequence waits or runs (the engine cannot be sized again then)."""
        if self.has_unfinished():
            raise RuntimeError("the engine has unfinished requests: finish or abort them before preparing again")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def request_ids(self, waiting: bool = True, running: bool = True) -> list[str]:
        """The unfinished requests' ids (a request of n completions once), waiting and/or running."""
        seqs = (list(self.waiting) if waiting else []) + (self.running if running else [])
        return list(dict.fromkeys(seq.output_request_id for seq in seqs))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
