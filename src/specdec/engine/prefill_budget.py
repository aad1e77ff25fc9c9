"""How many prompt tokens one step may prefill: a token bound and a time bound.

A step's prefill is one target forward over chunks of the prompts under way. While it runs,
nothing else does: a new request waits to start, and a client that left is aborted only after
it. The token bound (--max-prefill-tokens) caps the forward's size, but what a token costs
varies by model and machine a hundredfold (a 400-token chunk: about a second for a 135M GGUF on
a 2-core CPU). The time bound caps the forward's expected seconds: from the cost per token of
the prefills already run (rows x the longest chunk, as the forward runs them), a running mean.

Terms: budget = the most tokens the next step's forward may run (rows x the longest chunk).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdec.sequence import Sequence

MIN_TOKENS = 32  # a time budget never shrinks a step's prefill below this: prompts still advance
COST_WEIGHT = 0.3  # the weight of the newest prefill in the running mean of a token's cost


@dataclass
class PrefillBudget:
    """max_tokens: the token bound (None: none); max_seconds: the time bound (None: none)."""

    max_tokens: int | None = None
    max_seconds: float | None = None
    seconds_per_token: float | None = field(default=None, init=False)  # measured; None until a prefill ran

    def __post_init__(self):
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be at least 1, got {self.max_tokens}")
        if self.max_seconds is not None and not (math.isfinite(self.max_seconds) and self.max_seconds > 0):
            raise ValueError(f"max_prefill_seconds must be a positive number of seconds, got {self.max_seconds}")

    def tokens(self) -> int | None:
        """The next step's budget: the token bound, lowered to what the time bound affords (but
        not below MIN_TOKENS) once a prefill has been timed. None: no bound."""
        if self.max_seconds is None or self.seconds_per_token is None:
            return self.max_tokens
        affordable = max(MIN_TOKENS, int(self.max_seconds / self.seconds_per_token))
        return affordable if self.max_tokens is None else min(self.max_tokens, affordable)

    def chunks(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """The next chunks of the prefills under way among seqs, oldest first, within the budget
        (a prompt longer than it is prefilled over several steps, so that a step, and the wait to
        abort a request, stays short): (the sequences fed, their chunks' lengths)."""
        budget = self.tokens()
        batch, lengths = [], []
        for seq in seqs:
            if not seq.prefilling:
                continue
            remaining = len(seq.prefill_token_ids) - seq.num_written
            length = remaining if budget is None else min(remaining, budget)
            if batch and budget is not None and (len(batch) + 1) * max(*lengths, length) > budget:
                break
            batch.append(seq)
            lengths.append(length)
        return batch, lengths

    def record(self, num_tokens: int, seconds: float) -> None:
        """A prefill forward ran num_tokens (rows x the longest chunk) in seconds."""
        if num_tokens <= 0 or seconds <= 0:
            return
        cost = seconds / num_tokens
        previous = self.seconds_per_token
        self.seconds_per_token = cost if previous is None else (1 - COST_WEIGHT) * previous + COST_WEIGHT * cost
