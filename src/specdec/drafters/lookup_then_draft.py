"""Prompt lookup first; a drafter (a draft model or an EAGLE head) for the rows where it finds nothing.

Each round, a greedy row whose context's last n tokens (n >= ngram_min) occurred earlier in
it proposes what followed them there, at no cost (see ngram.py); the other rows are drafted
by the drafter behind it: the draft model (draft_model.py), or an EAGLE head (eagle.py) where
speculative_model is a head's directory. Code repeats itself (names, calls, whole lines), so
on code many rounds need no drafter at all, and the rest still get its drafts. The drafter
catches up on the tokens it skipped the next time it drafts for the row: the draft model
feeds them to its cache, the head the target's features of them, which it is handed after
every target forward whoever drafted.

A sampled row keeps a looked-up token (a point mass) only with the target's probability of
it: where the text is copied (an edited function) that is most of the time, where a match is a
coincidence (new code) seldom. So a sampled row with a match takes lookup while lookup's
acceptance rate on that sequence is at least the drafter's, each estimated from the sequence's
own rounds (metrics.py's AcceptanceEstimate, as goodput.py's: recent rounds weigh more, and the one not used
drifts back to the prior, so it is tried again). Both start at the same prior and lookup, free,
is tried first. On Qwen2.5-Coder-1.5B at temperature 0.8 prompt lookup alone ran 2.30x plain
decoding on "edit" prompts and 1.10x on "write" ones, the EAGLE head 0.89x and 1.32x
(docs/runner.md, "Prompt lookup on sampled rows"). The choice reads only acceptance, never
timings: a seeded request gets the same tokens every run.

Under k by goodput the k policy makes that choice instead, every row's, greedy or sampled
(outlook offers it lookup or the drafter, assign says which): from its own estimates of each
drafter's acceptance on the sequence, what a match gives and what the drafter's steps cost. A
match that is a coincidence (the same instruction over new inputs) then gives way to the drafter
rather than to a plain round, and a long copy, free, is verified wide.

Per row, the draft is a point mass (a looked-up row) or the drafter's distributions:
rejection sampling keeps the output exactly the target's either way.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specdec.drafters.base import Draft, Drafter, RowOutlook
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.kv_cache import BlockPool
from specdec.methods import METHODS
from specdec.metrics import AcceptanceEstimate
from specdec.models.eagle import is_head_directory
from specdec.sampling import SamplingTensors, point_mass
from specdec.sequence import Sequence
from specdec.tree import ROOT

LOOKUP, DRAFTER = "lookup", "drafter"  # who drafted a sampled row's round
PRIOR = 0.5  # both acceptance estimates start here (AcceptanceEstimate's prior)


class Lookup(Protocol):
    """What drafts first: a drafter that can say, before proposing, how much it would propose."""

    def propose(self, batch: list[Sequence], ks: list[int], sampling: SamplingTensors) -> Draft: ...

    def proposal_length(self, seq: Sequence, k: int) -> int: ...

    def release(self, seq: Sequence) -> None: ...


class LookupThenDraftDrafter(Drafter):
    """lookup: what drafts first, at no cost (prompt lookup here; suffix decoding in
    suffix_then_draft.py, whose rows may be trees); drafter: the draft model or head behind it."""

    def __init__(self, lookup: Lookup, drafter: DraftModelDrafter | EagleDrafter):
        self.lookup = lookup
        self.drafter = drafter
        self.needs_target_hidden = drafter.needs_target_hidden  # a head: the target's features, every round
        # sampled rows: per request, lookup's and the drafter's acceptance rates, and who drafted last round
        self.rates: dict[str, dict[str, AcceptanceEstimate]] = {}
        self.last_round: dict[str, tuple[str, int]] = {}  # request id -> (LOOKUP or DRAFTER, tokens proposed)
        self.assigned: dict[str, str] = {}  # request id -> LOOKUP or DRAFTER: the k policy's pick for the coming round

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
            NgramDrafter(METHODS["lookup_then_draft"].ngram_min or 1, device=draft_model.model.device),
            draft_model.sharing_weights(),
        )

    def observe(self, batch: list[Sequence], num_accepted: torch.Tensor) -> None:
        for seq, accepted in zip(batch, num_accepted.tolist()):
            source, proposed = self.last_round.pop(seq.request_id, (None, 0))
            if source is None:
                continue
            rates = self._rates(seq)
            rates[source].observe(proposed, accepted)
            rates[DRAFTER if source == LOOKUP else LOOKUP].relax()
        self.drafter.observe(batch, num_accepted)

    def _rates(self, seq: Sequence) -> dict[str, AcceptanceEstimate]:
        return self.rates.setdefault(seq.request_id, {LOOKUP: AcceptanceEstimate(), DRAFTER: AcceptanceEstimate()})

    def takes_lookup(self, seq: Sequence, greedy: bool) -> bool:
        """Whether a row with a match takes it: a greedy row always, a sampled one while lookup's
        estimated acceptance on its sequence is at least the drafter's."""
        if greedy:
            return True
        rates = self._rates(seq)
        return rates[LOOKUP].rate(PRIOR) >= rates[DRAFTER].rate(PRIOR)

    def outlook(self, batch: list[Sequence], k: int) -> list[tuple[RowOutlook, ...]]:
        """A row lookup continues: lookup, free, with as many tokens as the match gives, or the
        drafter behind it (lookup first where the row would take it by itself: takes_lookup);
        any other row: the drafter."""
        options = []
        for seq in batch:
            looked_up = self.lookup.proposal_length(seq, k)
            lookup, drafter = RowOutlook(LOOKUP, free=True, most=looked_up), RowOutlook(DRAFTER)
            if not looked_up:
                options.append((drafter,))
            elif self.takes_lookup(seq, seq.params.greedy):
                options.append((lookup, drafter))
            else:
                options.append((drafter, lookup))
        return options

    def assign(self, batch: list[Sequence], chosen: list[RowOutlook]) -> None:
        self.assigned = {seq.request_id: outlook.source for seq, outlook in zip(batch, chosen)}

    def observe_hidden(
        self, batch: list[Sequence], first_positions: torch.Tensor, hidden: torch.Tensor, num_valid: torch.Tensor
    ) -> None:
        self.drafter.observe_hidden(batch, first_positions, hidden, num_valid)

    def compiles(self, max_batch: int, max_len: int, num_forwards: int) -> bool:
        return self.drafter.compiles(max_batch, max_len, num_forwards)

    def reserve(self, max_batch: int, max_len: int, num_forwards: int = 0, pool: BlockPool | None = None) -> None:
        self.drafter.reserve(max_batch, max_len, num_forwards, pool)

    def release(self, seq: Sequence) -> None:
        self.rates.pop(seq.request_id, None)
        self.last_round.pop(seq.request_id, None)
        self.lookup.release(seq)
        self.drafter.release(seq)

    def cached_entries(self, seq: Sequence) -> int | None:
        return self.drafter.cached_entries(seq)

    def adaptable(self) -> Drafter | None:
        return self.drafter.adaptable()

    def position_bytes(self) -> int:
        return self.drafter.position_bytes()

    def time_step(self, batch_size: int) -> None:
        self.drafter.time_step(batch_size)

    def propose(self, batch: list[Sequence], ks: list[int], sampling: SamplingTensors) -> Draft:
        looked_up = self.lookup.propose(batch, ks, sampling)
        greedy = sampling.greedy.tolist()
        assigned, self.assigned = self.assigned, {}
        takes = [
            n > 0 and (assigned[s.request_id] == LOOKUP if s.request_id in assigned else self.takes_lookup(s, g))
            for s, n, g in zip(batch, looked_up.num_tokens.tolist(), greedy)
        ]
        draft = self._with_drafter(batch, ks, sampling, looked_up, [row for row, t in enumerate(takes) if not t])
        for row, (seq, n) in enumerate(zip(batch, draft.num_tokens.tolist())):
            if not greedy[row] and min(n, ks[row]) > 0:  # a sampled row's round, to learn from
                self.last_round[seq.request_id] = (LOOKUP if takes[row] else DRAFTER, min(n, ks[row]))
        return draft

    def _with_drafter(
        self, batch: list[Sequence], ks: list[int], sampling: SamplingTensors, looked_up: Draft, unmatched: list[int]
    ) -> Draft:
        """looked_up, with the drafter's draft in the rows unmatched."""
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
    """looked_up's rows, with drafted's in place of rows drafted_rows [R]. Where looked_up is a
    tree (suffix decoding's), the drafted rows join it as chains of point masses (a token judged as
    a point mass is accepted with the target's probability of it: exact whatever drew it); else,
    where drafted has distributions, looked-up rows get point masses on their tokens."""
    width = max(looked_up.token_ids.shape[1], drafted.token_ids.shape[1])
    drafted_width = drafted.token_ids.shape[1]
    token_ids = _widened(looked_up.token_ids, width, 0)  # [B, width]
    token_ids[drafted_rows] = 0
    token_ids[drafted_rows, :drafted_width] = drafted.token_ids
    num_tokens = looked_up.num_tokens.clone()  # [B]
    num_tokens[drafted_rows] = drafted.num_tokens
    if looked_up.parents is not None:
        parents = _widened(looked_up.parents, width, ROOT)  # [B, width]
        parents[drafted_rows] = torch.arange(-1, width - 1, device=parents.device)  # each after the one before
        return Draft(token_ids, num_tokens, None, parents)  # unranked: the drafted rows' chains have no scores
    probs = None
    if drafted.probs is not None:
        B, k = token_ids.shape
        probs = point_mass(token_ids.reshape(-1), drafted.probs.shape[-1]).view(B, k, -1)  # [B, k, V]
        probs[drafted_rows] = 0
        probs[drafted_rows, :drafted_width] = drafted.probs
    return Draft(token_ids, num_tokens, probs)


def _widened(columns: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """columns [B, w] padded with fill to [B, width] (a copy)."""
    widened = columns.new_full((columns.shape[0], width), fill)  # [B, width]
    widened[:, : columns.shape[1]] = columns
    return widened
