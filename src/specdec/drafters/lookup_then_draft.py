"""Prompt lookup first; a drafter (a draft model or an EAGLE head) for the rows where it finds nothing.

Each round, a greedy row whose context's last n tokens (n >= ngram_min) occurred earlier in
it proposes what followed them there, at no cost (see ngram.py); the other rows are drafted
by the drafter behind it: the draft model (draft_model.py), or an EAGLE head (eagle.py) where
speculative_model is a head's directory. Code repeats itself (names, calls, whole lines), so
on code many rounds need no drafter at all, and the rest still get its drafts. The drafter
catches up on the tokens it skipped the next time it drafts for the row: the draft model
feeds them to its cache, the head the target's features of them, which it is handed after
every target forward whoever drafted.

Sampled rows always take the drafter: a looked-up token is a point mass, which a sampled
row keeps only with the target's probability of it (on the shipped pair's sampled code prompts
prompt lookup's α is a fraction of the draft model's: docs/runner.md, "Prompt lookup on sampled
rows").

Per row, the draft is a point mass (a looked-up row) or the drafter's distributions:
rejection sampling keeps the output exactly the target's either way.
"""

from __future__ import annotations

import torch

from specdec.config import DEFAULT_NGRAM_MIN
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.kv_cache import BlockPool
from specdec.models.eagle import is_head_directory
from specdec.sampling import SamplingTensors, point_mass
from specdec.sequence import Sequence


class LookupThenDraftDrafter(Drafter):
    def __init__(self, lookup: NgramDrafter, drafter: DraftModelDrafter | EagleDrafter):
        self.lookup = lookup
        self.drafter = drafter
        self.needs_target_hidden = drafter.needs_target_hidden  # a head: the target's features, every round

    @classmethod
    def from_config(cls, spec, target, target_runner) -> LookupThenDraftDrafter:
        behind = EagleDrafter if is_head_directory(spec.model) else DraftModelDrafter
        return cls(
            NgramDrafter.from_config(spec, target, target_runner), behind.from_config(spec, target, target_runner)
        )

    @classmethod
    def sharing_weights(cls, draft_model: DraftModelDrafter) -> LookupThenDraftDrafter:
        """Prompt lookup with this method's default n-gram lengths in front of draft_model's
        weights (and runner: see DraftModelDrafter.sharing_weights)."""
        return cls(
            NgramDrafter(DEFAULT_NGRAM_MIN["lookup_then_draft"], device=draft_model.model.device),
            draft_model.sharing_weights(),
        )

    def observe(self, batch: list[Sequence], num_accepted: torch.Tensor) -> None:
        self.drafter.observe(batch, num_accepted)

    def observe_hidden(
        self, batch: list[Sequence], first_positions: torch.Tensor, hidden: torch.Tensor, num_valid: torch.Tensor
    ) -> None:
        self.drafter.observe_hidden(batch, first_positions, hidden, num_valid)

    def reserve(self, max_batch: int, max_len: int, num_forwards: int = 0, pool: BlockPool | None = None) -> None:
        self.drafter.reserve(max_batch, max_len, num_forwards, pool)

    def release(self, seq: Sequence) -> None:
        self.drafter.release(seq)

    def cached_entries(self, seq: Sequence) -> int | None:
        return self.drafter.cached_entries(seq)

    def position_bytes(self) -> int:
        return self.drafter.position_bytes()

    def time_step(self, batch_size: int) -> None:
        self.drafter.time_step(batch_size)

    def propose(self, batch: list[Sequence], ks: list[int], sampling: SamplingTensors) -> Draft:
        if not sampling.any_greedy:
            return self.drafter.propose(batch, ks, sampling)
        looked_up = self.lookup.propose(batch, ks, sampling)
        greedy = sampling.greedy.tolist()
        unmatched = [row for row, n in enumerate(looked_up.num_tokens.tolist()) if n == 0 or not greedy[row]]
        if not unmatched:
            return looked_up
        if len(unmatched) == len(batch):
            return self.drafter.propose(batch, ks, sampling)
        rows = torch.tensor(unmatched, device=looked_up.token_ids.device)  # [R]
        drafted = self.drafter.propose(
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
