"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
context's last n tokens (n from ngram_max down to ngram_min). No model; the proposal is a
point mass (draft_probs = None), and a row may propose fewer than k tokens, or none.

When the match is so recent that its continuation runs into the end of the context (a
repeating loop), the copy goes on over the tokens it has just proposed, as LZ77 copies
overlapping runs: "a b c a b" with the match "a b" at 0 proposes "c a b c a"."""

from __future__ import annotations

import numpy as np
import torch

from specdec.drafters.base import Draft, Drafter
from specdec.sampling import SamplingTensors
from specdec.sequence import Sequence


class NgramDrafter(Drafter):
    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, device: torch.device | str = "cpu"):
        self.ngram_min, self.ngram_max, self.device = ngram_min, ngram_max, device

    @classmethod
    def from_config(cls, spec, target, target_runner) -> NgramDrafter:
        return cls(spec.ngram_min, spec.ngram_max, target_runner.device)

    def propose(self, batch: list[Sequence], ks: list[int], sampling: SamplingTensors) -> Draft:
        token_ids = torch.zeros(len(batch), max(ks, default=0), dtype=torch.long)
        num_tokens = torch.zeros(len(batch), dtype=torch.long)
        for row, (seq, k) in enumerate(zip(batch, ks)):
            proposal = lookup(np.asarray(seq.token_ids), k, self.ngram_min, self.ngram_max)
            token_ids[row, : len(proposal)] = torch.as_tensor(proposal, dtype=torch.long)
            num_tokens[row] = len(proposal)
        return Draft(token_ids.to(self.device), num_tokens.to(self.device), None)

    def proposal_length(self, seq: Sequence, k: int) -> int:
        """How many tokens propose would give seq with k: 0 where nothing matches."""
        return len(lookup(np.asarray(seq.token_ids), k, self.ngram_min, self.ngram_max))


def lookup(context: np.ndarray, k: int, ngram_min: int, ngram_max: int) -> np.ndarray:
    """Up to k tokens that followed the latest earlier match of the context's last n tokens,
    trying the longest n first; empty when nothing matches."""
    L = len(context)
    ends = np.flatnonzero(context[: L - 1] == context[L - 1])  # earlier places where a match could end
    if L < 2 or not len(ends):
        return context[:0]
    match_len = np.ones(len(ends), dtype=np.int64)  # how far back each candidate keeps matching
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(ngram_max, L - 1)):
        alive &= ends >= back
        alive[alive] &= context[ends[alive] - back] == context[L - 1 - back]
        match_len += alive
    for n in range(min(ngram_max, L - 1), ngram_min - 1, -1):
        matching = np.flatnonzero(match_len >= n)
        if len(matching):
            start = ends[matching[-1]] + 1  # first token after the latest match (start < L)
            extended = np.concatenate([context, np.empty(k, dtype=context.dtype)])
            for i in range(k):  # overlapping copy: start + i < L + i, always already written
                extended[L + i] = extended[start + i]
            return extended[L : L + k]
    return context[:0]
