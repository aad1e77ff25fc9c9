"""The scheduler: which requests wait, which run, and in which cache slot. Plain Python, no
tensors.

A request waits (first come, first served) until a slot is free; then it runs, holding its slot
(a row of every KV cache) until it finishes or is aborted, when the slot goes to the next waiting
request: continuous batching. The number of slots is the most sequences run at once, sized by
the engine to max_num_seqs and the memory the caches may take.
"""

from __future__ import annotations

from collections import deque

from specdec.sequence import Sequence


class Scheduler:
    """max_prefill_tokens: the most tokens one step's prefill may run, counted as the forward
    runs them (rows x the longest prompt among them); more waiting requests start at the next
    steps, so that a burst of prompts does not stall the running requests' decoding for one long
    prefill. At least one request starts whenever a slot is free. None: no limit."""

    def __init__(self, num_slots: int = 0, max_prefill_tokens: int | None = None):
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_slots = 0
        self._free_slots: list[int] = []
        self.resize(num_slots)

    def resize(self, num_slots: int) -> None:
        """Run up to num_slots sequences at once from now on (only while none is running)."""
        if self.running:
            raise RuntimeError("the scheduler's slots cannot change while sequences run")
        self.num_slots = num_slots
        self._free_slots = list(range(num_slots))[::-1]  # slot 0 first

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Waiting sequences, in order, into the free slots: the ones that start running now."""
        admitted, longest = [], 0
        while self.waiting and self._free_slots:
            longest = max(longest, self.waiting[0].num_tokens)
            if (
                admitted
                and self.max_prefill_tokens is not None
                and (len(admitted) + 1) * longest > self.max_prefill_tokens
            ):
                break
            seq = self.waiting.popleft()
            seq.slot = self._free_slots.pop()
            admitted.append(seq)
        self.running += admitted
        return admitted

    def retire_finished(self) -> list[Sequence]:
        """The running sequences that finished, out of the batch, their slots free."""
        finished = [seq for seq in self.running if seq.finished]
        if finished:
            self.running = [seq for seq in self.running if not seq.finished]
            self._free_slots += [seq.slot for seq in finished]
        return finished

    def remove(self, request_id: str) -> Sequence | None:
        """Take a request out, waiting or running (freeing its slot); None if it is not here."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                self._free_slots.append(seq.slot)
                return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
