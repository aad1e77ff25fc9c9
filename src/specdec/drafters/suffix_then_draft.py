"""Suffix decoding first; a drafter (a draft model or an EAGLE head) for the rows where it finds nothing.

As lookup_then_draft.py, with suffix decoding (suffix.py) in prompt lookup's place: a row whose
context matches the request's own text or an earlier request's output drafts what followed
there, at no cost, often a tree; the other rows are drafted by the draft model or head in
speculative_model. A sampled row keeps suffix decoding while its acceptance on that sequence is
at least the drafter's, as lookup_then_draft's rows keep lookup. Where a round has tree rows, the
drafter's rows join the tree as chains of point masses (lookup_then_draft._merge); rejection
sampling keeps the output exactly the target's either way.
"""

from __future__ import annotations

from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.lookup_then_draft import LookupThenDraftDrafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.models.eagle import is_head_directory


class SuffixThenDraftDrafter(LookupThenDraftDrafter):
    lookup: SuffixDrafter

    @classmethod
    def from_config(cls, spec, target, target_runner) -> SuffixThenDraftDrafter:
        behind = EagleDrafter if is_head_directory(spec.model) else DraftModelDrafter
        return cls(
            SuffixDrafter.from_config(spec, target, target_runner), behind.from_config(spec, target, target_runner)
        )

    def forget(self) -> None:
        """Suffix decoding's trees dropped (SuffixDrafter.forget)."""
        self.lookup.forget()
