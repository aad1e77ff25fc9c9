"""The Drafter interface: whatever proposes tokens for the target to verify."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specdec.kv_cache import BlockPool
from specdec.sampling import SamplingTensors
from specdec.sequence import Sequence
from specdec.tree import TreeShape, likeliest_nodes


@dataclass
class Draft:
    """Proposed tokens for a batch.

    token_ids [B, k]        entries past a row's num_tokens are ignored (0 padding, or the
                            tokens an adaptive draft drafted after the row stopped)
    num_tokens [B]          how many tokens each row proposes (0..k)
    probs [B, k, V] | None  the warped distributions each token was drawn from, in the
                            target's vocabulary; None = point masses (a deterministic drafter)
    parents [B, k] | None   a tree draft (tree.py): each token's parent's column in token_ids,
                            tree.ROOT (-1) for a child of the sequence's last token, every
                            parent before its children; its tokens are point masses (probs
                            None). None: a chain, each token after the one before.
    scores [B, k] | None    a tree's node scores, where its drafter ranks them: the log of the
                            drafter's probability of the node's whole branch (a child never
                            above its parent; -inf past a row's nodes). None: unranked.
    """

    token_ids: torch.Tensor
    num_tokens: torch.Tensor
    probs: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    scores: torch.Tensor | None = None

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    @classmethod
    def empty(cls, batch_size: int, device: torch.device | str) -> Draft:
        return cls(
            torch.zeros(batch_size, 0, dtype=torch.long, device=device),
            torch.zeros(batch_size, dtype=torch.long, device=device),
        )

    def narrowed(self, width: int) -> Draft:
        """A chain draft cut to its first width columns (at least its longest row's proposal):
        what the verify forward then feeds, so that a round whose rows proposed less than k (a
        lookup that found no match, an adaptive draft that stopped) costs no more than that."""
        probs = self.probs[:, :width] if self.probs is not None else None  # [B, width, V]
        return Draft(self.token_ids[:, :width], self.num_tokens, probs)  # [B, width]

    def scattered(self, batch_size: int, rows: torch.Tensor) -> Draft:
        """This draft of some rows as one of batch_size rows: row i here goes to rows[i] [R];
        the other rows propose nothing."""
        B, k = batch_size, self.token_ids.shape[1]
        token_ids = self.token_ids.new_zeros(B, k)  # [B, k]
        token_ids[rows] = self.token_ids
        num_tokens = self.num_tokens.new_zeros(B)  # [B]
        num_tokens[rows] = self.num_tokens
        probs = parents = scores = None
        if self.probs is not None:
            probs = self.probs.new_zeros(B, k, self.probs.shape[-1])  # [B, k, V]
            probs[rows] = self.probs
        if self.parents is not None:
            parents = self.parents.new_full((B, k), -1)  # [B, k]: every padding node a child of the root
            parents[rows] = self.parents
        if self.scores is not None:
            scores = self.scores.new_full((B, k), float("-inf"))  # [B, k]
            scores[rows] = self.scores
        return Draft(token_ids, num_tokens, probs, parents, scores)

    def likeliest(self, n: int) -> Draft:
        """A ranked tree draft cut to each row's n likeliest nodes (tree.likeliest_nodes): what a
        round verifies where a verify of more nodes would cost more than they are expected to
        give (spec/tree_width.py)."""
        assert self.parents is not None and self.scores is not None, "only a ranked tree is cut"
        kept, parents, num_tokens = likeliest_nodes(self.parents, self.scores, self.num_tokens, n)  # [B, n] x2, [B]
        is_kept = torch.arange(kept.shape[1], device=kept.device)[None, :] < num_tokens[:, None]  # [B, n]
        token_ids = torch.where(is_kept, self.token_ids.gather(1, kept), 0)  # [B, n]
        scores = torch.where(is_kept, self.scores.gather(1, kept), float("-inf"))  # [B, n]
        return Draft(token_ids, num_tokens, parents=parents, scores=scores)


DRAFT = "draft"  # the source of a drafter that is one drafter (RowOutlook.source)


@dataclass(frozen=True)
class RowOutlook:
    """What a drafter made of several drafters will do for one row in the coming round, said
    before the round's k is chosen (Drafter.outlook), so that k is chosen for that drafter:

    source  which of its drafters drafts the row: acceptance is estimated per source (a lookup
            that found the text it copies is accepted more often than a head's guess)
    free    whether that drafter's tokens cost no draft steps (a lookup, a suffix tree)
    most    the most tokens it would propose, whatever k (a lookup's match supports only so
            many); None: as many as asked
    """

    source: str = DRAFT
    free: bool = False
    most: int | None = None

    def __post_init__(self) -> None:
        if self.most is not None and self.most < 0:
            raise ValueError(f"RowOutlook.most must be None or >= 0, not {self.most}")


class Drafter(ABC):
    """Proposes up to its k tokens per sequence each round (the engine says each row's k: the
    round's choice, cut to what the row can still emit; a drafter never decides it).

    The engine calls `reserve` before a batch, `propose` (or, for a tree draft from a drafter
    that grows_trees, `propose_tree`) once per round, `observe` with what
    the target accepted, and `release` when a sequence leaves its slot. A drafter that drafts
    from the target's features sets needs_target_hidden: the engine then also hands it, after
    every target forward, the target's hidden states there (`observe_hidden`), so that features
    flow from verification to the next round without a forward of their own.
    """

    needs_target_hidden = False
    grows_trees = False  # whether propose_tree works (a model-based drafter, which has logits to rank)

    def reserve(self, max_batch: int, max_len: int, num_forwards: int = 0, pool: BlockPool | None = None) -> None:
        """Make room for max_batch sequences of up to max_len positions, for work of at most
        num_forwards rounds (a model-based drafter may compile for it). pool: the blocks and
        block table of the target's cache, which a drafter whose cache holds a sequence's own
        positions shares (its cache then holds what the sequence's blocks hold; kv_cache.py);
        None, or a drafter of other positions: a cache of its own."""

    def compiles(self, max_batch: int, max_len: int, num_forwards: int) -> bool:
        """Whether reserve() for this work runs a model of this drafter compiled (then the
        engine's pool is shaped for compiled forwards: kv_cache.pool_for)."""
        return False

    @abstractmethod
    def propose(self, batch: list[Sequence], ks: list[int], sampling: SamplingTensors) -> Draft:
        """Draft up to ks[i] tokens for sequence i (whose tokens so far are seq.token_ids): a
        Draft of max(ks) columns."""

    def propose_tree(
        self, batch: list[Sequence], budget: int, shape: TreeShape, max_depths: list[int], sampling: SamplingTensors
    ) -> Draft:
        """(grows_trees only) A tree draft of up to budget nodes per sequence, grown as shape says
        (tree.py), row i's no deeper than max_depths[i] (the engine's cut: what it can still
        emit), its candidates ranked for the batch's sampling settings: a Draft with parents."""
        raise NotImplementedError(f"{type(self).__name__} drafts chains only")

    def outlook(self, batch: list[Sequence], k: int) -> list[tuple[RowOutlook, ...]] | None:
        """Before a round's k is chosen: for each sequence, who among this drafter's drafters
        could draft it with up to k tokens (RowOutlook: which, whether it costs draft steps, how
        many tokens it would give at most), the one it would take by itself first. The engine's
        k policy may pick another (assign). None (a drafter that is one drafter): every row is
        drafted alike, at the draft step's cost."""
        return None

    def assign(self, batch: list[Sequence], chosen: list[RowOutlook]) -> None:
        """The coming round's drafters, one of outlook's options for each row of batch: propose
        then drafts each row with the one chosen (only the coming round's propose)."""

    def time_step(self, batch_size: int) -> None:
        """Run what one draft token costs for batch_size rows, for the engine to time before any
        round (it runs before sequences arrive: nothing kept may depend on it). A drafter whose
        steps cost next to nothing (a table lookup) does nothing."""

    def observe(self, batch: list[Sequence], num_accepted: torch.Tensor) -> None:
        """Told how many draft tokens each row had accepted; a drafter may adapt."""

    def observe_hidden(
        self, batch: list[Sequence], first_positions: torch.Tensor, hidden: torch.Tensor, num_valid: torch.Tensor
    ) -> None:
        """(needs_target_hidden only) The target's final normed hidden states hidden [B, T, H] of
        its last forward: row b's entry t is at position first_positions[b] + t, and its first
        num_valid[b] entries hold tokens the sequence keeps (the prompt after a prefill; the
        last token and the accepted drafts after a round)."""

    def position_bytes(self) -> int:
        """The bytes this drafter's caches take per position of a sequence (the serving budget
        holds them beside the target's); 0: no cache."""
        return 0

    def cached_entries(self, seq: Sequence) -> int | None:
        """The leading positions of seq whose entries this drafter's cache holds in the engine's
        pool (prefix caching shares a block with a later sequence's drafter once they cover it;
        such a sequence's drafter starts at seq.num_drafter_cached_tokens); None: the drafter
        keeps nothing in the pool (no cache, or one of its own)."""
        return None

    def release(self, seq: Sequence) -> None:
        """seq has finished; its slot may be reused."""

    def adaptable(self) -> Drafter | None:
        """The drafter in this one whose learned weights may be replaced while it serves (an EAGLE
        head: EagleDrafter.load_version, then swap_head between rounds); None where there is none."""
        return None
