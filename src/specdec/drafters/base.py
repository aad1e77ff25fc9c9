"""The Drafter interface: whatever proposes tokens for the target to verify."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specdec.sampling import SamplingTensors
from specdec.sequence import Sequence


@dataclass
class Draft:
    """Proposed tokens for a batch.

    token_ids [B, k]        entries past a row's num_tokens are ignored (0 padding, or the
                            tokens an adaptive draft drafted after the row stopped)
    num_tokens [B]          how many tokens each row proposes (0..k)
    probs [B, k, V] | None  the warped distributions each token was drawn from, in the
                            target's vocabulary; None = point masses (a deterministic drafter)
    """

    token_ids: torch.Tensor
    num_tokens: torch.Tensor
    probs: torch.Tensor | None = None

    @classmethod
    def empty(cls, batch_size: int, device: torch.device | str) -> "Draft":
        return cls(torch.zeros(batch_size, 0, dtype=torch.long, device=device),
                   torch.zeros(batch_size, dtype=torch.long, device=device))


class Drafter(ABC):
    """Proposes up to k tokens per sequence each round.

    The engine calls `reserve` before a batch, `propose` once per round, `observe` with what
    the target accepted, and `release` when a sequence leaves its slot.
    """

    def reserve(self, max_batch: int, max_len: int, num_forwards: int = 0) -> None:
        """Make room for max_batch sequences of up to max_len positions, for work of at most
        num_forwards rounds (a model-based drafter may compile for it)."""

    @abstractmethod
    def propose(self, batch: list[Sequence], k: int, sampling: SamplingTensors) -> Draft:
        """Draft up to k tokens for each sequence (whose tokens so far are seq.token_ids)."""

    def observe(self, batch: list[Sequence], num_accepted: torch.Tensor) -> None:
        """Told how many draft tokens each row had accepted; a drafter may adapt."""

    def release(self, seq: Sequence) -> None:
        """seq has finished; its slot may be reused."""
