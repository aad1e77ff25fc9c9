"""Prompt lookup first; the draft model for the rows where it finds nothing.

Each round, a greedy row whose context's last n tokens (n >= ngram_min) occurred earlier in
it proposes what followed them there, at no cost (see ngram.py); the other rows are drafted
by the draft model (see draft_model.py). Code repeats itself (names, calls, whole lines), so
on code many rounds need no draft model at all, and the rest still get its drafts. The draft
model's cache catches up on the tokens it skipped the next time it drafts for the row.

Sampled rows always take the draft model: a looked-up token is a point mass, which a sampled
row keeps only with the target's probability of it (on the shipped pair's sampled code prompts
prompt lookup's α is a fraction of the draft model's: docs/runner.md, "Prompt lookup on sampled
rows").

Per row, the draft is a point mass (a looked-up row) or the draft model's distributions:
rejection sampling keeps the output exactly the target's either way.
"""

from __future__ import annotations

import torch

from specdec.config import DEFAULT_NGRAM_MIN
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.kv_cache import BlockPool
from specdec.sampling import SamplingTensors, point_mass
from specdec.sequence import Sequence


class LookupThenDraftDrafter(Drafter):
    def __init__(self, lookup: NgramDrafter, draft_model: DraftModelDrafter):
        self.lookup = lookup
        self.draft_model = draft_model

    @classmethod
    def from_config(cls, spec, target, target_runner) -> LookupThenDraftDrafter:
        return cls(
            NgramDrafter.from_config(spec, target, target_runner),
            DraftModelDrafter.from_config(spec, target, target_runner),
        )

    @classmethod
    def sharing_weights(cls, draft_model: DraftModelDrafter) -> LookupThenDraftDrafter:
        """Prompt lookup with this method's default n-gram lengths in front of draft_model's
        weights (and runner: see DraftModelDrafter.sharing_weights)."""
        return cls(
            NgramDrafter(DEFAULT_NGRAM_MIN["lookup_then_draft"], device=draft_model.model.device),
            draft_model.sharing_weights(),
        )

    def reserve(self, max_batch: int, max_len: int, num_forwards: int = 0, pool: BlockPool | None = None) -> None:
        self.draft_model.reserve(max_batch, max_len, num_forwards, pool)

    def release(self, seq: Sequence) -> None:
        self.draft_model.release(seq)

    def cached_entries(self, seq: Sequence) -> int | None:
        return self.draft_model.cached_entries(seq)

    def position_bytes(self) -> int:
        return self.draft_model.position_bytes()

    def time_step(self, batch_size: int) -> None:
        self.draft_model.time_step(batch_size)

    def propose(self, batch: list[Sequence], ks: list[int], sampling: SamplingTensors) -> Draft:
        if not sampling.any_greedy:
            return self.draft_model.propose(batch, ks, sampling)
        looked_up = self.lookup.propose(batch, ks, sampling)
        greedy = sampling.greedy.tolist()
        unmatched = [row for row, n in enumerate(looked_up.num_tokens.tolist()) if n == 0 or not greedy[row]]
        if not unmatched:
            return looked_up
        if len(unmatched) == len(batch):
            return self.draft_model.propose(batch, ks, sampling)
        rows = torch.tensor(unmatched, device=looked_up.token_ids.device)  # [R]
        drafted = self.draft_model.propose(
            [batch[row] for row in unmatched], [ks[row] for row in unmatched], sampling.select_rows(rows)
        )
        return _merge(looked_up, drafted, rows)


def _merge(looked_up: Draft, drafted: Draft, drafted_rows: torch.Tensor) -> Draft:
    """looked_up's rows, with drafted's in place of rows drafted_rows [R]. Where drafted has
    distributions, looked-up rows get point masses on their tokens."""
    token_ids = looked_up.token_ids.clone()  # [B, k]
    width = drafted.token_ids.shape[1]  # at most k: the drafted rows' largest k
    token_ids[drafted_rows] = 0
    token_ids[drafted_rows, :width] = drafted.token_ids
    num_tokens = looked_up.num_tokens.clone()  # [B]
    num_tokens[drafted_rows] = drafted.num_tokens
    probs = None
    if drafted.probs is not None:
        B, k = token_ids.shape
        probs = point_mass(looked_up.token_ids.reshape(-1), drafted.probs.shape[-1]).view(B, k, -1)  # [B, k, V]
        probs[drafted_rows] = 0
        probs[drafted_rows, :width] = drafted.probs
    return Draft(token_ids, num_tokens, probs)
